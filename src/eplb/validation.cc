// Choosing placements by validation: a placement is used on the steps after the ones it was fitted
// on, so auto and min-move judge a fit by how it balances later steps of the load (a split by
// time), not by how well it fits the steps it saw.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
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
TimeSplit SplitByTime(const LoadMatrix& load, double validation_fraction) {
  if (load.num_steps < 2) return {load.num_steps, 0};
  const int64_t validation = std::clamp<int64_t>(static_cast<int64_t>(std::floor(validation_fraction * load.num_steps)),
                                                 1, load.num_steps - 1);
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
Result<Placement> ValidatedMinMove(const LoadMatrix& load, const PolicyOptions& options) {
  EPMOE_ASSIGN_OR_RETURN(Placement whole, eplb_internal::FitPlacement(load, options));
  const TimeSplit split = SplitByTime(load, options.validation_fraction);
  if (split.validation_steps == 0) return whole;
  const LoadMatrix fit = SliceSteps(load, 0, split.fit_steps);
  const LoadMatrix validation = SliceSteps(load, split.fit_steps, load.num_steps);
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

// Per step of `load`, the mean over layers of mean/max picks per rank.
std::vector<double> StepBalancedness(const Placement& placement, const LoadMatrix& load) {
  std::vector<double> out(load.num_steps, 0.0), per_rank(placement.num_ranks());
  for (int64_t step = 0; step < load.num_steps; ++step)
    for (int layer = 0; layer < load.num_layers; ++layer) {
      RankPicks(placement, layer, load.at(step, layer), per_rank);
      out[step] += Balancedness(per_rank) / load.num_layers;
    }
  return out;
}

// The one-standard-error rule of cross-validation: the first candidate whose mean per-step score
// is within one standard error (of its per-step difference to the best) of the best candidate's.
// A winner by less than the steps' noise does not displace a simpler candidate. With one step
// there is no error estimate: the best is taken.
size_t OneStandardErrorChoice(const std::vector<std::vector<double>>& per_step) {
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  size_t best = 0;
  for (size_t i = 1; i < per_step.size(); ++i)
    if (mean(per_step[i]) > mean(per_step[best]) + kBetterBy) best = i;
  const size_t n = per_step[best].size();
  if (n < 2) return best;
  for (size_t i = 0; i < best; ++i) {
    std::vector<double> difference(n);
    for (size_t s = 0; s < n; ++s) difference[s] = per_step[best][s] - per_step[i][s];
    const double m = mean(difference);
    double squares = 0;
    for (double d : difference) squares += (d - m) * (d - m);
    const double standard_error = std::sqrt(squares / (n - 1) / n);
    if (m <= standard_error + kBetterBy) return i;
  }
  return best;
}

}  // namespace

Result<ValidatedChoice> ChooseByValidation(const LoadMatrix& load, const PolicyOptions& options) {
  PolicyOptions checked = options;
  checked.policy = Policy::kAuto;
  EPMOE_RETURN_IF_ERROR(eplb_internal::CheckPolicyInputs(load, checked));
  const BalanceShape& shape = options.shape;
  EPMOE_ASSIGN_OR_RETURN(Placement trivial, Placement::Trivial(load.num_layers, load.num_experts, shape.num_redundant,
                                                               shape.num_ranks, shape.num_nodes));
  const TimeSplit split = SplitByTime(load, options.validation_fraction);
  const LoadMatrix fit = split.validation_steps > 0 ? SliceSteps(load, 0, split.fit_steps) : load;
  const LoadMatrix validation = split.validation_steps > 0 ? SliceSteps(load, split.fit_steps, load.num_steps) : load;

  // Candidates from the simplest (nothing moves, no load needed) to the most fitted: the
  // one-standard-error rule below prefers the first that is not clearly worse than the best.
  struct Candidate {
    std::string name;
    std::optional<Policy> policy;    // none: the current or the trivial placement, used as it is
    std::optional<Placement> early;  // fitted on `fit`
  };
  std::vector<Candidate> candidates;
  if (options.current != nullptr) candidates.push_back({"current", std::nullopt, *options.current});
  if (options.current == nullptr || !(*options.current == trivial))
    candidates.push_back({"trivial", std::nullopt, trivial});
  for (Policy policy : {Policy::kUniform, Policy::kDeepseek, Policy::kDeepseekGuarded, Policy::kMinMove,
                        Policy::kPerStep, Policy::kCost}) {
    if (policy == Policy::kMinMove && options.current == nullptr) continue;
    PolicyOptions one = options;
    one.policy = policy;
    EPMOE_ASSIGN_OR_RETURN(Placement early, ComputePlacement(fit, one));
    candidates.push_back({PolicyName(policy), policy, std::move(early)});
  }

  ValidatedChoice choice{trivial, split.fit_steps, split.validation_steps, {}};
  std::vector<std::vector<double>> per_step;  // [candidate][validation step], mean over layers
  for (const Candidate& c : candidates) {
    ValidatedCandidate report{c.name, 0, 0, false};
    for (int layer = 0; layer < load.num_layers; ++layer) {
      report.fitted += LayerBalancedness(*c.early, layer, fit) / load.num_layers;
      report.validated += LayerBalancedness(*c.early, layer, validation) / load.num_layers;
    }
    if (split.validation_steps == 0) report.validated = std::numeric_limits<double>::quiet_NaN();
    choice.candidates.push_back(std::move(report));
    per_step.push_back(StepBalancedness(*c.early, validation));
  }
  const size_t chosen = OneStandardErrorChoice(per_step);
  choice.candidates[chosen].chosen = true;

  // The winner refitted on every step; the trivial and current placements stay as they are.
  const Candidate& winner = candidates[chosen];
  if (!winner.policy || split.validation_steps == 0) {
    choice.placement = *winner.early;
    return choice;
  }
  PolicyOptions one = options;
  one.policy = *winner.policy;
  EPMOE_ASSIGN_OR_RETURN(choice.placement, ComputePlacement(load, one));
  return choice;
}

Result<Placement> ComputePlacement(const ExpertLoad& load, const PolicyOptions& options) {
  EPMOE_RETURN_IF_ERROR(ValidateExpertLoad(load, "load"));
  return ComputePlacement(ToLoadMatrix(load), options);
}

Result<Placement> ComputePlacement(const LoadMatrix& load, const PolicyOptions& options) {
  EPMOE_RETURN_IF_ERROR(eplb_internal::CheckPolicyInputs(load, options));
  if (options.policy == Policy::kAuto) {
    EPMOE_ASSIGN_OR_RETURN(ValidatedChoice choice, ChooseByValidation(load, options));
    return std::move(choice.placement);
  }
  if (options.policy == Policy::kMinMove) return ValidatedMinMove(load, options);
  return eplb_internal::FitPlacement(load, options);
}

}  // namespace epmoe
