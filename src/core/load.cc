#include "epmoe/load.h"

#include <fmt/format.h>

namespace epmoe {

Status ValidateExpertLoad(const ExpertLoad& load, const std::string& source) {
  if (load.num_layers <= 0 || load.num_experts <= 0 || load.num_steps < 0 || load.top_k < 0)
    return InvalidArgument(fmt::format("{}: bad load shape: {} steps, {} layers, {} experts, top-k {}", source,
                                       load.num_steps, load.num_layers, load.num_experts, load.top_k));
  const size_t expected = static_cast<size_t>(load.num_steps) * load.num_layers * load.num_experts;
  if (load.counts.size() != expected || load.rows.size() != static_cast<size_t>(load.num_steps))
    return InvalidArgument(fmt::format("{}: load holds {} counts and {} row totals, expected {} and {}", source,
                                       load.counts.size(), load.rows.size(), expected, load.num_steps));
  for (size_t i = 0; i < load.counts.size(); ++i) {
    if (load.counts[i] < 0) {
      const int64_t per_step = static_cast<int64_t>(load.num_layers) * load.num_experts;
      return InvalidArgument(fmt::format("{}: negative count {} at step {} layer {} expert {}", source, load.counts[i],
                                         static_cast<int64_t>(i) / per_step,
                                         static_cast<int64_t>(i) % per_step / load.num_experts,
                                         static_cast<int64_t>(i) % load.num_experts));
    }
  }
  return Status::Ok();
}

ExpertLoad SliceSteps(const ExpertLoad& load, int64_t begin, int64_t end) {
  EPMOE_CHECK(0 <= begin && begin <= end && end <= load.num_steps);
  ExpertLoad out(end - begin, load.num_layers, load.num_experts, load.top_k);
  const int64_t per_step = static_cast<int64_t>(load.num_layers) * load.num_experts;
  std::copy(load.counts.begin() + begin * per_step, load.counts.begin() + end * per_step, out.counts.begin());
  std::copy(load.rows.begin() + begin, load.rows.begin() + end, out.rows.begin());
  return out;
}

std::vector<int64_t> SumOverSteps(const ExpertLoad& load) {
  std::vector<int64_t> sum(static_cast<size_t>(load.num_layers) * load.num_experts, 0);
  const size_t per_step = sum.size();
  for (size_t i = 0; i < load.counts.size(); ++i) sum[i % per_step] += load.counts[i];
  return sum;
}

}  // namespace epmoe
