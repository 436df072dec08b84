// The production MoE layer against a naive per-row loop, for every preset at reduced sizes.
#include "epmoe/layer.h"

#include <gtest/gtest.h>

#include <cmath>

#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

// Plain restatement of the layer, independent of the production code: for each row, for each pick,
// the expert written out inline (SwiGLU, or gpt-oss's clamped form and biases as transformers'
// GptOssExperts computes them); then the shared experts (scaled by their output gate where the
// model has one, as transformers' Qwen2MoeSparseMoeBlock does).
Matrix NaiveLayer(const ModelConfig& m, const MoeLayerWeights& w, const Matrix& rows, const Picks& picks) {
  Matrix out(rows.rows, m.hidden);
  const bool oai = m.activation == Activation::kSwiGluOai;
  auto ffn = [&](const ExpertWeights& e, const float* x, double scale, float* y) {
    std::vector<double> act(e.intermediate());
    for (int64_t i = 0; i < e.intermediate(); ++i) {
      double g = 0, u = 0;
      for (int64_t c = 0; c < m.hidden; ++c) {
        g += e.gate.at(i, c) * static_cast<double>(x[c]);
        u += e.up.at(i, c) * static_cast<double>(x[c]);
      }
      if (!oai) {
        act[i] = g * (1.0 / (1.0 + std::exp(-g))) * u;
        continue;
      }
      g += e.gate_bias[i];
      u += e.up_bias[i];
      const double limit = static_cast<float>(m.swiglu_limit);
      if (g > limit) g = limit;
      if (u > limit) u = limit;
      if (u < -limit) u = -limit;
      act[i] = (u + 1) * (g / (1.0 + std::exp(-g * static_cast<double>(1.702f))));
    }
    for (int64_t h = 0; h < m.hidden; ++h) {
      double acc = m.expert_bias ? e.down_bias[h] : 0.0;
      for (int64_t i = 0; i < e.intermediate(); ++i) acc += e.down.at(h, i) * act[i];
      y[h] += static_cast<float>(scale * acc);
    }
  };
  for (int64_t r = 0; r < rows.rows; ++r) {
    for (int j = 0; j < picks.k; ++j) ffn(w.experts[picks.expert(r, j)], rows.row(r), picks.weight(r, j), out.row(r));
    // Qwen2-MoE: the shared expert's output times sigmoid(shared_expert_gate(x)).
    double gate = 0;
    for (int64_t c = 0; m.shared_output_gate && c < m.hidden; ++c) gate += w.shared_output_gate[c] * rows.at(r, c);
    const double scale = m.shared_output_gate ? 1.0 / (1.0 + std::exp(-gate)) : 1.0;
    for (const auto& s : w.shared) ffn(s, rows.row(r), scale, out.row(r));
  }
  return out;
}

class EveryPreset : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryPreset, ProductionAndReferenceMatchTheNaiveLoop) {
  auto loaded = LoadModel(GetParam());
  ASSERT_TRUE(loaded.ok());
  const ModelConfig m = ScaledModel(*loaded, 64, 32);
  ThreadPool pool(2);
  const MoeLayerWeights w = MakeSyntheticLayer(m, 1, 42, &pool);
  auto layer = MoeLayer::Create(m, w, PackOptions{});
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  // 200 rows: more than the 64 from which Forward's row steps (gather, combine, shared experts)
  // split their rows over the pool's threads.
  for (int64_t tokens : {1, 3, 37, 200}) {
    const Matrix rows = SyntheticRows(42, m, 0, 0, tokens);
    Picks picks;
    ASSERT_TRUE((*layer)->Route(rows, &picks).ok());
    ASSERT_TRUE(ValidatePicks(picks, m.num_experts).ok());
    const Matrix naive = NaiveLayer(m, w, rows, picks);
    Matrix reference, production;
    ASSERT_TRUE(ReferenceMoeForward(m, w, rows, picks, &reference).ok());
    LayerStats stats;
    ASSERT_TRUE((*layer)->Forward(rows, picks, &production, pool, &stats).ok());
    EXPECT_LT(NormalizedMaxError(reference, naive), 1e-5) << GetParam() << " T=" << tokens;
    EXPECT_LT(NormalizedMaxError(production, naive), 1e-5) << GetParam() << " T=" << tokens;
    EXPECT_EQ(stats.picks, tokens * m.top_k);
    EXPECT_GT(stats.experts_touched, 0);
    EXPECT_LE(stats.experts_touched, m.num_experts);
  }
}

// gpt-oss's clamps, with a limit low enough that they bite on synthetic rows (the presets' 7 is
// never reached), in every format and instruction set's kernel.
TEST(GptOss, ClampedActivationAndBiasesMatchTheNaiveLoop) {
  auto loaded = LoadModel("gpt-oss-20b");
  ASSERT_TRUE(loaded.ok());
  ModelConfig m = ScaledModel(*loaded, 64, 48);
  m.swiglu_limit = 0.05;
  ThreadPool pool(2);
  const MoeLayerWeights w = MakeSyntheticLayer(m, 0, 5, &pool);
  const Matrix rows = SyntheticRows(5, m, 0, 0, 40);
  Picks picks;
  ASSERT_TRUE(Router(m).Route(rows, *RouterWeights::Pack(w.router), w.router_bias, &picks).ok());
  const Matrix naive = NaiveLayer(m, w, rows, picks);
  ModelConfig unclamped = m;
  unclamped.swiglu_limit = 100;
  EXPECT_GT(NormalizedMaxError(naive, NaiveLayer(unclamped, w, rows, picks)), 0.1) << "the clamps do not bite";
  Matrix reference;
  ASSERT_TRUE(ReferenceMoeForward(m, w, rows, picks, &reference).ok());
  EXPECT_LT(NormalizedMaxError(reference, naive), 1e-5);
  for (WeightFormat format : AllWeightFormats()) {
    for (const char* isa : {"reference", "avx2", "avx512"}) {
      auto layer = MoeLayer::Create(m, w, PackOptions{format, isa});
      if (!layer.ok()) continue;  // an instruction set this CPU lacks
      Matrix production;
      ASSERT_TRUE((*layer)->Forward(rows, picks, &production, pool, nullptr).ok());
      // The formats' own quantization error (fp32: none), as kernels_expert_ffn_test bounds it.
      const double bound = format == WeightFormat::kFp32 ? 1e-5 : format == WeightFormat::kBf16 ? 0.02 : 0.15;
      EXPECT_LT(NormalizedMaxError(production, naive), bound)
          << WeightFormatName(format) << " " << (*layer)->routed().kernel_name();
    }
  }
}

// A shared output gate the model does not have, or none where it has one, is refused.
TEST(SharedOutputGate, OfTheWrongLengthIsRefused) {
  const ModelConfig m = ScaledModel(*LoadModel("qwen3-next-80b-a3b"), 64, 32);
  MoeLayerWeights w = MakeSyntheticLayer(m, 0, 3);
  ASSERT_EQ(w.shared_output_gate.size(), 64u);
  w.shared_output_gate.pop_back();
  auto layer = MoeLayer::Create(m, w, PackOptions{});
  ASSERT_FALSE(layer.ok());
  EXPECT_NE(layer.status().message().find("a shared output gate of 63 values"), std::string::npos);
  ModelConfig ungated = m;
  ungated.shared_output_gate = false;
  w.shared_output_gate.push_back(0.0f);
  EXPECT_FALSE(MoeLayer::Create(ungated, w, PackOptions{}).ok());
}

// Packed expert by expert, on a pool, the synthetic layer routes and computes exactly as the layer
// packed from MakeSyntheticLayer's weights (shared experts and correction bias included).
TEST_P(EveryPreset, SyntheticLayerPackedAsMadeIsTheSameLayer) {
  auto loaded = LoadModel(GetParam());
  ASSERT_TRUE(loaded.ok());
  const ModelConfig m = ScaledModel(*loaded, 64, 32);
  ThreadPool pool(2);
  auto whole = MoeLayer::Create(m, MakeSyntheticLayer(m, 2, 7), PackOptions{WeightFormat::kInt8});
  auto made = MoeLayer::Create(m, *SyntheticWeights(m, 7), 2, PackOptions{WeightFormat::kInt8, "auto", &pool});
  ASSERT_TRUE(whole.ok() && made.ok());
  const Matrix rows = SyntheticRows(7, m, 0, 0, 37);
  Picks a, b;
  ASSERT_TRUE((*whole)->Route(rows, &a).ok());
  ASSERT_TRUE((*made)->Route(rows, &b).ok());
  ASSERT_EQ(a.experts, b.experts);
  ASSERT_EQ(a.weights, b.weights);
  Matrix x, y;
  ASSERT_TRUE((*whole)->Forward(rows, a, &x, pool, nullptr).ok());
  ASSERT_TRUE((*made)->Forward(rows, b, &y, pool, nullptr).ok());
  EXPECT_EQ(x.data, y.data);
}

INSTANTIATE_TEST_SUITE_P(Presets, EveryPreset, ::testing::ValuesIn(ListModelPresets()), [](const auto& info) {
  std::string name = info.param;
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
});

ModelConfig SmallModel() {
  auto m = LoadModel("qwen3-30b-a3b");
  EPMOE_CHECK(m.ok());
  return ScaledModel(*m, 32, 16);
}

TEST(Permutation, StableCountingSortRoundTrips) {
  const ModelConfig m = SmallModel();
  const Picks picks = UniformPicks(m, 50, 3);
  const PermutedPicks p = PermuteByExpert(picks, m.num_experts);
  ASSERT_EQ(p.offsets.size(), static_cast<size_t>(m.num_experts + 1));
  ASSERT_EQ(p.offsets.back(), 50 * m.top_k);
  std::vector<int> seen(picks.experts.size(), 0);
  for (int e = 0; e < m.num_experts; ++e) {
    for (int64_t q = p.offsets[e]; q < p.offsets[e + 1]; ++q) {
      EXPECT_EQ(picks.experts[p.source_pick[q]], e);
      if (q > p.offsets[e]) {
        EXPECT_LT(p.source_pick[q - 1], p.source_pick[q]);  // stable
      }
      seen[p.source_pick[q]]++;
    }
  }
  for (int s : seen) EXPECT_EQ(s, 1);

  // Gather then combine with unit weights and an identity "expert" gives k * row back.
  Matrix rows = SyntheticRows(1, m, 0, 0, 50);
  Matrix gathered, combined;
  GatherPermutedRows(rows, p, picks.k, &gathered);
  Picks unit = picks;
  std::fill(unit.weights.begin(), unit.weights.end(), 1.0f);
  CombinePermutedRows(gathered, p, unit, &combined);
  for (int64_t i = 0; i < rows.rows * rows.cols; ++i) EXPECT_FLOAT_EQ(combined.data[i], m.top_k * rows.data[i]);
}

TEST(Layer, ZeroRowsGiveAnEmptyOutput) {
  const ModelConfig m = SmallModel();
  ThreadPool pool(2);
  const MoeLayerWeights w = MakeSyntheticLayer(m, 0, 1);
  auto layer = MoeLayer::Create(m, w, PackOptions{});
  ASSERT_TRUE(layer.ok());
  Matrix rows(0, m.hidden), out;
  Picks picks;
  ASSERT_TRUE((*layer)->Route(rows, &picks).ok());
  LayerStats stats;
  ASSERT_TRUE((*layer)->Forward(rows, picks, &out, pool, &stats).ok());
  EXPECT_EQ(out.rows, 0);
  EXPECT_EQ(stats.experts_touched, 0);
  ASSERT_TRUE(ReferenceMoeForward(m, w, rows, picks, &out).ok());
}

TEST(Layer, RefusesNonFiniteRowsAndBadPicks) {
  const ModelConfig m = SmallModel();
  ThreadPool pool(1);
  const MoeLayerWeights w = MakeSyntheticLayer(m, 0, 1);
  auto layer = MoeLayer::Create(m, w, PackOptions{});
  ASSERT_TRUE(layer.ok());
  Matrix rows = SyntheticRows(1, m, 0, 0, 4), out;
  Picks picks = RoundRobinPicks(m, 4);
  rows.at(2, 5) = INFINITY;
  Status s = (*layer)->Forward(rows, picks, &out, pool, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("row 2 column 5"), std::string::npos) << s.message();
  EXPECT_FALSE(ReferenceMoeForward(m, w, rows, picks, &out).ok());
  rows.at(2, 5) = 0;
  picks.experts[3] = m.num_experts;
  EXPECT_FALSE((*layer)->Forward(rows, picks, &out, pool, nullptr).ok());
  picks = RoundRobinPicks(m, 3);
  EXPECT_FALSE((*layer)->Forward(rows, picks, &out, pool, nullptr).ok());  // 4 rows, 3 rows of picks
}

TEST(Layer, SlicesOfAnExpertSumToTheExpert) {
  const ModelConfig m = SmallModel();
  const ExpertWeights whole = MakeSyntheticExpert(m, 2, 5, 9);
  const ExpertWeights a = MakeSyntheticExpert(m, 2, 5, 9, 0, 6);
  const ExpertWeights b = MakeSyntheticExpert(m, 2, 5, 9, 6, 16);
  const Matrix rows = SyntheticRows(3, m, 0, 0, 1);
  std::vector<float> y(m.hidden), ya(m.hidden), yb(m.hidden);
  ReferenceExpertFfn(whole, {}, rows.row_span(0), y);
  ReferenceExpertFfn(a, {}, rows.row_span(0), ya);
  ReferenceExpertFfn(b, {}, rows.row_span(0), yb);
  for (int h = 0; h < m.hidden; ++h) EXPECT_NEAR(ya[h] + yb[h], y[h], 1e-6);
}

}  // namespace
}  // namespace epmoe
