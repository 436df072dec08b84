// The router's logits (RouterWeights::Logits) for a model's router on every core, as a layer
// step computes them: each timed run starts with the caches flushed by a read of a
// MemoryReadProbe, and is followed by a flushed read of as many bytes as the packed weights
// (MeasureReadRate), so that each run is judged against the memory's speed of that moment.
// Counters, medians over the runs:
//   us              the logits' time
//   read_fraction   read time / logits time: 1 is memory speed (decode)
//   gflops          2 x rows x experts x hidden per second, and fma_fraction, its share of the fp32
//                   FMA peak measured once at the start (the path the logits run on; prefill)
// Args: model (kModels), rows, packing (0 fp32, 1 bf16: a checkpoint's router).
//   build/benchmarks/router_bench
//   build/benchmarks/router_bench --benchmark_filter='Logits/./1/'      (decode steps only)
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "epmoe/machine_limits.h"
#include "epmoe/model.h"
#include "epmoe/router.h"
#include "epmoe/statistics.h"
#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"

namespace epmoe {
namespace {

const char* const kModels[] = {"qwen3-next-80b-a3b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"};

ThreadPool& Pool() {
  static ThreadPool pool(0);
  return pool;
}

double FmaPeakGflops() {
  static const double peak = [] {
    const Result<double> measured = MeasurePeak(ArithmeticPath::kFp32Fma, Pool(), {}, BestSupportedIsa());
    return measured.ok() ? *measured : 0.0;
  }();
  return peak;
}

void BM_RouterLogits(benchmark::State& state) {
  const Result<ModelConfig> model = LoadModel(kModels[state.range(0)]);
  if (!model.ok()) {
    state.SkipWithError(model.status().ToString().c_str());
    return;
  }
  const int64_t rows = state.range(1), experts = model->num_experts, hidden = model->hidden;
  const bool bf16 = state.range(2) == 1;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Matrix weight(experts, hidden), x(rows, hidden), logits;
  for (float& v : weight.data) v = bf16 ? FloatFromBf16(Bf16FromFloat(0.02f * normal(rng))) : 0.02f * normal(rng);
  for (float& v : x.data) v = normal(rng);
  const Result<RouterWeights> router = RouterWeights::Pack(weight);
  Result<MemoryReadProbe> probe = MemoryReadProbe::Create(Pool(), BytesBeyondCaches(int64_t{128} << 20));
  if (!router.ok() || !probe.ok()) {
    state.SkipWithError("cannot pack the router or allocate the probe");
    return;
  }
  const std::vector<std::byte> same_bytes(router->bytes(), std::byte{1});
  const std::span<const std::byte> range(same_bytes);
  const double peak = FmaPeakGflops();
  std::vector<double> us, read_fraction;
  for (auto _ : state) {
    probe->Read(Pool());
    const auto start = std::chrono::steady_clock::now();
    router->Logits(x, &logits, &Pool());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    benchmark::DoNotOptimize(logits.data.data());
    state.SetIterationTime(seconds);
    probe->Read(Pool());
    const double read_gbps = MeasureReadRate(Pool(), {&range, 1});
    us.push_back(seconds * 1e6);
    read_fraction.push_back(static_cast<double>(router->bytes()) / (read_gbps * 1e3) / us.back());
  }
  const double median_us = Median(us);
  const double gflops = 2.0 * static_cast<double>(rows * experts * hidden) / (median_us * 1e3);
  state.counters["us"] = median_us;
  state.counters["read_fraction"] = Median(read_fraction);
  state.counters["gflops"] = gflops;
  state.counters["fma_fraction"] = peak > 0 ? gflops / peak : 0;
  state.SetLabel(
      fmt::format("{} {} {}x{}", kModels[state.range(0)], router->bf16() ? "bf16" : "fp32", experts, hidden));
}

void Arguments(benchmark::internal::Benchmark* b) {
  for (int64_t model = 0; model < static_cast<int64_t>(std::size(kModels)); ++model)
    for (const int64_t rows : {1, 16, 256, 4096})
      for (const int64_t bf16 : {1, 0}) b->Args({model, rows, bf16});
}

BENCHMARK(BM_RouterLogits)->Apply(Arguments)->Iterations(11)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace epmoe
