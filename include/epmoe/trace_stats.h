// Statistics of a routing trace: per layer, how many experts a step touches, how uneven the picks
// are, which experts are hottest, the balancedness over G ranks with the trivial placement, and
// how many ranks a row must reach (traveling rows). Plain values; computing them streams the trace.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "epmoe/trace.h"

namespace epmoe {

struct LayerTraceStats {
  int layer_id = 0;                   // the source's layer id
  int64_t picks = 0;                  // over the whole trace
  double experts_touched_mean = 0;    // experts with at least one pick, mean over steps
  double max_over_mean_mean = 0;      // per step: busiest expert / mean picks per expert; mean over steps
  double max_over_mean_total = 0;     // the same over the whole trace's summed counts
  std::vector<std::pair<int, int64_t>> hottest;  // (expert, picks over the trace), busiest first
  double balancedness_mean = 0;       // per step: mean / max picks per rank; mean over steps
  double ranks_per_row_mean = 0;      // distinct ranks among a row's k experts (needs picks)
  double copies_per_row_mean = 0;     // of those, ranks other than the row's home rank (needs picks)
};

struct TraceStats {
  TraceInfo info;
  int ranks = 1;                      // G
  int64_t steps = 0;
  int64_t rows = 0;                   // over all steps (0 when the source does not say)
  std::vector<LayerTraceStats> layers;
  double balancedness_mean = 0;       // mean over layers of the per-layer means
  double ranks_per_row_mean = 0;      // mean over layers
  double copies_per_row_mean = 0;     // mean over layers
  double uniform_ranks_per_row = 0;   // G * (1 - C(E - E/G, k) / C(E, k)): uniform routing's expectation
};

// Trivial placement: expert e lives on rank floor(e * G / E). Rows start data-parallel: row r of a
// step of T rows lives on rank floor(r * G / T). Steps without picks are left out of the per-step
// means. `hottest` experts are listed per layer. Requires 1 <= ranks <= experts.
Result<TraceStats> ComputeTraceStats(TraceReader* reader, int ranks, int hottest = 5);

// The rank holding expert e under the trivial placement.
inline int TrivialRankOf(int expert, int num_experts, int ranks) {
  return static_cast<int>(static_cast<int64_t>(expert) * ranks / num_experts);
}

}  // namespace epmoe
