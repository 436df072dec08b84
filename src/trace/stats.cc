// Trace statistics (see trace_stats.h).
#include <fmt/format.h>

#include <algorithm>

#include "epmoe/load_figures.h"
#include "epmoe/trace_stats.h"

namespace epmoe {
namespace {

struct LayerAccumulator {
  double touched = 0, max_over_mean = 0, balancedness = 0, ranks_per_row = 0, copies_per_row = 0;
  int64_t steps_with_picks = 0, rows_with_picks = 0, picks = 0;
  std::vector<int64_t> total;  // per expert
};

}  // namespace

Result<TraceStats> ComputeTraceStats(TraceReader* reader, int ranks, int hottest) {
  const TraceInfo& info = reader->info();
  const int L = info.num_layers, E = info.num_experts, k = info.top_k, G = ranks;
  if (G < 1 || G > E) return InvalidArgument(fmt::format("ranks {} out of [1, {} experts]", G, E));
  if (hottest < 0) return InvalidArgument(fmt::format("hottest {} is negative", hottest));
  TraceStats stats;
  stats.info = info;
  stats.ranks = G;
  std::vector<LayerAccumulator> acc(L);
  for (auto& a : acc) a.total.assign(E, 0);
  std::vector<double> per_rank(G);
  std::vector<uint8_t> seen(G);
  while (true) {
    StepPicks step;
    EPMOE_ASSIGN_OR_RETURN(bool more, reader->Next(&step));
    if (!more) break;
    ++stats.steps;
    stats.rows += step.rows;
    for (int l = 0; l < L; ++l) {
      LayerAccumulator& a = acc[l];
      const int64_t* counts = &step.counts[static_cast<size_t>(l) * E];
      int64_t sum = 0, max = 0, touched = 0;
      std::fill(per_rank.begin(), per_rank.end(), 0);
      for (int e = 0; e < E; ++e) {
        sum += counts[e];
        max = std::max(max, counts[e]);
        touched += counts[e] > 0;
        a.total[e] += counts[e];
        per_rank[TrivialRankOf(e, E, G)] += static_cast<double>(counts[e]);
      }
      if (sum == 0) continue;
      a.picks += sum;
      ++a.steps_with_picks;
      a.touched += static_cast<double>(touched);
      a.max_over_mean += static_cast<double>(max) * E / static_cast<double>(sum);
      a.balancedness += Balancedness(per_rank);
      if (info.has_picks && step.rows > 0) {
        const Picks& picks = step.layers[l];
        for (int64_t r = 0; r < picks.rows; ++r) {
          std::fill(seen.begin(), seen.end(), 0);
          int distinct = 0;
          for (int j = 0; j < k; ++j) {
            const int rank = TrivialRankOf(picks.expert(r, j), E, G);
            distinct += !seen[rank];
            seen[rank] = 1;
          }
          const int home = static_cast<int>(r * G / picks.rows);
          a.ranks_per_row += distinct;
          a.copies_per_row += distinct - seen[home];
        }
        a.rows_with_picks += picks.rows;
      }
    }
  }
  double balancedness_sum = 0, ranks_sum = 0, copies_sum = 0;
  int layers_with_picks = 0;
  for (int l = 0; l < L; ++l) {
    const LayerAccumulator& a = acc[l];
    LayerTraceStats s;
    s.layer_id = info.layer_ids.empty() ? l : info.layer_ids[l];
    s.picks = a.picks;
    if (a.steps_with_picks > 0) {
      const double steps = static_cast<double>(a.steps_with_picks);
      s.experts_touched_mean = a.touched / steps;
      s.max_over_mean_mean = a.max_over_mean / steps;
      s.balancedness_mean = a.balancedness / steps;
      s.max_over_mean_total = static_cast<double>(*std::max_element(a.total.begin(), a.total.end())) * E /
                              static_cast<double>(a.picks);
      balancedness_sum += s.balancedness_mean;
      ++layers_with_picks;
    }
    if (a.rows_with_picks > 0) {
      s.ranks_per_row_mean = a.ranks_per_row / static_cast<double>(a.rows_with_picks);
      s.copies_per_row_mean = a.copies_per_row / static_cast<double>(a.rows_with_picks);
      ranks_sum += s.ranks_per_row_mean;
      copies_sum += s.copies_per_row_mean;
    }
    std::vector<int> order(E);
    for (int e = 0; e < E; ++e) order[e] = e;
    const int shown = std::min(hottest, E);
    std::partial_sort(order.begin(), order.begin() + shown, order.end(), [&](int x, int y) {
      return a.total[x] > a.total[y] || (a.total[x] == a.total[y] && x < y);
    });
    for (int i = 0; i < shown; ++i) s.hottest.push_back({order[i], a.total[order[i]]});
    stats.layers.push_back(std::move(s));
  }
  if (layers_with_picks > 0) {
    stats.balancedness_mean = balancedness_sum / layers_with_picks;
    if (info.has_picks) {
      stats.ranks_per_row_mean = ranks_sum / layers_with_picks;
      stats.copies_per_row_mean = copies_sum / layers_with_picks;
    }
  }
  if (k > 0 && E % G == 0) stats.uniform_ranks_per_row = ExpectedRanksPerRow(E, k, G);
  return stats;
}

}  // namespace epmoe
