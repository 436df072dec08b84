// DeepSeek's EPLB (rebalance_experts) and the guarded variant. Follows the published reference
// step by step so that it reproduces it exactly, ties included: balanced packing takes items in a
// stable descending order and puts each in the least loaded pack with room (lowest index on ties);
// replication gives each redundant slot to the expert with the largest load per copy (lowest index).
#include <algorithm>
#include <numeric>

#include "solver.h"

namespace epmoe::eplb_internal {
namespace {

struct Packing {
  std::vector<int> pack;          // item -> pack
  std::vector<int> rank_in_pack;  // item -> position inside its pack
};

bool PackHolds(const std::vector<std::vector<int>>& contents, int pack, int expert,
               const std::vector<int>& expert_of_item) {
  for (int item : contents[pack])
    if (expert_of_item[item] == expert) return true;
  return false;
}

// Packs n items into num_packs packs of n / num_packs items. With expert_of_item, no pack gets two
// items of one expert: when every pack with room already holds the item's expert, an item of a
// full pack B (one without the expert) moves to the least loaded pack A with room and the new item
// takes its place in B. Such a pair exists while each expert has at most num_packs items: B exists
// because A holds the expert, and A holds fewer distinct experts than B holds items.
Packing BalancedPacking(std::span<const double> weight, int num_packs, const std::vector<int>* expert_of_item) {
  const int n = static_cast<int>(weight.size());
  const int per_pack = n / num_packs;
  Packing out{std::vector<int>(n), std::vector<int>(n, 0)};
  if (per_pack == 1) {
    std::iota(out.pack.begin(), out.pack.end(), 0);
    return out;
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return weight[a] > weight[b]; });
  std::vector<double> load(num_packs, 0.0);
  std::vector<std::vector<int>> contents(num_packs);
  auto place = [&](int item, int pack, int position) {
    out.pack[item] = pack;
    out.rank_in_pack[item] = position;
    load[pack] += weight[item];
  };
  for (int item : order) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p) {
      if (static_cast<int>(contents[p].size()) >= per_pack) continue;
      if (expert_of_item != nullptr && PackHolds(contents, p, (*expert_of_item)[item], *expert_of_item)) continue;
      if (best < 0 || load[p] < load[best]) best = p;
    }
    if (best >= 0) {
      place(item, best, static_cast<int>(contents[best].size()));
      contents[best].push_back(item);
      continue;
    }
    EPMOE_CHECK(expert_of_item != nullptr);
    const std::vector<int>& experts = *expert_of_item;
    int room = -1;
    for (int p = 0; p < num_packs; ++p)
      if (static_cast<int>(contents[p].size()) < per_pack && (room < 0 || load[p] < load[room])) room = p;
    EPMOE_CHECK(room >= 0);
    int best_pack = -1, best_index = -1;
    double best_max = 0;
    for (int p = 0; p < num_packs; ++p) {
      if (p == room || PackHolds(contents, p, experts[item], experts)) continue;
      for (int index = 0; index < static_cast<int>(contents[p].size()); ++index) {
        const int moved = contents[p][index];
        if (PackHolds(contents, room, experts[moved], experts)) continue;
        const double new_max = std::max(load[room] + weight[moved], load[p] - weight[moved] + weight[item]);
        if (best_pack < 0 || new_max < best_max) best_pack = p, best_index = index, best_max = new_max;
      }
    }
    EPMOE_CHECK_MSG(best_pack >= 0, "guarded packing found no swap");
    const int moved = contents[best_pack][best_index];
    const int moved_position = out.rank_in_pack[moved];
    load[best_pack] -= weight[moved];
    place(moved, room, static_cast<int>(contents[room].size()));
    contents[room].push_back(moved);
    place(item, best_pack, moved_position);
    contents[best_pack][best_index] = item;
  }
  return out;
}

// Replicates n experts into num_slots slots: slot i < n holds expert i, each further slot the
// expert with the largest weight per copy (at most max_copies copies each); with `uniform`, the
// expert with the fewest copies, the largest weight per copy among those.
struct Replication {
  std::vector<int> slot_expert;
  std::vector<int> copies;
};
Replication Replicate(const std::function<double(int, int)>& copy_weight, int n, int num_slots, int max_copies,
                      bool uniform) {
  Replication out{std::vector<int>(num_slots), std::vector<int>(n, 1)};
  std::iota(out.slot_expert.begin(), out.slot_expert.begin() + n, 0);
  std::vector<double> per_copy(n);
  for (int e = 0; e < n; ++e) per_copy[e] = copy_weight(e, 1);
  for (int slot = n; slot < num_slots; ++slot) {
    int best = -1;
    for (int e = 0; e < n; ++e)
      if (out.copies[e] < max_copies &&
          (best < 0 || (uniform && out.copies[e] < out.copies[best]) ||
           ((!uniform || out.copies[e] == out.copies[best]) && per_copy[e] > per_copy[best])))
        best = e;
    EPMOE_CHECK_MSG(best >= 0, "replication ran out of experts below the copy cap");
    out.slot_expert[slot] = best;
    per_copy[best] = copy_weight(best, ++out.copies[best]);
  }
  return out;
}

}  // namespace

int RegionRanks(const BalanceShape& shape) {
  return shape.num_groups % shape.num_nodes == 0 ? shape.num_ranks / shape.num_nodes : shape.num_ranks;
}

std::vector<int32_t> SolveDeepseek(const CopyWeight& weight, int num_experts, const BalanceShape& shape, bool guarded,
                                   const std::vector<int32_t>* fixed_copies, bool uniform_copies) {
  const int num_slots = num_experts + shape.num_redundant;
  const bool hierarchical = shape.num_groups % shape.num_nodes == 0;
  const int groups = hierarchical ? shape.num_groups : 1;
  const int nodes = hierarchical ? shape.num_nodes : 1;
  const int group_size = num_experts / groups;
  const int groups_per_node = groups / nodes;
  const int experts_per_node = num_experts / nodes;
  const int slots_per_node = num_slots / nodes;
  const int ranks_per_node = shape.num_ranks / nodes;
  const int slots_per_rank = num_slots / shape.num_ranks;

  // Step 1: expert groups to nodes.
  std::vector<double> group_weight(groups, 0.0);
  for (int e = 0; e < num_experts; ++e) group_weight[e / group_size] += weight(e, 1);
  const Packing group_packing = BalancedPacking(group_weight, nodes, nullptr);
  std::vector<int> node_expert_to_expert(num_experts);  // "mlog" -> logical
  for (int e = 0; e < num_experts; ++e) {
    const int g = e / group_size;
    const int node_expert =
        (group_packing.pack[g] * groups_per_node + group_packing.rank_in_pack[g]) * group_size + e % group_size;
    node_expert_to_expert[node_expert] = e;
  }

  std::vector<int32_t> phy2log(num_slots);
  for (int node = 0; node < nodes; ++node) {
    const int* local_to_expert = node_expert_to_expert.data() + node * experts_per_node;
    auto local_weight = [&](int local, int copies) { return weight(local_to_expert[local], copies); };
    // Step 2: copies inside the node.
    Replication replication;
    if (fixed_copies != nullptr) {
      replication.copies.resize(experts_per_node);
      for (int local = 0; local < experts_per_node; ++local) {
        replication.copies[local] = (*fixed_copies)[local_to_expert[local]];
        replication.slot_expert.push_back(local);
      }
      for (int local = 0; local < experts_per_node; ++local)
        for (int c = 1; c < replication.copies[local]; ++c) replication.slot_expert.push_back(local);
      EPMOE_CHECK(static_cast<int>(replication.slot_expert.size()) == slots_per_node);
    } else {
      replication = Replicate(local_weight, experts_per_node, slots_per_node, guarded ? ranks_per_node : slots_per_node,
                              uniform_copies);
    }
    // Step 3: copies to the node's ranks.
    std::vector<double> copy_weight(slots_per_node);
    for (int i = 0; i < slots_per_node; ++i)
      copy_weight[i] = local_weight(replication.slot_expert[i], replication.copies[replication.slot_expert[i]]);
    const Packing packing = BalancedPacking(copy_weight, ranks_per_node, guarded ? &replication.slot_expert : nullptr);
    for (int i = 0; i < slots_per_node; ++i) {
      const int slot = node * slots_per_node + packing.pack[i] * slots_per_rank + packing.rank_in_pack[i];
      phy2log[slot] = local_to_expert[replication.slot_expert[i]];
    }
  }
  return phy2log;
}

std::vector<int32_t> CountCopies(std::span<const int32_t> phy2log, int num_experts) {
  std::vector<int32_t> copies(num_experts, 0);
  for (int32_t e : phy2log) ++copies[e];
  return copies;
}

std::vector<double> RankLoads(const CopyWeight& weight, std::span<const int32_t> phy2log, int num_experts,
                              int num_ranks) {
  const std::vector<int32_t> copies = CountCopies(phy2log, num_experts);
  const int slots_per_rank = static_cast<int>(phy2log.size()) / num_ranks;
  std::vector<double> loads(num_ranks, 0.0);
  for (size_t slot = 0; slot < phy2log.size(); ++slot)
    loads[slot / slots_per_rank] += weight(phy2log[slot], copies[phy2log[slot]]);
  return loads;
}

double MaxLoad(const CopyWeight& weight, std::span<const int32_t> phy2log, int num_experts, int num_ranks) {
  const std::vector<double> loads = RankLoads(weight, phy2log, num_experts, num_ranks);
  return *std::max_element(loads.begin(), loads.end());
}

bool HasDuplicateOnRank(std::span<const int32_t> phy2log, int num_ranks) {
  const int slots_per_rank = static_cast<int>(phy2log.size()) / num_ranks;
  for (int rank = 0; rank < num_ranks; ++rank)
    for (int a = 0; a < slots_per_rank; ++a)
      for (int b = a + 1; b < slots_per_rank; ++b)
        if (phy2log[rank * slots_per_rank + a] == phy2log[rank * slots_per_rank + b]) return true;
  return false;
}

bool ImproveGuarded(const CopyWeight& weight, int num_experts, const BalanceShape& shape,
                    std::vector<int32_t>* phy2log_ptr) {
  std::vector<int32_t>& phy2log = *phy2log_ptr;
  const int num_ranks = shape.num_ranks;
  const int slots_per_rank = static_cast<int>(phy2log.size()) / num_ranks;
  const int region = RegionRanks(shape);
  const std::vector<int32_t> copies = CountCopies(phy2log, num_experts);
  std::vector<double> slot_weight(phy2log.size());
  for (size_t s = 0; s < phy2log.size(); ++s) slot_weight[s] = weight(phy2log[s], copies[phy2log[s]]);
  std::vector<double> load = RankLoads(weight, phy2log, num_experts, num_ranks);
  // copies_on[rank * E + expert]: how many copies of the expert the rank holds.
  std::vector<uint16_t> copies_on(static_cast<size_t>(num_ranks) * num_experts, 0);
  for (size_t s = 0; s < phy2log.size(); ++s) ++copies_on[s / slots_per_rank * num_experts + phy2log[s]];
  // Whether `rank` holds a copy of `expert` other than the one in slot `except`.
  auto holds = [&](int rank, int expert, int except) {
    const int n = copies_on[static_cast<size_t>(rank) * num_experts + expert];
    return n - (except >= 0 && phy2log[except] == expert ? 1 : 0) > 0;
  };
  auto swap_slots = [&](int a, int b) {
    const int rank_a = a / slots_per_rank, rank_b = b / slots_per_rank;
    load[rank_a] += slot_weight[b] - slot_weight[a];
    load[rank_b] += slot_weight[a] - slot_weight[b];
    --copies_on[static_cast<size_t>(rank_a) * num_experts + phy2log[a]];
    --copies_on[static_cast<size_t>(rank_b) * num_experts + phy2log[b]];
    ++copies_on[static_cast<size_t>(rank_a) * num_experts + phy2log[b]];
    ++copies_on[static_cast<size_t>(rank_b) * num_experts + phy2log[a]];
    std::swap(phy2log[a], phy2log[b]);
    std::swap(slot_weight[a], slot_weight[b]);
  };
  // Best partner slot for moving slot a off its rank (guard kept on both ranks), or -1.
  auto best_partner = [&](int a, bool must_lower_max) {
    const int rank_a = a / slots_per_rank;
    const int first_rank = rank_a / region * region;
    int best = -1;
    double best_max = must_lower_max ? load[rank_a] : 0;
    for (int rank_b = first_rank; rank_b < first_rank + region; ++rank_b) {
      if (rank_b == rank_a || holds(rank_b, phy2log[a], -1)) continue;
      for (int b = rank_b * slots_per_rank; b < (rank_b + 1) * slots_per_rank; ++b) {
        if (phy2log[b] == phy2log[a] || holds(rank_a, phy2log[b], a)) continue;
        const double delta = slot_weight[b] - slot_weight[a];
        const double new_max = std::max(load[rank_a] + delta, load[rank_b] - delta);
        const bool better = best < 0 ? (!must_lower_max || new_max < best_max * (1 - 1e-12)) : new_max < best_max;
        if (better) best = b, best_max = new_max;
      }
    }
    return best;
  };
  bool guarded = true;
  for (int rank = 0; rank < num_ranks; ++rank)
    for (int a = rank * slots_per_rank; a < (rank + 1) * slots_per_rank; ++a) {
      if (!holds(rank, phy2log[a], a)) continue;
      const int b = best_partner(a, false);
      if (b < 0) {
        guarded = false;
        continue;
      }
      swap_slots(a, b);
    }
  const int max_rounds = 4 * static_cast<int>(phy2log.size());
  for (int round = 0; round < max_rounds; ++round) {
    const int busiest = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
    int best_a = -1, best_b = -1;
    double best_max = load[busiest];
    for (int a = busiest * slots_per_rank; a < (busiest + 1) * slots_per_rank; ++a) {
      const int b = best_partner(a, true);
      if (b < 0) continue;
      const double delta = slot_weight[b] - slot_weight[a];
      const double new_max = std::max(load[busiest] + delta, load[b / slots_per_rank] - delta);
      if (new_max < best_max) best_a = a, best_b = b, best_max = new_max;
    }
    if (best_a < 0) break;
    swap_slots(best_a, best_b);
  }
  return guarded && !HasDuplicateOnRank(phy2log, num_ranks);
}

}  // namespace epmoe::eplb_internal

namespace epmoe::eplb_internal {

std::vector<int32_t> SearchCopyCounts(std::span<const double> weight, const BalanceShape& shape,
                                      std::span<const int32_t> start, double best_max) {
  const int num_experts = static_cast<int>(weight.size());
  const CopyWeight per_copy = [&](int e, int n) { return weight[e] / n; };
  const int cap = RegionRanks(shape);
  // The node of each expert (fixed by the group packing, which does not depend on copy counts).
  const int slots_per_region = static_cast<int>(start.size()) / (shape.num_ranks / cap);
  std::vector<int> region_of(num_experts, 0);
  for (size_t slot = 0; slot < start.size(); ++slot) region_of[start[slot]] = static_cast<int>(slot) / slots_per_region;
  // Lexicographic score: max rank load, then the sum of squared rank loads.
  struct Score {
    double max = 0, squares = 0;
    bool operator<(const Score& o) const {
      const double eps = 1e-9 * std::max(1.0, o.max);
      return max < o.max - eps || (max <= o.max + eps && squares < o.squares - eps * o.max);
    }
  };
  auto evaluate = [&](const std::vector<int32_t>& copies, std::vector<int32_t>* phy2log) {
    *phy2log = SolveDeepseek(per_copy, num_experts, shape, true, &copies);
    Score score{1e300, 1e300};
    if (!ImproveGuarded(per_copy, num_experts, shape, phy2log)) return score;
    const std::vector<double> loads = RankLoads(per_copy, *phy2log, num_experts, shape.num_ranks);
    score.max = *std::max_element(loads.begin(), loads.end());
    score.squares = 0;
    for (double l : loads) score.squares += l * l;
    return score;
  };
  std::vector<int32_t> copies = CountCopies(start, num_experts);
  std::vector<int32_t> phy2log;
  Score best = evaluate(copies, &phy2log);
  std::vector<int32_t> best_phy2log = phy2log;
  // Bounded work: about 100k slots packed in all (6,250 candidates for 16 slots, 1,400 for 72).
  const int kMaxEvaluations = std::max(100, 100000 / static_cast<int>(start.size()));
  int evaluations = 0;
  bool improved = true;
  while (improved && evaluations < kMaxEvaluations) {
    improved = false;
    // One move (a copy from x to y), then two moves together when no single move helps.
    for (int depth = 1; depth <= 2 && !improved; ++depth) {
      std::vector<int32_t> trial = copies;
      std::function<bool(int)> search = [&](int level) {
        for (int x = 0; x < num_experts; ++x) {
          if (trial[x] < 2) continue;
          for (int y = 0; y < num_experts; ++y) {
            if (y == x || trial[y] >= cap || region_of[y] != region_of[x]) continue;
            --trial[x], ++trial[y];
            bool found = false;
            if (level < depth) {
              found = search(level + 1);
            } else if (++evaluations <= kMaxEvaluations) {
              const Score score = evaluate(trial, &phy2log);
              if (score < best) best = score, best_phy2log = phy2log, copies = trial, found = true;
            }
            ++trial[x], --trial[y];
            if (found) return true;
          }
        }
        return false;
      };
      improved = search(1);
    }
  }
  if (best.max < best_max * (1 - 1e-12)) return best_phy2log;
  return {};
}

}  // namespace epmoe::eplb_internal
