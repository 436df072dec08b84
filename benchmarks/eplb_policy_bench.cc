// EPLB benchmarks:
//  - policy solve time on DeepSeek-V3's shape (58 MoE layers x 256 experts, 288 slots, 32 ranks,
//    4 nodes, 8 expert groups): deepseek and deepseek-guarded on the summed load (target < 5 ms for
//    all layers), per-step, cost and min-move on a 1000-step series (target < 2 s);
//  - the load recorder's overhead on one MoE layer's forward pass at T = 64 rows (target < 1%):
//    compare BM_LayerForward/recorder:0 with /recorder:1 in the same run.
#include <memory>
#include <random>

#include <benchmark/benchmark.h>

#include "epmoe/eplb_policy.h"
#include "epmoe/layer.h"
#include "epmoe/model.h"
#include "epmoe/recorder.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

constexpr int kLayers = 58, kExperts = 256, kRanks = 32, kNodes = 4, kGroups = 8, kRedundant = 32;

// Skewed synthetic routing: per layer a heavy-tailed popularity, 64 rows x 8 picks per step.
ExpertLoad SyntheticLoad(int64_t steps) {
  std::mt19937_64 rng(11);
  ExpertLoad load(steps, kLayers, kExperts, 8);
  std::lognormal_distribution<double> popularity(0.0, 1.0);
  for (int layer = 0; layer < kLayers; ++layer) {
    std::vector<double> p(kExperts);
    for (double& v : p) v = popularity(rng);
    std::discrete_distribution<int> pick(p.begin(), p.end());
    for (int64_t step = 0; step < steps; ++step)
      for (int i = 0; i < 512; ++i) ++load.at(step, layer)[pick(rng)];
  }
  for (int64_t step = 0; step < steps; ++step) load.rows[step] = 64;
  return load;
}

const ExpertLoad& Series() {
  static const ExpertLoad load = SyntheticLoad(1000);
  return load;
}
const ExpertLoad& Summed() {
  static const ExpertLoad load = [] {
    ExpertLoad sum(1, kLayers, kExperts, 8);
    sum.counts = SumOverSteps(Series());
    return sum;
  }();
  return load;
}

void BM_Policy(benchmark::State& state) {
  const Policy policy = static_cast<Policy>(state.range(0));
  const bool summed =
      policy == Policy::kDeepseek || policy == Policy::kDeepseekGuarded || policy == Policy::kUniform;
  const ExpertLoad& load = summed ? Summed() : Series();
  PolicyOptions options;
  options.policy = policy;
  options.shape = {kRanks, kNodes, kGroups, kRedundant};
  options.cost.bytes_per_expert = 44e6;  // DeepSeek-V3 expert in bf16: 3 x 7168 x 2048 x 2 bytes
  options.cost.flops_per_row = 6.0 * 7168 * 2048;
  options.cost.memory_bandwidth = 3e12;
  options.cost.peak_flops = 1e15;
  auto current = Placement::Trivial(kLayers, kExperts, kRedundant, kRanks, kNodes);
  options.current = &*current;
  for (auto _ : state) {
    auto placement = ComputePlacement(load, options);
    if (!placement.ok()) state.SkipWithError(placement.status().message().c_str());
    benchmark::DoNotOptimize(placement);
  }
  state.SetLabel(std::string(PolicyName(policy)) + (summed ? " (summed load)" : " (1000 steps)"));
}
BENCHMARK(BM_Policy)->DenseRange(0, static_cast<int>(Policy::kAuto))->Unit(benchmark::kMillisecond)->UseRealTime();

// One MoE layer of Qwen3-30B-A3B (128 experts, top-8) at reduced width, bf16, T = 64 rows.
void BM_LayerForward(benchmark::State& state) {
  const bool record = state.range(0) != 0;
  static const ModelConfig model = ScaledModel(*LoadModel("qwen3-30b-a3b"), 1024, 384);
  static ThreadPool pool(0);
  static const std::unique_ptr<MoeLayer> layer = [] {
    const MoeLayerWeights weights = MakeSyntheticLayer(model, 0, 5, &pool);
    PackOptions pack;
    pack.format = WeightFormat::kBf16;
    pack.pool = &pool;
    return std::move(MoeLayer::Create(model, weights, pack).value());
  }();
  Matrix rows(64, model.hidden);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (float& v : rows.data) v = normal(rng);
  Picks picks;
  if (!layer->Route(rows, &picks).ok()) state.SkipWithError("route failed");
  Matrix out;
  auto placement = Placement::Trivial(1, model.num_experts, 0, 8, 1);
  RecorderOptions options;
  options.bytes_per_expert = 3.0 * 1024 * 384 * 2;
  auto recorder = LoadRecorder::Create(options, *LivePlacement::Create(std::make_shared<const Placement>(*placement), 0));
  for (auto _ : state) {
    if (!layer->Forward(rows, picks, &out, pool, nullptr).ok()) state.SkipWithError("forward failed");
    if (record) {
      benchmark::DoNotOptimize(recorder->Record(0, picks));
      recorder->EndStep();
    }
  }
  state.SetLabel(record ? "with recorder" : "without recorder");
}
BENCHMARK(BM_LayerForward)->Arg(0)->Arg(1)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The recorder alone on the same picks (one layer): Record + EndStep.
void BM_Recorder(benchmark::State& state) {
  const RecorderMode mode = static_cast<RecorderMode>(state.range(0));
  ModelConfig model = *LoadModel("qwen3-30b-a3b");
  const Picks picks = UniformPicks(model, 64, 7);
  auto placement = Placement::Trivial(1, model.num_experts, 0, 8, 1);
  RecorderOptions options;
  options.mode = mode;
  auto recorder = LoadRecorder::Create(options, *LivePlacement::Create(std::make_shared<const Placement>(*placement), 0));
  for (auto _ : state) {
    benchmark::DoNotOptimize(recorder->Record(0, picks));
    recorder->EndStep();
  }
  state.SetLabel(RecorderModeName(mode));
}
BENCHMARK(BM_Recorder)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace epmoe
