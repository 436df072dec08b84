// Live rebalancing of the real executors (a2a and whole) under mpirun with 1, 2, 4 and 8 ranks: an
// executor that the Rebalancer rebalances every few steps runs beside one that never rebalances,
// on the same rows and picks; with fp32 weights, rows and combine, a2a's outputs are identical bit
// for bit every step and layer, whole's equal to fp32 rounding (its partial sums meet in the
// reduce-scatter in an order that depends on which rank holds which copy).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/layer.h"
#include "epmoe/rebalancer.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "mpi_world.h"

namespace epmoe {
namespace {

Communicator& World() { return testing::SharedWorld(60); }

void CheckOk(const Status& status) { EPMOE_CHECK_MSG(status.ok(), status.ToString()); }

constexpr int kLayers = 2;
constexpr int64_t kRowsPerRank = 12;

ModelConfig TestModel() {
  auto model = LoadModel("olmoe-1b-7b");
  CheckOk(model.status());
  return ScaledModel(*model, 64, 32);
}

// Picks of global rows [first, first + count): a few popular experts that change every 4 steps.
Picks SkewedPicks(const ModelConfig& model, int step, int layer, int64_t first, int64_t count) {
  Picks picks = UniformPicks(model, count, 977 * step + layer, first);
  const int popular = (step / 4 * 5 + layer * 3) % model.num_experts;
  for (int64_t r = 0; r < count; ++r) {
    // The first pick of most rows goes to one of two popular experts (kept distinct within the row).
    const int want = (popular + static_cast<int>((first + r) % 2)) % model.num_experts;
    bool present = false;
    for (int j = 0; j < picks.k; ++j) present = present || picks.expert(r, j) == want;
    if (!present && (first + r) % 5 != 0) picks.experts[r * picks.k] = want;
  }
  return picks;
}

double NormalizedMaxDifference(const Matrix& a, const Matrix& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.data.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a.data[i]) - b.data[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b.data[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

struct Variant {
  EpOption option = EpOption::kA2a;
  bool async = false;
  int layers_per_chunk = 0;
};

// Returns the rebalances of the rebalanced executor after `steps` steps (more while one is in
// progress), checking every layer of every step against the executor that never rebalances.
std::vector<RebalanceReport> RunBesideFixed(const Variant& variant, int steps) {
  Communicator& comm = World();
  const int g = comm.size(), me = comm.rank();
  const ModelConfig model = TestModel();
  ThreadPool pool(1);
  const int redundant = g > 1 ? g : 0;
  auto trivial = Placement::Trivial(kLayers, model.num_experts, redundant, g, 1);
  CheckOk(trivial.status());
  const PlacementPtr start = std::make_shared<const Placement>(*trivial);
  ExecutorOptions eo;
  eo.option = variant.option;
  eo.num_layers = kLayers;
  eo.dispatch_format = RowFormat::kFp32;
  eo.combine_format = RowFormat::kFp32;
  eo.pack.format = WeightFormat::kFp32;
  eo.placement = start;
  auto live = CreateExecutor(comm, model, eo, pool);
  CheckOk(live.status());
  auto fixed = CreateExecutor(comm, model, eo, pool);
  CheckOk(fixed.status());
  RebalanceTarget* target = (*live)->rebalance_target();
  EPMOE_CHECK(target != nullptr);
  RebalancerOptions ro;
  ro.trigger.interval_steps = 3;
  ro.policy.policy = Policy::kDeepseekGuarded;
  ro.policy.shape = {g, 1, 1, redundant};
  ro.async = variant.async;
  ro.layers_per_chunk = variant.layers_per_chunk;
  auto rebalancer = Rebalancer::Create(comm, *target, (*live)->live_placement(), ro);
  CheckOk(rebalancer.status());
  RecorderOptions rec;
  rec.window_steps = 3;
  auto recorder = LoadRecorder::Create(rec, (*live)->live_placement());
  CheckOk(recorder.status());
  const int64_t total = kRowsPerRank * g;
  const int64_t first = RowBegin(total, g, me), count = RowBegin(total, g, me + 1) - first;
  for (int step = 0; step < steps || (*rebalancer)->in_progress(); ++step) {
    Matrix x = SyntheticRows(7, model, step, first, count);
    for (int layer = 0; layer < kLayers; ++layer) {
      const Picks picks = SkewedPicks(model, step, layer, first, count);
      CheckOk(recorder->Record(layer, picks));
      Matrix got, want;
      CheckOk((*live)->Forward(layer, x, picks, &got, nullptr));
      CheckOk((*fixed)->Forward(layer, x, picks, &want, nullptr));
      if (variant.option == EpOption::kA2a) {
        EXPECT_EQ(std::memcmp(got.data.data(), want.data.data(), got.data.size() * sizeof(float)), 0)
            << "rank " << me << " step " << step << " layer " << layer << " differs from the run that never rebalances";
      } else {
        EXPECT_LE(NormalizedMaxDifference(got, want), 1e-5) << "rank " << me << " step " << step << " layer " << layer;
      }
      x = std::move(want);
    }
    recorder->EndStep();
    // Async: rank 0's placement thread needs some time; toy steps take microseconds.
    if (variant.async) std::this_thread::sleep_for(std::chrono::milliseconds(3));
    auto outcome = (*rebalancer)->AtStepBoundary(step + 1, *recorder);
    CheckOk(outcome.status());
  }
  const auto reports = (*rebalancer)->reports();
  if (g > 1) {
    int64_t moved = 0;
    for (const auto& r : reports) moved += r.bytes_moved;
    EXPECT_GT(moved, 0) << "the test load should make the placement change";
    EXPECT_NE(*(*rebalancer)->placement(), *start);
  }
  for (const auto& r : reports) EXPECT_EQ(r.bytes_moved, r.remote_copies * target->expert_bytes());
  return reports;
}

TEST(ExecutorRebalance, A2aSyncMatchesBitForBit) { EXPECT_GE(RunBesideFixed({EpOption::kA2a, false, 0}, 12).size(), 3u); }

TEST(ExecutorRebalance, A2aAsyncChunkedMatchesBitForBit) {
  EXPECT_GE(RunBesideFixed({EpOption::kA2a, true, 1}, 24).size(), 2u);
}

TEST(ExecutorRebalance, WholeSyncChunkedMatches) { EXPECT_GE(RunBesideFixed({EpOption::kWhole, false, 1}, 12).size(), 3u); }

TEST(ExecutorRebalance, OtherOptionsOfferNoTarget) {
  ThreadPool pool(1);
  ExecutorOptions eo;
  eo.option = EpOption::kSliced;
  eo.num_layers = 1;
  auto sliced = CreateExecutor(World(), TestModel(), eo, pool);
  ASSERT_TRUE(sliced.ok()) << sliced.status().ToString();
  EXPECT_EQ((*sliced)->rebalance_target(), nullptr);
}

// A packed expert exported from one store and imported into another (another format would not
// fit) makes that store compute what the first one does, scales included.
TEST(ExecutorRebalance, ExportImportMovesQuantizedExpertsWithTheirScales) {
  for (WeightFormat format : {WeightFormat::kFp32, WeightFormat::kInt8, WeightFormat::kNvfp4}) {
    const ModelConfig model = TestModel();
    ExpertWeights a = MakeSyntheticExpert(model, 0, 1, 3), b = MakeSyntheticExpert(model, 0, 2, 3);
    PackOptions pack;
    pack.format = format;
    const ExpertWeights* first[] = {&a};
    const ExpertWeights* second[] = {&b};
    auto source = PackExperts(first, pack);
    auto dest = PackExperts(second, pack);
    ASSERT_TRUE(source.ok() && dest.ok());
    std::vector<std::byte> bytes((*source)->expert_bytes(0));
    ASSERT_TRUE((*source)->ExportExpert(0, bytes).ok());
    EXPECT_FALSE((*dest)->ImportExpert(0, std::span(bytes).first(bytes.size() - 1)).ok());
    EXPECT_FALSE((*dest)->ImportExpert(1, bytes).ok());
    ASSERT_TRUE((*dest)->ImportExpert(0, bytes).ok());
    std::vector<std::byte> again(bytes.size());
    ASSERT_TRUE((*dest)->ExportExpert(0, again).ok());
    EXPECT_EQ(again, bytes) << WeightFormatName(format);
    ThreadPool pool(1);
    const Matrix rows = SyntheticRows(5, model, 0, 0, 3);
    const int64_t offsets[] = {0, 3};
    Matrix out_source(3, model.hidden), out_dest(3, model.hidden);
    (*source)->Run(rows.data.data(), offsets, out_source.data.data(), pool);
    (*dest)->Run(rows.data.data(), offsets, out_dest.data.data(), pool);
    EXPECT_EQ(out_source.data, out_dest.data) << WeightFormatName(format);
  }
}

}  // namespace
}  // namespace epmoe
