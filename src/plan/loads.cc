// Routing loads for the planner: an even router's picks, or a trace's picks regrouped to a batch.
#include <algorithm>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "epmoe/plan.h"

namespace epmoe {

std::vector<LayerLoad> EvenRouterLoads(const ModelConfig& m, int64_t rows, int samples, uint64_t seed) {
  EPMOE_CHECK(rows >= 0 && samples >= 0 && m.top_k <= m.num_experts);
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(rows));
  std::uniform_int_distribution<int> expert(0, m.num_experts - 1);
  std::vector<LayerLoad> loads(samples);
  std::vector<int> chosen(m.top_k);
  for (auto& load : loads) {
    load.rows = rows;
    load.picks.assign(m.num_experts, 0);
    for (int64_t r = 0; r < rows; ++r) {
      // k distinct experts: redraw a repeat (k << E in every preset, so few redraws).
      for (int j = 0; j < m.top_k; ++j) {
        int e = expert(rng);
        while (std::find(chosen.begin(), chosen.begin() + j, e) != chosen.begin() + j) e = expert(rng);
        chosen[j] = e;
        ++load.picks[e];
      }
    }
  }
  return loads;
}

Result<std::vector<LayerLoad>> TraceLayerLoads(const ExpertLoad& trace, const ModelConfig& m, int64_t rows,
                                               int max_samples, uint64_t seed) {
  if (trace.num_experts != m.num_experts)
    return InvalidArgument(fmt::format("the trace has {} experts per layer but model '{}' has {}", trace.num_experts,
                                       m.name, m.num_experts));
  if (trace.top_k != 0 && trace.top_k != m.top_k)
    return InvalidArgument(fmt::format("the trace picks top-{} but model '{}' picks top-{}", trace.top_k, m.name,
                                       m.top_k));
  if (trace.num_steps < 1 || trace.num_layers < 1) return InvalidArgument("the trace has no steps or no layers");
  if (rows < 1) return InvalidArgument(fmt::format("batch must be positive, got {}", rows));
  // Rows per step: recorded, or picks / k.
  std::vector<int64_t> step_rows(trace.num_steps);
  for (int64_t s = 0; s < trace.num_steps; ++s) {
    int64_t r = s < static_cast<int64_t>(trace.rows.size()) ? trace.rows[s] : 0;
    if (r == 0) {
      const auto counts = trace.at(s, 0);
      const int64_t picks = std::accumulate(counts.begin(), counts.end(), int64_t{0});
      r = picks / m.top_k;
    }
    step_rows[s] = r;
  }
  // Groups of consecutive steps holding at least `rows` rows.
  struct Group {
    int64_t first = 0, count = 0, rows = 0;
  };
  std::vector<Group> groups;
  for (int64_t s = 0; s < trace.num_steps;) {
    Group g{s, 0, 0};
    while (s < trace.num_steps && g.rows < rows) {
      g.rows += step_rows[s];
      ++g.count;
      ++s;
    }
    if (g.rows >= rows && g.rows > 0) groups.push_back(g);
  }
  if (groups.empty()) {
    const int64_t total = std::accumulate(step_rows.begin(), step_rows.end(), int64_t{0});
    return InvalidArgument(fmt::format("the trace holds {} rows in all, fewer than a batch of {}", total, rows));
  }
  // (group, layer) pairs, spread evenly when there are more than max_samples.
  const int64_t pairs = static_cast<int64_t>(groups.size()) * trace.num_layers;
  const int64_t wanted = std::min<int64_t>(pairs, std::max(1, max_samples));
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(rows) + 1);
  std::vector<LayerLoad> loads;
  loads.reserve(wanted);
  for (int64_t i = 0; i < wanted; ++i) {
    const int64_t pair = i * pairs / wanted;
    const Group& g = groups[pair / trace.num_layers];
    const int layer = static_cast<int>(pair % trace.num_layers);
    LayerLoad load;
    load.rows = rows;
    load.layer = layer;
    load.picks.assign(m.num_experts, 0);
    for (int64_t s = g.first; s < g.first + g.count; ++s) {
      const auto counts = trace.at(s, layer);
      for (int e = 0; e < m.num_experts; ++e) load.picks[e] += counts[e];
    }
    if (g.rows > rows) {
      // Keep the picks of `rows` of the group's rows: each pick with probability rows / g.rows.
      const double keep = static_cast<double>(rows) / g.rows;
      for (auto& p : load.picks) p = std::binomial_distribution<int64_t>(p, keep)(rng);
    }
    loads.push_back(std::move(load));
  }
  return loads;
}

double Balancedness(const LayerLoad& load, int gpus) {
  EPMOE_CHECK(gpus >= 1);
  const int experts = static_cast<int>(load.picks.size());
  std::vector<double> per_rank(gpus, 0.0);
  for (int e = 0; e < experts; ++e)
    per_rank[static_cast<int64_t>(e) * gpus / experts] += static_cast<double>(load.picks[e]);
  return Balancedness(per_rank);
}

}  // namespace epmoe
