#include "epmoe/router.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"

namespace epmoe {
namespace {

ModelConfig TinyModel(Scoring scoring, int experts, int k) {
  ModelConfig m;
  m.name = "tiny";
  m.hidden = 4;
  m.num_experts = experts;
  m.expert_intermediate = 4;
  m.top_k = k;
  m.num_layers = 1;
  m.scoring = scoring;
  return m;
}

// The router's weights packed as the layer packs them.
RouterWeights Packed(const Matrix& weight) {
  Result<RouterWeights> packed = RouterWeights::Pack(weight);
  EXPECT_TRUE(packed.ok()) << packed.status().ToString();
  return packed.ok() ? std::move(packed).value() : RouterWeights();
}

Matrix Logits(std::vector<std::vector<float>> rows) {
  Matrix m(static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size()));
  for (size_t r = 0; r < rows.size(); ++r)
    for (size_t c = 0; c < rows[r].size(); ++c) m.at(r, c) = rows[r][c];
  return m;
}

double Sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

TEST(Router, SoftmaxTopkWithoutRenormalization) {
  const ModelConfig m = TinyModel(Scoring::kSoftmax, 4, 2);
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Logits({{1, 2, 3, 0}}), {}, &picks).ok());
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(0.0);
  EXPECT_EQ(picks.expert(0, 0), 2);
  EXPECT_EQ(picks.expert(0, 1), 1);
  EXPECT_NEAR(picks.weight(0, 0), std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(picks.weight(0, 1), std::exp(2.0) / z, 1e-6);
}

TEST(Router, SoftmaxRenormalizedAndScaled) {
  ModelConfig m = TinyModel(Scoring::kSoftmax, 4, 2);
  m.renormalize = true;
  m.routed_scaling = 2.0;
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Logits({{1, 2, 3, 0}}), {}, &picks).ok());
  const double a = std::exp(3.0), b = std::exp(2.0);
  EXPECT_NEAR(picks.weight(0, 0), 2.0 * a / (a + b), 1e-6);
  EXPECT_NEAR(picks.weight(0, 1), 2.0 * b / (a + b), 1e-6);
}

TEST(Router, SoftmaxOverTheChosen) {
  const ModelConfig m = TinyModel(Scoring::kSoftmaxTopk, 8, 2);
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Logits({{0.5f, -1, 2, 0, 1.5f, 0, 0, -3}}), {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 2);
  EXPECT_EQ(picks.expert(0, 1), 4);
  const double a = std::exp(2.0), b = std::exp(1.5);
  EXPECT_NEAR(picks.weight(0, 0), a / (a + b), 1e-6);
  EXPECT_NEAR(picks.weight(0, 1), b / (a + b), 1e-6);
}

TEST(Router, SigmoidBiasChoosesButDoesNotWeigh) {
  ModelConfig m = TinyModel(Scoring::kSigmoid, 4, 2);
  m.correction_bias = true;
  m.renormalize = false;
  // Without the bias experts 0 and 1 win; the bias lifts expert 3 above expert 1.
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.5f};
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Logits({{2, 1, -1, 0}}), bias, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 3);  // sigmoid(0) + 0.5 = 1.0 > sigmoid(2) = 0.88
  EXPECT_EQ(picks.expert(0, 1), 0);
  EXPECT_NEAR(picks.weight(0, 0), Sigmoid(0), 1e-6);  // weight from the unbiased score
  EXPECT_NEAR(picks.weight(0, 1), Sigmoid(2), 1e-6);
}

TEST(Router, SigmoidRenormalized) {
  ModelConfig m = TinyModel(Scoring::kSigmoid, 4, 2);
  m.renormalize = true;
  m.routed_scaling = 2.5;
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Logits({{2, 1, -1, 0}}), {}, &picks).ok());
  const double a = Sigmoid(2), b = Sigmoid(1);
  EXPECT_EQ(picks.expert(0, 0), 0);
  EXPECT_EQ(picks.expert(0, 1), 1);
  EXPECT_NEAR(picks.weight(0, 0), 2.5 * a / (a + b), 1e-6);
  EXPECT_NEAR(picks.weight(0, 1), 2.5 * b / (a + b), 1e-6);
}

TEST(Router, GroupLimitedTopkRanksGroupsByTheirTwoBestScores) {
  // DeepSeek-V3 style: 8 experts in 4 groups of 2, keep the best 2 groups, then top-2 inside them.
  ModelConfig m = TinyModel(Scoring::kSigmoid, 8, 2);
  m.num_expert_groups = 4;
  m.topk_groups = 2;
  // Group 0 holds the single best expert (0) but a weak partner: sum 0.95+0.05 = 1.0.
  // Group 1: 0.6+0.6 = 1.2, group 2: 0.55+0.55 = 1.1, group 3: 0.1+0.1 = 0.2.
  // Groups 1 and 2 win, so expert 0 is excluded even though it is the best single expert.
  auto logit = [](double p) { return static_cast<float>(std::log(p / (1 - p))); };
  Matrix logits =
      Logits({{logit(0.95), logit(0.05), logit(0.6), logit(0.6), logit(0.55), logit(0.55), logit(0.1), logit(0.1)}});
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(logits, {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 2);
  EXPECT_EQ(picks.expert(0, 1), 3);

  // Without group limiting expert 0 is chosen first.
  m.num_expert_groups = 1;
  m.topk_groups = 1;
  ASSERT_TRUE(Router(m).RouteLogits(logits, {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 0);
}

// DeepSeek-V2's group-limited greedy ranks groups by their best score alone: a group with one high
// score beats a group with two middling ones, which the sum of the best two would prefer.
TEST(Router, GroupsRankedByTheirBestScore) {
  ModelConfig m = TinyModel(Scoring::kSoftmaxTopk, 8, 2);
  m.num_expert_groups = 2;
  m.topk_groups = 1;
  // Group 0: best 3; group 1: 2.5 + 2.5.
  const Matrix logits = Logits({{3.0f, 0, 0, 0, 2.5f, 2.5f, 0, 0}});
  Picks picks;
  m.group_rank_experts = 1;
  ASSERT_TRUE(Router(m).RouteLogits(logits, {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 0);  // group 0 chosen: expert 0, then a 0-logit expert of group 0
  EXPECT_EQ(picks.expert(0, 1), 1);
  m.group_rank_experts = 2;
  ASSERT_TRUE(Router(m).RouteLogits(logits, {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 4);  // group 1 chosen
  EXPECT_EQ(picks.expert(0, 1), 5);
}

TEST(Router, TiesBreakTowardTheLowerExpertId) {
  const ModelConfig m = TinyModel(Scoring::kSoftmax, 6, 3);
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Logits({{1, 2, 2, 1, 2, 1}, {0, 0, 0, 0, 0, 0}}), {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 1);
  EXPECT_EQ(picks.expert(0, 1), 2);
  EXPECT_EQ(picks.expert(0, 2), 4);
  EXPECT_EQ(picks.expert(1, 0), 0);
  EXPECT_EQ(picks.expert(1, 1), 1);
  EXPECT_EQ(picks.expert(1, 2), 2);
}

TEST(Router, TiedGroupsBreakTowardTheLowerGroup) {
  ModelConfig m = TinyModel(Scoring::kSigmoid, 8, 2);
  m.num_expert_groups = 4;
  m.topk_groups = 1;
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Logits({{0, 0, 0, 0, 0, 0, 0, 0}}), {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 0);
  EXPECT_EQ(picks.expert(0, 1), 1);
}

TEST(Router, RefusesNonFiniteScoresNamingRowAndExpert) {
  const ModelConfig m = TinyModel(Scoring::kSoftmax, 4, 2);
  Picks picks;
  const Status s = Router(m).RouteLogits(Logits({{1, 2, 3, 0}, {0, NAN, 0, 0}}), {}, &picks);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("row 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("expert 1"), std::string::npos) << s.message();
  EXPECT_FALSE(Router(m).RouteLogits(Logits({{INFINITY, 0, 0, 0}}), {}, &picks).ok());
}

// Rows are routed in chunks on the pool's threads; the error names the lowest bad row whichever
// chunk finds it first.
TEST(Router, RefusesNonFiniteScoresOfTheLowestRowOnThreads) {
  const ModelConfig m = TinyModel(Scoring::kSoftmax, 4, 2);
  Matrix logits(100, 4);
  logits.at(90, 2) = NAN;
  logits.at(41, 3) = INFINITY;
  logits.at(41, 1) = NAN;
  ThreadPool pool(2);
  for (int i = 0; i < 20; ++i) {
    Picks picks;
    const Status s = Router(m).RouteLogits(logits, {}, &picks, &pool);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("row 41 for expert 1 "), std::string::npos) << s.message();
  }
}

TEST(Router, RefusesNonFiniteRows) {
  const ModelConfig m = TinyModel(Scoring::kSoftmax, 4, 2);
  Matrix rows(2, 4), weight(4, 4);
  rows.at(1, 3) = NAN;
  Picks picks;
  const Status s = Router(m).Route(rows, Packed(weight), {}, &picks);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("row 1 column 3"), std::string::npos) << s.message();
}

TEST(Router, RefusesWrongBiasAndShapes) {
  ModelConfig m = TinyModel(Scoring::kSigmoid, 4, 2);
  m.correction_bias = true;
  Picks picks;
  const std::vector<float> short_bias = {0.1f};
  EXPECT_FALSE(Router(m).RouteLogits(Logits({{1, 2, 3, 0}}), short_bias, &picks).ok());
  EXPECT_FALSE(Router(m).RouteLogits(Logits({{1, 2, 3}}), {}, &picks).ok());
}

TEST(Router, RouteComputesLogitsFromTheRouterMatrix) {
  const ModelConfig m = TinyModel(Scoring::kSoftmax, 4, 1);
  Matrix rows = Logits({{1, 0, 0, 0}, {0, 0, 0, 2}});
  Matrix weight = Logits({{0, 0, 0, 1}, {1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}});
  Picks picks;
  ASSERT_TRUE(Router(m).Route(rows, Packed(weight), {}, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 1);  // row 0 = e0, expert 1's weight is e0
  EXPECT_EQ(picks.expert(1, 0), 0);  // row 1 = 2 e3, expert 0's weight is e3
}

// gpt-oss: the router's bias is part of its logits, so it both chooses and weighs.
TEST(Router, RouterBiasIsAddedToTheLogits) {
  ModelConfig m = TinyModel(Scoring::kSoftmaxTopk, 4, 2);
  m.router_bias = true;
  const Matrix rows = Logits({{1, 0, 0, 0}});
  // Logits 3, 2, 1, 0; with the bias 3, 2, 2.5, 0.
  const Matrix weight = Logits({{3, 0, 0, 0}, {2, 0, 0, 0}, {1, 0, 0, 0}, {0, 0, 0, 0}});
  const std::vector<float> bias = {0, 0, 1.5f, 0};
  Picks picks;
  ASSERT_TRUE(Router(m).Route(rows, Packed(weight), bias, &picks).ok());
  EXPECT_EQ(picks.expert(0, 0), 0);
  EXPECT_EQ(picks.expert(0, 1), 2);
  const double a = std::exp(3.0), b = std::exp(2.5);
  EXPECT_NEAR(picks.weight(0, 0), a / (a + b), 1e-6);
  EXPECT_NEAR(picks.weight(0, 1), b / (a + b), 1e-6);
  const std::vector<float> short_bias = {0.1f};
  EXPECT_EQ(Router(m).Route(rows, Packed(weight), short_bias, &picks).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Router(m).Route(rows, Packed(weight), {}, &picks).code(), StatusCode::kInvalidArgument);
}

// The logits are computed in tiles of rows x experts spread over threads; a row's picks must not
// depend on that (nor on the batch it comes in), and must be what its exact logits give. Hidden
// 4100 and 13 experts leave a partial 512-step chunk and a partial 16-expert block.
TEST(Router, RouteDoesNotDependOnBatchTilesOrThreads) {
  ModelConfig m = TinyModel(Scoring::kSoftmax, 13, 3);
  m.hidden = 4100;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Matrix rows(70, m.hidden), weight(m.num_experts, m.hidden);
  for (float& v : rows.data) v = normal(rng);
  for (float& v : weight.data) v = normal(rng) * 0.02f;
  const Router router(m);
  const RouterWeights packed = Packed(weight);
  Picks alone, pooled;
  ThreadPool pool(2);
  ASSERT_TRUE(router.Route(rows, packed, {}, &alone).ok());
  ASSERT_TRUE(router.Route(rows, packed, {}, &pooled, &pool).ok());
  EXPECT_EQ(alone.experts, pooled.experts);
  EXPECT_EQ(alone.weights, pooled.weights);
  Matrix exact(rows.rows, m.num_experts);
  for (int64_t r = 0; r < rows.rows; ++r) {
    Matrix one(1, m.hidden);
    std::copy(rows.row(r), rows.row(r) + m.hidden, one.row(0));
    Picks single;
    ASSERT_TRUE(router.Route(one, packed, {}, &single, &pool).ok());
    for (int j = 0; j < m.top_k; ++j) {
      EXPECT_EQ(single.expert(0, j), alone.expert(r, j)) << "row " << r;
      EXPECT_EQ(single.weight(0, j), alone.weight(r, j)) << "row " << r;
    }
    for (int e = 0; e < m.num_experts; ++e) {
      double dot = 0;
      for (int64_t c = 0; c < m.hidden; ++c) dot += static_cast<double>(rows.at(r, c)) * weight.at(e, c);
      exact.at(r, e) = static_cast<float>(dot);
    }
  }
  Picks from_exact;
  ASSERT_TRUE(router.RouteLogits(exact, {}, &from_exact).ok());
  EXPECT_EQ(from_exact.experts, alone.experts);
  for (size_t i = 0; i < alone.weights.size(); ++i) EXPECT_NEAR(from_exact.weights[i], alone.weights[i], 1e-5);
}

// The logits as RouterWeights promises them: each the fp32 sum of its products in input order, one
// fused multiply-add each, with no packing, tiling or vectors in the way.
Matrix SequentialFmaLogits(const Matrix& rows, const Matrix& weight) {
  Matrix logits(rows.rows, weight.rows);
  for (int64_t r = 0; r < rows.rows; ++r)
    for (int64_t e = 0; e < weight.rows; ++e) {
      float sum = 0.0f;
      for (int64_t c = 0; c < rows.cols; ++c) sum = std::fma(weight.at(e, c), rows.at(r, c), sum);
      logits.at(r, e) = sum;
    }
  return logits;
}

Matrix NormalMatrix(int64_t rows, int64_t cols, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  Matrix m(rows, cols);
  for (float& v : m.data) v = normal(rng);
  return m;
}

Matrix RoundedToBf16(Matrix m) {
  for (float& v : m.data) v = FloatFromBf16(Bf16FromFloat(v));
  return m;
}

// Every instruction set's logits have the bits of the plain sequential loop, in bf16 and fp32
// packing, whatever the rows per call (partial row tiles and work items), the threads and the
// shape: experts that leave a partial 16-expert block or 4-block group, hidden sizes odd (bf16's
// padded last step), past one 512-step chunk, or under one vector.
TEST(RouterWeights, LogitsHaveTheBitsOfTheSequentialSumOnEveryInstructionSet) {
  ThreadPool pool(2);
  const std::pair<int64_t, int64_t> shapes[] = {{13, 4100}, {72, 2049}, {8, 31}, {130, 64}, {16, 1}, {1, 7}};
  for (const auto& [experts, hidden] : shapes) {
    const Matrix rows = NormalMatrix(70, hidden, 1.0f, 7);
    for (const bool bf16 : {false, true}) {
      const Matrix fp32_weight = NormalMatrix(experts, hidden, 0.05f, 8);
      const Matrix weight = bf16 ? RoundedToBf16(fp32_weight) : fp32_weight;
      const Matrix expected = SequentialFmaLogits(rows, weight);
      for (const Isa isa : AllIsas()) {
        if (!IsaSupported(isa)) continue;
        const std::string where = fmt::format("{}x{} {} {}", experts, hidden, bf16 ? "bf16" : "fp32", IsaName(isa));
        Result<RouterWeights> packed = RouterWeights::Pack(weight, IsaName(isa));
        ASSERT_TRUE(packed.ok()) << where << ": " << packed.status().ToString();
        EXPECT_EQ(packed->bf16(), bf16) << where;
        for (const int64_t count : {int64_t{1}, int64_t{3}, int64_t{5}, int64_t{37}, int64_t{70}}) {
          Matrix part(count, hidden);
          std::copy(rows.data.begin(), rows.data.begin() + count * hidden, part.data.begin());
          for (ThreadPool* threads : {static_cast<ThreadPool*>(nullptr), &pool}) {
            Matrix logits;
            packed->Logits(part, &logits, threads);
            ASSERT_EQ(logits.rows, count);
            ASSERT_EQ(logits.cols, experts);
            for (int64_t i = 0; i < count * experts; ++i)
              ASSERT_EQ(std::bit_cast<uint32_t>(logits.data[i]), std::bit_cast<uint32_t>(expected.data[i]))
                  << where << ", " << count << " rows: row " << i / experts << " expert " << i % experts;
          }
        }
      }
    }
  }
}

// bf16 packing reads half the bytes (the experts padded to a multiple of 16); weights that are not
// all bf16 values stay fp32.
TEST(RouterWeights, KeepsBf16ValuesInBf16AndOthersInFp32) {
  const Matrix weight = NormalMatrix(40, 33, 0.05f, 9);
  const Result<RouterWeights> fp32 = RouterWeights::Pack(weight);
  ASSERT_TRUE(fp32.ok());
  EXPECT_FALSE(fp32->bf16());
  EXPECT_EQ(fp32->bytes(), 48 * 33 * 4);
  EXPECT_EQ(fp32->experts(), 40);
  EXPECT_EQ(fp32->hidden(), 33);
  const Result<RouterWeights> bf16 = RouterWeights::Pack(RoundedToBf16(weight));
  ASSERT_TRUE(bf16.ok());
  EXPECT_TRUE(bf16->bf16());
  EXPECT_EQ(bf16->bytes(), 48 * 34 * 2);
  Matrix one_off = RoundedToBf16(weight);
  one_off.at(39, 32) = std::nextafter(one_off.at(39, 32), 1.0f);
  EXPECT_FALSE(RouterWeights::Pack(one_off)->bf16());
}

TEST(RouterWeights, RefusesAnEmptyMatrixAndUnknownInstructionSets) {
  EXPECT_EQ(RouterWeights::Pack(Matrix(0, 8)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RouterWeights::Pack(Matrix(8, 0)).status().code(), StatusCode::kInvalidArgument);
  const Result<RouterWeights> unknown = RouterWeights::Pack(Matrix(8, 8), "fast");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("fast"), std::string::npos) << unknown.status().message();
}

TEST(Router, ZeroRowsGiveNoPicks) {
  const ModelConfig m = TinyModel(Scoring::kSoftmax, 4, 2);
  Picks picks;
  ASSERT_TRUE(Router(m).RouteLogits(Matrix(0, 4), {}, &picks).ok());
  EXPECT_EQ(picks.rows, 0);
  EXPECT_TRUE(picks.experts.empty());
}

TEST(SimulatedRouting, RoundRobinSpreadsPicksEvenly) {
  ModelConfig m = TinyModel(Scoring::kSoftmax, 16, 4);
  const Picks picks = RoundRobinPicks(m, 8);
  ASSERT_TRUE(ValidatePicks(picks, m.num_experts).ok());
  for (int64_t c : CountPicks(picks, m.num_experts)) EXPECT_EQ(c, 2);
  // A rank's part of the batch agrees with the whole batch.
  const Picks tail = RoundRobinPicks(m, 3, 5);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(tail.expert(0, j), picks.expert(5, j));
}

TEST(SimulatedRouting, UniformIsSeededDistinctAndSplitByRowsConsistently) {
  ModelConfig m = TinyModel(Scoring::kSoftmax, 16, 4);
  m.routed_scaling = 2.0;
  const Picks a = UniformPicks(m, 100, 7), b = UniformPicks(m, 100, 7), c = UniformPicks(m, 100, 8);
  ASSERT_TRUE(ValidatePicks(a, m.num_experts).ok());
  EXPECT_EQ(a.experts, b.experts);
  EXPECT_NE(a.experts, c.experts);
  for (int64_t r = 0; r < a.rows; ++r) {
    double sum = 0;
    for (int j = 0; j < a.k; ++j) sum += a.weight(r, j);
    EXPECT_NEAR(sum, 2.0, 1e-5);
  }
  const Picks part = UniformPicks(m, 10, 7, 40);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(part.expert(3, j), a.expert(43, j));
}

TEST(Picks, ValidateRefusesBadPicks) {
  Picks p;
  p.rows = 1;
  p.k = 2;
  p.experts = {1, 1};
  p.weights = {0.5f, 0.5f};
  EXPECT_FALSE(ValidatePicks(p, 4).ok());  // repeated expert
  p.experts = {1, 4};
  EXPECT_FALSE(ValidatePicks(p, 4).ok());  // out of range
  p.experts = {1, 2};
  p.weights = {NAN, 0.5f};
  EXPECT_FALSE(ValidatePicks(p, 4).ok());  // non-finite weight
  p.weights = {0.5f};
  EXPECT_FALSE(ValidatePicks(p, 4).ok());  // wrong size
}

TEST(RoutingMode, ParsesNamesAndRefusesOthers) {
  EXPECT_EQ(*ParseRoutingMode("round_robin"), RoutingMode::kRoundRobin);
  EXPECT_FALSE(ParseRoutingMode("random").ok());
}

}  // namespace
}  // namespace epmoe
