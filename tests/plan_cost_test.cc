// The cost model: hand-priced cases, monotonicity, loads from traces, and the measurements of seed
// 000 (GLM-5.3 NVFP4 on 8 x B300) that the model must reproduce.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "epmoe/hardware.h"
#include "epmoe/model.h"
#include "epmoe/plan.h"
#include "epmoe/trace.h"
#include "plan_tiny.h"

namespace epmoe {
namespace {

ModelConfig Preset(const char* name) {
  auto model = LoadModel(name);
  EXPECT_TRUE(model.ok()) << model.status().message();
  return *model;
}
HardwareProfile Profile(const char* name) {
  auto profile = LoadHardware(name);
  EXPECT_TRUE(profile.ok()) << profile.status().message();
  return *profile;
}

// GLM-5.3 without the shared expert and dense layers: isolates the routed experts, as the seed's replay did.
ModelConfig RoutedOnly(ModelConfig m) {
  m.num_shared_experts = 0;
  m.shared_intermediate = 0;
  m.num_dense_layers = 0;
  m.dense_intermediate = 0;
  return m;
}

const OptionCost& Find(const PlanResult& r, EpOption option, int gpus, int64_t batch) {
  for (const auto& c : r.costs)
    if (c.option == option && c.gpus == gpus && c.batch == batch) return c;
  ADD_FAILURE() << "no cost for option " << EpOptionName(option) << " gpus " << gpus << " batch " << batch;
  static OptionCost none;
  return none;
}

PlanResult Plan(const ModelConfig& m, const HardwareProfile& hw, PlanConfig config, const ExpertLoad* trace = nullptr) {
  auto r = RunPlan(m, hw, config, trace, trace ? "trace" : "even");
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : PlanResult{};
}

using testing::TinyPlanModel;
using testing::UnitProfile;

// One step of 2 rows, top-2: expert 0 twice, expert 1 twice (rows {0,1} and {0,1}); experts 2, 3
// idle.
ExpertLoad TinyTrace() {
  ExpertLoad trace(1, 1, 4, 2);
  trace.rows[0] = 2;
  trace.at(0, 0)[0] = 2;
  trace.at(0, 0)[1] = 2;
  return trace;
}

// The tiny model's plan at 2 rows on 2 GPUs, fp32 weights, one sample: the trace's load.
PlanConfig TinyConfig(std::vector<EpOption> options) {
  PlanConfig config;
  config.batches = {2};
  config.gpus = {2};
  config.options = std::move(options);
  config.formats = {WeightFormat::kFp32, WeightFormat::kFp32, WeightFormat::kFp32};
  config.samples = 1;
  return config;
}

TEST(PlanCostTest, HandPricedTinyModel) {
  // Top-2, fp32 weights: 3 x 16 x 16 x 4 = 3,072 B per expert, 2 x 768 = 1,536 flops per pick.
  const ModelConfig m = TinyPlanModel(2);
  ASSERT_TRUE(ValidateModel(m, "tiny").ok());
  const ExpertLoad trace = TinyTrace();
  const PlanResult r =
      Plan(m, UnitProfile(), TinyConfig({EpOption::kSliced, EpOption::kWhole, EpOption::kA2a}), &trace);
  // Every pick moves 128 B of rows: its fp32 input (64 B) and its bf16 output written and read (2 x 32 B).
  EXPECT_EQ(PickRowBytes(m, WeightFormat::kFp32), 128);
  // Sliced, 2 ranks: each rank reads half of experts 0 and 1 (1,536 B each, read-bound: 1,536 us vs
  // 2 x 1,536 / 2 = 1,536 flops -> tie counts as reading) and moves all 4 picks' rows (4 x 128 B)
  // -> 5 + 2 x 1,536 + 512 = 3,589 us.
  const OptionCost& sliced = Find(r, EpOption::kSliced, 2, 2);
  EXPECT_NEAR(sliced.kernel_us, 3589, 1e-6);
  EXPECT_NEAR(sliced.rows_us, 512, 1e-6);
  // All-gather: 1 row per rank to 1 peer, 32 B (bf16 row) -> 32 us; reduce-scatter the same; + 2 x 10 us.
  EXPECT_NEAR(sliced.comm_us, 84, 1e-6);
  EXPECT_NEAR(sliced.step_ms, (3589 + 84) / 1000.0, 1e-9);
  // Whole experts: rank 0 holds experts 0, 1 (both used, 4 picks), rank 1 experts 2, 3 (idle):
  // rank 0 = 5 + 2 x max(3,072 B, 3,072 flops) + 4 x 128 = 6,661 us; rank 1 = 5 us; mean 3,333.
  const OptionCost& whole = Find(r, EpOption::kWhole, 2, 2);
  EXPECT_NEAR(whole.kernel_us, 6661, 1e-6);
  EXPECT_NEAR(whole.kernel_mean_us, 3333, 1e-6);
  EXPECT_NEAR(whole.imbalance_us, 3328, 1e-6);
  EXPECT_NEAR(whole.balancedness, 0.5, 1e-12);  // picks 4 and 0: mean 2 / max 4
  // Traveling rows: rank 0 holds all picks (share 1 -> held = 4 experts -> covered 1), rank 1 none.
  // Rank 0 receives rank 1's row (1 row) and sends none; rank 1 sends 1 row. 32 B each way -> 64 us
  // + 2 x 10 us.
  const OptionCost& rows = Find(r, EpOption::kA2a, 2, 2);
  EXPECT_NEAR(rows.comm_us, 84, 1e-6);
  EXPECT_NEAR(rows.copies_per_row, 0.5, 1e-12);  // (G-1)/G x sum of coverage = 1/2 x 1
}

TEST(PlanCostTest, Fp32PartialSumsPriceOutputsAndReduceScatterAtFourBytes) {
  // The tiny model of HandPricedTinyModel on a runtime whose pick outputs and partial sums are fp32
  // (epmoe's CPU executors): a pick moves its fp32 input (64 B) and its fp32 output written and read
  // (2 x 64 B) = 192 B; the all-gather still moves bf16 rows, the reduce-scatter fp32 partials.
  const ModelConfig m = TinyPlanModel(2);
  EXPECT_EQ(PickRowBytes(m, WeightFormat::kFp32, 4), 192);
  const ExpertLoad trace = TinyTrace();
  HardwareProfile hw = UnitProfile();
  hw.partial_sum_bytes = 4;
  const PlanResult r = Plan(m, hw, TinyConfig({EpOption::kSliced, EpOption::kA2a}), &trace);
  // Sliced: 5 + 2 x 1,536 + 4 picks x 192 B = 3,845 us; all-gather 32 B, reduce-scatter 64 B, + 2 x 10.
  const OptionCost& sliced = Find(r, EpOption::kSliced, 2, 2);
  EXPECT_NEAR(sliced.rows_us, 768, 1e-6);
  EXPECT_NEAR(sliced.kernel_us, 3845, 1e-6);
  EXPECT_NEAR(sliced.comm_us, 116, 1e-6);
  // Traveling rows come back weighted in bf16 whatever the partial sums: the comm of the bf16 case.
  EXPECT_NEAR(Find(r, EpOption::kA2a, 2, 2).comm_us, 84, 1e-6);
}

TEST(PlanCostTest, MoreBytesNeverFaster) {
  const ModelConfig m = Preset("glm-5.3");
  PlanConfig config;
  config.batches = {8, 64, 512, 8192};
  config.gpus = {8, 32};
  config.samples = 4;
  const HardwareProfile hw = Profile("h200x8");
  const PlanResult nvfp4 = Plan(m, hw, config);
  config.formats.experts = WeightFormat::kInt8;
  const PlanResult int8 = Plan(m, hw, config);
  config.formats.experts = WeightFormat::kBf16;
  const PlanResult bf16 = Plan(m, hw, config);
  ASSERT_EQ(nvfp4.costs.size(), bf16.costs.size());
  for (size_t i = 0; i < nvfp4.costs.size(); ++i) {
    if (!nvfp4.costs[i].applicable) continue;
    // Same load (same seed), more bytes per expert: never a shorter kernel or step.
    EXPECT_LE(nvfp4.costs[i].read_gb, int8.costs[i].read_gb);
    EXPECT_LE(int8.costs[i].read_gb, bf16.costs[i].read_gb);
    EXPECT_LE(int8.costs[i].kernel_us, bf16.costs[i].kernel_us + 1e-9) << EpOptionName(bf16.costs[i].option);
    EXPECT_LE(int8.costs[i].step_ms, bf16.costs[i].step_ms + 1e-9) << EpOptionName(bf16.costs[i].option);
  }
  // A slower memory system never makes anything faster.
  HardwareProfile slow = hw;
  slow.memory_bandwidth_gbs /= 2;
  config.formats.experts = WeightFormat::kNvfp4;
  const PlanResult slower = Plan(m, slow, config);
  for (size_t i = 0; i < nvfp4.costs.size(); ++i) {
    if (!nvfp4.costs[i].applicable) continue;
    EXPECT_GE(slower.costs[i].step_ms, nvfp4.costs[i].step_ms - 1e-9);
  }
}

TEST(PlanCostTest, MoreRanksNeverMoreBytesPerRankForSliced) {
  const ModelConfig m = Preset("deepseek-v3");
  PlanConfig config;
  config.batches = {64, 4096};
  config.gpus = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  config.options = {EpOption::kSliced};
  config.samples = 4;
  const PlanResult r = Plan(m, Profile("gb200nvl72"), config);
  for (int64_t batch : config.batches) {
    double previous_read = INFINITY;
    int64_t previous_memory = INT64_MAX;
    for (int g : config.gpus) {
      const OptionCost& c = Find(r, EpOption::kSliced, g, batch);
      ASSERT_TRUE(c.applicable) << g;
      EXPECT_LE(c.read_gb, previous_read) << g;
      EXPECT_LE(c.memory_bytes, previous_memory) << g;
      previous_read = c.read_gb;
      previous_memory = c.memory_bytes;
    }
  }
  // And for whole experts, the memory per rank shrinks too.
  for (int g = 2; g <= 256; g *= 2) {
    EXPECT_LE(ComputeMemoryPerRank(m, {}, EpOption::kA2a, g, SharedMode::kDefault, SharedMode::kSliced).routed,
              ComputeMemoryPerRank(m, {}, EpOption::kA2a, g / 2, SharedMode::kDefault, SharedMode::kSliced).routed);
  }
}

TEST(PlanCostTest, MoreRowsNeverLessCommunication) {
  const ModelConfig m = Preset("glm-5.3");
  PlanConfig config;
  config.batches = {8, 64, 512, 4096, 32768};
  config.gpus = {8, 16, 64};
  config.samples = 2;
  const PlanResult r = Plan(m, Profile("b300x8"), config);
  for (int g : config.gpus)
    for (EpOption o : {EpOption::kSliced, EpOption::kA2a})
      for (size_t i = 1; i < config.batches.size(); ++i)
        EXPECT_GE(Find(r, o, g, config.batches[i]).comm_us, Find(r, o, g, config.batches[i - 1]).comm_us);
}

TEST(PlanCostTest, NotApplicableOptionsSayWhy) {
  const ModelConfig m = Preset("glm-5.3");
  PlanConfig config;
  config.batches = {64};
  config.gpus = {24, 512};
  config.samples = 1;
  const PlanResult r = Plan(m, Profile("gb200nvl72"), config);
  // 2,048 is not a multiple of 24: slices cannot be cut (SGLang fails at startup).
  EXPECT_FALSE(Find(r, EpOption::kSliced, 24, 64).applicable);
  EXPECT_NE(Find(r, EpOption::kSliced, 24, 64).not_applicable.find("24"), std::string::npos);
  EXPECT_TRUE(Find(r, EpOption::kA2a, 24, 64).applicable);
  // More ranks than experts.
  EXPECT_FALSE(Find(r, EpOption::kA2a, 512, 64).applicable);
  // Bad configurations are refused.
  config.gpus = {0};
  EXPECT_FALSE(RunPlan(m, Profile("b300x8"), config, nullptr, "").ok());
  config.gpus = {8};
  config.batches = {0};
  EXPECT_FALSE(RunPlan(m, Profile("b300x8"), config, nullptr, "").ok());
  // Work is bounded: 16 M rows x 8 picks x 4,096 samples is refused, not run for hours.
  config.batches = {16'000'000};
  config.samples = 4096;
  auto too_much = RunPlan(m, Profile("b300x8"), config, nullptr, "");
  ASSERT_FALSE(too_much.ok());
  EXPECT_NE(too_much.status().message().find("--samples"), std::string::npos);
}

TEST(PlanCostTest, TraceLoadsJoinAndThinSteps) {
  ModelConfig m = Preset("olmoe-1b-7b");  // 64 experts, top-8
  ExpertLoad trace(4, 2, 64, 8);
  for (int64_t s = 0; s < 4; ++s) {
    trace.rows[s] = 10;
    for (int l = 0; l < 2; ++l)
      for (int e = 0; e < 8; ++e) trace.at(s, l)[(e + s) % 64] = 10;  // 10 rows x 8 picks
  }
  // 20 rows: two steps joined, 160 picks per layer load; 2 groups x 2 layers = 4 loads.
  auto joined = TraceLayerLoads(trace, m, 20, 100, 1);
  ASSERT_TRUE(joined.ok()) << joined.status().message();
  ASSERT_EQ(joined->size(), 4u);
  for (const auto& load : *joined) {
    EXPECT_EQ(load.rows, 20);
    int64_t picks = 0;
    for (int64_t p : load.picks) picks += p;
    EXPECT_EQ(picks, 160);
  }
  // 5 rows: each step thinned to about half its picks (binomial, seeded).
  auto thinned = TraceLayerLoads(trace, m, 5, 100, 1);
  ASSERT_TRUE(thinned.ok());
  int64_t picks = 0;
  for (const auto& load : *thinned)
    for (int64_t p : load.picks) picks += p;
  EXPECT_NEAR(static_cast<double>(picks) / thinned->size(), 40.0, 10.0);
  // Too few rows, wrong expert count, wrong k.
  EXPECT_FALSE(TraceLayerLoads(trace, m, 41, 100, 1).ok());
  ModelConfig other = m;
  other.num_experts = 128;
  EXPECT_FALSE(TraceLayerLoads(trace, other, 10, 100, 1).ok());
  other = m;
  other.top_k = 6;
  EXPECT_FALSE(TraceLayerLoads(trace, other, 10, 100, 1).ok());
}

TEST(PlanCostTest, BalancerPlacementEvensSkewedPicks) {
  // OLMoE shape (64 experts, top-8), 256 rows a step: experts 0-3 are hot (200 picks each), the other
  // 60 share the remaining 1,248 picks. Trivially, rank 0 holds all four hot experts.
  const ModelConfig m = Preset("olmoe-1b-7b");
  ExpertLoad trace(8, 1, 64, 8);
  for (int64_t s = 0; s < 8; ++s) {
    trace.rows[s] = 256;
    for (int e = 0; e < 64; ++e) trace.at(s, 0)[e] = e < 4 ? 200 : (e < 4 + 48 ? 21 : 20);
  }
  PlanConfig config;
  config.batches = {256};
  config.gpus = {8};
  config.options = {EpOption::kA2a};
  config.samples = 4;
  const PlanResult trivial = Plan(m, Profile("h100x8"), config, &trace);
  config.placement = "deepseek";
  config.redundant = 8;
  const PlanResult placed = Plan(m, Profile("h100x8"), config, &trace);
  const OptionCost& before = Find(trivial, EpOption::kA2a, 8, 256);
  const OptionCost& after = Find(placed, EpOption::kA2a, 8, 256);
  ASSERT_TRUE(after.applicable) << after.not_applicable;
  // Rank 0: 4 x 200 + 4 x 21 = 884 of 2,048 picks; mean 256: balancedness 0.29.
  EXPECT_NEAR(before.balancedness, 256.0 / 884.0, 1e-9);
  EXPECT_GT(after.balancedness, before.balancedness + 0.3);
  // The 8 redundant copies cost 8 experts / 8 ranks of weights per MoE layer.
  const int64_t expert = ComputeModelBytes(m, config.formats).expert;
  EXPECT_EQ(after.memory_bytes - before.memory_bytes, expert * m.num_moe_layers());
  // A shape the balancer refuses makes the option not applicable, with the reason.
  config.redundant = 3;  // 67 slots do not split over 8 ranks
  const PlanResult refused = Plan(m, Profile("h100x8"), config, &trace);
  EXPECT_FALSE(Find(refused, EpOption::kA2a, 8, 256).applicable);
}

TEST(PlanCostTest, CopiesPerRowFromPerRowPicks) {
  // 4 experts, top-2, one step of 2 rows: row 0 picks {0, 1}, row 1 picks {0, 2}.
  const std::string path = ::testing::TempDir() + "plan_copies.trace";
  TraceInfo info;
  info.num_layers = 1;
  info.num_experts = 4;
  info.top_k = 2;
  info.has_picks = true;
  info.layer_ids = {0};
  {
    auto writer = TraceWriter::Create(path, info);
    ASSERT_TRUE(writer.ok()) << writer.status().message();
    StepPicks step;
    step.rows = 2;
    Picks picks;
    picks.rows = 2;
    picks.k = 2;
    picks.experts = {0, 1, 0, 2};
    step.layers = {picks};
    CountStepPicks(1, 4, &step);
    ASSERT_TRUE((*writer)->Append(step).ok());
    ASSERT_TRUE((*writer)->Close().ok());
  }
  auto reader = TraceReader::Open(path, LoadReadOptions{});
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  // G = 1: nothing leaves. G = 2 (experts {0,1} | {2,3}; row 0 home 0, row 1 home 1): row 0 stays,
  // row 1 goes to rank 0: 0.5. G = 4 (one expert each; homes 0 and 2): one copy each: 1.0.
  auto copies = TraceCopiesPerRow(**reader, {1, 2, 4}, 1000);
  ASSERT_TRUE(copies.ok()) << copies.status().message();
  EXPECT_DOUBLE_EQ((*copies)[0], 0.0);
  EXPECT_DOUBLE_EQ((*copies)[1], 0.5);
  EXPECT_DOUBLE_EQ((*copies)[2], 1.0);
  auto again = TraceReader::Open(path, LoadReadOptions{});
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(TraceCopiesPerRow(**again, {8}, 1000).ok());  // more ranks than experts
}

// ---- Seed 000: GLM-5.3, NVFP4, 8 x B300 ----

TEST(PlanSeedTest, EvenRouterBalancednessMatchesSeed) {
  const ModelConfig m = Preset("glm-5.3");
  // Seed: an even router reaches 0.85 with 512 picks (64 rows) on 8 GPUs, 0.76 on 16 and 0.65 on 32;
  // in prefill batches of about 14,000 tokens 0.99, 0.97 and 0.96.
  const auto decode = EvenRouterLoads(m, 64, 200, 3);
  const auto prefill = EvenRouterLoads(m, 14000, 20, 3);
  auto mean = [](const std::vector<LayerLoad>& loads, int g) {
    double sum = 0;
    for (const auto& l : loads) sum += Balancedness(l, g);
    return sum / loads.size();
  };
  EXPECT_NEAR(mean(decode, 8), 0.85, 0.02);
  EXPECT_NEAR(mean(decode, 16), 0.76, 0.02);
  EXPECT_NEAR(mean(decode, 32), 0.65, 0.02);
  EXPECT_NEAR(mean(prefill, 8), 0.99, 0.01);
  EXPECT_NEAR(mean(prefill, 16), 0.97, 0.01);
  EXPECT_NEAR(mean(prefill, 32), 0.96, 0.01);
}

TEST(PlanSeedTest, KernelLineOn32Gpus) {
  // Seed section 7: a 64-token step touches about 188 experts (4.0 GB with scales); on 32 GPUs a GPU
  // reads 0.125 GB and its kernel would take 28 + 150 x 0.125 = 47 us.
  const ModelConfig m = RoutedOnly(Preset("glm-5.3"));
  ExpertLoad trace(1, 1, 256, 8);
  trace.rows[0] = 64;
  int64_t left = 512;
  for (int e = 0; e < 188; ++e) {  // 188 experts, 512 picks
    const int64_t p = e < 136 ? 3 : 2;
    trace.at(0, 0)[e * 256 / 188] = std::min(p, left);
    left -= std::min(p, left);
  }
  PlanConfig config;
  config.batches = {64};
  config.gpus = {32};
  config.options = {EpOption::kA2a};
  config.samples = 1;
  const PlanResult r = Plan(m, Profile("b300x8"), config, &trace);
  const OptionCost& c = Find(r, EpOption::kA2a, 32, 64);
  EXPECT_NEAR(c.kernel_mean_us, 28 + 150 * 188 * 21'233'676e-9 / 32, 0.5);
  EXPECT_NEAR(c.kernel_mean_us, 47, 1.5);
}

TEST(PlanSeedTest, CommunicationMatchesFigure10) {
  // Seed Figure 10 (8 x B300, 16-bit rows): all-gather + reduce-scatter against dispatch + combine.
  // Rows per GPU: 8 -> 72 / 70 us; 32 -> 87 / 75; 128 -> 131 / 86; 1,024 -> 379 / 274; 4,096 -> 1,217 / 900.
  // The model (one latency and one bandwidth per link) must land within 25% of each; the small-batch
  // points are its fixed cost, the large ones its bandwidth.
  const ModelConfig m = RoutedOnly(Preset("glm-5.3"));
  PlanConfig config;
  config.batches = {64, 256, 1024, 8192, 32768};
  config.gpus = {8};
  config.options = {EpOption::kSliced, EpOption::kA2a};
  config.samples = 4;
  const PlanResult r = Plan(m, Profile("b300x8"), config);
  const double gather[] = {72, 87, 131, 379, 1217};
  const double travel[] = {70, 75, 86, 274, 900};
  for (size_t i = 0; i < config.batches.size(); ++i) {
    const double sliced = Find(r, EpOption::kSliced, 8, config.batches[i]).comm_us;
    const double rows = Find(r, EpOption::kA2a, 8, config.batches[i]).comm_us;
    EXPECT_NEAR(sliced / gather[i], 1.0, 0.25) << config.batches[i] << ": " << sliced;
    EXPECT_NEAR(rows / travel[i], 1.0, 0.25) << config.batches[i] << ": " << rows;
    EXPECT_LE(rows, sliced + 1e-9);  // traveling rows never send more
  }
  // Copies per row with an even router on 8 GPUs: 4.6 (seed section 4.3).
  EXPECT_NEAR(Find(r, EpOption::kA2a, 8, 64).copies_per_row, 4.63, 0.1);
}

TEST(PlanSeedTest, DecodeKernelFollowsBytes) {
  // Seed section 2: with the router touching 72% of the experts at 64 tokens, whole experts take
  // about 102 us on the average GPU (the measured line gives 28 + 150 x 0.5 GB). The even router
  // touches 87% and reads more, so it is slower (the dashed line of Figure 3).
  const ModelConfig m = RoutedOnly(Preset("glm-5.3"));
  ExpertLoad trace(1, 1, 256, 8);
  trace.rows[0] = 64;
  for (int e = 0; e < 184; ++e) trace.at(0, 0)[e * 256 / 184] = e < 144 ? 3 : 2;  // 184 touched, 512 picks
  PlanConfig config;
  config.batches = {64};
  config.gpus = {8};
  config.options = {EpOption::kWhole};
  config.samples = 1;
  const PlanResult traced = Plan(m, Profile("b300x8"), config, &trace);
  const double measured_average = 102;
  EXPECT_NEAR(Find(traced, EpOption::kWhole, 8, 64).kernel_mean_us / measured_average, 1.0, 0.05);
  config.samples = 16;
  const PlanResult even = Plan(m, Profile("b300x8"), config);
  EXPECT_GT(Find(even, EpOption::kWhole, 8, 64).kernel_mean_us, Find(traced, EpOption::kWhole, 8, 64).kernel_mean_us);
}

TEST(PlanSeedTest, PrefillWholeExpertsAndSlicesKernel) {
  // Seed section 6.1: an 8,192-token chunk, tuned kernel: whole experts 353 us on the average GPU,
  // slices 609 us. Slices compute the same flops from the same bytes; what they add is rows: every
  // GPU moves all 65,536 picks' rows through its slices instead of its own 8,192 picks
  // (57,344 x 28,032 B more at 6.64 TB/s = 242 us), and the line's 10 us for slices.
  const ModelConfig m = RoutedOnly(Preset("glm-5.3"));
  PlanConfig config;
  config.phase = PlanPhase::kPrefill;
  config.batches = {8192};
  config.gpus = {8};
  config.options = {EpOption::kWhole, EpOption::kSliced};
  config.samples = 4;
  const PlanResult r = Plan(m, Profile("b300x8"), config);
  const OptionCost& whole = Find(r, EpOption::kWhole, 8, 8192);
  EXPECT_NEAR(whole.kernel_mean_us / 353, 1.0, 0.05);
  const OptionCost& sliced = Find(r, EpOption::kSliced, 8, 8192);
  EXPECT_NEAR(sliced.kernel_mean_us / 609, 1.0, 0.05);
  EXPECT_NEAR(sliced.rows_us - whole.rows_us, 57'344 * 28'032 / 6.64e6, 1.0);
  // The kernel is arithmetic-bound; the layer as a whole is dominated by the all-gather of 1,024 rows per GPU.
  EXPECT_GT(whole.arith_us, 5 * whole.read_us);
  EXPECT_EQ(whole.dominant, "communication");
}

TEST(PlanSeedTest, DwdpLosesDecodeAndPrefillAtEightGpus) {
  // Seed section 4.4: DWDP copies about 4.8 GB per GPU per layer; it pays only when the computation
  // takes longer than the copies, never in a 64-token decode step.
  const ModelConfig m = Preset("glm-5.3");
  PlanConfig config;
  config.batches = {64};
  config.gpus = {8};
  config.samples = 4;
  const PlanResult r = Plan(m, Profile("b300x8"), config);
  const OptionCost& dwdp = Find(r, EpOption::kDwdp, 8, 64);
  EXPECT_GT(dwdp.comm_us, 10 * dwdp.kernel_us);
  EXPECT_EQ(dwdp.dominant, "communication");
  ASSERT_EQ(r.winners.size(), 1u);
  EXPECT_NE(r.winners[0].option, EpOption::kDwdp);
}

TEST(PlanCostTest, DwdpFetchesOverlapOnGpusAndAddUpOnASharedDevice) {
  const ModelConfig m = Preset("qwen3-30b-a3b");
  PlanConfig config;
  config.batches = {64};
  config.gpus = {2};
  config.samples = 2;
  HardwareProfile gpus = Profile("h100x8");
  const OptionCost overlapped = Find(Plan(m, gpus, config), EpOption::kDwdp, 2, 64);
  EXPECT_DOUBLE_EQ(overlapped.layer_us, std::max(overlapped.kernel_us, overlapped.comm_us));
  // On GPUs fetches are one-sided reads: at a measured quarter of the collectives' rate they take 4x as long.
  gpus.intra_node.one_sided_efficiency = gpus.intra_node.efficiency / 4;
  const OptionCost slow_reads = Find(Plan(m, gpus, config), EpOption::kDwdp, 2, 64);
  EXPECT_NEAR(slow_reads.comm_us, 4 * overlapped.comm_us, 1e-6 * slow_reads.comm_us);
  gpus.ranks_share_device = true;  // now the same cores and memory fetch and compute
  const OptionCost shared = Find(Plan(m, gpus, config), EpOption::kDwdp, 2, 64);
  EXPECT_NEAR(shared.layer_us, shared.kernel_us + shared.comm_us, 1e-6 * shared.layer_us);
}

// Where ranks share a device, DWDP's fetch is a copy of the lacking experts' bytes at the device's
// copy rate shared by the ranks: hand-priced on the unit profile, sharing the device makes the layer
// slower by exactly that term on top of the kernel.
TEST(PlanCostTest, DwdpOnASharedDeviceAddsTheCopyOfTheFetchedBytes) {
  const ModelConfig m = TinyPlanModel(1);
  ASSERT_TRUE(ValidateModel(m, "tiny").ok());
  PlanConfig config;
  config.formats = {WeightFormat::kBf16, WeightFormat::kBf16, WeightFormat::kBf16};
  config.batches = {64};
  config.gpus = {2};
  config.samples = 4;
  config.options = {EpOption::kDwdp};
  HardwareProfile hw = UnitProfile();
  hw.memory_copy_gbs = 0.5e-3;  // the device copies 0.5 B/us in all
  // One expert: 3 x 16 x 16 bf16 = 1,536 bytes; a rank fetches the 2 experts it lacks: 3,072 bytes.
  const double fetched = 3072;
  ASSERT_EQ(DwdpBytesPerRankPerLayer(m, WeightFormat::kBf16, 2), fetched);
  const OptionCost gpu = Find(Plan(m, hw, config), EpOption::kDwdp, 2, 64);
  // GPUs: one-sided reads on the 1 B/us link, overlapped with the kernel.
  EXPECT_DOUBLE_EQ(gpu.comm_us, fetched / 1.0);
  EXPECT_DOUBLE_EQ(gpu.layer_us, std::max(gpu.kernel_us, gpu.comm_us));

  hw.ranks_share_device = true;
  const OptionCost cpu = Find(Plan(m, hw, config), EpOption::kDwdp, 2, 64);
  // Two ranks copy at once, each at 0.25 B/us: 3,072 / 0.25 = 12,288 us, after the kernel.
  const double copy_us = fetched * 2 / 0.5;
  EXPECT_DOUBLE_EQ(cpu.comm_us, copy_us);
  EXPECT_NEAR(cpu.layer_us, cpu.kernel_us + copy_us, 1e-9 * cpu.layer_us);

  // Without a measured copy rate: half the read rate (1 B/us read, each byte read and written).
  hw.memory_copy_gbs = 0;
  const OptionCost unmeasured = Find(Plan(m, hw, config), EpOption::kDwdp, 2, 64);
  EXPECT_DOUBLE_EQ(unmeasured.comm_us, fetched * 2 / 0.5);
  hw.memory_read_efficiency = 0.5;
  EXPECT_DOUBLE_EQ(Find(Plan(m, hw, config), EpOption::kDwdp, 2, 64).comm_us, fetched * 2 / 0.25);
}

TEST(PlanSeedTest, TravelingRowsWinPrefillOnEightB300) {
  // Seed section 6: traveling rows are the fastest option for prefill on 8 B300 (82,000 against
  // 60,200 tokens per second for slices), mostly from moving fewer rows.
  const ModelConfig m = Preset("glm-5.3");
  PlanConfig config;
  config.phase = PlanPhase::kPrefill;
  config.batches = {8192};
  config.gpus = {8};
  config.rows = RowFormat::kQ4;
  config.samples = 4;
  const PlanResult r = Plan(m, Profile("b300x8"), config);
  ASSERT_EQ(r.winners.size(), 1u);
  EXPECT_EQ(r.winners[0].option, EpOption::kA2a);
  EXPECT_LT(Find(r, EpOption::kA2a, 8, 8192).comm_us, Find(r, EpOption::kSliced, 8, 8192).comm_us);
}

}  // namespace
}  // namespace epmoe
