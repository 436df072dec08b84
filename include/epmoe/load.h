// ExpertLoad: picks per logical expert for each step and MoE layer, the common currency of the
// trace tools (which produce it), the load balancer (which places experts from it) and the planner
// (which predicts costs from it). A plain value (thread-compatible).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

struct ExpertLoad {
  int num_layers = 0;
  int num_experts = 0;
  int top_k = 0;  // picks per row, 0 when unknown (e.g. count-only sources)
  int64_t num_steps = 0;
  std::vector<int64_t> rows;    // rows (tokens) in each step, num_steps values; 0 when unknown
  std::vector<int64_t> counts;  // [step][layer][expert], num_steps * num_layers * num_experts values

  ExpertLoad() = default;
  ExpertLoad(int64_t steps, int layers, int experts, int k = 0)
      : num_layers(layers),
        num_experts(experts),
        top_k(k),
        num_steps(steps),
        rows(steps, 0),
        counts(static_cast<size_t>(steps) * layers * experts, 0) {}

  std::span<int64_t> at(int64_t step, int layer) {
    return {counts.data() + (step * num_layers + layer) * num_experts, static_cast<size_t>(num_experts)};
  }
  std::span<const int64_t> at(int64_t step, int layer) const {
    return {counts.data() + (step * num_layers + layer) * num_experts, static_cast<size_t>(num_experts)};
  }
};

// Checks the shape and that no count is negative; `source` names the data in errors.
Status ValidateExpertLoad(const ExpertLoad& load, const std::string& source);

// Steps [begin, end) as a new ExpertLoad (used to split a trace into training and held-out parts).
ExpertLoad SliceSteps(const ExpertLoad& load, int64_t begin, int64_t end);

// Sum over all steps: [layer][expert], num_layers * num_experts values.
std::vector<int64_t> SumOverSteps(const ExpertLoad& load);

}  // namespace epmoe
