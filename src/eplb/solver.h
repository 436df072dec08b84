// Internal pieces shared by the placement policies (not a public header).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "epmoe/eplb_policy.h"

namespace epmoe::eplb_internal {

// The load one copy of `expert` carries when the expert has `copies` copies (e.g. weight / copies).
using CopyWeight = std::function<double(int expert, int copies)>;

// Ranks that may exchange copies: a node when DeepSeek's hierarchical mode applies (the expert
// groups divide over the nodes), else all ranks.
int RegionRanks(const BalanceShape& shape);

// DeepSeek's rebalance (hierarchical or global, as the reference chooses) on per-copy weights.
// guarded: at most one copy of an expert per rank (copies capped at the region's ranks, packing
// that skips ranks holding the expert, repaired by a swap when no rank is left).
// fixed_copies: use these copy counts (per logical expert; each node's total must match its slots) instead of
// DeepSeek's replication. uniform_copies: each redundant slot to an expert of its node with the fewest copies (the most
// loaded per copy among them), so copy counts differ by at most one inside a node.
std::vector<int32_t> SolveDeepseek(const CopyWeight& weight, int num_experts, const BalanceShape& shape, bool guarded,
                                   const std::vector<int32_t>* fixed_copies = nullptr, bool uniform_copies = false);

// For small layers (at most kCopySearchMaxSlots slots): searches copy counts by
// moving one or two copies between experts, each candidate packed with the guard, and returns the
// best guarded phy2log found if it beats `best_max` (else an empty vector).
constexpr int kCopySearchMaxSlots = 128;
std::vector<int32_t> SearchCopyCounts(std::span<const double> weight, const BalanceShape& shape,
                                      std::span<const int32_t> start, double best_max);

// Removes duplicate copies on a rank by swaps inside regions (when possible), then swaps copies
// between the busiest rank and others while that lowers it. Returns whether the guard holds.
bool ImproveGuarded(const CopyWeight& weight, int num_experts, const BalanceShape& shape,
                    std::vector<int32_t>* phy2log);

// Copies per expert of a layer (E values).
std::vector<int32_t> CountCopies(std::span<const int32_t> phy2log, int num_experts);
// Per-rank loads and their maximum under `weight`.
std::vector<double> RankLoads(const CopyWeight& weight, std::span<const int32_t> phy2log, int num_experts,
                              int num_ranks);
double MaxLoad(const CopyWeight& weight, std::span<const int32_t> phy2log, int num_experts, int num_ranks);
bool HasDuplicateOnRank(std::span<const int32_t> phy2log, int num_ranks);

}  // namespace epmoe::eplb_internal

namespace epmoe::eplb_internal {

// ComputePlacement's checks of the load, shape and options (every policy).
Status CheckPolicyInputs(const LoadMatrix& load, const PolicyOptions& options);
// A policy other than auto fitted on all of `load`, without validation (inputs already checked).
Result<Placement> FitPlacement(const LoadMatrix& load, const PolicyOptions& options);

// Per-step values of one layer: values(expert, copies, out) writes, for each of num_steps steps,
// what one copy of `expert` costs its rank when the expert has `copies` copies.
using StepValues = std::function<void(int expert, int copies, std::span<float> out)>;

// Swaps copies between ranks of a region to lower sum over steps of (fixed + the busiest rank's
// summed values); keeps the guard when `keep_guard`. At most `rounds` swaps. With
// `spread_over_nodes` (global mode, several nodes), then spreads replicated experts' copies over
// nodes by swaps that do not raise the objective. Returns the objective.
double SearchPerStep(const StepValues& values, int num_experts, int64_t num_steps, double fixed,
                     const BalanceShape& shape, bool keep_guard, int rounds, bool spread_over_nodes,
                     std::vector<int32_t>* phy2log);
// The objective of SearchPerStep for a placement.
double PerStepObjective(const StepValues& values, int num_experts, int64_t num_steps, double fixed,
                        std::span<const int32_t> phy2log, int num_ranks);

// min-move on one layer: changes as few slots of `current` as it can until the max rank load
// (weights split evenly over copies) is at most `target`. Returns the new phy2log.
std::vector<int32_t> MinMoveLayer(std::span<const double> weight, std::span<const int32_t> current,
                                  std::span<const int32_t> reference, double target, const BalanceShape& shape);

}  // namespace epmoe::eplb_internal
