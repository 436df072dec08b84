// min-move: reach a target max rank load from the current placement with few changed slots.
// Greedy: each round applies the move that removes the most load above the target per changed
// slot: a swap of two copies between ranks (2 slots) or giving one copy of an expert that has
// several to another expert (1 slot). Copies that stay on their rank keep their slot. If the greedy
// stalls above the target, the reference placement (deepseek-guarded) is used instead, with its
// ranks matched to the current ones inside each node and kept copies left in their slots.
#include <algorithm>
#include <map>

#include "solver.h"

namespace epmoe::eplb_internal {
namespace {

double Excess(double load, double target) { return std::max(0.0, load - target); }

// `reference` relabeled to change as few slots of `current` as possible: ranks permuted inside
// nodes (greedy on shared copies), then each copy that a rank keeps stays in its current slot.
std::vector<int32_t> AlignToCurrent(std::span<const int32_t> current, std::span<const int32_t> reference,
                                    const BalanceShape& shape) {
  const int num_ranks = shape.num_ranks;
  const int spr = static_cast<int>(current.size()) / num_ranks;
  const int rpn = num_ranks / shape.num_nodes;
  auto overlap = [&](int current_rank, int reference_rank) {
    std::vector<int32_t> a(current.begin() + current_rank * spr, current.begin() + (current_rank + 1) * spr);
    std::vector<int32_t> b(reference.begin() + reference_rank * spr, reference.begin() + (reference_rank + 1) * spr);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    std::vector<int32_t> common;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
    return static_cast<int>(common.size());
  };
  std::vector<int> reference_of(num_ranks, -1);
  for (int node = 0; node < shape.num_nodes; ++node) {
    std::vector<std::tuple<int, int, int>> pairs;  // (-overlap, current rank, reference rank)
    for (int c = node * rpn; c < (node + 1) * rpn; ++c)
      for (int r = node * rpn; r < (node + 1) * rpn; ++r) pairs.emplace_back(-overlap(c, r), c, r);
    std::sort(pairs.begin(), pairs.end());
    std::vector<bool> used(num_ranks, false);
    for (const auto& [negative, c, r] : pairs)
      if (reference_of[c] < 0 && !used[r]) reference_of[c] = r, used[r] = true;
  }
  std::vector<int32_t> out(current.size(), -1);
  for (int c = 0; c < num_ranks; ++c) {
    std::vector<int32_t> wanted(reference.begin() + reference_of[c] * spr,
                                reference.begin() + (reference_of[c] + 1) * spr);
    for (int s = c * spr; s < (c + 1) * spr; ++s) {
      auto it = std::find(wanted.begin(), wanted.end(), current[s]);
      if (it != wanted.end()) out[s] = current[s], wanted.erase(it);
    }
    for (int s = c * spr; s < (c + 1) * spr; ++s)
      if (out[s] < 0) out[s] = wanted.back(), wanted.pop_back();
  }
  return out;
}

}  // namespace

std::vector<int32_t> MinMoveLayer(std::span<const double> weight, std::span<const int32_t> current,
                                  std::span<const int32_t> reference, double target, const BalanceShape& shape) {
  const int num_experts = static_cast<int>(weight.size());
  const int num_ranks = shape.num_ranks;
  const int num_slots = static_cast<int>(current.size());
  const int spr = num_slots / num_ranks;
  std::vector<int32_t> phy2log(current.begin(), current.end());
  std::vector<int32_t> copies = CountCopies(phy2log, num_experts);
  auto per_copy = [&](int e, int n) { return weight[e] / n; };
  std::vector<double> load = RankLoads(per_copy, phy2log, num_experts, num_ranks);
  auto holds = [&](int rank, int expert, int except) {
    for (int s = rank * spr; s < (rank + 1) * spr; ++s)
      if (s != except && phy2log[s] == expert) return true;
    return false;
  };
  std::vector<bool> changed(num_slots, false);
  const double tolerance = 1e-9 * std::max(1.0, target);
  for (int round = 0; round < 2 * num_slots; ++round) {
    if (*std::max_element(load.begin(), load.end()) <= target + tolerance) break;
    double best_gain = 0;
    int best_kind = 0, best_a = -1, best_b = -1;  // kind 1: swap slots a, b; kind 2: slot a -> expert b
    auto consider = [&](double excess_removed, int slots_changed, int kind, int a, int b) {
      const double gain = excess_removed / std::max(slots_changed, 1);
      if (excess_removed > tolerance && gain > best_gain) best_gain = gain, best_kind = kind, best_a = a, best_b = b;
    };
    for (int rank_a = 0; rank_a < num_ranks; ++rank_a) {
      if (load[rank_a] <= target + tolerance) continue;
      for (int a = rank_a * spr; a < (rank_a + 1) * spr; ++a) {
        const double wa = per_copy(phy2log[a], copies[phy2log[a]]);
        for (int b = 0; b < num_slots; ++b) {
          const int rank_b = b / spr;
          if (rank_b == rank_a || phy2log[a] == phy2log[b]) continue;
          const double d = per_copy(phy2log[b], copies[phy2log[b]]) - wa;
          if (d >= 0) continue;
          if (holds(rank_b, phy2log[a], b) || holds(rank_a, phy2log[b], a)) continue;
          const double before = Excess(load[rank_a], target) + Excess(load[rank_b], target);
          const double after = Excess(load[rank_a] + d, target) + Excess(load[rank_b] - d, target);
          consider(before - after, (changed[a] ? 0 : 1) + (changed[b] ? 0 : 1), 1, a, b);
        }
      }
    }
    // Give a copy of an expert with several copies to one of the experts with the most load per copy.
    std::vector<int> hot(num_experts);
    for (int e = 0; e < num_experts; ++e) hot[e] = e;
    const int num_hot = std::min(num_experts, 8);
    std::partial_sort(hot.begin(), hot.begin() + num_hot, hot.end(),
                      [&](int x, int y) { return per_copy(x, copies[x]) > per_copy(y, copies[y]); });
    for (int a = 0; a < num_slots; ++a) {
      const int x = phy2log[a];
      if (copies[x] < 2) continue;
      for (int h = 0; h < num_hot; ++h) {
        const int y = hot[h];
        if (y == x || holds(a / spr, y, a)) continue;
        std::map<int, double> delta;  // rank -> load change
        for (int s = 0; s < num_slots; ++s) {
          if (phy2log[s] == x)
            delta[s / spr] += s == a ? -per_copy(x, copies[x])
                                     : per_copy(x, copies[x] - 1) - per_copy(x, copies[x]);
          else if (phy2log[s] == y)
            delta[s / spr] += per_copy(y, copies[y] + 1) - per_copy(y, copies[y]);
        }
        delta[a / spr] += per_copy(y, copies[y] + 1);
        double removed = 0;
        for (const auto& [rank, d] : delta) removed += Excess(load[rank], target) - Excess(load[rank] + d, target);
        consider(removed, changed[a] ? 0 : 1, 2, a, y);
      }
    }
    if (best_a < 0) break;
    if (best_kind == 1) {
      const double d = per_copy(phy2log[best_b], copies[phy2log[best_b]]) -
                       per_copy(phy2log[best_a], copies[phy2log[best_a]]);
      load[best_a / spr] += d;
      load[best_b / spr] -= d;
      std::swap(phy2log[best_a], phy2log[best_b]);
      changed[best_a] = changed[best_b] = true;
    } else {
      --copies[phy2log[best_a]];
      phy2log[best_a] = best_b;
      ++copies[best_b];
      changed[best_a] = true;
      load = RankLoads(per_copy, phy2log, num_experts, num_ranks);
    }
  }
  std::vector<int32_t> aligned = AlignToCurrent(current, reference, shape);
  if (*std::max_element(load.begin(), load.end()) > target + tolerance) return aligned;
  auto moves = [&](const std::vector<int32_t>& p) {
    int n = 0;
    for (int s = 0; s < num_slots; ++s) n += p[s] != current[s];
    return n;
  };
  return moves(phy2log) <= moves(aligned) ? phy2log : aligned;
}

}  // namespace epmoe::eplb_internal
