// Single-matrix kernel benchmark: one thread streams a weight matrix larger than the last-level
// cache through MatrixKernel::MatMul for 1..64 activation rows, next to a plain read of the same
// bytes. Google Benchmark reports CPU time of the benchmark thread, so the figures hold up on a
// machine shared with other processes (unlike wall time); compare weights GB/s with BM_Read.
// BM_MatMulCached and BM_Peak compare the prefill register tiles with the arithmetic peak.
// BM_ExpertStore times a whole grouped SwiGLU (ExpertStore::Run, all four phases) on one thread
// for a given number of rows per expert, which is what T tokens make of a layer. BM_PoolDispatch:
// the thread pool's cost per parallel phase.
//   build/benchmarks/kernels_matmul_bench --benchmark_filter='int8|Read'
//   EPMOE_ISA=avx2 build/benchmarks/kernels_matmul_bench ...   (the kernels of a lower instruction set)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <random>

#include "epmoe/caches.h"
#include "epmoe/cpu.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/thread_pool.h"
#include "kernels/cpu/limits_kernels.h"
#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

constexpr int64_t kCols = 2048;                      // qwen3-30b-a3b hidden size
// Three times the L3 of the reference CPU (Zen 4, 32 MB), or 4 x a larger machine's caches.
const int64_t kMatrixBytes = BytesBeyondCaches(int64_t{96} << 20);

// The instruction set of the kernels benchmarked: the CPU's best, or EPMOE_ISA's if lower. (The
// read and the peaks stay the machine's.)
Isa KernelIsa() {
  const Result<Isa> isa = ResolveIsa("auto");
  return isa.ok() ? *isa : BestSupportedIsa();
}

// A [rows x cols] matrix of values uniform in [-bound, bound], drawn from `seed`.
Matrix UniformMatrix(int64_t rows, int64_t cols, float bound, uint32_t seed) {
  Matrix m(rows, cols);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-bound, bound);
  for (float& v : m.data) v = dist(rng);
  return m;
}

// `rows` activation rows of kCols features in `kernel`'s format, stride ActivationBytes(kCols).
std::vector<uint8_t> QuantizedRows(const MatrixKernel& kernel, int64_t rows, uint32_t seed) {
  const Matrix x = UniformMatrix(rows, kCols, 1.0f, seed);
  const int64_t stride = kernel.ActivationBytes(kCols);
  std::vector<uint8_t> acts(rows * stride);
  for (int64_t r = 0; r < rows; ++r) kernel.QuantizeActivations(x.row(r), kCols, acts.data() + r * stride);
  return acts;
}

struct Fixture {
  std::unique_ptr<MatrixKernel> kernel;
  PackedMatrix weights;
};

const Fixture& FixtureFor(WeightFormat format) {
  static std::map<WeightFormat, Fixture> cache;
  auto it = cache.find(format);
  if (it != cache.end()) return it->second;
  Fixture f;
  f.kernel = ChooseKernel(format, KernelIsa(), kCols, kCols);
  // A whole number of 16-channel blocks, as the AVX-512 layout needs.
  const int64_t rows = kMatrixBytes / std::max<int64_t>(1, ByteCount(format, 16, kCols)) * 16;
  f.weights = PackMatrix(*Quantize(format, UniformMatrix(rows, kCols, 0.02f, 1)), f.kernel->layout());
  return cache.emplace(format, std::move(f)).first->second;
}

void BM_MatMul(benchmark::State& state) {
  const auto format = static_cast<WeightFormat>(state.range(0));
  const int64_t rows = state.range(1);
  const Fixture& f = FixtureFor(format);
  const std::vector<uint8_t> acts = QuantizedRows(*f.kernel, rows, 2);
  const int64_t channels = f.weights.rows;
  std::vector<float> out(rows * channels);
  for (auto _ : state) {
    // Blocks of 128 channels, as the decode path's work items.
    for (int64_t n = 0; n < channels; n += 128)
      f.kernel->MatMul(f.weights, n, std::min(channels, n + 128), acts.data(), rows, out.data() + n, channels,
                       OutputWrites::kCached);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * f.weights.bytes());
  state.counters["GOP/s"] = benchmark::Counter(2.0 * rows * channels * kCols * state.iterations(),
                                               benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  state.SetLabel(std::string(WeightFormatName(format)) + "/" + IsaName(f.kernel->isa()));
}

void BM_Read(benchmark::State& state) {
  std::vector<uint8_t> buffer(kMatrixBytes, 1);
  for (auto _ : state) {
    uint64_t sum = 0;
    switch (BestSupportedIsa()) {
      case Isa::kAvx512: sum = ReadSumAvx512(buffer.data(), kMatrixBytes); break;
      case Isa::kAvx2: sum = ReadSumAvx2(buffer.data(), kMatrixBytes); break;
      case Isa::kReference: sum = ReadSumReference(buffer.data(), kMatrixBytes); break;
    }
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(state.iterations() * kMatrixBytes);
}

// Weights that stay in L2 (192 channels): with 192 rows the figure is the prefill register tile's
// arithmetic rate (compare GOP/s with BM_Peak of the format's path); with 1 row it is the decode
// tile's instruction cost per weight byte, with no memory in the way (bytes_per_second); with 3, 4
// and 8 rows, the decode tiles' arithmetic rate without waiting for memory (3 rows: a short tile;
// 8 rows: two row tiles over the same weights); with 48 and 64 rows, the 4-bit kernels' last call
// that expands its codes as it streams and a call that expands a panel first (as at T = 1024).
void BM_MatMulCached(benchmark::State& state) {
  const auto format = static_cast<WeightFormat>(state.range(0));
  const int64_t kRows = state.range(1);
  constexpr int64_t kChannels = 192;
  const std::unique_ptr<MatrixKernel> kernel = ChooseKernel(format, KernelIsa(), kCols, kCols);
  const PackedMatrix weights =
      PackMatrix(*Quantize(format, UniformMatrix(kChannels, kCols, 0.02f, 3)), kernel->layout());
  const std::vector<uint8_t> acts = QuantizedRows(*kernel, kRows, 3);
  std::vector<float> out(kRows * kChannels);
  for (auto _ : state) {
    kernel->MatMul(weights, 0, kChannels, acts.data(), kRows, out.data(), kChannels, OutputWrites::kCached);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * weights.bytes());
  state.counters["GOP/s"] = benchmark::Counter(2.0 * kRows * kChannels * kCols * state.iterations(),
                                               benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  state.SetLabel(std::string(WeightFormatName(format)) + "/" + IsaName(kernel->isa()));
}

// Quantizing activation rows the way each kernel's dot product wants them (ExpertStore::Run's
// first and third phases): 64 rows of 2048 features, in cache.
void BM_QuantizeActivations(benchmark::State& state) {
  const auto format = static_cast<WeightFormat>(state.range(0));
  constexpr int64_t kRows = 64;
  const std::unique_ptr<MatrixKernel> kernel = ChooseKernel(format, KernelIsa(), kCols, kCols);
  const Matrix x = UniformMatrix(kRows, kCols, 1.0f, 7);
  const int64_t stride = kernel->ActivationBytes(kCols);
  std::vector<uint8_t> out(kRows * stride);
  for (auto _ : state) {
    for (int64_t r = 0; r < kRows; ++r) kernel->QuantizeActivations(x.row(r), kCols, out.data() + r * stride);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["rows/s"] =
      benchmark::Counter(static_cast<double>(kRows * state.iterations()), benchmark::Counter::kIsRate);
  state.SetLabel(std::string(WeightFormatName(format)) + "/" + IsaName(kernel->isa()));
}

void BM_Peak(benchmark::State& state) {
  const auto path = static_cast<ArithmeticPath>(state.range(0));
  float sink = 0;
  int64_t operations = 0;
  for (auto _ : state) {
    operations += BestSupportedIsa() == Isa::kAvx512 ? ArithmeticLoopAvx512(path, 1 << 16, &sink)
                                                     : ArithmeticLoopAvx2(path, 1 << 16, &sink);
  }
  benchmark::DoNotOptimize(sink);
  state.counters["GOP/s"] =
      benchmark::Counter(static_cast<double>(operations), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  state.SetLabel(ArithmeticPathName(path));
}

constexpr int64_t kIntermediate = 768;  // qwen3-30b-a3b expert intermediate size

// `count` experts of the qwen3-30b-a3b shape in `format`, packed once per (format, count).
ExpertStore* StoreFor(WeightFormat format, int count, benchmark::State& state) {
  static std::map<std::pair<WeightFormat, int>, std::unique_ptr<ExpertStore>> stores;
  std::unique_ptr<ExpertStore>& store = stores[{format, count}];
  if (store == nullptr) {
    std::mt19937 rng(4);
    std::uniform_real_distribution<float> dist(-0.02f, 0.02f);
    std::vector<ExpertWeights> experts(count);
    std::vector<const ExpertWeights*> pointers;
    for (ExpertWeights& e : experts) {
      e = {Matrix(kIntermediate, kCols), Matrix(kIntermediate, kCols), Matrix(kCols, kIntermediate)};
      for (Matrix* m : {&e.gate, &e.up, &e.down})
        for (float& v : m->data) v = dist(rng);
      pointers.push_back(&e);
    }
    auto packed = PackExperts(pointers, {.format = format});
    if (!packed.ok()) {
      state.SkipWithError(packed.status().ToString().c_str());
      return nullptr;
    }
    store = std::move(packed).value();
  }
  return store.get();
}

// Runs `store` on rows per expert `counts` with `pool` for every benchmark iteration.
void RunStore(benchmark::State& state, const ExpertStore& store, const std::vector<int64_t>& counts, ThreadPool& pool) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) offsets[e + 1] = offsets[e] + counts[e];
  const Matrix x = UniformMatrix(offsets.back(), kCols, 1.0f, 5);
  Matrix out(offsets.back(), kCols);
  for (auto _ : state) {
    store.Run(x.data.data(), offsets, out.data.data(), pool);
    benchmark::DoNotOptimize(out.data.data());
  }
  state.counters["GOP/s"] = benchmark::Counter(2.0 * 3 * kIntermediate * kCols * offsets.back() * state.iterations(),
                                               benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  state.SetLabel(store.kernel_name());
}

// 24 experts of the qwen3-30b-a3b shape (64 MB in the 4-bit formats, twice the L3), each with
// `rows` rows, run by a pool of one thread (which runs inline, so CPU time is the kernel's).
void BM_ExpertStore(benchmark::State& state) {
  constexpr int kExperts = 24;
  const ExpertStore* store = StoreFor(static_cast<WeightFormat>(state.range(0)), kExperts, state);
  if (store == nullptr) return;
  ThreadPool pool(1);
  RunStore(state, *store, std::vector<int64_t>(kExperts, state.range(1)), pool);
}

// The layer of `epmoe bench kernels` at T = 64 in miniature: 48 experts (127 MB in the 4-bit
// formats) with that point's skew of rows per expert (1 to 10, about 4.2 on average: 202 picks),
// in a fixed shuffled order, on a pool of state.range(1) threads. Time is the process's CPU time
// (all threads; idle pool threads sleep), so GOP/s is per CPU second: with 2 threads against 1 it
// shows what running two threads costs each (shared reads, waits at the phase ends), and holds
// up on a shared machine; wall_ms is the wall time per run.
void BM_ExpertStoreSkewed(benchmark::State& state) {
  // Rows per expert -> experts, scaled from the T = 64 point's 121 touched experts.
  constexpr std::pair<int, int> kHistogram[] = {{1, 3}, {2, 7}, {3, 10}, {4, 11}, {5, 6},
                                                {6, 4}, {7, 2}, {8, 3},  {9, 1},  {10, 1}};
  std::vector<int64_t> counts;
  for (const auto& [rows, experts] : kHistogram) counts.insert(counts.end(), experts, rows);
  std::shuffle(counts.begin(), counts.end(), std::mt19937(6));
  const ExpertStore* store =
      StoreFor(static_cast<WeightFormat>(state.range(0)), static_cast<int>(counts.size()), state);
  if (store == nullptr) return;
  ThreadPool pool(static_cast<int>(state.range(1)));
  const auto start = std::chrono::steady_clock::now();
  RunStore(state, *store, counts, pool);
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  state.counters["wall_ms"] = wall_ms / std::max<double>(1, static_cast<double>(state.iterations()));
}

// What one of Run's four parallel phases costs besides its work: RunOnAll of an empty task on a
// pool of state.range(0) threads (skipped above the cores this process may use), wall time.
void BM_PoolDispatch(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  if (threads > UsableCores()) {
    state.SkipWithError("more threads than usable cores");
    return;
  }
  ThreadPool pool(threads);
  std::atomic<int> calls{0};
  for (auto _ : state) pool.RunOnAll([&](int) { calls.fetch_add(1, std::memory_order_relaxed); });
  benchmark::DoNotOptimize(calls.load());
}

void MatMulArguments(benchmark::internal::Benchmark* b) {
  for (WeightFormat f : AllWeightFormats())
    for (int rows : {1, 2, 3, 4, 5, 8, 12, 13, 16, 18, 20, 64}) b->Args({static_cast<int64_t>(f), rows});
}

BENCHMARK(BM_Read)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MatMul)->Apply(MatMulArguments)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MatMulCached)
    ->ArgsProduct({benchmark::CreateDenseRange(0, static_cast<int>(AllWeightFormats().size()) - 1, 1),
                   {1, 3, 4, 8, 48, 64, 192}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ExpertStore)
    ->ArgsProduct({benchmark::CreateDenseRange(1, static_cast<int>(AllWeightFormats().size()) - 1, 1),
                   {1, 4, 8, 16, 32, 64}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ExpertStoreSkewed)
    ->ArgsProduct({benchmark::CreateDenseRange(2, static_cast<int>(AllWeightFormats().size()) - 1, 1), {1, 2}})
    ->MeasureProcessCPUTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_QuantizeActivations)->DenseRange(0, static_cast<int>(AllWeightFormats().size()) - 1, 1);
BENCHMARK(BM_Peak)->DenseRange(0, 5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PoolDispatch)->RangeMultiplier(2)->Range(2, 64)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace epmoe::kernels
