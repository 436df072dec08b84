#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "epmoe/router.h"
#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"
#include "router/logits_tile.h"

namespace epmoe {

using namespace router_internal;

namespace {

// Steps of a group run before its sums go back to memory: 128 KB of weights (512 steps of 4
// blocks), which then stay in L2 for the other row tiles of a work item.
constexpr int64_t kChunkSteps = 512;
// Rows per work item: their inputs of a chunk (at most 32 x 1024 floats, 128 KB) stay in L2 beside
// the chunk's weights.
constexpr int64_t kItemRows = 32;

}  // namespace

namespace router_internal {

void LogitsTileReference(const LogitsTile& t) {
  const int64_t step_bytes = t.blocks * kStepBytes;
  for (int64_t r = 0; r < t.rows; ++r) {
    const float* x = t.x + r * t.x_stride;
    for (int64_t b = 0; b < t.blocks; ++b) {
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        float& out = t.sums[r * t.sums_stride + b * kLanes + lane];
        float sum = t.first ? 0.0f : out;
        for (int64_t s = 0; s < t.steps; ++s) {
          const uint8_t* at = t.weights + s * step_bytes + b * kStepBytes + lane * 4;
          if (!t.bf16) {
            float w;
            std::memcpy(&w, at, sizeof w);
            sum = std::fma(w, x[s], sum);
            continue;
          }
          const int64_t inputs = t.odd_tail && s == t.steps - 1 ? 1 : 2;
          for (int64_t i = 0; i < inputs; ++i) {
            uint16_t bits;
            std::memcpy(&bits, at + 2 * i, sizeof bits);
            sum = std::fma(FloatFromBf16(bits), x[2 * s + i], sum);
          }
        }
        out = sum;
      }
    }
  }
}

}  // namespace router_internal

Result<RouterWeights> RouterWeights::Pack(const Matrix& weight, std::string_view isa) {
  if (weight.rows <= 0 || weight.cols <= 0)
    return InvalidArgument(fmt::format("router weights: {}x{} is empty", weight.rows, weight.cols));
  RouterWeights packed;
  EPMOE_ASSIGN_OR_RETURN(packed.isa_, ResolveIsa(isa));
  packed.experts_ = weight.rows;
  packed.hidden_ = weight.cols;
  packed.bf16_ =
      std::all_of(weight.data.begin(), weight.data.end(), [](float w) { return FloatFromBf16(Bf16FromFloat(w)) == w; });
  const int64_t blocks = (weight.rows + kLanes - 1) / kLanes;
  const int64_t steps = packed.bf16_ ? (weight.cols + 1) / 2 : weight.cols;
  packed.packed_.assign(blocks * steps * kStepBytes, 0);
  for (int64_t e = 0; e < weight.rows; ++e) {
    const int64_t block = e / kLanes, group = block / kGroupBlocks;
    const int64_t group_blocks = std::min(kGroupBlocks, blocks - group * kGroupBlocks);
    uint8_t* lane = packed.packed_.data() + group * kGroupBlocks * steps * kStepBytes +
                    (block % kGroupBlocks) * kStepBytes + (e % kLanes) * 4;
    for (int64_t k = 0; k < weight.cols; ++k) {
      const float w = weight.at(e, k);
      if (packed.bf16_) {
        const uint16_t bits = Bf16FromFloat(w);
        std::memcpy(lane + (k / 2) * group_blocks * kStepBytes + (k % 2) * 2, &bits, sizeof bits);
      } else {
        std::memcpy(lane + k * group_blocks * kStepBytes, &w, sizeof w);
      }
    }
  }
  return packed;
}

void RouterWeights::Logits(const Matrix& rows, Matrix* logits, ThreadPool* pool) const {
  EPMOE_CHECK(rows.cols == hidden_);
  logits->Reshape(rows.rows, experts_);
  const int64_t blocks = (experts_ + kLanes - 1) / kLanes;
  const int64_t groups = (blocks + kGroupBlocks - 1) / kGroupBlocks;
  const int64_t steps = bf16_ ? (hidden_ + 1) / 2 : hidden_;
  const int64_t inputs_per_step = bf16_ ? 2 : 1;
  const bool odd_tail = bf16_ && hidden_ % 2 == 1;
  void (*const tile)(const LogitsTile&) = isa_ == Isa::kAvx512 ? LogitsTileAvx512
                                          : isa_ == Isa::kAvx2 ? LogitsTileAvx2
                                                               : LogitsTileReference;
  const int64_t row_items = (rows.rows + kItemRows - 1) / kItemRows;
  // Item i: the rows of item i / groups against group i % groups, so that the groups of a few rows
  // (a decode step) spread over the threads.
  auto run = [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kItemRows * kGroupBlocks * kLanes];
    constexpr int64_t kSumsStride = kGroupBlocks * kLanes;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t group = item % groups, r0 = item / groups * kItemRows;
      const int64_t item_rows = std::min(kItemRows, rows.rows - r0);
      const int64_t group_blocks = std::min(kGroupBlocks, blocks - group * kGroupBlocks);
      const uint8_t* weights = packed_.data() + group * kGroupBlocks * steps * kStepBytes;
      for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
        const int64_t chunk_steps = std::min(kChunkSteps, steps - s0);
        for (int64_t r = 0; r < item_rows; r += kTileRows) {
          tile({.weights = weights + s0 * group_blocks * kStepBytes,
                .blocks = group_blocks,
                .steps = chunk_steps,
                .bf16 = bf16_,
                .odd_tail = odd_tail && s0 + chunk_steps == steps,
                .x = rows.row(r0 + r) + s0 * inputs_per_step,
                .x_stride = rows.cols,
                .rows = std::min(kTileRows, item_rows - r),
                .sums = sums + r * kSumsStride,
                .sums_stride = kSumsStride,
                .first = s0 == 0});
        }
      }
      const int64_t e0 = group * kGroupBlocks * kLanes, e1 = std::min(experts_, e0 + group_blocks * kLanes);
      for (int64_t r = 0; r < item_rows; ++r)
        std::copy(sums + r * kSumsStride, sums + r * kSumsStride + (e1 - e0), logits->row(r0 + r) + e0);
    }
  };
  ParallelFor(pool, row_items * groups, 1, run);
}

}  // namespace epmoe
