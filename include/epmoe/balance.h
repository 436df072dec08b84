// Balance figures of a placement: picks and bytes per rank, balancedness, and a small cost model
// of one rank's expert time. Shared by the recorder, the placement policies, `epmoe balance` and
// the planner. Free functions on plain values: thread-safe.
//
// Picks of a logical expert with n copies are assumed to split evenly over its copies (what the
// dispatch table aims for), so per-rank picks are fractional. A copy is read (its bytes count)
// with weight min(1, picks/n): with c < n picks only c of the n copies are touched.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/load.h"
#include "epmoe/load_figures.h"
#include "epmoe/load_matrix.h"
#include "epmoe/placement.h"

namespace epmoe {

// Time of one rank's experts in one layer (DESIGN.md, cost model):
//   fixed_seconds + sum over touched local copies of max(bytes_per_expert / memory_bandwidth,
//                                                       rows * flops_per_row / peak_flops).
// Decode (few rows per expert) follows bytes read, prefill follows rows computed. The defaults
// are this machine's figures with unit-sized experts; callers set bytes and flops from a model.
struct CostModel {
  double bytes_per_expert = 1.0;   // bytes of one routed expert's weights
  double memory_bandwidth = 30e9;  // bytes per second one rank reads weights at
  double flops_per_row = 6.0;      // operations one row costs in one expert (2 x 3 x hidden x inter)
  double peak_flops = 115e9;       // operations per second of one rank
  double fixed_seconds = 0.0;      // per rank and layer (launch, synchronization)
};

// Predicted seconds of one expert copy that receives `rows` rows (fractional: an expected value).
double ExpertCopySeconds(const CostModel& cost, double rows);

// Per rank, for one layer and one step's per-expert counts (E values): picks (even split over
// copies), expected distinct copies read, and predicted seconds. Each output gets G values.
// The overloads on weights take one step of a LoadMatrix (its values stand for picks).
void RankPicks(const Placement& placement, int layer, std::span<const int64_t> counts, std::span<double> out);
void RankPicks(const Placement& placement, int layer, std::span<const double> weights, std::span<double> out);
void RankCopiesRead(const Placement& placement, int layer, std::span<const int64_t> counts,
                    std::span<double> out);
void RankCopiesRead(const Placement& placement, int layer, std::span<const double> weights,
                    std::span<double> out);
void RankSeconds(const Placement& placement, int layer, std::span<const int64_t> counts, const CostModel& cost,
                 std::span<double> out);
void RankSeconds(const Placement& placement, int layer, std::span<const double> weights, const CostModel& cost,
                 std::span<double> out);

// Mean over the load's steps of one layer's balancedness (mean/max picks per rank); 1 without steps.
double LayerBalancedness(const Placement& placement, int layer, const LoadMatrix& load);

// A placement scored on a load (each step and layer, then averaged).
struct PlacementScore {
  double balancedness = 1;       // mean over steps and layers of mean/max picks per rank
  double max_picks = 0;          // mean over steps and layers of the busiest rank's picks
  double mean_picks = 0;         // mean over steps and layers of the mean rank's picks
  double byte_balancedness = 1;  // mean over steps and layers of mean/max bytes read per rank
  double max_bytes = 0;          // mean over steps and layers of the most bytes one rank reads
  double mean_bytes = 0;
  double step_seconds = 0;       // mean over steps of the sum over layers of the slowest rank's time
  double mean_rank_seconds = 0;  // the same with the mean rank's time (no waiting)
};
PlacementScore ScorePlacement(const Placement& placement, const ExpertLoad& load, const CostModel& cost);
// The same on a load matrix: its values stand for picks.
PlacementScore ScorePlacement(const Placement& placement, const LoadMatrix& load, const CostModel& cost);

// The reference "even router": every step's picks redrawn uniformly (k distinct experts per row,
// rows from the load, or independent picks when k or rows are unknown), scored on `placement`.
// Deterministic from `seed`.
PlacementScore ScoreEvenRouter(const Placement& placement, const ExpertLoad& load, const CostModel& cost,
                               uint64_t seed);

}  // namespace epmoe
