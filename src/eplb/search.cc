// Local search on the per-step objective (sum over steps of the busiest rank), used by the
// per-step and cost policies. A swap of two copies changes only two ranks, so each candidate is
// scored in O(steps) from the per-step top three ranks.
#include <algorithm>
#include <cmath>
#include <limits>

#include "solver.h"

namespace epmoe::eplb_internal {
namespace {

struct Top3 {
  double value[3];
  int rank[3];
};

class StepLoads {
 public:
  StepLoads(const StepValues& values, int num_experts, int64_t num_steps, double fixed,
            std::span<const int32_t> phy2log, int num_ranks)
      : steps_(num_steps), ranks_(num_ranks), slots_per_rank_(static_cast<int>(phy2log.size()) / num_ranks),
        expert_values_(static_cast<size_t>(num_experts) * num_steps),
        load_(static_cast<size_t>(num_ranks) * num_steps, static_cast<float>(fixed)), top_(num_steps),
        top_max_(num_steps) {
    const std::vector<int32_t> copies = CountCopies(phy2log, num_experts);
    for (int e = 0; e < num_experts; ++e) values(e, copies[e], ExpertValues(e));
    for (size_t slot = 0; slot < phy2log.size(); ++slot) AddSlot(static_cast<int>(slot) / slots_per_rank_, phy2log[slot], 1);
    RefreshTop();
  }

  std::span<float> ExpertValues(int e) { return {expert_values_.data() + static_cast<size_t>(e) * steps_, static_cast<size_t>(steps_)}; }
  const float* Load(int rank) const { return load_.data() + static_cast<size_t>(rank) * steps_; }
  float* MutableLoad(int rank) { return load_.data() + static_cast<size_t>(rank) * steps_; }
  const std::vector<Top3>& top() const { return top_; }

  void AddSlot(int rank, int expert, float sign) {
    float* load = MutableLoad(rank);
    const float* v = expert_values_.data() + static_cast<size_t>(expert) * steps_;
    for (int64_t s = 0; s < steps_; ++s) load[s] += sign * v[s];
  }

  void RefreshTop() {
    for (int64_t s = 0; s < steps_; ++s) {
      Top3 t{{-1e300, -1e300, -1e300}, {-1, -1, -1}};
      for (int g = 0; g < ranks_; ++g) {
        const double v = load_[static_cast<size_t>(g) * steps_ + s];
        if (v > t.value[0]) {
          t.value[2] = t.value[1], t.rank[2] = t.rank[1];
          t.value[1] = t.value[0], t.rank[1] = t.rank[0];
          t.value[0] = v, t.rank[0] = g;
        } else if (v > t.value[1]) {
          t.value[2] = t.value[1], t.rank[2] = t.rank[1];
          t.value[1] = v, t.rank[1] = g;
        } else if (v > t.value[2]) {
          t.value[2] = v, t.rank[2] = g;
        }
      }
      top_[s] = t;
      top_max_[s] = static_cast<float>(t.value[0]);
    }
  }

  double Objective() const {
    double sum = 0;
    for (const Top3& t : top_) sum += t.value[0];
    return sum;
  }

  // Change of the objective when rank a swaps a copy of expert x for rank b's copy of expert y.
  // `other`: RestExcluding(a, b).
  double SwapDelta(int a, int x, int b, int y, const float* other) const {
    const float* la = Load(a);
    const float* lb = Load(b);
    const float* vx = expert_values_.data() + static_cast<size_t>(x) * steps_;
    const float* vy = expert_values_.data() + static_cast<size_t>(y) * steps_;
    // The new per-step maximum minus the old one (top_max_), summed. Eight partial sums let the
    // compiler vectorize (a single float sum may not be reordered).
    constexpr int kLanes = 8;
    float partial[kLanes] = {};
    int64_t s = 0;
    for (; s + kLanes <= steps_; s += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float d = vy[s + j] - vx[s + j];
        partial[j] += std::max(other[s + j], std::max(la[s + j] + d, lb[s + j] - d)) - top_max_[s + j];
      }
    double delta = 0;
    for (; s < steps_; ++s) {
      const float d = vy[s] - vx[s];
      delta += std::max(other[s], std::max(la[s] + d, lb[s] - d)) - top_max_[s];
    }
    for (float p : partial) delta += p;
    return delta;
  }

  // Per step, the largest load among ranks other than a and b (from the top three).
  const float* RestExcluding(int a, int b, std::vector<float>* rest) const {
    rest->resize(steps_);
    for (int64_t s = 0; s < steps_; ++s) {
      const Top3& t = top_[s];
      float v = ranks_ > 2 ? 0.0f : -1e30f;
      for (int i = 0; i < 3; ++i)
        if (t.rank[i] >= 0 && t.rank[i] != a && t.rank[i] != b) {
          v = t.value[i];
          break;
        }
      (*rest)[s] = v;
    }
    return rest->data();
  }

  int slots_per_rank() const { return slots_per_rank_; }
  int64_t steps() const { return steps_; }

 private:
  int64_t steps_;
  int ranks_;
  int slots_per_rank_;
  std::vector<float> expert_values_;
  std::vector<float> load_;
  std::vector<Top3> top_;
  std::vector<float> top_max_;  // top_[s].value[0], contiguous
};

// Node-awareness in global mode: a replicated expert with two copies in one node while another
// node has none moves one copy there (a swap with a copy on that node) when the per-step objective
// does not rise and the number of (expert, node) pairs covered grows, so more ranks find a copy in
// their own node (the dispatch table's second preference).
void SpreadOverNodes(const BalanceShape& shape, bool keep_guard, StepLoads* loads, std::vector<int32_t>* phy2log_ptr) {
  std::vector<int32_t>& phy2log = *phy2log_ptr;
  const int num_slots = static_cast<int>(phy2log.size());
  const int spr = loads->slots_per_rank();
  const int ranks_per_node = shape.num_ranks / shape.num_nodes;
  constexpr int kPartnerRanks = 4;
  auto node_of = [&](int slot) { return slot / spr / ranks_per_node; };
  auto copies_in_node = [&](int expert, int node, int except) {
    int n = 0;
    for (int s = node * ranks_per_node * spr; s < (node + 1) * ranks_per_node * spr; ++s)
      n += s != except && phy2log[s] == expert;
    return n;
  };
  auto holds = [&](int rank, int expert, int except) {
    for (int s = rank * spr; s < (rank + 1) * spr; ++s)
      if (s != except && phy2log[s] == expert) return true;
    return false;
  };
  std::vector<float> rest;
  for (int a = 0; a < num_slots; ++a) {
    const int x = phy2log[a];
    const int node_a = node_of(a);
    if (copies_in_node(x, node_a, a) == 0) continue;  // the only copy of x in its node
    // Partner ranks: the least loaded ranks (mean over steps) in nodes without a copy of x.
    std::vector<std::pair<double, int>> partners;
    for (int rank = 0; rank < shape.num_ranks; ++rank) {
      const int node = rank / ranks_per_node;
      if (node == node_a || copies_in_node(x, node, -1) > 0) continue;
      double sum = 0;
      const float* load = loads->Load(rank);
      for (int64_t s = 0; s < loads->steps(); ++s) sum += load[s];
      partners.push_back({sum, rank});
    }
    std::sort(partners.begin(), partners.end());
    if (static_cast<int>(partners.size()) > kPartnerRanks) partners.resize(kPartnerRanks);
    const int rank_a = a / spr;
    double best_delta = 0;
    int best_b = -1;
    for (const auto& [unused, rank_b] : partners) {
      const float* other = loads->RestExcluding(rank_a, rank_b, &rest);
      for (int b = rank_b * spr; b < (rank_b + 1) * spr; ++b) {
        const int y = phy2log[b];
        if (y == x) continue;
        // y must stay in b's node (another copy there) or already be in a's node: coverage grows by one.
        if (copies_in_node(y, node_of(b), b) == 0 && copies_in_node(y, node_a, -1) == 0) continue;
        if (keep_guard && (holds(rank_b, x, b) || holds(rank_a, y, a))) continue;
        const double delta = loads->SwapDelta(rank_a, x, rank_b, y, other);
        if (delta <= best_delta) best_delta = delta, best_b = b;
      }
    }
    if (best_b < 0) continue;
    const int rank_b = best_b / spr;
    loads->AddSlot(rank_a, phy2log[a], -1);
    loads->AddSlot(rank_b, phy2log[best_b], -1);
    std::swap(phy2log[a], phy2log[best_b]);
    loads->AddSlot(rank_a, phy2log[a], 1);
    loads->AddSlot(rank_b, phy2log[best_b], 1);
    loads->RefreshTop();
  }
}

}  // namespace

double PerStepObjective(const StepValues& values, int num_experts, int64_t num_steps, double fixed,
                        std::span<const int32_t> phy2log, int num_ranks) {
  return StepLoads(values, num_experts, num_steps, fixed, phy2log, num_ranks).Objective();
}

double SearchPerStep(const StepValues& values, int num_experts, int64_t num_steps, double fixed,
                     const BalanceShape& shape, bool keep_guard, int rounds, bool spread_over_nodes,
                     std::vector<int32_t>* phy2log_ptr) {
  std::vector<int32_t>& phy2log = *phy2log_ptr;
  const int num_ranks = shape.num_ranks;
  StepLoads loads(values, num_experts, num_steps, fixed, phy2log, num_ranks);
  if (num_ranks < 2 || num_steps == 0) return loads.Objective();
  const int spr = loads.slots_per_rank();
  const int region = RegionRanks(shape);
  constexpr int kCriticalRanks = 2;   // busiest ranks whose copies are tried
  constexpr int kPartnerRanks = 4;    // least loaded ranks (in the busiest's steps) to swap with
  auto holds = [&](int rank, int expert, int except) {
    for (int s = rank * spr; s < (rank + 1) * spr; ++s)
      if (s != except && phy2log[s] == expert) return true;
    return false;
  };
  std::vector<float> rest;
  for (int round = 0; round < rounds; ++round) {
    // How much each rank, when it is the busiest, stands above the second busiest.
    std::vector<double> critical(num_ranks, 0.0);
    for (const Top3& t : loads.top()) critical[t.rank[0]] += t.value[0] - t.value[1] + 1e-300;
    std::vector<int> order(num_ranks);
    for (int g = 0; g < num_ranks; ++g) order[g] = g;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return critical[a] > critical[b]; });
    double best_delta = 0;
    int best_a = -1, best_b = -1;
    for (int c = 0; c < std::min(kCriticalRanks, num_ranks); ++c) {
      const int rank_a = order[c];
      if (critical[rank_a] <= 0) break;
      // Partner ranks: in rank_a's region, least loaded over the steps where rank_a is busiest.
      const int first = rank_a / region * region;
      std::vector<std::pair<double, int>> partners;
      for (int g = first; g < first + region; ++g) {
        if (g == rank_a) continue;
        double sum = 0;
        const float* load = loads.Load(g);
        for (int64_t s = 0; s < loads.steps(); ++s)
          if (loads.top()[s].rank[0] == rank_a) sum += load[s];
        partners.push_back({sum, g});
      }
      std::sort(partners.begin(), partners.end());
      if (static_cast<int>(partners.size()) > kPartnerRanks) partners.resize(kPartnerRanks);
      for (int a = rank_a * spr; a < (rank_a + 1) * spr; ++a)
        for (const auto& [unused, rank_b] : partners) {
          const float* other = loads.RestExcluding(rank_a, rank_b, &rest);
          for (int b = rank_b * spr; b < (rank_b + 1) * spr; ++b) {
            if (phy2log[a] == phy2log[b]) continue;
            if (keep_guard && (holds(rank_b, phy2log[a], b) || holds(rank_a, phy2log[b], a))) continue;
            const double delta = loads.SwapDelta(rank_a, phy2log[a], rank_b, phy2log[b], other);
            if (delta < best_delta) best_delta = delta, best_a = a, best_b = b;
          }
        }
    }
    // Stop when the best swap gains less than 0.01% of the objective (diminishing returns).
    if (best_a < 0 || best_delta > -1e-4 * std::abs(loads.Objective())) break;
    const int rank_a = best_a / spr, rank_b = best_b / spr;
    loads.AddSlot(rank_a, phy2log[best_a], -1);
    loads.AddSlot(rank_b, phy2log[best_b], -1);
    std::swap(phy2log[best_a], phy2log[best_b]);
    loads.AddSlot(rank_a, phy2log[best_a], 1);
    loads.AddSlot(rank_b, phy2log[best_b], 1);
    loads.RefreshTop();
  }
  if (spread_over_nodes && shape.num_nodes > 1 && region == num_ranks) SpreadOverNodes(shape, keep_guard, &loads, &phy2log);
  return loads.Objective();
}

}  // namespace epmoe::eplb_internal
