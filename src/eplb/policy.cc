#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "epmoe/enum_names.h"
#include "epmoe/eplb_policy.h"
#include "solver.h"

namespace epmoe {

using eplb_internal::CopyWeight;

namespace {
constexpr EnumNames<Policy, 7> kPolicies("policy", {{{Policy::kDeepseek, "deepseek"},
                                                     {Policy::kDeepseekGuarded, "deepseek-guarded"},
                                                     {Policy::kPerStep, "per-step"},
                                                     {Policy::kCost, "cost"},
                                                     {Policy::kMinMove, "min-move"},
                                                     {Policy::kUniform, "uniform"},
                                                     {Policy::kAuto, "auto"}}});
}  // namespace

const char* PolicyName(Policy policy) {
  return kPolicies.Name(policy);
}
std::vector<Policy> AllPolicies() {
  return kPolicies.All();
}
Result<Policy> ParsePolicy(std::string_view name) {
  return kPolicies.Parse(name);
}

bool PolicyValidates(Policy policy) {
  return policy == Policy::kAuto || policy == Policy::kMinMove;
}

Status ValidateBalanceShape(const BalanceShape& shape, int num_experts) {
  if (num_experts < 1) return InvalidArgument(fmt::format("{} experts: need at least 1", num_experts));
  if (shape.num_ranks < 1) return InvalidArgument(fmt::format("ranks {} must be >= 1", shape.num_ranks));
  if (shape.num_nodes < 1 || shape.num_ranks % shape.num_nodes != 0)
    return InvalidArgument(
        fmt::format("nodes {} must be >= 1 and divide the ranks ({})", shape.num_nodes, shape.num_ranks));
  if (shape.num_groups < 1 || num_experts % shape.num_groups != 0)
    return InvalidArgument(
        fmt::format("expert groups {} must be >= 1 and divide the experts ({})", shape.num_groups, num_experts));
  if (shape.num_redundant < 0)
    return InvalidArgument(fmt::format("redundant copies {} must not be negative", shape.num_redundant));
  EPMOE_RETURN_IF_ERROR(CheckRedundantCopies(num_experts, shape.num_redundant, shape.num_ranks));
  const int num_slots = num_experts + shape.num_redundant;
  if (num_slots % shape.num_ranks != 0)
    return InvalidArgument(fmt::format("{} experts + {} redundant = {} slots do not split evenly over {} ranks",
                                       num_experts, shape.num_redundant, num_slots, shape.num_ranks));
  if (shape.num_groups % shape.num_nodes == 0 && shape.num_nodes > 1) {
    if (num_slots % shape.num_nodes != 0)
      return InvalidArgument(fmt::format("{} slots do not split evenly over {} nodes", num_slots, shape.num_nodes));
  }
  return Status::Ok();
}

Status CheckCurrentPlacement(const Placement& current, int num_layers, int num_experts, const BalanceShape& shape) {
  const int num_slots = num_experts + shape.num_redundant;
  if (current.num_layers() != num_layers || current.num_experts() != num_experts || current.num_slots() != num_slots ||
      current.num_ranks() != shape.num_ranks || current.num_nodes() != shape.num_nodes)
    return InvalidArgument(
        fmt::format("the current placement has {} layers, {} experts, {} slots, {} ranks, {} nodes; the load and "
                    "shape need {}, {}, {}, {}, {}",
                    current.num_layers(), current.num_experts(), current.num_slots(), current.num_ranks(),
                    current.num_nodes(), num_layers, num_experts, num_slots, shape.num_ranks, shape.num_nodes));
  return Status::Ok();
}

namespace {

// The guard needs each rank's slots to hold distinct experts of its region.
Status CheckGuardPossible(const BalanceShape& shape, int num_experts) {
  const int num_slots = num_experts + shape.num_redundant;
  const int region_ranks = eplb_internal::RegionRanks(shape);
  const int region_experts = num_experts / (shape.num_ranks / region_ranks);
  if (num_slots / shape.num_ranks > region_experts)
    return InvalidArgument(fmt::format("{} slots per rank cannot hold distinct experts: only {} experts per {}",
                                       num_slots / shape.num_ranks, region_experts,
                                       region_ranks == shape.num_ranks ? "layer" : "node"));
  return Status::Ok();
}

// Uniform weights for a layer without load, so redundant copies spread instead of all going to
// expert 0.
std::vector<double> UsableWeights(std::span<const double> weight) {
  if (std::any_of(weight.begin(), weight.end(), [](double w) { return w > 0; }))
    return std::vector<double>(weight.begin(), weight.end());
  return std::vector<double>(weight.size(), 1.0);
}

// Uniform replication, packed by load with the guard (as deepseek-guarded packs).
std::vector<int32_t> UniformLayer(std::span<const double> raw_weight, const BalanceShape& shape) {
  const std::vector<double> weight = UsableWeights(raw_weight);
  const int num_experts = static_cast<int>(weight.size());
  const CopyWeight per_copy = [&](int e, int n) { return weight[e] / n; };
  std::vector<int32_t> phy2log = eplb_internal::SolveDeepseek(per_copy, num_experts, shape, true, nullptr, true);
  EPMOE_CHECK(eplb_internal::ImproveGuarded(per_copy, num_experts, shape, &phy2log));
  return phy2log;
}

std::vector<int32_t> GuardedLayer(std::span<const double> raw_weight, const BalanceShape& shape) {
  const std::vector<double> weight = UsableWeights(raw_weight);
  const int num_experts = static_cast<int>(weight.size());
  const CopyWeight per_copy = [&](int e, int n) { return weight[e] / n; };
  std::vector<int32_t> plain = eplb_internal::SolveDeepseek(per_copy, num_experts, shape, false);
  if (!eplb_internal::HasDuplicateOnRank(plain, shape.num_ranks)) {
    // DeepSeek's placement already keeps the guard: only lower its busiest rank further.
    EPMOE_CHECK(eplb_internal::ImproveGuarded(per_copy, num_experts, shape, &plain));
    return plain;
  }
  std::vector<int32_t> best = eplb_internal::SolveDeepseek(per_copy, num_experts, shape, true);
  EPMOE_CHECK(eplb_internal::ImproveGuarded(per_copy, num_experts, shape, &best));
  double best_max = eplb_internal::MaxLoad(per_copy, best, num_experts, shape.num_ranks);
  const double plain_max = eplb_internal::MaxLoad(per_copy, plain, num_experts, shape.num_ranks);
  const int num_slots = num_experts + shape.num_redundant;
  const bool small = num_slots <= eplb_internal::kCopySearchMaxSlots;
  if (best_max <= plain_max && !small) return best;  // never worse than deepseek: done
  // Else also repair deepseek's own placement (move duplicates away, then lower the busiest rank).
  std::vector<int32_t> repaired = plain;
  if (eplb_internal::ImproveGuarded(per_copy, num_experts, shape, &repaired)) {
    const double repaired_max = eplb_internal::MaxLoad(per_copy, repaired, num_experts, shape.num_ranks);
    if (repaired_max < best_max) best = repaired, best_max = repaired_max;
  }
  // Small layers: search copy counts too (the guard binds here: deepseek put two copies on a rank).
  if (small) {
    std::vector<int32_t> searched = eplb_internal::SearchCopyCounts(weight, shape, best, best_max);
    if (!searched.empty()) {
      best = std::move(searched);
      best_max = eplb_internal::MaxLoad(per_copy, best, num_experts, shape.num_ranks);
    }
  }
  return best;
}

// Summed load per layer: [layer][expert].
std::vector<std::vector<double>> LayerWeights(const LoadMatrix& load) {
  const std::vector<double> sums = SumOverSteps(load);
  std::vector<std::vector<double>> out(load.num_layers);
  for (int layer = 0; layer < load.num_layers; ++layer)
    out[layer].assign(sums.begin() + layer * load.num_experts, sums.begin() + (layer + 1) * load.num_experts);
  return out;
}

// Per-step search for one layer: values from the series (`per_copy_value` maps a copy's rows to
// its cost), started from each candidate and the best result kept. Each step's picks of an expert
// are shrunk toward the step's mean over experts by `uniform_prior` (0: the picks as counted), so
// the search does not chase which expert happened to be busy in a step.
std::vector<int32_t> SearchLayer(const LoadMatrix& load, int layer, const BalanceShape& shape, double fixed,
                                 const std::function<double(double)>& per_copy_value,
                                 std::vector<std::vector<int32_t>> starts, int rounds, bool spread_over_nodes,
                                 double uniform_prior) {
  const int64_t steps = std::max<int64_t>(load.num_steps, 1);
  bool any_load = false;
  std::vector<double> step_mean(steps, 0.0);  // load per expert, mean over the step's experts
  for (int64_t s = 0; s < load.num_steps; ++s)
    for (double value : load.at(s, layer)) {
      any_load = any_load || value > 0;
      step_mean[s] += value / load.num_experts;
    }
  // Memoized per (expert, copies): the starts and the search ask for the same series.
  std::map<std::pair<int, int>, std::vector<float>> memo;
  const eplb_internal::StepValues values = [&](int expert, int copies, std::span<float> out) {
    std::vector<float>& known = memo[{expert, copies}];
    if (known.empty()) {
      known.resize(steps);
      for (int64_t s = 0; s < steps; ++s) {
        const double rows =
            any_load ? (1 - uniform_prior) * load.at(s, layer)[expert] + uniform_prior * step_mean[s] : 1.0;
        known[s] = static_cast<float>(per_copy_value(rows / copies));
      }
    }
    std::copy(known.begin(), known.end(), out.begin());
  };
  // Start from the candidate with the best objective; the search only lowers it.
  size_t best_start = 0;
  double best_objective = 0;
  for (size_t i = 0; i < starts.size(); ++i) {
    const double objective =
        eplb_internal::PerStepObjective(values, load.num_experts, steps, fixed, starts[i], shape.num_ranks);
    if (i == 0 || objective < best_objective) best_start = i, best_objective = objective;
  }
  std::vector<int32_t> phy2log = std::move(starts[best_start]);
  const bool keep_guard = !eplb_internal::HasDuplicateOnRank(phy2log, shape.num_ranks);
  eplb_internal::SearchPerStep(values, load.num_experts, steps, fixed, shape, keep_guard, rounds, spread_over_nodes,
                               &phy2log);
  return phy2log;
}

}  // namespace

Result<std::vector<int32_t>> DeepseekLayer(std::span<const double> weight, const BalanceShape& shape, bool guarded) {
  const int num_experts = static_cast<int>(weight.size());
  EPMOE_RETURN_IF_ERROR(ValidateBalanceShape(shape, num_experts));
  for (size_t e = 0; e < weight.size(); ++e)
    if (!(weight[e] >= 0) || !std::isfinite(weight[e]))
      return InvalidArgument(fmt::format("weight of expert {} is {}: must be finite and >= 0", e, weight[e]));
  if (guarded) {
    EPMOE_RETURN_IF_ERROR(CheckGuardPossible(shape, num_experts));
    return GuardedLayer(weight, shape);
  }
  const std::vector<double> usable = UsableWeights(weight);
  return eplb_internal::SolveDeepseek([&](int e, int n) { return usable[e] / n; }, num_experts, shape, false);
}

double MaxRankLoad(std::span<const double> weight, std::span<const int32_t> phy2log, int num_ranks) {
  return eplb_internal::MaxLoad([&](int e, int n) { return weight[e] / n; }, phy2log, static_cast<int>(weight.size()),
                                num_ranks);
}

Status ValidatePolicyShape(Policy policy, const BalanceShape& shape, int num_experts) {
  EPMOE_RETURN_IF_ERROR(ValidateBalanceShape(shape, num_experts));
  if (policy != Policy::kDeepseek) EPMOE_RETURN_IF_ERROR(CheckGuardPossible(shape, num_experts));
  return Status::Ok();
}

namespace eplb_internal {

Status CheckPolicyInputs(const LoadMatrix& load, const PolicyOptions& options) {
  EPMOE_RETURN_IF_ERROR(ValidateLoadMatrix(load, "load"));
  const BalanceShape& shape = options.shape;
  const int num_experts = load.num_experts;
  const Policy policy = options.policy;
  EPMOE_RETURN_IF_ERROR(ValidatePolicyShape(policy, shape, num_experts));
  if (options.search_rounds < 0)
    return InvalidArgument(fmt::format("search rounds {} must not be negative", options.search_rounds));
  if (!(options.uniform_prior >= 0 && options.uniform_prior <= 1))
    return InvalidArgument(fmt::format("uniform prior {} must be in [0, 1]", options.uniform_prior));
  const CostModel& cost = options.cost;
  if ((policy == Policy::kCost || policy == Policy::kAuto) &&
      !(cost.bytes_per_expert > 0 && cost.memory_bandwidth > 0 && cost.flops_per_row >= 0 && cost.peak_flops > 0 &&
        cost.fixed_seconds >= 0))
    return InvalidArgument(fmt::format(
        "cost model: bytes per expert {}, bandwidth {}, flops per row {}, peak {}, fixed {}: need positive "
        "bytes, bandwidth and peak, non-negative flops and fixed time",
        cost.bytes_per_expert, cost.memory_bandwidth, cost.flops_per_row, cost.peak_flops, cost.fixed_seconds));
  if (policy == Policy::kMinMove && options.current == nullptr)
    return InvalidArgument("min-move needs the current placement");
  if (options.current != nullptr)
    EPMOE_RETURN_IF_ERROR(CheckCurrentPlacement(*options.current, load.num_layers, num_experts, shape));
  if ((policy == Policy::kMinMove || policy == Policy::kAuto) && !(options.min_move_factor >= 1))
    return InvalidArgument(fmt::format("min-move factor {} must be >= 1", options.min_move_factor));
  if (PolicyValidates(policy) && !(options.validation_fraction > 0 && options.validation_fraction < 1))
    return InvalidArgument(fmt::format("validation fraction {} must be in (0, 1): the later steps that validate",
                                       options.validation_fraction));
  return Status::Ok();
}

Result<Placement> FitPlacement(const LoadMatrix& load, const PolicyOptions& options) {
  const BalanceShape& shape = options.shape;
  const int num_experts = load.num_experts;
  const Policy policy = options.policy;
  const CostModel& cost = options.cost;
  EPMOE_CHECK(policy != Policy::kAuto);
  // Starts of the searches besides their own: uniform replication and the placement in use.
  auto extra_starts = [&](std::span<const double> weight, int layer) {
    std::vector<std::vector<int32_t>> starts = {UniformLayer(weight, shape)};
    if (options.current != nullptr) {
      auto in_use = options.current->phy2log(layer);
      starts.emplace_back(in_use.begin(), in_use.end());
    }
    return starts;
  };

  const std::vector<std::vector<double>> weights = LayerWeights(load);
  std::vector<std::vector<int32_t>> phy2log(load.num_layers);
  for (int layer = 0; layer < load.num_layers; ++layer) {
    const std::vector<double>& weight = weights[layer];
    switch (policy) {
      case Policy::kDeepseek:
      case Policy::kDeepseekGuarded: {
        EPMOE_ASSIGN_OR_RETURN(phy2log[layer], DeepseekLayer(weight, shape, policy == Policy::kDeepseekGuarded));
        break;
      }
      case Policy::kPerStep: {
        EPMOE_ASSIGN_OR_RETURN(std::vector<int32_t> plain, DeepseekLayer(weight, shape, false));
        EPMOE_ASSIGN_OR_RETURN(std::vector<int32_t> guarded, DeepseekLayer(weight, shape, true));
        std::vector<std::vector<int32_t>> starts = extra_starts(weight, layer);
        starts.push_back(std::move(plain));
        starts.push_back(std::move(guarded));
        phy2log[layer] = SearchLayer(
            load, layer, shape, 0.0, [](double rows) { return rows; }, std::move(starts), options.search_rounds, false,
            options.uniform_prior);
        break;
      }
      case Policy::kCost: {
        // Starts: DeepSeek's steps on the mean predicted time per copy, and deepseek-guarded.
        const int64_t steps = std::max<int64_t>(load.num_steps, 1);
        const bool any_load = std::any_of(weight.begin(), weight.end(), [](double w) { return w > 0; });
        // Mean over steps of one copy's time, memoized per (expert, copies): the solver asks often.
        std::vector<std::vector<double>> memo(num_experts);
        const CopyWeight time_per_copy = [&](int e, int n) {
          std::vector<double>& known = memo[e];
          if (static_cast<int>(known.size()) <= n) known.resize(n + 1, -1.0);
          if (known[n] >= 0) return known[n];
          double sum = 0;
          for (int64_t s = 0; s < load.num_steps; ++s)
            sum += ExpertCopySeconds(cost, load.at(s, layer)[e] / n);
          return known[n] = any_load ? sum / steps : ExpertCopySeconds(cost, 1.0 / n);
        };
        std::vector<int32_t> timed = eplb_internal::SolveDeepseek(time_per_copy, num_experts, shape, true);
        eplb_internal::ImproveGuarded(time_per_copy, num_experts, shape, &timed);
        EPMOE_ASSIGN_OR_RETURN(std::vector<int32_t> guarded, DeepseekLayer(weight, shape, true));
        std::vector<std::vector<int32_t>> starts = extra_starts(weight, layer);
        starts.push_back(std::move(timed));
        starts.push_back(std::move(guarded));
        phy2log[layer] = SearchLayer(
            load, layer, shape, cost.fixed_seconds, [&](double rows) { return ExpertCopySeconds(cost, rows); },
            std::move(starts), options.search_rounds, true, options.uniform_prior);
        break;
      }
      case Policy::kMinMove: {
        EPMOE_ASSIGN_OR_RETURN(std::vector<int32_t> reference, DeepseekLayer(weight, shape, true));
        const std::vector<double> usable = UsableWeights(weight);
        const double target = options.min_move_factor * MaxRankLoad(usable, reference, shape.num_ranks);
        phy2log[layer] = eplb_internal::MinMoveLayer(usable, options.current->phy2log(layer), reference, target, shape);
        break;
      }
      case Policy::kUniform: {
        phy2log[layer] = UniformLayer(weight, shape);
        break;
      }
      case Policy::kAuto: break;  // checked above: auto fits through the other policies
    }
  }
  return Placement::Create(num_experts, shape.num_ranks, shape.num_nodes, std::move(phy2log));
}

}  // namespace eplb_internal

}  // namespace epmoe
