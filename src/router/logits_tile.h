// The router's logits kernels (RouterWeights::Logits): one call accumulates the logits of up to 4
// rows against the 16-expert blocks of one group of RouterWeights' packed weights.
//
// Packed layout: the experts in blocks of 16 (zero-padded), the blocks in groups of up to 4; a
// group's weights are steps of 64 bytes per block, block after block: in fp32 one input of the
// block's 16 experts (lane e: expert e), in bf16 two consecutive inputs (lane e: the 32 bits of
// expert e's inputs 2s and 2s + 1, the first in the low half; an odd hidden size pads the last step
// with a zero). Every kernel sums each (row, expert) over the inputs in order with one fused
// multiply-add per input, so all give the same bits.
#pragma once

#include <cstdint>

namespace epmoe::router_internal {

constexpr int64_t kLanes = 16;       // experts per block (one 64-byte vector)
constexpr int64_t kGroupBlocks = 4;  // blocks per group
constexpr int64_t kTileRows = 4;     // rows per call, at most
constexpr int64_t kStepBytes = 64;   // per block and step

struct LogitsTile {
  const uint8_t* weights;  // the group's first step to run
  int64_t blocks;          // in the group: 1 - 4 (a step of the group is blocks * 64 bytes)
  int64_t steps;           // steps to run
  bool bf16;               // the packing (else fp32)
  bool odd_tail;           // bf16: the last step's second input is padding (not in x)
  const float* x;          // row 0's input of the first step (bf16: its first input)
  int64_t x_stride;        // floats between rows
  int64_t rows;            // 1 - 4
  float* sums;             // row r, expert 16 b + lane at sums[r * sums_stride + 16 b + lane]
  int64_t sums_stride;     // floats between rows of sums
  bool first;              // start from +0, not from what sums holds
};

void LogitsTileReference(const LogitsTile& t);
void LogitsTileAvx2(const LogitsTile& t);
void LogitsTileAvx512(const LogitsTile& t);

}  // namespace epmoe::router_internal
