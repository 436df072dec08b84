// Placement policies of the expert-parallel load balancer (EPLB): from measured load (ExpertLoad)
// and a shape (G ranks in N nodes, expert groups, R redundant copies) to a Placement.
//
//   deepseek          DeepSeek's EPLB, exactly (hierarchical when the expert groups divide evenly
//                     over the nodes: groups -> nodes, copies inside nodes, copies -> ranks; global
//                     otherwise). Ties: stable descending sort, lowest pack among equal packs.
//   deepseek-guarded  the same steps, but never two copies of one logical expert on one rank, then
//                     swaps that lower the busiest rank; never worse than deepseek on max load.
//   per-step          minimizes the sum over steps of each step's busiest rank (picks), from the
//                     per-step series, each step's picks shrunk toward its even split over the
//                     experts by uniform_prior (a prior against fitting which expert was busy in a
//                     step), starting from deepseek and deepseek-guarded.
//   cost              minimizes the sum over steps of the slowest rank's predicted time
//                     (CostModel: bytes read in decode, rows computed in prefill), on the picks
//                     smoothed as per-step's; copies stay in
//                     the node of their expert group when the groups divide over the nodes.
//   min-move          from the current placement, the fewest changed slots that bring the max
//                     load (summed picks) within min_move_factor of deepseek-guarded's. A layer
//                     keeps its current placement unless the move, fitted on the earlier steps,
//                     balances the later (validation) steps better than it does.
//   uniform           every expert the same number of copies (R a multiple of E), else copy
//                     counts differing by at most one (the extra copies to the most loaded
//                     experts); copies packed onto ranks by load as deepseek-guarded does.
//   auto              chooses by validation: the current and the trivial placement and uniform,
//                     deepseek, deepseek-guarded, min-move, per-step and cost fitted on the earlier
//                     steps of the load are scored on the later ones (validation_fraction of the
//                     steps); the first in that order whose validated balancedness is within one
//                     standard error (over the validation steps) of the best wins and is refitted
//                     on all steps.
// per-step and cost also start from uniform and the current placement. The summed load drives
// deepseek, deepseek-guarded, uniform and min-move. All policies handle all-zero load (spread as
// if uniform), one expert, R = 0 and G = 1; impossible shapes are refused. A load of one step
// cannot be split: there auto chooses by the fitted balancedness and min-move does not validate.
// Free functions on plain values: thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/balance.h"
#include "epmoe/load.h"
#include "epmoe/load_matrix.h"
#include "epmoe/placement.h"
#include "epmoe/status.h"

namespace epmoe {

struct BalanceShape {
  int num_ranks = 1;      // G: ranks of the EP group
  int num_nodes = 1;      // N: nodes (G/N consecutive ranks each)
  int num_groups = 1;     // expert groups of the model (device-limited routing); 1: none
  int num_redundant = 0;  // R: redundant copies per layer (P = E + R slots)
};

// Checks a shape against E experts: (E + R) % G == 0, G % N == 0, E % groups == 0, and so on.
Status ValidateBalanceShape(const BalanceShape& shape, int num_experts);

enum class Policy { kDeepseek, kDeepseekGuarded, kPerStep, kCost, kMinMove, kUniform, kAuto };
const char* PolicyName(Policy policy);
Result<Policy> ParsePolicy(std::string_view name);
std::vector<Policy> AllPolicies();
// Whether the policy splits its load by time to validate (auto, min-move): a caller that keeps a
// window of steps should pass them as steps, not summed.
bool PolicyValidates(Policy policy);

struct PolicyOptions {
  Policy policy = Policy::kDeepseek;
  BalanceShape shape;
  CostModel cost;                      // kCost: the per-rank time model
  const Placement* current = nullptr;  // the placement in use (same shape): min-move starts
                                       // from it, per-step, cost and auto consider it
  double min_move_factor = 1.05;       // kMinMove: target max load = factor x deepseek-guarded's
  int search_rounds = 64;              // kPerStep, kCost: improving swaps tried per layer (bound)
  double validation_fraction = 0.5;    // kAuto, kMinMove: the later steps that validate, in (0, 1)
  double uniform_prior = 0.5;          // kPerStep, kCost: each step's picks of an expert shrunk this
                                       // far toward the step's mean over experts, in [0, 1]
};

// The placement of `options.policy` for `load` (all its steps). Errors name the bad shape value.
// A trace's picks and a load matrix of the same values give the same placement.
Result<Placement> ComputePlacement(const ExpertLoad& load, const PolicyOptions& options);
Result<Placement> ComputePlacement(const LoadMatrix& load, const PolicyOptions& options);

// What auto saw of one candidate: balancedness (mean over steps and layers of mean/max picks per
// rank) on the steps it was fitted on and on the later validation steps, and whether it won.
struct ValidatedCandidate {
  std::string name;  // a policy's name, "trivial" or "current"
  double fitted = 1;
  double validated = 1;  // NaN when the load has one step (nothing to validate on)
  bool chosen = false;
};
struct ValidatedChoice {
  Placement placement;                          // the winner, refitted on every step
  int64_t fit_steps = 0, validation_steps = 0;  // the split (validation_steps 0: one step, no split)
  std::vector<ValidatedCandidate> candidates;
};
// auto with its report (ComputePlacement with kAuto returns its placement).
Result<ValidatedChoice> ChooseByValidation(const LoadMatrix& load, const PolicyOptions& options);

// DeepSeek's rebalance_experts on one layer's weights (E values), returning phy2log (E + R slots).
// `guarded` gives deepseek-guarded. Exposed for tests and for callers with their own weights.
Result<std::vector<int32_t>> DeepseekLayer(std::span<const double> weight, const BalanceShape& shape, bool guarded);

// The largest per-rank load of one layer under `phy2log`: a copy carries weight[e] / copies(e).
double MaxRankLoad(std::span<const double> weight, std::span<const int32_t> phy2log, int num_ranks);

}  // namespace epmoe
