// Choosing placements by validation: a placement is used on the steps after the ones it was fitted
// on, so auto and min-move judge a fit by how it balances later steps of the load (a split by
// time), not by how well it fits the steps it saw.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "epmoe/balance.h"
#include "epmoe/eplb_policy.h"
#include "solver.h"

namespace epmoe {
namespace {

// A fit must beat the placement in use by more than rounding to be worth moving copies.
constexpr double kBetterBy = 1e-9;

// Steps [0, fit) fit, [fit, n) validate; 0 validation steps when the load has a single step.
struct TimeSplit {
  int64_t fit_steps = 0;
  int64_t validation_steps = 0;
};
TimeSplit SplitByTime(const ExpertLoad& load, double validation_fraction) {
  if (load.num_steps < 2) return {load.num_steps, 0};
  const int64_t validation =
      std::clamp<int64_t>(std::llround(validation_fraction * load.num_steps), 1, load.num_steps - 1);
  return {load.num_steps - validation, validation};
}

std::vector<std::vector<int32_t>> Layers(const Placement& placement) {
  std::vector<std::vector<int32_t>> out;
  for (int layer = 0; layer < placement.num_layers(); ++layer) {
    auto p = placement.phy2log(layer);
    out.emplace_back(p.begin(), p.end());
  }
  return out;
}

// A layer moves only when min-move fitted on the earlier steps balances the later steps better
// than the current placement, and min-move refitted on every step (the one used) does too.
Result<Placement> ValidatedMinMove(const ExpertLoad& load, const PolicyOptions& options) {
  EPMOE_ASSIGN_OR_RETURN(Placement whole, eplb_internal::FitPlacement(load, options));
  const TimeSplit split = SplitByTime(load, options.validation_fraction);
  if (split.validation_steps == 0) return whole;
  const ExpertLoad fit = SliceSteps(load, 0, split.fit_steps);
  const ExpertLoad validation = SliceSteps(load, split.fit_steps, load.num_steps);
  EPMOE_ASSIGN_OR_RETURN(Placement early, eplb_internal::FitPlacement(fit, options));
  const Placement& current = *options.current;
  std::vector<std::vector<int32_t>> phy2log = Layers(whole);
  for (int layer = 0; layer < load.num_layers; ++layer) {
    const double start = LayerBalancedness(current, layer, validation);
    if (LayerBalancedness(early, layer, validation) > start + kBetterBy &&
        LayerBalancedness(whole, layer, validation) > start + kBetterBy)
      continue;
    auto in_use = current.phy2log(layer);
    phy2log[layer].assign(in_use.begin(), in_use.end());
  }
  return Placement::Create(load.num_experts, options.shape.num_ranks, options.shape.num_nodes, std::move(phy2log));
}

}  // namespace

Result<ValidatedChoice> ChooseByValidation(const ExpertLoad& load, const PolicyOptions& options) {
  PolicyOptions checked = options;
  checked.policy = Policy::kAuto;
  EPMOE_RETURN_IF_ERROR(eplb_internal::CheckPolicyInputs(load, checked));
  const BalanceShape& shape = options.shape;
  EPMOE_ASSIGN_OR_RETURN(Placement trivial, Placement::Trivial(load.num_layers, load.num_experts, shape.num_redundant,
                                                               shape.num_ranks, shape.num_nodes));
  const TimeSplit split = SplitByTime(load, options.validation_fraction);
  const ExpertLoad fit = split.validation_steps > 0 ? SliceSteps(load, 0, split.fit_steps) : load;
  const ExpertLoad validation = split.validation_steps > 0 ? SliceSteps(load, split.fit_steps, load.num_steps) : load;

  // Candidates in order of preference on ties: the placement in use (nothing moves), the trivial
  // one, then the policies.
  struct Candidate {
    std::string name;
    Policy policy;
    bool fitted_by_policy;
    std::optional<Placement> early;  // fitted on `fit`
  };
  std::vector<Candidate> candidates;
  if (options.current != nullptr) candidates.push_back({"current", Policy::kAuto, false, *options.current});
  if (options.current == nullptr || !(*options.current == trivial))
    candidates.push_back({"trivial", Policy::kAuto, false, trivial});
  for (Policy policy : AllPolicies()) {
    if (policy == Policy::kAuto || (policy == Policy::kMinMove && options.current == nullptr)) continue;
    PolicyOptions one = options;
    one.policy = policy;
    EPMOE_ASSIGN_OR_RETURN(Placement early, ComputePlacement(fit, one));
    candidates.push_back({PolicyName(policy), policy, true, std::move(early)});
  }

  ValidatedChoice choice{trivial, split.fit_steps, split.validation_steps, {}};
  std::vector<size_t> winner(load.num_layers, 0);
  std::vector<double> best(load.num_layers, -1);
  for (size_t i = 0; i < candidates.size(); ++i) {
    ValidatedCandidate report{candidates[i].name, 0, 0, 0};
    for (int layer = 0; layer < load.num_layers; ++layer) {
      const double fitted = LayerBalancedness(*candidates[i].early, layer, fit);
      const double validated = LayerBalancedness(*candidates[i].early, layer, validation);
      report.fitted += fitted / load.num_layers;
      report.validated += validated / load.num_layers;
      if (validated > best[layer] + kBetterBy) best[layer] = validated, winner[layer] = i;
    }
    if (split.validation_steps == 0) report.validated = std::numeric_limits<double>::quiet_NaN();
    choice.candidates.push_back(std::move(report));
  }

  // Refit each winning policy on every step; the trivial and current placements stay as they are.
  std::vector<std::vector<int32_t>> phy2log(load.num_layers);
  for (size_t i = 0; i < candidates.size(); ++i) {
    std::optional<Placement> refitted;
    for (int layer = 0; layer < load.num_layers; ++layer) {
      if (winner[layer] != i) continue;
      ++choice.candidates[i].layers_chosen;
      if (!refitted) {
        if (candidates[i].fitted_by_policy && split.validation_steps > 0) {
          PolicyOptions one = options;
          one.policy = candidates[i].policy;
          EPMOE_ASSIGN_OR_RETURN(refitted, ComputePlacement(load, one));
        } else {
          refitted = *candidates[i].early;
        }
      }
      auto p = refitted->phy2log(layer);
      phy2log[layer].assign(p.begin(), p.end());
    }
  }
  EPMOE_ASSIGN_OR_RETURN(choice.placement,
                         Placement::Create(load.num_experts, shape.num_ranks, shape.num_nodes, std::move(phy2log)));
  return choice;
}

Result<Placement> ComputePlacement(const ExpertLoad& load, const PolicyOptions& options) {
  EPMOE_RETURN_IF_ERROR(eplb_internal::CheckPolicyInputs(load, options));
  if (options.policy == Policy::kAuto) {
    EPMOE_ASSIGN_OR_RETURN(ValidatedChoice choice, ChooseByValidation(load, options));
    return std::move(choice.placement);
  }
  if (options.policy == Policy::kMinMove) return ValidatedMinMove(load, options);
  return eplb_internal::FitPlacement(load, options);
}

}  // namespace epmoe
