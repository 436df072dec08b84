// Synthetic generators (determinism, validity, the distributions they promise) and trace
// statistics (against hand-computed values and a plain per-row reference).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <set>

#include <gtest/gtest.h>

#include "epmoe/trace.h"
#include "epmoe/trace_gen.h"
#include "epmoe/trace_stats.h"

namespace epmoe {
namespace {

std::vector<StepPicks> Generate(const TraceGenOptions& options) {
  auto generator = TraceGenerator::Create(options);
  EXPECT_TRUE(generator.ok()) << generator.status().ToString();
  std::vector<StepPicks> steps;
  StepPicks step;
  while (generator.ok() && (*generator)->Next(&step)) steps.push_back(step);
  return steps;
}

// Serves fixed steps as a trace.
class FixedReader final : public TraceReader {
 public:
  FixedReader(TraceInfo info, std::vector<StepPicks> steps) : steps_(std::move(steps)) { info_ = std::move(info); }
  Result<bool> Next(StepPicks* step) override {
    if (next_ >= steps_.size()) return false;
    *step = steps_[next_++];
    return true;
  }

 private:
  std::vector<StepPicks> steps_;
  size_t next_ = 0;
};

std::vector<int64_t> TotalCounts(const std::vector<StepPicks>& steps, int layer, int experts) {
  std::vector<int64_t> total(experts, 0);
  for (const StepPicks& s : steps)
    for (int e = 0; e < experts; ++e) total[e] += s.counts[static_cast<size_t>(layer) * experts + e];
  return total;
}

TEST(TraceGen, DeterministicValidAndWeighted) {
  for (const char* dist : {"uniform", "zipf", "gaussian", "round-robin"}) {
    TraceGenOptions o;
    o.distribution = dist;
    o.num_layers = 3;
    o.num_experts = 32;
    o.top_k = 4;
    o.steps = 6;
    o.batch = 10;
    o.correlation = std::string(dist) == "zipf" ? 0.5 : 0.0;
    auto a = Generate(o), b = Generate(o);
    ASSERT_EQ(a.size(), 6u) << dist;
    for (size_t s = 0; s < a.size(); ++s) {
      ASSERT_EQ(a[s].rows, 10);
      for (int l = 0; l < 3; ++l) {
        const Picks& p = a[s].layers[l];
        EXPECT_EQ(p.experts, b[s].layers[l].experts) << dist;
        EXPECT_EQ(p.weights, b[s].layers[l].weights) << dist;
        EXPECT_TRUE(ValidatePicks(p, 32).ok()) << dist;
        for (int64_t r = 0; r < p.rows; ++r) {
          double sum = 0;
          for (int j = 0; j < 4; ++j) {
            sum += p.weight(r, j);
            if (j > 0) {
              EXPECT_GE(p.weight(r, j - 1), p.weight(r, j)) << dist;
            }
          }
          EXPECT_NEAR(sum, 1.0, 1e-5) << dist;
        }
      }
      int64_t total = std::accumulate(a[s].counts.begin(), a[s].counts.end(), int64_t{0});
      EXPECT_EQ(total, 3 * 10 * 4);
    }
    o.seed = 2;
    auto c = Generate(o);
    if (std::string(dist) != "round-robin") {
      EXPECT_NE(c[0].layers[0].experts, a[0].layers[0].experts) << dist;
    }
  }
}

TEST(TraceGen, RoundRobinSpreadsEvenly) {
  TraceGenOptions o;
  o.distribution = "round-robin";
  o.num_layers = 1;
  o.num_experts = 12;
  o.top_k = 4;
  o.steps = 3;
  o.batch = 6;
  auto steps = Generate(o);
  // Row r (over the trace), pick j -> (r*k + j) mod E.
  EXPECT_EQ(steps[1].layers[0].expert(0, 0), (6 * 4) % 12);
  EXPECT_EQ(steps[1].layers[0].expert(1, 3), (7 * 4 + 3) % 12);
  for (int64_t c : TotalCounts(steps, 0, 12)) EXPECT_EQ(c, 3 * 6 * 4 / 12);
}

TEST(TraceGen, ZipfTopOneFrequencyMatchesPopularity) {
  // With k = 1, Gumbel top-k draws expert e with probability p_e exactly.
  TraceGenOptions o;
  o.distribution = "zipf";
  o.num_layers = 1;
  o.num_experts = 16;
  o.top_k = 1;
  o.steps = 50;
  o.batch = 400;
  o.zipf_exponent = 1.0;
  auto total = TotalCounts(Generate(o), 0, 16);
  std::sort(total.rbegin(), total.rend());
  double harmonic = 0;
  for (int r = 1; r <= 16; ++r) harmonic += 1.0 / r;
  const double n = 50.0 * 400;
  for (int r = 0; r < 4; ++r) EXPECT_NEAR(total[r] / n, 1.0 / (r + 1) / harmonic, 0.012) << "rank " << r;
}

TEST(TraceGen, UniformIsFlatAndMatchesRanksPerRowFormula) {
  TraceGenOptions o;
  o.num_layers = 2;
  o.num_experts = 64;
  o.top_k = 8;
  o.steps = 40;
  o.batch = 64;
  auto steps = Generate(o);
  auto total = TotalCounts(steps, 1, 64);
  const double mean = 40.0 * 64 * 8 / 64;
  for (int64_t c : total) EXPECT_NEAR(c, mean, 0.2 * mean);
  TraceInfo info;
  info.num_layers = 2;
  info.num_experts = 64;
  info.top_k = 8;
  info.has_picks = true;
  info.layer_ids = {0, 1};
  FixedReader reader(info, steps);
  auto stats = ComputeTraceStats(&reader, 8);
  ASSERT_TRUE(stats.ok());
  EXPECT_NEAR(stats->ranks_per_row_mean, stats->uniform_ranks_per_row, 0.05);
  EXPECT_NEAR(stats->uniform_ranks_per_row, 8 * (1 - 0.320931), 1e-4);  // C(56,8)/C(64,8) = 0.320931
}

TEST(TraceGen, GaussianTemperatureControlsSkew) {
  auto max_over_mean = [](double temperature) {
    TraceGenOptions o;
    o.distribution = "gaussian";
    o.num_layers = 1;
    o.num_experts = 64;
    o.top_k = 4;
    o.steps = 20;
    o.batch = 64;
    o.temperature = temperature;
    auto total = TotalCounts(Generate(o), 0, 64);
    const double mean = std::accumulate(total.begin(), total.end(), 0.0) / 64;
    return *std::max_element(total.begin(), total.end()) / mean;
  };
  const double hot = max_over_mean(0.5), mild = max_over_mean(2.0), flat = max_over_mean(100.0);
  EXPECT_GT(hot, mild);
  EXPECT_GT(mild, flat);
  EXPECT_LT(flat, 1.4);
}

TEST(TraceGen, DriftChangesThePopularSetEveryNSteps) {
  TraceGenOptions o;
  o.distribution = "zipf";
  o.zipf_exponent = 2.0;
  o.num_layers = 1;
  o.num_experts = 64;
  o.top_k = 1;
  o.steps = 12;
  o.batch = 200;
  o.drift_every = 4;
  auto steps = Generate(o);
  auto hottest = [&](size_t s) {
    auto c = steps[s].counts;
    return std::max_element(c.begin(), c.end()) - c.begin();
  };
  // Within an epoch the hottest expert stays; across the three epochs it changes at least once.
  std::set<int64_t> epochs;
  for (size_t epoch = 0; epoch < 3; ++epoch) {
    for (size_t s = epoch * 4; s < epoch * 4 + 4; ++s) EXPECT_EQ(hottest(s), hottest(epoch * 4)) << "step " << s;
    epochs.insert(hottest(epoch * 4));
  }
  EXPECT_GE(epochs.size(), 2u);
  o.drift_every = 0;
  auto fixed = Generate(o);
  EXPECT_EQ(fixed[0].counts, Generate(o)[0].counts);
}

TEST(TraceGen, CorrelatedRequestsShareExpertsAcrossSteps) {
  auto overlap = [](double correlation) {
    TraceGenOptions o;
    o.num_layers = 1;
    o.num_experts = 64;
    o.top_k = 8;
    o.steps = 10;
    o.batch = 32;
    o.correlation = correlation;
    o.request_steps = 1000000;  // requests stay for the whole trace
    auto steps = Generate(o);
    double shared = 0, total = 0;
    for (size_t s = 1; s < steps.size(); ++s)
      for (int64_t r = 0; r < 32; ++r) {
        const Picks& now = steps[s].layers[0];
        const Picks& before = steps[s - 1].layers[0];
        std::set<int32_t> previous(before.experts.begin() + r * 8, before.experts.begin() + (r + 1) * 8);
        for (int j = 0; j < 8; ++j) shared += previous.count(now.expert(r, j));
        total += 8;
      }
    return shared / total;
  };
  EXPECT_NEAR(overlap(0.0), 8.0 / 64, 0.03);  // independent rows: chance overlap k/E
  // Kept: c of the k; each fresh pick hits one of the (1-c)k dropped ones with chance (1-c)k / (E - ck).
  EXPECT_NEAR(overlap(0.8), 0.8 + 0.2 * (0.2 * 8) / (64 - 0.8 * 8), 0.03);
  EXPECT_DOUBLE_EQ(overlap(1.0), 1.0);
}

TEST(TraceGen, OptionsAreChecked) {
  TraceGenOptions o;
  o.top_k = 65;
  EXPECT_FALSE(TraceGenerator::Create(o).ok());
  o = {};
  o.distribution = "pareto";
  EXPECT_FALSE(TraceGenerator::Create(o).ok());
  o = {};
  o.correlation = 1.5;
  EXPECT_FALSE(TraceGenerator::Create(o).ok());
  o = {};
  o.temperature = 0;
  EXPECT_FALSE(TraceGenerator::Create(o).ok());
  o = {};
  o.batch = 0;
  EXPECT_FALSE(TraceGenerator::Create(o).ok());
}

TEST(TraceStats, HandComputedExample) {
  // E = 4 on G = 2 ranks (experts 0,1 on rank 0; 2,3 on rank 1), k = 2, rows 0 and 1 homed on ranks 0, 1.
  TraceInfo info;
  info.num_layers = 1;
  info.num_experts = 4;
  info.top_k = 2;
  info.has_picks = true;
  info.layer_ids = {5};
  StepPicks step;
  step.rows = 2;
  step.layers = {Picks{2, 2, {0, 1, 0, 3}, {}}};
  CountStepPicks(1, 4, &step);
  FixedReader reader(info, {step});
  auto stats = ComputeTraceStats(&reader, 2, 2);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  const LayerTraceStats& l = stats->layers[0];
  EXPECT_EQ(l.layer_id, 5);
  EXPECT_EQ(l.picks, 4);
  EXPECT_DOUBLE_EQ(l.experts_touched_mean, 3);
  EXPECT_DOUBLE_EQ(l.max_over_mean_mean, 2);           // expert 0: 2 picks, mean 1
  EXPECT_DOUBLE_EQ(l.balancedness_mean, 2.0 / 3.0);    // ranks hold 3 and 1 picks
  EXPECT_DOUBLE_EQ(l.ranks_per_row_mean, 1.5);         // row 0 -> {0}, row 1 -> {0, 1}
  EXPECT_DOUBLE_EQ(l.copies_per_row_mean, 0.5);        // row 1 (home rank 1) also goes to rank 0
  ASSERT_EQ(l.hottest.size(), 2u);
  EXPECT_EQ(l.hottest[0], std::make_pair(0, int64_t{2}));
  EXPECT_EQ(l.hottest[1], std::make_pair(1, int64_t{1}));
  FixedReader again(info, {step});
  EXPECT_FALSE(ComputeTraceStats(&again, 5).ok());  // more ranks than experts
}

TEST(TraceStats, MatchesAPlainReferenceOnASkewedTrace) {
  TraceGenOptions o;
  o.distribution = "zipf";
  o.num_layers = 2;
  o.num_experts = 24;
  o.top_k = 3;
  o.steps = 7;
  o.batch = 9;
  auto steps = Generate(o);
  const int E = 24, G = 6;
  for (int layer = 0; layer < 2; ++layer) {
    double balanced = 0, ranks = 0, copies = 0, touched = 0;
    int64_t rows = 0;
    for (const StepPicks& s : steps) {
      std::vector<int64_t> per_rank(G, 0);
      std::set<int> experts;
      const Picks& p = s.layers[layer];
      for (int64_t r = 0; r < p.rows; ++r) {
        std::set<int> row_ranks;
        for (int j = 0; j < p.k; ++j) {
          const int rank = p.expert(r, j) / (E / G);
          ++per_rank[rank];
          row_ranks.insert(rank);
          experts.insert(p.expert(r, j));
        }
        ranks += row_ranks.size();
        copies += row_ranks.size() - row_ranks.count(static_cast<int>(r * G / p.rows));
        ++rows;
      }
      balanced += (p.rows * p.k / static_cast<double>(G)) / *std::max_element(per_rank.begin(), per_rank.end());
      touched += experts.size();
    }
    TraceInfo info;
    info.num_layers = 2;
    info.num_experts = E;
    info.top_k = 3;
    info.has_picks = true;
    info.layer_ids = {0, 1};
    FixedReader reader(info, steps);
    auto stats = ComputeTraceStats(&reader, G);
    ASSERT_TRUE(stats.ok());
    const LayerTraceStats& l = stats->layers[layer];
    EXPECT_NEAR(l.balancedness_mean, balanced / 7, 1e-12);
    EXPECT_NEAR(l.ranks_per_row_mean, ranks / rows, 1e-12);
    EXPECT_NEAR(l.copies_per_row_mean, copies / rows, 1e-12);
    EXPECT_NEAR(l.experts_touched_mean, touched / 7, 1e-12);
  }
}

TEST(TraceStats, RealFlameDecodeTrace) {
  auto reader = TraceReader::Open(EPMOE_TEST_DATA_DIR "/flame_moe_290m/decode_32seqs_pos1-10", {});
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto stats = ComputeTraceStats(reader->get(), 8);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->steps, 10);
  EXPECT_EQ(stats->rows, 320);
  for (const LayerTraceStats& l : stats->layers) {
    EXPECT_EQ(l.picks, 10 * 32 * 6);
    EXPECT_GT(l.balancedness_mean, 0.5);
    EXPECT_LE(l.balancedness_mean, 1.0);
    EXPECT_GT(l.ranks_per_row_mean, 1.0);
    EXPECT_LE(l.ranks_per_row_mean, 6.0);
    EXPECT_LT(l.copies_per_row_mean, l.ranks_per_row_mean);
  }
}

}  // namespace
}  // namespace epmoe
