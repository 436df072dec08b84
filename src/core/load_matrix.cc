#include "epmoe/load_matrix.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace epmoe {

Status ValidateLoadMatrix(const LoadMatrix& load, const std::string& source) {
  if (load.num_steps < 0 || load.num_layers < 1 || load.num_experts < 1)
    return InvalidArgument(fmt::format("{}: load matrix of {} steps, {} layers, {} experts: need a layer and an expert",
                                       source, load.num_steps, load.num_layers, load.num_experts));
  const size_t expected = static_cast<size_t>(load.num_steps) * load.num_layers * load.num_experts;
  if (load.values.size() != expected)
    return InvalidArgument(
        fmt::format("{}: load matrix holds {} values, its shape needs {}", source, load.values.size(), expected));
  for (size_t i = 0; i < load.values.size(); ++i) {
    if (!(load.values[i] >= 0) || !std::isfinite(load.values[i])) {
      const int64_t per_step = static_cast<int64_t>(load.num_layers) * load.num_experts;
      return InvalidArgument(fmt::format("{}: load {} at step {} layer {} expert {}: must be finite and >= 0", source,
                                         load.values[i], static_cast<int64_t>(i) / per_step,
                                         static_cast<int64_t>(i) % per_step / load.num_experts,
                                         static_cast<int64_t>(i) % load.num_experts));
    }
  }
  return Status::Ok();
}

LoadMatrix ToLoadMatrix(const ExpertLoad& load) {
  LoadMatrix out;
  out.num_steps = load.num_steps;
  out.num_layers = load.num_layers;
  out.num_experts = load.num_experts;
  out.values.assign(load.counts.begin(), load.counts.end());
  return out;
}

LoadMatrix SliceSteps(const LoadMatrix& load, int64_t begin, int64_t end) {
  EPMOE_CHECK(0 <= begin && begin <= end && end <= load.num_steps);
  LoadMatrix out(end - begin, load.num_layers, load.num_experts);
  const int64_t per_step = static_cast<int64_t>(load.num_layers) * load.num_experts;
  std::copy(load.values.begin() + begin * per_step, load.values.begin() + end * per_step, out.values.begin());
  return out;
}

std::vector<double> SumOverSteps(const LoadMatrix& load) {
  std::vector<double> sum(static_cast<size_t>(load.num_layers) * load.num_experts, 0.0);
  const size_t per_step = sum.size();
  for (size_t i = 0; i < load.values.size(); ++i) sum[i % per_step] += load.values[i];
  return sum;
}

}  // namespace epmoe
