#include "kernels/expert_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>

#include "epmoe/caches.h"
#include "epmoe/thread_pool.h"

namespace epmoe::kernels {
namespace {

// Cache budgets (per core) for the blocking: weights of one work item, and one block of rows.
constexpr int64_t kWeightBlockBytes = 256 * 1024;
constexpr int64_t kRowBlockBytes = 256 * 1024;
// Channels per work item in the decode path: small, so that a step touching few experts still has
// work for every thread.
constexpr int64_t kDecodeChannels = 128;

// One unit of parallel work: channels [n_begin, n_end) of one expert, for all of its rows.
struct WorkItem {
  int expert;
  int64_t n_begin, n_end;
  // The decode path (up to kDecodeMaxRows rows, one row block): the expert's consecutive items can
  // run as one.
  bool decode;
};

// An expert's rows go through the decode path: one row block, each weight read once for all rows.
bool IsDecode(int64_t rows) {
  return rows <= KernelExpertStore::kDecodeMaxRows;
}

// Channels of one work item: few in decode (so few experts still spread over every thread), a
// multiple of the kernel's register tile that keeps the weights of an item in L2 in prefill.
int64_t ChannelsPerItem(int64_t rows, int64_t weight_row_bytes, int64_t matrices, int64_t tile) {
  if (IsDecode(rows)) return kDecodeChannels;
  const int64_t fit = kWeightBlockBytes / std::max<int64_t>(1, weight_row_bytes * matrices);
  return std::max(tile, std::min<int64_t>(fit, 256) / tile * tile);
}

int64_t RowsPerBlock(int64_t rows, int64_t act_row_bytes) {
  if (IsDecode(rows)) return rows;
  return std::clamp<int64_t>(kRowBlockBytes / std::max<int64_t>(1, act_row_bytes), 16, 512);
}

std::vector<WorkItem> MakeItems(std::span<const int64_t> offsets, int64_t channels, int64_t weight_row_bytes,
                                int64_t matrices, int64_t tile) {
  std::vector<WorkItem> items;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    const int64_t step = ChannelsPerItem(rows, weight_row_bytes, matrices, tile);
    for (int64_t n = 0; n < channels; n += step)
      items.push_back({static_cast<int>(e), n, std::min(channels, n + step), IsDecode(rows)});
  }
  return items;
}

// Runs `body` over every work item of `items` (each expert's items consecutive, in channel
// order) on all of the pool's threads. A thread claims a run of one expert's consecutive items at a
// time, at most a (2 x threads)-th of the items left, so that runs are long while much is left and
// single items at the end (the threads finish together). Runs rather than single items: a thread's
// streaming tiles prefetch past the end of their item into the next one, and the hardware
// prefetchers follow one long sequential stream, both of which need the thread's next item to be
// the one after; with items handed out one at a time two threads alternate along an expert and
// each starts every item cold (one thread on the skewed T = 64 layer, items taken in that
// alternating order: 1.11 - 1.16 x the time; two threads with runs: 0.76 x the time of single
// items, the same CPU time as one thread alone). A run of decode items goes to `body` as one item
// over all of their channels, one MatMul per matrix: the gate and up matrices are then each read as
// one stream, not in turns of 128 channels (two threads, the skewed layer in the memory's fast
// state, fraction of the read rate, medians of 6 runs alternated in one process: int8 T = 1 / 8 /
// 16 / 64 0.82 / 0.89 / 0.89 / 0.79 -> 0.85 / 0.90 / 0.93 / 0.85, nvfp4 0.76 / 0.81 / 0.78 / 0.57
// -> 0.80 / 0.84 / 0.83 / 0.59). Prefill items stay apart: each keeps its weights in L2 through its
// row blocks.
void ForEachItemInRuns(ThreadPool& pool, const std::vector<WorkItem>& items,
                       const std::function<void(const WorkItem&)>& body) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t divisor = 2 * static_cast<int64_t>(pool.size());
  std::atomic<int64_t> next{0};
  pool.RunOnAll([&](int thread) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t limit = begin + std::max<int64_t>(1, (n - begin) / divisor);
      int64_t end = begin + 1;
      while (end < limit && items[end].expert == items[begin].expert) ++end;
      // On failure `begin` is reloaded with what another thread left: claim again from there.
      if (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) continue;
      if (items[begin].decode) {
        body({items[begin].expert, items[begin].n_begin, items[end - 1].n_end, true});
      } else {
        for (int64_t i = begin; i < end; ++i) body(items[i]);
      }
      pool.ChunkDone(thread);
      begin = next.load(std::memory_order_relaxed);
    }
  });
}

// `count` fp32 rows of `cols` features into the kernel's activation format, `stride` bytes apart,
// in parallel.
void QuantizeActivationRows(const MatrixKernel& kernel, const float* rows, int64_t count, int64_t cols, uint8_t* out,
                            int64_t stride, ThreadPool& pool) {
  constexpr int64_t kGrain = 8;  // rows per task: a row is quick to quantize
  pool.ParallelFor(count, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) kernel.QuantizeActivations(rows + r * cols, cols, out + r * stride);
  });
}

// An expert's stored bytes as contiguous ranges (empty ones left out), in the one order that
// export, import and MutableExpertParts share: per matrix (gate, up, down) its values, its scales
// and, for nvfp4, its tensor scale; then the biases it has. Byte is std::byte, or const std::byte
// for a const expert.
template <class Byte, class Expert>
std::vector<std::span<Byte>> PartsOf(Expert& expert) {
  std::vector<std::span<Byte>> parts;
  auto add = [&parts](auto* at, size_t bytes) {
    if (bytes > 0) parts.emplace_back(reinterpret_cast<Byte*>(at), bytes);
  };
  for (auto* m : {&expert.gate, &expert.up, &expert.down}) {
    add(m->values.data(), m->values.size());
    add(m->scales.data(), m->scales.size());
    if (m->format == WeightFormat::kNvfp4) add(&m->tensor_scale, sizeof(float));
  }
  for (auto* bias : {&expert.gate_bias, &expert.up_bias, &expert.down_bias})
    add(bias->data(), bias->size() * sizeof(float));
  return parts;
}

}  // namespace

Result<std::unique_ptr<KernelExpertStore>> KernelExpertStore::Create(int count, int64_t hidden, int64_t intermediate,
                                                                     const Source& source, WeightFormat format,
                                                                     const GatedActivation& activation, Isa highest,
                                                                     ThreadPool* pool) {
  std::unique_ptr<KernelExpertStore> store(new KernelExpertStore());
  store->format_ = format;
  store->activation_ = activation;
  store->hidden_ = hidden;
  store->intermediate_ = intermediate;
  store->kernel_ = ChooseKernel(format, highest, store->hidden_, store->intermediate_);
  store->experts_.resize(count);
  // All experts in one allocation on 2 MiB pages (core/huge_pages.h), each expert's gate, up and
  // down in turn: the decode path streams them, and a single allocation rounds up to whole pages
  // once (a 4-bit matrix of the qwen3-30b-a3b shape alone is 0.75 MB).
  const int64_t gate_storage = PackedStorageBytes(format, intermediate, hidden);  // and up's
  const int64_t offsets[3] = {0, gate_storage, 2 * gate_storage};
  const int64_t expert_storage = 2 * gate_storage + PackedStorageBytes(format, hidden, intermediate);
  store->weights_memory_ = AllocateHugePageMemory(expert_storage * count);
  if (store->weights_memory_ == nullptr)
    return OutOfRange(fmt::format("cannot allocate {} bytes for {} packed experts", expert_storage * count, count));
  std::vector<Status> errors(count);
  const PackLayout layout = store->kernel_->layout();
  auto pack_one = [&](int64_t begin, int64_t end) {
    ExpertWeights scratch;  // this thread's buffers, reused from expert to expert
    QuantizedMatrix quantized;
    for (int64_t e = begin; e < end; ++e) {
      const Result<const ExpertWeights*> weights = source(static_cast<int>(e), &scratch);
      if (!weights.ok()) {
        errors[e] = weights.status();
        continue;
      }
      PackedExpert& packed = store->experts_[e];
      const Matrix* matrices[3] = {&(*weights)->gate, &(*weights)->up, &(*weights)->down};
      PackedMatrix* targets[3] = {&packed.gate, &packed.up, &packed.down};
      uint8_t* memory = store->weights_memory_.get() + e * expert_storage;
      for (int m = 0; m < 3; ++m) {
        const Status q = Quantize(format, *matrices[m], &quantized);
        if (!q.ok()) {
          static constexpr const char* kNames[3] = {"gate", "up", "down"};
          errors[e] = q.WithContext(fmt::format("expert {} {}", e, kNames[m]));
          break;
        }
        *targets[m] = PackMatrixAt(quantized, layout, memory + offsets[m]);
      }
      packed.gate_bias = (*weights)->gate_bias;
      packed.up_bias = (*weights)->up_bias;
      packed.down_bias = (*weights)->down_bias;
    }
  };
  ParallelFor(pool, count, 1, pack_one);
  for (const Status& s : errors) EPMOE_RETURN_IF_ERROR(s);
  return store;
}

int64_t KernelExpertStore::expert_bytes(int expert) const {
  const PackedExpert& e = experts_[expert];
  const size_t biases = e.gate_bias.size() + e.up_bias.size() + e.down_bias.size();
  return e.gate.bytes() + e.up.bytes() + e.down.bytes() + static_cast<int64_t>(biases * sizeof(float));
}

Status KernelExpertStore::ExportExpert(int expert, std::span<std::byte> out) const {
  if (expert < 0 || expert >= num_experts())
    return InvalidArgument(fmt::format("export expert: expert {} outside [0, {})", expert, num_experts()));
  if (static_cast<int64_t>(out.size()) != expert_bytes(expert))
    return InvalidArgument(fmt::format("export expert: expert {} takes {} bytes, the buffer has {}", expert,
                                       expert_bytes(expert), out.size()));
  std::byte* at = out.data();
  for (const std::span<const std::byte> part : PartsOf<const std::byte>(experts_[expert])) {
    std::memcpy(at, part.data(), part.size());
    at += part.size();
  }
  return Status::Ok();
}

Status KernelExpertStore::ImportExpert(int expert, std::span<const std::byte> bytes) {
  if (expert < 0 || expert >= num_experts())
    return InvalidArgument(fmt::format("import expert: expert {} outside [0, {})", expert, num_experts()));
  if (static_cast<int64_t>(bytes.size()) != expert_bytes(expert))
    return InvalidArgument(
        fmt::format("import expert: expert {} takes {} bytes, got {}", expert, expert_bytes(expert), bytes.size()));
  const std::byte* at = bytes.data();
  for (const std::span<std::byte> part : PartsOf<std::byte>(experts_[expert])) {
    std::memcpy(part.data(), at, part.size());
    at += part.size();
  }
  return Status::Ok();
}

Result<std::vector<std::span<std::byte>>> KernelExpertStore::MutableExpertParts(int expert) {
  if (expert < 0 || expert >= num_experts())
    return InvalidArgument(fmt::format("expert parts: expert {} outside [0, {})", expert, num_experts()));
  return PartsOf<std::byte>(experts_[expert]);
}

std::string KernelExpertStore::kernel_name() const {
  return fmt::format("{}/{}", WeightFormatName(format_), IsaName(kernel_->isa()));
}

int64_t KernelExpertStore::activation_row_bytes() const {
  return kernel_->ActivationBytes(hidden_);
}

void KernelExpertStore::QuantizeRows(const float* rows, int64_t count, std::byte* out, ThreadPool& pool) const {
  QuantizeActivationRows(*kernel_, rows, count, hidden_, reinterpret_cast<uint8_t*>(out), activation_row_bytes(), pool);
}

void KernelExpertStore::Run(const float* rows, std::span<const int64_t> offsets, float* out, ThreadPool& pool) const {
  EPMOE_CHECK(static_cast<int>(offsets.size()) == num_experts() + 1);
  const int64_t total = offsets.back();
  if (total == 0) return;
  // Phase 1: input rows in the kernel's activation format.
  // Scratch kept by the calling thread across calls: fresh buffers of this size cost a page fault
  // per 4 KB on every step (about a tenth of a large prefill step).
  thread_local std::vector<std::byte> inputs_scratch;
  std::vector<std::byte>& inputs = inputs_scratch;
  inputs.resize(total * activation_row_bytes());
  QuantizeRows(rows, total, inputs.data(), pool);
  RunQuantized(inputs.data(), offsets, out, pool);
}

void KernelExpertStore::RunQuantized(const std::byte* rows, std::span<const int64_t> offsets, float* out,
                                     ThreadPool& pool) const {
  const int num = num_experts();
  EPMOE_CHECK(static_cast<int>(offsets.size()) == num + 1);
  EPMOE_CHECK(offsets[0] == 0);
  for (int e = 0; e < num; ++e) EPMOE_CHECK(offsets[e] <= offsets[e + 1]);
  const int64_t total = offsets[num];
  if (total == 0) return;
  const MatrixKernel& kernel = *kernel_;
  const int64_t hidden_stride = kernel.ActivationBytes(hidden_);
  const int64_t mid_stride = kernel.ActivationBytes(intermediate_);
  const uint8_t* inputs = reinterpret_cast<const uint8_t*>(rows);

  // Phase 2: the activation of (gate x, up x) for every row, in fp32.
  // Scratch kept by the calling thread, as Run's inputs. Named through references: the pool's
  // threads run the lambdas below, and a thread_local named there would be their own.
  thread_local std::vector<float> mid_scratch;
  std::vector<float>& mid = mid_scratch;
  mid.resize(total * intermediate_);
  const std::vector<WorkItem> gate_items =
      MakeItems(offsets, intermediate_, experts_[0].gate.row_bytes, 2, kernel.channel_tile());
  ForEachItemInRuns(pool, gate_items, [&](const WorkItem& item) {
    const PackedExpert& expert = experts_[item.expert];
    const int64_t first = offsets[item.expert];
    const int64_t count = offsets[item.expert + 1] - first;
    const int64_t width = item.n_end - item.n_begin;
    const int64_t block = RowsPerBlock(count, hidden_stride);
    // Per pool thread, kept across items and calls: allocated per item (2 x 25 - 32 KB in prefill,
    // 1,536 items at T = 1024), the pair cost nvfp4 and int8 T = 1024 up to 0.05 of the bound.
    thread_local std::vector<float> gate, up;
    gate.resize(block * width);
    up.resize(block * width);
    for (int64_t r0 = 0; r0 < count; r0 += block) {
      const int64_t n_rows = std::min(block, count - r0);
      const uint8_t* acts = inputs + (first + r0) * hidden_stride;
      kernel.MatMul(expert.gate, item.n_begin, item.n_end, acts, n_rows, gate.data(), width, OutputWrites::kCached);
      kernel.MatMul(expert.up, item.n_begin, item.n_end, acts, n_rows, up.data(), width, OutputWrites::kCached);
      const float* gate_bias = expert.gate_bias.empty() ? nullptr : expert.gate_bias.data() + item.n_begin;
      const float* up_bias = expert.up_bias.empty() ? nullptr : expert.up_bias.data() + item.n_begin;
      for (int64_t r = 0; r < n_rows; ++r)
        kernel.Activate(gate.data() + r * width, up.data() + r * width, gate_bias, up_bias, width, activation_,
                        mid.data() + (first + r0 + r) * intermediate_ + item.n_begin);
    }
  });

  // Phase 3: the intermediate rows in the kernel's activation format.
  thread_local std::vector<uint8_t> mid_acts_scratch;
  std::vector<uint8_t>& mid_acts = mid_acts_scratch;
  mid_acts.resize(total * mid_stride);
  QuantizeActivationRows(kernel, mid.data(), total, intermediate_, mid_acts.data(), mid_stride, pool);

  // Phase 4: down projection straight into the output rows, past the caches when they are larger
  // than the last-level caches (OutputWrites::kStreamed): written as they were, each row's part of
  // an item (1 KB here) to lines not in cache, they were read from memory first and evicted the
  // panel and activations the tiles read (nvfp4, two threads, the two alternated in one process:
  // T = 1024 / 8192 5 / 6% less time; with the outputs now on cache lines (Matrix), against the
  // old build, T = 1024: nvfp4 / int8 / bf16 5.5 / 3.5 / 2.5% less; T = 8 - 256, 4 - 16 MB of
  // outputs here, streamed or not, level).
  const int64_t last_level_cache = LastLevelCacheBytes();
  const OutputWrites down_writes =
      last_level_cache > 0 && total * hidden_ * static_cast<int64_t>(sizeof(float)) > last_level_cache
          ? OutputWrites::kStreamed
          : OutputWrites::kCached;
  const std::vector<WorkItem> down_items =
      MakeItems(offsets, hidden_, experts_[0].down.row_bytes, 1, kernel.channel_tile());
  ForEachItemInRuns(pool, down_items, [&](const WorkItem& item) {
    const PackedExpert& expert = experts_[item.expert];
    const int64_t first = offsets[item.expert];
    const int64_t count = offsets[item.expert + 1] - first;
    const int64_t block = RowsPerBlock(count, mid_stride);
    for (int64_t r0 = 0; r0 < count; r0 += block) {
      const int64_t n_rows = std::min(block, count - r0);
      float* rows_out = out + (first + r0) * hidden_ + item.n_begin;
      kernel.MatMul(expert.down, item.n_begin, item.n_end, mid_acts.data() + (first + r0) * mid_stride, n_rows,
                    rows_out, hidden_, down_writes);
      // The bias after the product (streamed outputs are then read back: only models with biases
      // pay).
      if (!expert.down_bias.empty()) {
        const float* bias = expert.down_bias.data() + item.n_begin;
        for (int64_t r = 0; r < n_rows; ++r)
          for (int64_t n = 0; n < item.n_end - item.n_begin; ++n) rows_out[r * hidden_ + n] += bias[n];
      }
    }
  });
}

}  // namespace epmoe::kernels
