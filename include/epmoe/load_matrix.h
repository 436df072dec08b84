// LoadMatrix: non-negative weights per step, MoE layer and logical expert, in any unit and with any
// totals (what DeepSeek's rebalance_experts takes as `weight`, with a step axis). Unlike ExpertLoad,
// which counts picks of a routing trace (integers, every layer of a step summing to rows x top-k),
// a load matrix may hold floats (e.g. decayed averages) and layers may total differently.
// A plain value (thread-compatible).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epmoe/load.h"
#include "epmoe/status.h"

namespace epmoe {

struct LoadMatrix {
  int64_t num_steps = 0;
  int num_layers = 0;
  int num_experts = 0;
  std::vector<double> values;  // [step][layer][expert], num_steps * num_layers * num_experts values

  LoadMatrix() = default;
  LoadMatrix(int64_t steps, int layers, int experts)
      : num_steps(steps),
        num_layers(layers),
        num_experts(experts),
        values(static_cast<size_t>(steps) * layers * experts, 0.0) {}

  std::span<double> at(int64_t step, int layer) {
    return {values.data() + (step * num_layers + layer) * num_experts, static_cast<size_t>(num_experts)};
  }
  std::span<const double> at(int64_t step, int layer) const {
    return {values.data() + (step * num_layers + layer) * num_experts, static_cast<size_t>(num_experts)};
  }
};

// Checks the shape (at least one layer and expert) and that every value is finite and >= 0;
// `source` names the data in errors.
Status ValidateLoadMatrix(const LoadMatrix& load, const std::string& source);

// The picks of a trace as weights (exact: counts below 2^53).
LoadMatrix ToLoadMatrix(const ExpertLoad& load);

// Steps [begin, end) as a new LoadMatrix.
LoadMatrix SliceSteps(const LoadMatrix& load, int64_t begin, int64_t end);

// Sum over all steps: [layer][expert], num_layers * num_experts values.
std::vector<double> SumOverSteps(const LoadMatrix& load);

// Reads a load matrix file; the format is told by its content:
//   .npy   a NumPy array (little-endian float16/32/64 or integers, C order) of 1, 2 or 3 dimensions
//   JSON   a number array `[[...]...]`, or an object whose "weight" (DeepSeek's argument name) or
//          "logical_count" (SGLang's recorder) field holds one; other fields are ignored
//   CSV    one line per layer, one number per expert, comma-separated; a first line that is not
//          numbers is a header; an empty line starts the next step
// 1 dimension is one layer, 2 are [layer][expert] (one step), 3 are [step][layer][expert]. Every
// value must be finite and >= 0; errors name the file and the position of the bad value.
Result<LoadMatrix> ReadLoadMatrix(const std::string& path);
// The JSON forms above from text; `source` names it in errors.
Result<LoadMatrix> LoadMatrixFromJson(const std::string& json_text, const std::string& source);

}  // namespace epmoe
