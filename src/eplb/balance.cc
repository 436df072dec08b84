#include "epmoe/balance.h"

#include <algorithm>
#include <numeric>
#include <random>

namespace epmoe {

double ExpertCopySeconds(const CostModel& cost, double rows) {
  if (rows <= 0) return 0;
  const double read = std::min(1.0, rows) * cost.bytes_per_expert / cost.memory_bandwidth;
  const double compute = rows * cost.flops_per_row / cost.peak_flops;
  return std::max(read, compute);
}

namespace {

// Per rank, the sum over its slots of copy_value(load of one copy), from `initial`: an expert's load
// splits evenly over its copies. Counts (picks) and weights (load matrices) share it.
template <typename T, typename CopyValue>
void SumPerRank(const Placement& placement, int layer, std::span<const T> load, double initial,
                const CopyValue& copy_value, std::span<double> out) {
  EPMOE_CHECK(static_cast<int>(load.size()) == placement.num_experts() &&
              static_cast<int>(out.size()) == placement.num_ranks());
  std::fill(out.begin(), out.end(), initial);
  auto phy2log = placement.phy2log(layer);
  auto logcnt = placement.logcnt(layer);
  for (int slot = 0; slot < placement.num_slots(); ++slot) {
    const int expert = phy2log[slot];
    out[placement.rank_of_slot(slot)] += copy_value(static_cast<double>(load[expert]) / logcnt[expert]);
  }
}

double Picks(double per_copy) { return per_copy; }
// A copy is read when it gets a pick: with c < n picks, c of the n copies are touched.
double CopiesRead(double per_copy) { return std::min(1.0, per_copy); }

}  // namespace

void RankPicks(const Placement& placement, int layer, std::span<const int64_t> counts, std::span<double> out) {
  SumPerRank(placement, layer, counts, 0.0, Picks, out);
}
void RankPicks(const Placement& placement, int layer, std::span<const double> weights, std::span<double> out) {
  SumPerRank(placement, layer, weights, 0.0, Picks, out);
}

void RankCopiesRead(const Placement& placement, int layer, std::span<const int64_t> counts,
                    std::span<double> out) {
  SumPerRank(placement, layer, counts, 0.0, CopiesRead, out);
}
void RankCopiesRead(const Placement& placement, int layer, std::span<const double> weights,
                    std::span<double> out) {
  SumPerRank(placement, layer, weights, 0.0, CopiesRead, out);
}

void RankSeconds(const Placement& placement, int layer, std::span<const int64_t> counts, const CostModel& cost,
                 std::span<double> out) {
  SumPerRank(placement, layer, counts, cost.fixed_seconds,
             [&](double rows) { return ExpertCopySeconds(cost, rows); }, out);
}
void RankSeconds(const Placement& placement, int layer, std::span<const double> weights, const CostModel& cost,
                 std::span<double> out) {
  SumPerRank(placement, layer, weights, cost.fixed_seconds,
             [&](double rows) { return ExpertCopySeconds(cost, rows); }, out);
}

double LayerBalancedness(const Placement& placement, int layer, const LoadMatrix& load) {
  if (load.num_steps == 0) return 1;
  std::vector<double> per_rank(placement.num_ranks());
  double sum = 0;
  for (int64_t step = 0; step < load.num_steps; ++step) {
    RankPicks(placement, layer, load.at(step, layer), per_rank);
    sum += Balancedness(per_rank);
  }
  return sum / static_cast<double>(load.num_steps);
}

namespace {

double Max(std::span<const double> values) {
  return *std::max_element(values.begin(), values.end());
}
double Mean(std::span<const double> values) {
  return std::accumulate(values.begin(), values.end(), 0.0) / values.size();
}

// Adds one step's figures; Finish divides by the number of (step, layer) pairs.
class ScoreAccumulator {
 public:
  ScoreAccumulator(const Placement& placement, const CostModel& cost)
      : placement_(placement), cost_(cost), values_(placement.num_ranks()) {}

  template <typename Load>
  void AddStep(const Load& load, int64_t step) {
    for (int layer = 0; layer < load.num_layers; ++layer) AddLayer(layer, load.at(step, layer));
    EndStep();
  }
  void EndStep() { ++steps_; }
  template <typename T>
  void AddLayer(int layer, std::span<const T> counts) {
    RankPicks(placement_, layer, counts, values_);
    score_.balancedness += Balancedness(values_);
    score_.max_picks += Max(values_);
    score_.mean_picks += Mean(values_);
    RankCopiesRead(placement_, layer, counts, values_);
    score_.byte_balancedness += Balancedness(values_);
    score_.max_bytes += Max(values_) * cost_.bytes_per_expert;
    score_.mean_bytes += Mean(values_) * cost_.bytes_per_expert;
    RankSeconds(placement_, layer, counts, cost_, values_);
    score_.step_seconds += Max(values_);
    score_.mean_rank_seconds += Mean(values_);
    ++layers_;
  }
  PlacementScore Finish() const {
    PlacementScore out = score_;
    if (layers_ == 0) return PlacementScore{};
    for (double* v :
         {&out.balancedness, &out.max_picks, &out.mean_picks, &out.byte_balancedness, &out.max_bytes, &out.mean_bytes})
      *v /= layers_;
    out.step_seconds /= std::max<int64_t>(steps_, 1);
    out.mean_rank_seconds /= std::max<int64_t>(steps_, 1);
    return out;
  }

 private:
  const Placement& placement_;
  const CostModel& cost_;
  std::vector<double> values_;
  PlacementScore score_{0, 0, 0, 0, 0, 0, 0, 0};
  int64_t layers_ = 0;
  int64_t steps_ = 0;
};

}  // namespace

PlacementScore ScorePlacement(const Placement& placement, const ExpertLoad& load, const CostModel& cost) {
  EPMOE_CHECK(load.num_layers == placement.num_layers() && load.num_experts == placement.num_experts());
  ScoreAccumulator accumulator(placement, cost);
  for (int64_t step = 0; step < load.num_steps; ++step) accumulator.AddStep(load, step);
  return accumulator.Finish();
}

PlacementScore ScorePlacement(const Placement& placement, const LoadMatrix& load, const CostModel& cost) {
  EPMOE_CHECK(load.num_layers == placement.num_layers() && load.num_experts == placement.num_experts());
  ScoreAccumulator accumulator(placement, cost);
  for (int64_t step = 0; step < load.num_steps; ++step) accumulator.AddStep(load, step);
  return accumulator.Finish();
}

PlacementScore ScoreEvenRouter(const Placement& placement, const ExpertLoad& load, const CostModel& cost,
                               uint64_t seed) {
  EPMOE_CHECK(load.num_layers == placement.num_layers() && load.num_experts == placement.num_experts());
  const int num_experts = load.num_experts;
  std::mt19937_64 rng(seed);
  std::vector<int64_t> counts(num_experts);
  std::vector<int32_t> ids(num_experts);
  ScoreAccumulator accumulator(placement, cost);
  for (int64_t step = 0; step < load.num_steps; ++step) {
    for (int layer = 0; layer < load.num_layers; ++layer) {
      auto actual = load.at(step, layer);
      const int64_t picks = std::accumulate(actual.begin(), actual.end(), int64_t{0});
      std::fill(counts.begin(), counts.end(), 0);
      const int k = load.top_k;
      const int64_t rows = load.rows[step];
      if (k > 0 && k <= num_experts && rows > 0 && rows * k == picks) {
        // k distinct experts per row: a partial Fisher-Yates shuffle per row.
        std::iota(ids.begin(), ids.end(), 0);
        for (int64_t row = 0; row < rows; ++row)
          for (int j = 0; j < k; ++j) {
            std::uniform_int_distribution<int> pick(j, num_experts - 1);
            std::swap(ids[j], ids[pick(rng)]);
            ++counts[ids[j]];
          }
      } else {
        std::uniform_int_distribution<int> pick(0, num_experts - 1);
        for (int64_t i = 0; i < picks; ++i) ++counts[pick(rng)];
      }
      accumulator.AddLayer(layer, std::span<const int64_t>(counts));
    }
    accumulator.EndStep();
  }
  return accumulator.Finish();
}

}  // namespace epmoe
