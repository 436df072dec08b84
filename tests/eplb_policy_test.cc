// Placement policies: DeepSeek's reference example, the guard's counterexample, degenerate shapes,
// and properties on random loads (valid placements, guard, each policy no worse on its objective).
#include "epmoe/eplb_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include "eplb/solver.h"
#include "epmoe/balance.h"
#include "epmoe/placement.h"

namespace epmoe {
namespace {

const char* kReference = EPMOE_TEST_DATA_DIR "/deepseek_eplb_reference_example.json";

ExpertLoad LoadFromWeights(const std::vector<std::vector<int64_t>>& weights) {
  ExpertLoad load(1, static_cast<int>(weights.size()), static_cast<int>(weights[0].size()));
  for (size_t layer = 0; layer < weights.size(); ++layer)
    std::copy(weights[layer].begin(), weights[layer].end(), load.at(0, static_cast<int>(layer)).begin());
  return load;
}

bool GuardHolds(const Placement& p) {
  for (int layer = 0; layer < p.num_layers(); ++layer)
    if (eplb_internal::HasDuplicateOnRank(p.phy2log(layer), p.num_ranks())) return false;
  return true;
}

// Max rank load of a layer, summed picks split evenly over copies (a plain loop).
double PlainMaxLoad(const Placement& p, int layer, const std::vector<int64_t>& weight) {
  std::vector<double> rank(p.num_ranks(), 0.0);
  for (int slot = 0; slot < p.num_slots(); ++slot) {
    const int e = p.phy2log(layer)[slot];
    rank[p.rank_of_slot(slot)] += static_cast<double>(weight[e]) / p.logcnt(layer)[e];
  }
  return *std::max_element(rank.begin(), rank.end());
}

TEST(EplbPolicy, ReproducesDeepseekReferenceExample) {
  std::ifstream in(kReference);
  ASSERT_TRUE(in) << "reference example not found: " << kReference;
  nlohmann::json json = nlohmann::json::parse(in);
  const auto weights = json["weight"].get<std::vector<std::vector<int64_t>>>();
  PolicyOptions options;
  options.policy = Policy::kDeepseek;
  options.shape = {json["num_gpus"].get<int>(), json["num_nodes"].get<int>(), json["num_groups"].get<int>(),
                   json["num_replicas"].get<int>() - static_cast<int>(weights[0].size())};
  auto placement = ComputePlacement(LoadFromWeights(weights), options);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  const auto expected = json["expected_phy2log"].get<std::vector<std::vector<int32_t>>>();
  const std::vector<std::vector<int32_t>> logcnt = {{1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1},
                                                    {1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1}};
  const double balancedness[] = {0.8277, 0.8050};
  for (int layer = 0; layer < 2; ++layer) {
    auto phy2log = placement->phy2log(layer);
    EXPECT_EQ(std::vector<int32_t>(phy2log.begin(), phy2log.end()), expected[layer]) << "layer " << layer;
    auto cnt = placement->logcnt(layer);
    EXPECT_EQ(std::vector<int32_t>(cnt.begin(), cnt.end()), logcnt[layer]);
    std::vector<double> per_rank(8);
    RankPicks(*placement, layer, LoadFromWeights(weights).at(0, layer), per_rank);
    EXPECT_NEAR(Balancedness(per_rank), balancedness[layer], 1e-4);
  }
}

TEST(EplbPolicy, GuardFixesTwoCopiesOnOneRank) {
  const std::vector<int64_t> weight = {600, 560, 120, 120, 20, 10, 10, 10};
  const ExpertLoad load = LoadFromWeights({weight});
  PolicyOptions options;
  options.shape = {8, 1, 1, 8};
  auto plain = ComputePlacement(load, options);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(GuardHolds(*plain));
  EXPECT_NEAR(PlainMaxLoad(*plain, 0, weight), 232, 1e-9);
  options.policy = Policy::kDeepseekGuarded;
  auto guarded = ComputePlacement(load, options);
  ASSERT_TRUE(guarded.ok());
  EXPECT_TRUE(GuardHolds(*guarded));
  EXPECT_LE(PlainMaxLoad(*guarded, 0, weight), 205);  // the issue: 205 is possible (the optimum is 196.67)
  std::printf("guarded max load %.2f (deepseek 232)\n", PlainMaxLoad(*guarded, 0, weight));
}

// Random per-step loads with skew (a few hot experts).
ExpertLoad RandomLoad(std::mt19937_64& rng, int steps, int layers, int experts, bool zeros) {
  ExpertLoad load(steps, layers, experts);
  std::vector<double> popularity(experts);
  std::exponential_distribution<double> skew(1.0);
  for (int layer = 0; layer < layers; ++layer) {
    for (double& p : popularity) p = std::pow(skew(rng), 3.0);
    if (zeros && experts > 2) popularity[experts - 1] = 0;
    for (int step = 0; step < steps; ++step) {
      std::discrete_distribution<int> pick(popularity.begin(), popularity.end());
      for (int i = 0; i < 16 * experts; ++i) ++load.at(step, layer)[pick(rng)];
    }
  }
  return load;
}

double SumOfStepMax(const Placement& p, const ExpertLoad& load) {
  double sum = 0;
  std::vector<double> ranks(p.num_ranks());
  for (int64_t s = 0; s < load.num_steps; ++s)
    for (int layer = 0; layer < load.num_layers; ++layer) {
      RankPicks(p, layer, load.at(s, layer), ranks);
      sum += *std::max_element(ranks.begin(), ranks.end());
    }
  return sum;
}

double SumOfStepSeconds(const Placement& p, const ExpertLoad& load, const CostModel& cost) {
  double sum = 0;
  std::vector<double> ranks(p.num_ranks());
  for (int64_t s = 0; s < load.num_steps; ++s)
    for (int layer = 0; layer < load.num_layers; ++layer) {
      RankSeconds(p, layer, load.at(s, layer), cost, ranks);
      sum += *std::max_element(ranks.begin(), ranks.end());
    }
  return sum;
}

TEST(EplbPolicy, RandomLoadsPropertiesHold) {
  std::mt19937_64 rng(42);
  struct Shape {
    int experts, ranks, nodes, groups, redundant;
  };
  const Shape shapes[] = {{16, 4, 1, 1, 4},   {24, 8, 2, 4, 8}, {32, 8, 2, 1, 8}, {12, 8, 2, 4, 4},
                          {64, 16, 4, 8, 16}, {8, 4, 1, 1, 0},  {16, 4, 1, 1, 4}};
  CostModel cost;
  cost.bytes_per_expert = 2e6;
  cost.flops_per_row = 2e6;
  cost.fixed_seconds = 1e-6;
  int trial = 0;
  for (const Shape& shape : shapes) {
    for (int repeat = 0; repeat < 4; ++repeat, ++trial) {
      const ExpertLoad load = RandomLoad(rng, 6, 2, shape.experts, repeat % 2 == 1);
      const std::vector<int64_t> sums = SumOverSteps(load);
      PolicyOptions options;
      options.shape = {shape.ranks, shape.nodes, shape.groups, shape.redundant};
      options.cost = cost;
      options.uniform_prior = 0;  // per-step and cost then search the objective checked below
      auto current = Placement::Trivial(2, shape.experts, shape.redundant, shape.ranks, shape.nodes);
      ASSERT_TRUE(current.ok());
      options.current = &*current;
      std::vector<std::optional<Placement>> results;
      for (Policy policy : AllPolicies()) {
        options.policy = policy;
        auto placement = ComputePlacement(load, options);
        ASSERT_TRUE(placement.ok()) << PolicyName(policy) << ": " << placement.status().ToString();
        // Valid: recreating it from phy2log succeeds and every slot is counted once.
        std::vector<std::vector<int32_t>> phy2log;
        for (int layer = 0; layer < 2; ++layer)
          phy2log.emplace_back(placement->phy2log(layer).begin(), placement->phy2log(layer).end());
        ASSERT_TRUE(Placement::Create(shape.experts, shape.ranks, shape.nodes, phy2log).ok());
        // per-step may keep deepseek's two copies on a rank when that start scores best, and auto
        // may choose deepseek.
        if (policy != Policy::kDeepseek && policy != Policy::kPerStep && policy != Policy::kAuto) {
          EXPECT_TRUE(GuardHolds(*placement)) << PolicyName(policy) << " trial " << trial;
        }
        results.emplace_back(std::move(*placement));
      }
      const Placement& deepseek = *results[0];
      for (int layer = 0; layer < 2; ++layer) {
        std::vector<int64_t> weight(sums.begin() + layer * shape.experts, sums.begin() + (layer + 1) * shape.experts);
        const double ds = PlainMaxLoad(deepseek, layer, weight);
        EXPECT_LE(PlainMaxLoad(*results[1], layer, weight), ds * (1 + 1e-9)) << "guarded, trial " << trial;
        // min-move: within 5% of deepseek-guarded's max load, or the layer kept as it was (the
        // move did not validate).
        const auto moved = results[4]->phy2log(layer);
        const auto kept = current->phy2log(layer);
        if (!std::equal(moved.begin(), moved.end(), kept.begin())) {
          EXPECT_LE(PlainMaxLoad(*results[4], layer, weight),
                    1.05 * PlainMaxLoad(*results[1], layer, weight) * (1 + 1e-9))
              << "min-move, trial " << trial;
        }
      }
      EXPECT_LE(SumOfStepMax(*results[2], load), SumOfStepMax(deepseek, load) * (1 + 1e-9))
          << "per-step, trial " << trial;
      EXPECT_LE(SumOfStepSeconds(*results[3], load, cost), SumOfStepSeconds(deepseek, load, cost) * (1 + 1e-9))
          << "cost, trial " << trial;
      EXPECT_LE(results[4]->MovedCopies(*current), results[1]->MovedCopies(*current)) << "min-move, trial " << trial;
    }
  }
}

TEST(EplbPolicy, MinMoveKeepsAGoodPlacement) {
  std::mt19937_64 rng(7);
  const ExpertLoad load = RandomLoad(rng, 4, 3, 32, false);
  PolicyOptions options;
  options.shape = {8, 1, 1, 8};
  options.policy = Policy::kDeepseekGuarded;
  auto good = ComputePlacement(load, options);
  ASSERT_TRUE(good.ok());
  options.policy = Policy::kMinMove;
  options.current = &*good;
  auto moved = ComputePlacement(load, options);
  ASSERT_TRUE(moved.ok());
  EXPECT_EQ(moved->MovedCopies(*good), 0);
}

TEST(EplbPolicy, CostSpreadsCopiesOverNodesInGlobalMode) {
  // 8 experts with equal load, 2 copies each, 4 ranks in 2 nodes, no expert groups (global mode):
  // the cost policy puts the two copies of each expert in different nodes, so every rank finds a
  // copy in its own node.
  ExpertLoad load(4, 1, 8);
  for (int64_t step = 0; step < 4; ++step)
    for (int64_t& c : load.at(step, 0)) c = 10;
  PolicyOptions options;
  options.policy = Policy::kCost;
  options.shape = {4, 2, 1, 8};
  auto placement = ComputePlacement(load, options);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  for (int e = 0; e < 8; ++e) {
    auto copies = placement->copies(0, e);
    ASSERT_EQ(copies.size(), 2u);
    EXPECT_NE(placement->node_of_rank(placement->rank_of_slot(copies[0])),
              placement->node_of_rank(placement->rank_of_slot(copies[1])))
        << "expert " << e;
  }
}

TEST(EplbPolicy, DegenerateInputs) {
  for (Policy policy : AllPolicies()) {
    SCOPED_TRACE(PolicyName(policy));
    PolicyOptions options;
    options.policy = policy;
    // All-zero load: redundant copies spread, not all on expert 0.
    ExpertLoad zero(3, 1, 8);
    options.shape = {4, 1, 1, 8};
    auto current = Placement::Trivial(1, 8, 8, 4, 1);
    ASSERT_TRUE(current.ok());
    options.current = &*current;
    auto p = ComputePlacement(zero, options);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_LE(*std::max_element(p->logcnt(0).begin(), p->logcnt(0).end()), 2);
    // One expert on one rank, R = 0, G = 1.
    ExpertLoad one(2, 1, 1);
    one.at(0, 0)[0] = 5;
    options.shape = {1, 1, 1, 0};
    auto single = Placement::Trivial(1, 1, 0, 1, 1);
    options.current = &*single;
    p = ComputePlacement(one, options);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->phy2log(0)[0], 0);
    // One expert copied to 4 ranks.
    options.shape = {4, 1, 1, 3};
    auto four = Placement::Trivial(1, 1, 3, 4, 1);
    options.current = &*four;
    p = ComputePlacement(one, options);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->logcnt(0)[0], 4);
    // G = 1 with redundant copies, R = 0 with many ranks.
    std::mt19937_64 rng(3);
    const ExpertLoad load = RandomLoad(rng, 3, 1, 16, false);
    options.shape = {1, 1, 1, 0};
    auto trivial = Placement::Trivial(1, 16, 0, 1, 1);
    options.current = &*trivial;
    EXPECT_TRUE(ComputePlacement(load, options).ok());
    options.shape = {16, 1, 1, 0};
    auto spread = Placement::Trivial(1, 16, 0, 16, 1);
    options.current = &*spread;
    EXPECT_TRUE(ComputePlacement(load, options).ok());
    // Impossible shapes are refused with the reason.
    options.shape = {3, 1, 1, 0};
    auto bad = ComputePlacement(load, options);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("do not split evenly over 3 ranks"), std::string::npos)
        << bad.status().message();
    options.shape = {4, 3, 1, 0};
    EXPECT_FALSE(ComputePlacement(load, options).ok());
    options.shape = {4, 1, 5, 0};
    EXPECT_FALSE(ComputePlacement(load, options).ok());
    options.shape = {4, 1, 1, -4};
    EXPECT_FALSE(ComputePlacement(load, options).ok());
  }
  // The guard cannot hold with more slots per rank than experts.
  ExpertLoad small(1, 1, 2);
  PolicyOptions options;
  options.policy = Policy::kDeepseekGuarded;
  options.shape = {1, 1, 1, 2};
  auto refused = ComputePlacement(small, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("distinct experts"), std::string::npos);
  options.policy = Policy::kDeepseek;
  EXPECT_TRUE(ComputePlacement(small, options).ok());
  options.policy = Policy::kMinMove;
  options.shape = {1, 1, 1, 0};
  EXPECT_FALSE(ComputePlacement(small, options).ok());  // no current placement
  EXPECT_FALSE(ParsePolicy("greedy").ok());
  // Validation needs a fraction in (0, 1).
  ExpertLoad two(2, 1, 8);
  options.shape = {4, 1, 1, 0};
  options.policy = Policy::kAuto;
  options.validation_fraction = 1;
  auto no_split = ComputePlacement(two, options);
  ASSERT_FALSE(no_split.ok());
  EXPECT_NE(no_split.status().message().find("validation fraction 1"), std::string::npos);
  options.validation_fraction = 0.5;
  options.uniform_prior = 1.5;
  auto bad_prior = ComputePlacement(two, options);
  ASSERT_FALSE(bad_prior.ok());
  EXPECT_NE(bad_prior.status().message().find("uniform prior 1.5"), std::string::npos);
}

// Mean over steps of mean/max picks per rank for one layer (a plain loop, no library scoring).
double PlainLayerBalancedness(const Placement& p, int layer, const ExpertLoad& load) {
  double sum = 0;
  for (int64_t step = 0; step < load.num_steps; ++step) {
    std::vector<double> rank(p.num_ranks(), 0.0);
    for (int slot = 0; slot < p.num_slots(); ++slot) {
      const int e = p.phy2log(layer)[slot];
      rank[p.rank_of_slot(slot)] += static_cast<double>(load.at(step, layer)[e]) / p.logcnt(layer)[e];
    }
    const double max = *std::max_element(rank.begin(), rank.end());
    sum += max > 0 ? std::accumulate(rank.begin(), rank.end(), 0.0) / rank.size() / max : 1.0;
  }
  return sum / load.num_steps;
}

TEST(EplbPolicy, UniformReplicationSpreadsCopiesEvenly) {
  std::mt19937_64 rng(11);
  struct Shape {
    int experts, ranks, nodes, groups, redundant;
  };
  // R a multiple of E (every expert twice or three times), R not a multiple (counts differ by one,
  // the extra copies to the most loaded experts), and a hierarchical shape (groups over 2 nodes).
  const Shape shapes[] = {{8, 4, 1, 1, 8}, {8, 8, 1, 1, 16}, {8, 4, 1, 1, 4}, {16, 4, 2, 4, 4}, {8, 4, 1, 1, 0}};
  for (const Shape& shape : shapes) {
    SCOPED_TRACE(::testing::Message() << shape.experts << " experts, " << shape.ranks << " ranks, R "
                                      << shape.redundant);
    const ExpertLoad load = RandomLoad(rng, 4, 2, shape.experts, false);
    PolicyOptions options;
    options.policy = Policy::kUniform;
    options.shape = {shape.ranks, shape.nodes, shape.groups, shape.redundant};
    auto placement = ComputePlacement(load, options);
    ASSERT_TRUE(placement.ok()) << placement.status().ToString();
    EXPECT_TRUE(GuardHolds(*placement));
    const std::vector<int64_t> sums = SumOverSteps(load);
    const int slots = shape.experts + shape.redundant;
    for (int layer = 0; layer < 2; ++layer) {
      auto cnt = placement->logcnt(layer);
      const int low = *std::min_element(cnt.begin(), cnt.end());
      const int high = *std::max_element(cnt.begin(), cnt.end());
      if (shape.nodes == 1) {
        EXPECT_EQ(low, slots / shape.experts);
        EXPECT_EQ(high, (slots + shape.experts - 1) / shape.experts);
        // The experts with an extra copy are the most loaded ones.
        for (int a = 0; a < shape.experts; ++a)
          for (int b = 0; b < shape.experts; ++b)
            if (cnt[a] > cnt[b]) {
              EXPECT_GE(sums[layer * shape.experts + a], sums[layer * shape.experts + b]);
            }
      } else {
        EXPECT_LE(high - low, 1);  // inside each node the counts differ by at most one
      }
    }
  }
}

// A load whose hot experts change after the first `drift_at` steps: expert 0 and 1 hot before, a
// flat load with sampling noise after (8 experts, 16 picks per expert and step on average).
ExpertLoad DriftingLoad(std::mt19937_64& rng, int steps, int drift_at, int layers) {
  ExpertLoad load(steps, layers, 8);
  for (int layer = 0; layer < layers; ++layer)
    for (int step = 0; step < steps; ++step) {
      std::vector<double> popularity(8, 1.0);
      if (step < drift_at) popularity[0] = popularity[1] = 6.0;
      std::discrete_distribution<int> pick(popularity.begin(), popularity.end());
      for (int i = 0; i < 128; ++i) ++load.at(step, layer)[pick(rng)];
    }
  return load;
}

// auto's choice recomputed from scratch: each candidate fitted on the first half, its per-step
// balancedness on the second half (plain loops), the one-standard-error rule over the candidates
// in auto's order, the winner refitted on every step. Returns the winner's name.
std::string CheckAutoChoice(const ExpertLoad& load, const Placement& current, const PolicyOptions& options) {
  auto choice = ChooseByValidation(ToLoadMatrix(load), options);
  EXPECT_TRUE(choice.ok()) << choice.status().ToString();
  if (!choice.ok()) return "";
  const int64_t half = load.num_steps / 2;
  EXPECT_EQ(choice->fit_steps, load.num_steps - half);
  EXPECT_EQ(choice->validation_steps, half);
  const ExpertLoad fit = SliceSteps(load, 0, load.num_steps - half);
  const ExpertLoad validation = SliceSteps(load, load.num_steps - half, load.num_steps);
  std::vector<std::vector<double>> scores;  // [candidate][validation step]
  std::vector<std::optional<Placement>> refits;
  for (const ValidatedCandidate& c : choice->candidates) {
    std::optional<Placement> early = current, refit = current;
    if (c.name != "current") {
      auto policy = ParsePolicy(c.name);
      EXPECT_TRUE(policy.ok()) << c.name;
      PolicyOptions one = options;
      one.policy = *policy;
      auto e = ComputePlacement(fit, one);
      auto r = ComputePlacement(load, one);
      EXPECT_TRUE(e.ok() && r.ok());
      early = *e, refit = *r;
    }
    std::vector<double> per_step;
    for (int64_t step = 0; step < validation.num_steps; ++step) {
      double sum = 0;
      for (int layer = 0; layer < load.num_layers; ++layer)
        sum += PlainLayerBalancedness(*early, layer, SliceSteps(validation, step, step + 1));
      per_step.push_back(sum / load.num_layers);
    }
    EXPECT_NEAR(std::accumulate(per_step.begin(), per_step.end(), 0.0) / per_step.size(), c.validated, 1e-9);
    scores.push_back(per_step);
    refits.push_back(refit);
  }
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  size_t best = 0;
  for (size_t i = 0; i < scores.size(); ++i)
    if (mean(scores[i]) > mean(scores[best]) + 1e-9) best = i;
  size_t expected = best;
  for (size_t i = 0; i < best && expected == best; ++i) {
    std::vector<double> d(scores[best].size());
    for (size_t s = 0; s < d.size(); ++s) d[s] = scores[best][s] - scores[i][s];
    double var = 0;
    for (double x : d) var += (x - mean(d)) * (x - mean(d));
    if (mean(d) <= std::sqrt(var / (d.size() - 1) / d.size()) + 1e-9) expected = i;
  }
  for (size_t i = 0; i < scores.size(); ++i) EXPECT_EQ(choice->candidates[i].chosen, i == expected) << i;
  EXPECT_EQ(choice->placement, *refits[expected]) << "winner " << choice->candidates[expected].name;
  auto placement = ComputePlacement(load, options);  // ComputePlacement(auto) is the same placement
  EXPECT_TRUE(placement.ok() && *placement == choice->placement);
  return choice->candidates[expected].name;
}

TEST(EplbPolicy, AutoChoosesTheValidatedWinnerAndRefitsIt) {
  std::mt19937_64 rng(5);
  auto trivial = Placement::Trivial(2, 8, 8, 4, 1);
  ASSERT_TRUE(trivial.ok());
  PolicyOptions options;
  options.policy = Policy::kAuto;
  options.shape = {4, 1, 1, 8};
  options.current = &*trivial;
  // Steps 0-5 skewed, 6-11 flat: DeepSeek fits the skew best, but validation must not take it.
  const ExpertLoad drifting = DriftingLoad(rng, 12, 6, 2);
  auto choice = ChooseByValidation(ToLoadMatrix(drifting), options);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  for (const ValidatedCandidate& c : choice->candidates)
    if (c.name == "deepseek") {
      EXPECT_GT(c.fitted, c.validated + 0.05) << "the drift makes deepseek's fit overfit";
    }
  EXPECT_NE(CheckAutoChoice(drifting, *trivial, options), "deepseek");
  // A skew that stays (experts 0 and 1 hot in every step): a policy wins and is refitted.
  const ExpertLoad skewed = DriftingLoad(rng, 12, 12, 2);
  const std::string winner = CheckAutoChoice(skewed, *trivial, options);
  EXPECT_NE(winner, "current");
  // One step: nothing to validate on; auto chooses by the fit and says so.
  auto single = ChooseByValidation(ToLoadMatrix(SliceSteps(drifting, 0, 1)), options);
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  EXPECT_EQ(single->validation_steps, 0);
  EXPECT_TRUE(std::isnan(single->candidates[0].validated));
}

TEST(EplbPolicy, MinMoveIsNeverWorseHeldOutThanItsStart) {
  // The held-out steps repeat the validation steps (the load after a drift stays as it is), so a
  // move that does not balance them better must not be made. Before validation, min-move moved
  // copies for the skew of the early steps and lost balance on the later ones.
  std::mt19937_64 rng(9);
  int used_to_lose = 0;
  for (int trial = 0; trial < 20; ++trial) {
    const ExpertLoad window = DriftingLoad(rng, 8, 4, 1);
    const ExpertLoad held_out = SliceSteps(window, 4, 8);
    auto current = Placement::Trivial(1, 8, 0, 4, 1);
    ASSERT_TRUE(current.ok());
    PolicyOptions options;
    options.policy = Policy::kMinMove;
    options.shape = {4, 1, 1, 0};
    options.current = &*current;
    auto unvalidated = eplb_internal::FitPlacement(ToLoadMatrix(window), options);
    auto moved = ComputePlacement(window, options);
    ASSERT_TRUE(unvalidated.ok() && moved.ok());
    const double start = PlainLayerBalancedness(*current, 0, held_out);
    used_to_lose += PlainLayerBalancedness(*unvalidated, 0, held_out) < start - 1e-9;
    EXPECT_GE(PlainLayerBalancedness(*moved, 0, held_out), start - 1e-12) << "trial " << trial;
  }
  EXPECT_GT(used_to_lose, 0) << "no case where min-move without validation lost balance held-out";
}

}  // namespace
}  // namespace epmoe
