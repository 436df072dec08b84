// Option 4's variants across nodes, each term against a hand-priced case: two-level's inter-node
// bytes, low-latency saving the count step, two-batch overlap (never above the sequential time,
// max-based when balanced) and single-batch overlap hiding the shared expert.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epmoe/hardware.h"
#include "epmoe/model.h"
#include "epmoe/plan.h"
#include "epmoe/trace.h"
#include "plan_tiny.h"

namespace epmoe {
namespace {

// 2 nodes of 2 ranks: inside a node 1 B/us and 10 us per collective step, between nodes 0.5 B/us
// and 20 us. Reading 1 B/us, 1 flop/us.
HardwareProfile TwoNodeProfile() {
  HardwareProfile p = testing::UnitProfile();
  p.name = "two-node";
  p.inter_node = {0.5e-3, 1, 20};
  return p;
}

using testing::TinyPlanModel;  // top-2: on 4 ranks each rank holds one of the 4 experts

// One step of 4 rows, every expert picked twice: each rank computes a quarter of the picks.
ExpertLoad EvenTrace() {
  ExpertLoad trace(1, 1, 4, 2);
  trace.rows[0] = 4;
  for (int e = 0; e < 4; ++e) trace.at(0, 0)[e] = 2;
  return trace;
}

PlanConfig A2aConfig(std::vector<A2aLevels> levels, std::vector<A2aMode> modes) {
  PlanConfig config;
  config.batches = {4};
  config.gpus = {4};
  config.options = {EpOption::kA2a};
  config.formats = {WeightFormat::kFp32, WeightFormat::kFp32, WeightFormat::kFp32};
  config.samples = 1;
  config.a2a_levels = std::move(levels);
  config.a2a_modes = std::move(modes);
  return config;
}

PlanResult Plan(const ModelConfig& m, const HardwareProfile& hw, const PlanConfig& config, const ExpertLoad* trace) {
  auto r = RunPlan(m, hw, config, trace, "trace");
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : PlanResult{};
}

const OptionCost& Find(const PlanResult& r, const A2aVariant& variant) {
  for (const auto& c : r.costs)
    if (c.option == EpOption::kA2a && c.a2a == variant) return c;
  ADD_FAILURE() << "no line " << A2aVariantLabel(variant);
  static OptionCost none;
  return none;
}

A2aVariant Variant(A2aLevels levels, A2aMode mode, bool tbo = false, bool sbo = false) {
  A2aVariant v;
  v.levels = levels;
  v.mode = mode;
  v.tbo = tbo;
  v.sbo = sbo;
  return v;
}

// Each rank holds 1 of 4 experts: a row (top-2) reaches it with probability 1 - C(3,2)/C(4,2) = 1/2,
// a node of 2 ranks with 1 - C(2,2)/C(4,2) = 5/6. One row per rank, 32 B each way (bf16).
TEST(PlanMultinodeTest, TwoLevelCrossesOncePerNode) {
  const ExpertLoad trace = EvenTrace();
  const PlanResult r = Plan(TinyPlanModel(2), TwoNodeProfile(),
                            A2aConfig({A2aLevels::kFlat, A2aLevels::kTwoLevel}, {A2aMode::kNormal}), &trace);
  // Flat: a rank sends 1/2 record to its node's other rank and 2 x 1/2 to the other node, and
  // receives as many; its outputs come back the same way. Per rank: 32 B intra and 64 B inter.
  // Dispatch data max(0.5 x 32 / 1, 1 x 32 / 0.5) = 64 us, + 20 us step; the combine the same.
  const OptionCost& flat = Find(r, Variant(A2aLevels::kFlat, A2aMode::kNormal));
  EXPECT_NEAR(flat.inter_node_mb * 1e6, 64, 1e-9);
  EXPECT_NEAR(flat.intra_node_mb * 1e6, 32, 1e-9);
  // The count step (normal): 20 us + 4 x 3 x 8 = 96 B, 2/3 of it to the other node at 0.5 B/us.
  const double count = 20 + 96 * 2.0 / 3 / 0.5;
  EXPECT_NEAR(flat.comm_us, count + 2 * (20 + 64), 1e-9);
  // Two-level: a row crosses to the other node with probability 5/6 (one record to the gateway),
  // and each gateway receives 5/6 of a row from the other node: 2 x 5/6 x 32 B inter-node. The
  // gateway forwards 5/6 x (1/2) / (5/6) = 1/2 record to its node's other rank and receives as
  // much: intra 32 B direct + 32 B forwarded. Dispatch: max(0.5 x 32, 5/6 x 32 / 0.5) + 20, then
  // forwarding 10 + 0.5 x 32; the combine the same.
  const OptionCost& two = Find(r, Variant(A2aLevels::kTwoLevel, A2aMode::kNormal));
  EXPECT_NEAR(two.inter_node_mb * 1e6, 2 * 5.0 / 6 * 32, 1e-9);
  EXPECT_NEAR(two.intra_node_mb * 1e6, 64, 1e-9);
  EXPECT_LT(two.inter_node_mb, flat.inter_node_mb);
  const double direct = 5.0 / 6 * 32 / 0.5;
  EXPECT_NEAR(two.comm_us, count + 2 * (20 + direct + 10 + 16), 1e-9);
  EXPECT_NEAR(two.copies_per_row, flat.copies_per_row, 1e-12);
}

// The combine as `epmoe run` makes it without --partial-sums: one output per pick instead of one
// summed row per rank a row visited.
TEST(PlanMultinodeTest, PerPickCombineReturnsEveryOutput) {
  const ExpertLoad trace = EvenTrace();
  // One node of 2 ranks holding 2 experts each: a row (top-2) reaches the other rank with
  // probability 1 - C(2,2)/C(4,2) = 5/6 and has 2 x 1/2 = 1 pick there on average. 2 rows per rank:
  // 2 x 5/6 records out; back 2 x 5/6 summed rows, or 2 x 1 outputs (32 B in bf16, 64 B in fp32).
  HardwareProfile hw = TwoNodeProfile();
  PlanConfig config = A2aConfig({A2aLevels::kFlat}, {A2aMode::kLowLatency});
  config.gpus = {2};
  const PlanResult summed = Plan(TinyPlanModel(2), hw, config, &trace);
  config.a2a_partial_sums = false;
  const PlanResult per_pick = Plan(TinyPlanModel(2), hw, config, &trace);
  config.combine = RowFormat::kFp32;
  const PlanResult per_pick_fp32 = Plan(TinyPlanModel(2), hw, config, &trace);
  const A2aVariant flat_low = Variant(A2aLevels::kFlat, A2aMode::kLowLatency);
  EXPECT_NEAR(Find(summed, flat_low).intra_node_mb * 1e6, 2 * 5.0 / 6 * 32 * 2, 1e-9);
  EXPECT_NEAR(Find(per_pick, flat_low).intra_node_mb * 1e6, 2 * 5.0 / 6 * 32 + 2 * 32, 1e-9);
  EXPECT_NEAR(Find(per_pick_fp32, flat_low).intra_node_mb * 1e6, 2 * 5.0 / 6 * 32 + 2 * 64, 1e-9);
  EXPECT_NEAR(Find(summed, flat_low).comm_us, 2 * 10 + 2 * (2 * 5.0 / 6 * 32), 1e-9);
  EXPECT_NEAR(Find(per_pick, flat_low).comm_us, 2 * 10 + 2 * 5.0 / 6 * 32 + 2 * 32, 1e-9);
  EXPECT_NEAR(Find(per_pick_fp32, flat_low).comm_us, 2 * 10 + 2 * 5.0 / 6 * 32 + 2 * 64, 1e-9);
  // Two nodes of 2 ranks, two-level: the gateway forwards a node's outputs back unchanged, so a row
  // gets 2 x 2/4 = 1 output back across the link where the summed combine sends 5/6 of a row.
  config = A2aConfig({A2aLevels::kTwoLevel}, {A2aMode::kNormal});
  const PlanResult two_summed = Plan(TinyPlanModel(2), hw, config, &trace);
  config.a2a_partial_sums = false;
  const PlanResult two_per_pick = Plan(TinyPlanModel(2), hw, config, &trace);
  const A2aVariant two = Variant(A2aLevels::kTwoLevel, A2aMode::kNormal);
  EXPECT_NEAR(Find(two_summed, two).inter_node_mb * 1e6, 2 * 5.0 / 6 * 32, 1e-9);
  EXPECT_NEAR(Find(two_per_pick, two).inter_node_mb * 1e6, 5.0 / 6 * 32 + 32, 1e-9);
}

TEST(PlanMultinodeTest, TwoLevelEqualsFlatWithOneRankPerNode) {
  HardwareProfile hw = TwoNodeProfile();
  hw.gpus_per_node = 1;
  const ExpertLoad trace = EvenTrace();
  const PlanResult r =
      Plan(TinyPlanModel(2), hw, A2aConfig({A2aLevels::kFlat, A2aLevels::kTwoLevel}, {A2aMode::kNormal}), &trace);
  const OptionCost& flat = Find(r, Variant(A2aLevels::kFlat, A2aMode::kNormal));
  const OptionCost& two = Find(r, Variant(A2aLevels::kTwoLevel, A2aMode::kNormal));
  EXPECT_DOUBLE_EQ(two.inter_node_mb, flat.inter_node_mb);
  EXPECT_DOUBLE_EQ(two.intra_node_mb, 0);
  EXPECT_DOUBLE_EQ(two.comm_us, flat.comm_us);
  // And on one node two-level has nothing to cross.
  hw.gpus_per_node = 4;
  const PlanResult one =
      Plan(TinyPlanModel(2), hw, A2aConfig({A2aLevels::kFlat, A2aLevels::kTwoLevel}, {A2aMode::kNormal}), &trace);
  EXPECT_DOUBLE_EQ(Find(one, Variant(A2aLevels::kTwoLevel, A2aMode::kNormal)).comm_us,
                   Find(one, Variant(A2aLevels::kFlat, A2aMode::kNormal)).comm_us);
  EXPECT_DOUBLE_EQ(Find(one, Variant(A2aLevels::kFlat, A2aMode::kNormal)).inter_node_mb, 0);
}

TEST(PlanMultinodeTest, LowLatencySavesTheCountStep) {
  const ExpertLoad trace = EvenTrace();
  const PlanResult r =
      Plan(TinyPlanModel(2), TwoNodeProfile(),
           A2aConfig({A2aLevels::kFlat, A2aLevels::kTwoLevel}, {A2aMode::kNormal, A2aMode::kLowLatency}), &trace);
  const OptionCost& normal = Find(r, Variant(A2aLevels::kFlat, A2aMode::kNormal));
  const OptionCost& low = Find(r, Variant(A2aLevels::kFlat, A2aMode::kLowLatency));
  EXPECT_NEAR(normal.comm_us - low.comm_us, 20 + 96 * 2.0 / 3 / 0.5, 1e-9);
  EXPECT_DOUBLE_EQ(normal.inter_node_mb, low.inter_node_mb);  // the same records
  EXPECT_LT(low.step_ms, normal.step_ms);
  // Low-latency is flat only.
  const OptionCost& two_low = Find(r, Variant(A2aLevels::kTwoLevel, A2aMode::kLowLatency));
  EXPECT_FALSE(two_low.applicable);
  EXPECT_NE(two_low.not_applicable.find("flat only"), std::string::npos) << two_low.not_applicable;
}

// a2a's dispatch and combine are all-to-all steps: where the profile measured that step's fixed
// cost apart (calibrate --links), they pay it instead of the collective's; the count step, an
// all-gather, still pays the collective's.
TEST(PlanMultinodeTest, ExchangeStepsPayTheMeasuredAllToAllCost) {
  const ExpertLoad trace = EvenTrace();
  const PlanConfig config =
      A2aConfig({A2aLevels::kFlat, A2aLevels::kTwoLevel}, {A2aMode::kNormal, A2aMode::kLowLatency});
  const PlanResult collective = Plan(TinyPlanModel(2), TwoNodeProfile(), config, &trace);
  HardwareProfile hw = TwoNodeProfile();
  hw.inter_node.exchange_latency_us = 5;  // against 20 for a collective step
  hw.intra_node.exchange_latency_us = 2;  // against 10
  const PlanResult measured = Plan(TinyPlanModel(2), hw, config, &trace);
  auto saved = [&](const A2aVariant& v) { return Find(collective, v).comm_us - Find(measured, v).comm_us; };
  // Flat across the nodes: dispatch and combine each pay the slower link's step, 5 instead of 20.
  EXPECT_NEAR(saved(Variant(A2aLevels::kFlat, A2aMode::kLowLatency)), 2 * (20 - 5), 1e-9);
  EXPECT_NEAR(saved(Variant(A2aLevels::kFlat, A2aMode::kNormal)), 2 * (20 - 5), 1e-9);
  // Two-level also forwards inside the node in each direction: 2 instead of 10 there.
  EXPECT_NEAR(saved(Variant(A2aLevels::kTwoLevel, A2aMode::kNormal)), 2 * (20 - 5) + 2 * (10 - 2), 1e-9);
}

// On a CPU server a2a's pack and unpack encode every record and output into its travel format and
// decode it back: each rank holds 1 expert, so a row (top-2) reaches each other rank with
// probability 1/2: 1 row per rank sends 3 x 1/2 records and receives as many, and the summed
// outputs come back alike: 6 rows of 16 numbers at row_codec_ns each, on a thread that gets a
// core, or a share of one where the ranks outnumber the cores.
TEST(PlanMultinodeTest, PackAndUnpackCostTheRowCodecRate) {
  const ExpertLoad trace = EvenTrace();
  const PlanConfig config = A2aConfig({A2aLevels::kFlat}, {A2aMode::kLowLatency});
  const A2aVariant flat_low = Variant(A2aLevels::kFlat, A2aMode::kLowLatency);
  HardwareProfile hw = TwoNodeProfile();
  const OptionCost plain = Find(Plan(TinyPlanModel(2), hw, config, &trace), flat_low);
  hw.row_codec_ns = 0.5;
  const OptionCost coded = Find(Plan(TinyPlanModel(2), hw, config, &trace), flat_low);
  EXPECT_NEAR(coded.kernel_us - plain.kernel_us, 6 * 16 * 0.5e-3, 1e-12);
  EXPECT_NEAR(coded.layer_us - plain.layer_us, 6 * 16 * 0.5e-3, 1e-12);
  EXPECT_DOUBLE_EQ(coded.comm_us, plain.comm_us);
  // 4 ranks on one machine of 2 cores: each thread gets half a core.
  hw.ranks_share_device = true;
  hw.nodes_share_device = true;
  hw.cores = 2;
  const OptionCost shared_cores = Find(Plan(TinyPlanModel(2), hw, config, &trace), flat_low);
  hw.row_codec_ns = 0;
  const OptionCost shared_plain = Find(Plan(TinyPlanModel(2), hw, config, &trace), flat_low);
  EXPECT_NEAR(shared_cores.kernel_us - shared_plain.kernel_us, 2 * 6 * 16 * 0.5e-3, 1e-12);
}

TEST(PlanMultinodeTest, AutoResolvesAsTheRuntime) {
  const ExpertLoad trace = EvenTrace();
  PlanConfig config = A2aConfig({A2aLevels::kAuto}, {A2aMode::kAuto});
  // Up to kAutoLowLatencyMaxRows rows per rank: low-latency, hence flat.
  config.batches = {4 * kAutoLowLatencyMaxRows};  // an even router: the trace holds only 4 rows
  PlanResult r = Plan(TinyPlanModel(2), TwoNodeProfile(), config, nullptr);
  ASSERT_EQ(r.costs.size(), 1u);
  EXPECT_EQ(r.costs[0].a2a, Variant(A2aLevels::kFlat, A2aMode::kLowLatency));
  // More: normal, and two-level on 2 nodes of 2 ranks.
  config.batches = {4 * kAutoLowLatencyMaxRows + 1};
  r = Plan(TinyPlanModel(2), TwoNodeProfile(), config, nullptr);
  ASSERT_EQ(r.costs.size(), 1u);
  EXPECT_EQ(r.costs[0].a2a, Variant(A2aLevels::kTwoLevel, A2aMode::kNormal));
  // ... but flat with one rank per node.
  HardwareProfile hw = TwoNodeProfile();
  hw.gpus_per_node = 1;
  r = Plan(TinyPlanModel(2), hw, config, nullptr);
  ASSERT_EQ(r.costs.size(), 1u);
  EXPECT_EQ(r.costs[0].a2a, Variant(A2aLevels::kFlat, A2aMode::kNormal));
  config.batches = {4};
  // An empty list of levels or modes is refused.
  config.a2a_modes.clear();
  EXPECT_FALSE(RunPlan(TinyPlanModel(2), hw, config, &trace, "trace").ok());
  config.a2a_modes = {A2aMode::kAuto};
  // auto and the level it resolves to are one line.
  config.a2a_levels = {A2aLevels::kAuto, A2aLevels::kFlat};
  r = Plan(TinyPlanModel(2), hw, config, &trace);
  EXPECT_EQ(r.costs.size(), 1u);
}

TEST(PlanMultinodeTest, TwoBatchOverlapFormula) {
  // Balanced: dispatch, experts and combine of each micro-batch 3 us: 3 + 3 + 3 + 3 = 12 us against
  // 2 x 9 sequentially.
  const LayerStages even{3, 0, 3, 3};
  EXPECT_DOUBLE_EQ(TwoBatchOverlapUs(even, even, false), 12);
  EXPECT_DOUBLE_EQ(SequentialUs(even) * 2, 18);
  // Exchange-bound: a.dispatch + max(a.compute, b.dispatch) + max(a.combine, b.compute) + b.combine.
  const LayerStages slow_links{10, 1, 2, 8};
  EXPECT_DOUBLE_EQ(TwoBatchOverlapUs(slow_links, slow_links, false), 10 + 10 + 8 + 8);
  // With SBO the first shared expert hides under the first dispatch.
  EXPECT_DOUBLE_EQ(TwoBatchOverlapUs(slow_links, slow_links, true), 10 + 10 + 8 + 8);
  const LayerStages big_shared{2, 5, 4, 2};
  EXPECT_DOUBLE_EQ(TwoBatchOverlapUs(big_shared, big_shared, false), 2 + 9 + 9 + 2);
  EXPECT_DOUBLE_EQ(TwoBatchOverlapUs(big_shared, big_shared, true), 5 + 4 + 9 + 2);
  // Never above the two micro-batches one after the other.
  for (const LayerStages& a : {even, slow_links, big_shared})
    for (const LayerStages& b : {even, slow_links, big_shared})
      for (bool sbo : {false, true}) EXPECT_LE(TwoBatchOverlapUs(a, b, sbo), SequentialUs(a) + SequentialUs(b) + 1e-12);
  EXPECT_DOUBLE_EQ(SingleBatchOverlapUs(big_shared), 5 + 4 + 2);
  EXPECT_DOUBLE_EQ(SingleBatchOverlapUs(slow_links), 10 + 2 + 8);
}

TEST(PlanMultinodeTest, TwoBatchOverlapNeverAboveItsSequentialTime) {
  for (const char* name : {"b300x8", "h200x8", "local"}) {
    auto hw = LoadHardware(name);
    ASSERT_TRUE(hw.ok()) << hw.status().message();
    auto model = LoadModel("qwen3-30b-a3b");
    ASSERT_TRUE(model.ok());
    for (PlanPhase phase : {PlanPhase::kDecode, PlanPhase::kPrefill}) {
      PlanConfig config;
      config.phase = phase;
      config.batches = phase == PlanPhase::kDecode ? std::vector<int64_t>{16, 256} : std::vector<int64_t>{4096};
      config.gpus = {4, 16};
      config.options = {EpOption::kA2a};
      config.samples = 2;
      config.tbo = true;
      config.sbo = true;
      const PlanResult r = Plan(*model, *hw, config, nullptr);
      ASSERT_EQ(r.costs.size(), config.batches.size() * config.gpus.size() * 4) << name;
      for (const auto& c : r.costs) {
        ASSERT_TRUE(c.applicable) << c.not_applicable;
        // kernel and comm sum both micro-batches' stages: the overlap only takes time away.
        EXPECT_LE(c.layer_us, c.kernel_us + c.comm_us + 1e-9) << name << " " << A2aVariantLabel(c.a2a);
        EXPECT_GE(c.exposed_comm_us, -1e-9);
        EXPECT_NEAR(c.exposed_comm_us, c.layer_us - c.kernel_us, 1e-9);
        if (!c.a2a.tbo && !c.a2a.sbo) {
          EXPECT_NEAR(c.exposed_comm_us, c.comm_us, 1e-9);
        }
      }
    }
  }
}

// Where a rank's two lanes outnumber the cores it gets, a lane waiting on its exchange holds the
// core the other would compute on: the two micro-batches take turns, each with its own SBO.
TEST(PlanMultinodeTest, TwoBatchOverlapHidesNothingWhenLanesOutnumberCores) {
  ModelConfig m = TinyPlanModel(2);
  m.num_shared_experts = 1;
  m.shared_intermediate = 16;
  ASSERT_TRUE(ValidateModel(m, "tiny").ok());
  const ExpertLoad trace = EvenTrace();
  PlanConfig config = A2aConfig({A2aLevels::kFlat}, {A2aMode::kNormal});
  config.tbo = true;
  config.sbo = true;
  HardwareProfile hw = TwoNodeProfile();
  hw.memory_bandwidth_gbs = 1;                      // 1,000 B/us
  hw.peak_tflops = {1e-3, 1e-3, 1e-3, 1e-3, 1e-3};  // 1,000 flop/us
  hw.cores = 2;                                     // one rank per device, 2 lanes: a core each
  const PlanResult enough = Plan(m, hw, config, &trace);
  hw.cores = 1;
  const PlanResult too_few = Plan(m, hw, config, &trace);
  const A2aVariant tbo = Variant(A2aLevels::kFlat, A2aMode::kNormal, true);
  const A2aVariant tbo_sbo = Variant(A2aLevels::kFlat, A2aMode::kNormal, true, true);
  EXPECT_LT(Find(enough, tbo).layer_us, Find(enough, tbo).kernel_us + Find(enough, tbo).comm_us - 1);
  // Taking turns: every stage of both micro-batches, one after the other.
  EXPECT_NEAR(Find(too_few, tbo).layer_us, Find(too_few, tbo).kernel_us + Find(too_few, tbo).comm_us, 1e-9);
  EXPECT_DOUBLE_EQ(Find(too_few, tbo).kernel_us, Find(enough, tbo).kernel_us);
  // With SBO each micro-batch still hides its shared expert under its own dispatch, in its own
  // thread: each reads all of it, 3 x 16 x 16 x 4 B = 3,072 B at 1,000 B/us.
  EXPECT_NEAR(Find(too_few, tbo).layer_us - Find(too_few, tbo_sbo).layer_us, 2 * 3.072, 1e-9);
  // Without the cores known, the overlap is priced as on GPUs.
  hw.cores = 0;
  EXPECT_DOUBLE_EQ(Find(Plan(m, hw, config, &trace), tbo).layer_us, Find(enough, tbo).layer_us);
}

// SBO runs the shared expert beside the dispatch: with a dispatch longer than the shared expert, the
// layer loses exactly the shared expert's time.
TEST(PlanMultinodeTest, SingleBatchOverlapHidesTheSharedExpert) {
  ModelConfig m = TinyPlanModel(2);
  m.num_shared_experts = 1;
  m.shared_intermediate = 16;
  ASSERT_TRUE(ValidateModel(m, "tiny").ok());
  HardwareProfile hw = TwoNodeProfile();
  hw.memory_bandwidth_gbs = 1;                      // 1,000 B/us
  hw.peak_tflops = {1e-3, 1e-3, 1e-3, 1e-3, 1e-3};  // 1,000 flop/us
  const ExpertLoad trace = EvenTrace();
  PlanConfig config = A2aConfig({A2aLevels::kFlat}, {A2aMode::kLowLatency});
  config.sbo = true;
  const PlanResult r = Plan(m, hw, config, &trace);
  const OptionCost& plain = Find(r, Variant(A2aLevels::kFlat, A2aMode::kLowLatency));
  const OptionCost& sbo = Find(r, Variant(A2aLevels::kFlat, A2aMode::kLowLatency, false, true));
  // The shared expert, copied, for this rank's 1 row: 3 x 16 x 16 x 4 B = 3,072 B at 1,000 B/us
  // (its 1,536 flops take 1.5 us).
  const double shared_us = 3.072;
  EXPECT_NEAR(plain.layer_us - sbo.layer_us, shared_us, 1e-9);
  EXPECT_NEAR(sbo.exposed_comm_us, plain.exposed_comm_us - shared_us, 1e-9);
  EXPECT_DOUBLE_EQ(sbo.kernel_us, plain.kernel_us);
}

}  // namespace
}  // namespace epmoe
