// Deterministic synthetic weights and rows, in a model's real shapes.
//
// Every value is a pure function of (seed, layer, tensor, row, column), so any rank can generate
// exactly its own experts or slices and get the same numbers as a single-process reference, and
// generation parallelizes without changing results. Values are uniform in
// [-1/sqrt(fan_in), 1/sqrt(fan_in)] so a layer's outputs stay of order one (rows in [-1, 1], router
// biases in [-0.1, 0.1], expert biases in [-0.5, 0.5]).
#pragma once

#include <cstdint>

#include "epmoe/matrix.h"
#include "epmoe/model.h"

namespace epmoe {

class ThreadPool;

// Which tensor of a layer; `index` in SyntheticTensor selects the expert.
enum class TensorKind : uint32_t {
  kRouter = 1,  // [E x hidden]
  kRouterBias,  // [1 x E]: the correction bias, or the bias added to the logits (ModelConfig)
  kExpertGate,  // [intermediate x hidden], index = logical expert
  kExpertUp,    // [intermediate x hidden]
  kExpertDown,  // [hidden x intermediate]
  kSharedGate,  // index = shared expert
  kSharedUp,
  kSharedDown,
  kRows,              // input rows, index = step
  kExpertGateBias,    // [1 x intermediate] (ModelConfig::expert_bias), index = logical expert
  kExpertUpBias,      // [1 x intermediate]
  kExpertDownBias,    // [1 x hidden]
  kSharedOutputGate,  // [1 x hidden] (ModelConfig::shared_output_gate)
};

struct SyntheticTensor {
  TensorKind kind;
  int layer = 0;
  int index = 0;
  int64_t rows = 0;  // full shape of the tensor
  int64_t cols = 0;
};

// Fills out (row_count x col_count, row-major) with the block of `tensor` that starts at
// (row_begin, col_begin). The value at (r, c) does not depend on the block asked for.
void FillSynthetic(uint64_t seed, const SyntheticTensor& tensor, int64_t row_begin, int64_t row_count,
                   int64_t col_begin, int64_t col_count, float* out);

// A whole synthetic tensor as a Matrix.
Matrix SyntheticMatrix(uint64_t seed, const SyntheticTensor& tensor, ThreadPool* pool = nullptr);

// Rows of a step: `count` rows starting at global row `first_row` of step `step`, values in [-1, 1].
Matrix SyntheticRows(uint64_t seed, const ModelConfig& model, int step, int64_t first_row, int64_t count);

}  // namespace epmoe
