// Placement policies: DeepSeek's reference example, the guard's counterexample, degenerate shapes,
// and properties on random loads (valid placements, guard, each policy no worse on its objective).
#include <algorithm>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "eplb/solver.h"
#include "epmoe/balance.h"
#include "epmoe/eplb_policy.h"
#include "epmoe/placement.h"

namespace epmoe {
namespace {

const char* kReference = "/work/shared/data/traces/deepseek_eplb_reference_example.json";

std::string ReferencePath() {
  // The shared data sits beside the repository (../shared/data/traces).
  const std::string beside = std::string(EPMOE_SOURCE_DIR) + "/../shared/data/traces/deepseek_eplb_reference_example.json";
  return std::ifstream(beside).good() ? beside : kReference;
}

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
  std::ifstream in(ReferencePath());
  if (!in) GTEST_SKIP() << "reference example not found: " << ReferencePath();
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

}  // namespace
}  // namespace epmoe
