// Derived quantities of the planner against hand calculations for glm-5.3 and deepseek-v3. Each
// expected value is worked out in the comment above it; the seed (000) quotes several of them.
#include <gtest/gtest.h>

#include "epmoe/model.h"
#include "epmoe/plan.h"

namespace epmoe {
namespace {

ModelConfig Preset(const char* name) {
  auto model = LoadModel(name);
  EXPECT_TRUE(model.ok()) << model.status().message();
  return *model;
}

TEST(PlanDerivedTest, Glm53SizesMatchHandCalculation) {
  const ModelConfig m = Preset("glm-5.3");
  // 3 x 6,144 x 2,048 = 37,748,736 weights ("37.7 million").
  EXPECT_EQ(WeightsPerExpert(m), 37'748'736);
  // 4 bits without scales: 37,748,736 / 2 = 18,874,368 B ("18.9 MB"); x 256 = 4,831,838,208 ("4.83 GB");
  // x 75 MoE layers = 362,387,865,600 ("362 GB").
  EXPECT_EQ(FourBitBytes(WeightsPerExpert(m)), 18'874'368);
  EXPECT_EQ(FourBitBytes(WeightsPerExpert(m)) * m.num_experts, 4'831'838'208);
  EXPECT_EQ(FourBitBytes(WeightsPerExpert(m)) * m.num_experts * m.num_moe_layers(), 362'387'865'600);

  const ModelBytes b = ComputeModelBytes(m, WeightFormats{});
  // NVFP4: a 2,048 x 6,144 matrix has 786,432 blocks of 16 at 9 B + one 4-byte scale = 7,077,892 B;
  // three of them 21,233,676 B ("21 MB per whole expert"); x 256 = 5,435,821,056 ("5.4 GB per layer").
  EXPECT_EQ(b.expert, 21'233'676);
  EXPECT_EQ(b.routed_layer, 5'435'821'056);
  EXPECT_EQ(b.routed_model, 5'435'821'056LL * 75);
  // Shared expert in bf16: 37,748,736 x 2 = 75,497,472 B ("75 MB").
  EXPECT_EQ(b.shared_layer, 75'497'472);
  // Dense layer in int8 (+ one fp32 scale per output row): gate and up 12,288 x 6,144 + 12,288 x 4 =
  // 75,546,624 each, down 6,144 x 12,288 + 6,144 x 4 = 75,522,048; total 226,615,296 ("226 MB").
  EXPECT_EQ(b.dense_layer, 226'615'296);

  // In bf16 and int8 (scales per output channel).
  EXPECT_EQ(ComputeModelBytes(m, {WeightFormat::kBf16, WeightFormat::kBf16, WeightFormat::kBf16}).expert, 75'497'472);
  EXPECT_EQ(ComputeModelBytes(m, {WeightFormat::kInt8, WeightFormat::kBf16, WeightFormat::kBf16}).expert,
            37'748'736 + (2 * 2048 + 6144) * 4);
}

TEST(PlanDerivedTest, Glm53RowsTrafficAndCoverage) {
  const ModelConfig m = Preset("glm-5.3");
  // A row: 6,144 x 2 = 12,288 B in bf16; q4 (row_codec.h) 192 blocks of 20 B = 3,840 B.
  EXPECT_EQ(RowBytes(RowFormat::kBf16, m.hidden), 12'288);
  EXPECT_EQ(RowBytes(RowFormat::kQ4, m.hidden), 3'840);
  // A pick through an NVFP4 expert kernel: its NVFP4 input row (3,072 B of values + 384 B of
  // scales = 3,456 B), the bf16 output written and read (2 x 12,288 B) = 28,032 B; bf16 experts take a bf16 input: 3 x
  // 12,288 = 36,864 B.
  EXPECT_EQ(PickRowBytes(m, WeightFormat::kNvfp4), 28'032);
  EXPECT_EQ(PickRowBytes(m, WeightFormat::kBf16), 36'864);
  // All-to-all per token per layer: 2 x 8 x 6,144 x 2 = 196,608 B.
  EXPECT_EQ(AllToAllBytesPerToken(m, 2), 196'608);
  // Even router, 64 rows: 1 - (1 - 8/256)^64 = 1 - 0.96875^64 = 1 - 0.131082 = 0.868918 ("87%").
  EXPECT_NEAR(EvenTouchedShare(m, 64), 0.868918, 1e-5);
  // 8 rows: 0.96875^8 = exp(8 x ln 0.96875) = exp(-0.253990) = 0.775700, so 0.224300.
  EXPECT_NEAR(EvenTouchedShare(m, 8), 0.224300, 1e-5);
  // Ranks per row on 8 GPUs: 8 x (1 - C(224,8)/C(256,8)) = 5.2947 ("5.3"); copies sent (7/8 of it)
  // 4.6328 ("4.6"); 16 GPUs 6.1156 ("6.1"); 32 GPUs 7.0397 ("7.0"). Products computed exactly.
  EXPECT_NEAR(ExpectedRanksPerRow(m.num_experts, m.top_k, 8), 5.294652, 1e-5);
  EXPECT_NEAR(CopiesSentPerRow(m, 8), 4.632821, 1e-5);
  EXPECT_NEAR(CopiesSentPerRow(m, 16), 6.115575, 1e-5);
  EXPECT_NEAR(CopiesSentPerRow(m, 32), 7.039712, 1e-5);
  EXPECT_NEAR(ExpectedRanksPerRow(m.num_experts, m.top_k, 1), 1.0, 1e-12);
  EXPECT_NEAR(CopiesSentPerRow(m, 1), 0.0, 1e-12);
  // Never more than k = 8 copies at any EP size.
  for (int g : {64, 128, 256}) EXPECT_LT(CopiesSentPerRow(m, g), 8.0);
  // DWDP on 8 GPUs: 7/8 of 5,435,821,056 = 4,756,343,424 B ("about 4.8 GB").
  EXPECT_EQ(DwdpBytesPerRankPerLayer(m, WeightFormat::kNvfp4, 8), 4'756'343'424);
}

TEST(PlanDerivedTest, Glm53MemoryPerRank) {
  const ModelConfig m = Preset("glm-5.3");
  const WeightFormats f;
  // Shared expert copied on every GPU over 75 layers: 75,497,472 x 75 = 5,662,310,400 ("about 5.7 GB");
  // sliced 8 ways 707,788,800, so copies cost 4,954,521,600 more ("5 GB more").
  const auto sliced = ComputeMemoryPerRank(m, f, EpOption::kSliced, 8, SharedMode::kDefault, SharedMode::kSliced);
  const auto rows = ComputeMemoryPerRank(m, f, EpOption::kA2a, 8, SharedMode::kDefault, SharedMode::kSliced);
  EXPECT_EQ(rows.shared, 5'662'310'400);
  EXPECT_EQ(sliced.shared, 707'788'800);
  // Routed: 5,435,821,056 / 8 x 75 = 50,960,822,400 under every option.
  EXPECT_EQ(sliced.routed, 50'960'822'400);
  EXPECT_EQ(rows.routed, sliced.routed);
  // Dense sliced: 226,615,296 / 8 x 3 = 84,980,736; copied 679,845,888.
  EXPECT_EQ(sliced.dense, 84'980'736);
  EXPECT_EQ(ComputeMemoryPerRank(m, f, EpOption::kSliced, 8, SharedMode::kDefault, SharedMode::kCopied).dense,
            679'845'888);
  // DWDP: two fetch buffers of 4,756,343,424 B.
  EXPECT_EQ(ComputeMemoryPerRank(m, f, EpOption::kDwdp, 8, SharedMode::kDefault, SharedMode::kSliced).fetch_buffers,
            2 * 4'756'343'424LL);
}

TEST(PlanDerivedTest, DeepSeekV3MatchesHandCalculation) {
  const ModelConfig m = Preset("deepseek-v3");
  // 3 x 7,168 x 2,048 = 44,040,192 weights; 4 bits: 22,020,096 B; x 256 = 5,637,144,576 per layer;
  // x 58 MoE layers = 326,954,385,408 B.
  EXPECT_EQ(WeightsPerExpert(m), 44'040'192);
  EXPECT_EQ(FourBitBytes(WeightsPerExpert(m)), 22'020'096);
  EXPECT_EQ(FourBitBytes(WeightsPerExpert(m)) * m.num_experts, 5'637'144'576);
  EXPECT_EQ(FourBitBytes(WeightsPerExpert(m)) * m.num_experts * m.num_moe_layers(), 326'954'385'408);
  // NVFP4: 2,048 x 7,168 = 14,680,064 weights = 917,504 blocks x 9 B + 4 = 8,257,540 B; x 3 = 24,772,620.
  const ModelBytes b = ComputeModelBytes(m, WeightFormats{});
  EXPECT_EQ(b.expert, 24'772'620);
  // Dense int8: 18,432 x 7,168 = 132,120,576 weights; gate, up + 18,432 x 4; down + 7,168 x 4:
  // 2 x 132,194,304 + 132,149,248 = 396,537,856 B.
  EXPECT_EQ(b.dense_layer, 396'537'856);
  // Rows: 14,336 B in bf16; 224 blocks of 20 B = 4,480 B in q4; all-to-all 2 x 8 x 7,168 x 2 = 229,376 B.
  EXPECT_EQ(RowBytes(RowFormat::kBf16, m.hidden), 14'336);
  EXPECT_EQ(RowBytes(RowFormat::kQ4, m.hidden), 4'480);
  // A pick through an MXFP4 expert kernel: 3,584 B of values + 224 scales + 2 x 14,336 = 32,480 B.
  EXPECT_EQ(PickRowBytes(m, WeightFormat::kMxfp4), 32'480);
  EXPECT_EQ(AllToAllBytesPerToken(m, 2), 229'376);
  // 32 GPUs (same E and k as GLM-5.3): copies 31 x (1 - C(248,8)/C(256,8)) = 7.0397.
  EXPECT_NEAR(CopiesSentPerRow(m, 32), 7.039712, 1e-5);
  // DWDP on 32 GPUs: 256 x 24,772,620 = 6,341,790,720; / 32 x 31 = 6,143,609,760 B.
  EXPECT_EQ(DwdpBytesPerRankPerLayer(m, WeightFormat::kNvfp4, 32), 6'143'609'760);
  // Routed weights per rank on 32 GPUs: 6,341,790,720 / 32 x 58 = 11,494,495,680 B.
  EXPECT_EQ(
      ComputeMemoryPerRank(m, WeightFormats{}, EpOption::kA2a, 32, SharedMode::kDefault, SharedMode::kSliced).routed,
      11'494'495'680);
}

}  // namespace
}  // namespace epmoe
