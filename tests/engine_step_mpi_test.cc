// The Engine under mpirun with 1, 2, 4 and 8 ranks: every option's steps against the
// single-process layers run here on all rows (routing, residual stream and all); a run started
// from a placement equals, bit for bit, one that installs the same placement live; the recorder's
// per-slot picks are what the dispatch tables sent; the load file a run records.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>

#include "epmoe/comm.h"
#include "epmoe/engine.h"
#include "epmoe/layer.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "epmoe/trace.h"
#include "mpi_world.h"
#include "tiny_model.h"

namespace epmoe {
namespace {

constexpr uint64_t kSeed = 11;
constexpr int kLayers = 2;

Communicator& World() {
  return testing::SharedWorld(120);
}

ThreadPool& Pool() {
  static ThreadPool pool(1);
  return pool;
}

ModelConfig TinyModel() {
  return testing::TinyModel(1);
}

EngineOptions FloatOptions(EpOption option, int ranks) {
  EngineOptions o;
  o.executor.option = option;
  o.executor.num_layers = kLayers;
  o.executor.dispatch_format = RowFormat::kFp32;
  o.executor.combine_format = RowFormat::kFp32;
  o.executor.pack.format = WeightFormat::kFp32;
  o.executor.seed = kSeed;
  if (option == EpOption::kHybrid) o.executor.tp_in_ep = ranks % 2 == 0 ? 2 : 1;
  return o;
}

int64_t First(int64_t total) {
  return RowBegin(total, World().size(), World().rank());
}
int64_t Count(int64_t total) {
  return RowBegin(total, World().size(), World().rank() + 1) - First(total);
}

// Every option, three steps of the model's router on this rank's rows, against the layers run
// in one process on all rows: this rank's rows of the residual stream after every step.
TEST(EngineStep, EveryOptionMatchesTheSingleProcessLayers) {
  const ModelConfig model = TinyModel();
  const int g = World().size();
  const int64_t total = 8 * g + 3;  // uneven rows
  auto weights = SyntheticWeights(model, kSeed);
  auto routing = ModelRouting(model, *weights, kLayers, "auto", Pool());
  ASSERT_TRUE(routing.ok()) << routing.status().ToString();
  std::vector<std::unique_ptr<MoeLayer>> layers;
  for (int l = 0; l < kLayers; ++l) {
    PackOptions pack;
    pack.format = WeightFormat::kFp32;
    auto layer = MoeLayer::Create(model, *weights, l, pack);
    ASSERT_TRUE(layer.ok());
    layers.push_back(std::move(*layer));
  }
  for (EpOption option : AllEpOptions()) {
    auto engine = Engine::Create(World(), model, FloatOptions(option, g), Pool());
    ASSERT_TRUE(engine.ok()) << EpOptionName(option) << ": " << engine.status().ToString();
    for (int step = 0; step < 3; ++step) {
      Matrix mine = SyntheticRows(kSeed, model, step, First(total), Count(total));
      auto report = (*engine)->Step(&mine, First(total), **routing);
      ASSERT_TRUE(report.ok()) << EpOptionName(option) << ": " << report.status().ToString();
      EXPECT_EQ(report->step, step);
      EXPECT_EQ(report->rows, total);
      Matrix all = SyntheticRows(kSeed, model, step, 0, total);
      for (int l = 0; l < kLayers; ++l) {
        Picks picks;
        ASSERT_TRUE((*routing)->Route(step, l, all, 0, &picks, Pool()).ok());
        Matrix out;
        ASSERT_TRUE(layers[l]->Forward(all, picks, &out, Pool(), nullptr).ok());
        for (size_t i = 0; i < all.data.size(); ++i) all.data[i] += out.data[i];
      }
      double worst = 0;
      for (int64_t r = 0; r < mine.rows; ++r)
        for (int64_t c = 0; c < model.hidden; ++c)
          worst = std::max(worst, std::abs(static_cast<double>(mine.row(r)[c] - all.row(First(total) + r)[c])));
      EXPECT_LE(worst, 1e-4) << EpOptionName(option) << " step " << step << " rank " << World().rank();
    }
    ASSERT_TRUE((*engine)->Close().ok());
  }
}

// A placement with redundant copies, rotated so that it differs from the trivial one.
PlacementPtr RotatedPlacement(int experts, int redundant, int ranks) {
  std::vector<std::vector<int32_t>> phy2log(kLayers);
  for (int l = 0; l < kLayers; ++l)
    for (int s = 0; s < experts + redundant; ++s) phy2log[l].push_back((s * 5 + l + 3) % experts);
  auto p = Placement::Create(experts, ranks, 1, phy2log);
  EPMOE_CHECK_MSG(p.ok(), p.status().ToString());
  return std::make_shared<const Placement>(std::move(*p));
}

TEST(EngineStep, StartingFromAPlacementEqualsInstallingItLive) {
  const ModelConfig model = TinyModel();
  const int g = World().size();
  const int redundant = 2 * g;
  const PlacementPtr target = RotatedPlacement(model.num_experts, redundant, g);
  auto trivial = Placement::Trivial(kLayers, model.num_experts, redundant, g, 1);
  ASSERT_TRUE(trivial.ok());
  auto routing = SimulatedRouting(model, RoutingMode::kUniform, kSeed);
  ASSERT_TRUE(routing.ok());
  const int64_t total = 6 * g;
  // The two-level a2a exchange on two nodes (one node with one rank) reads the placement each step
  // too: installed live it stays bit for bit the flat exchange started from the placement.
  CommOptions two_nodes;
  two_nodes.ranks_per_node = std::max(1, g / 2);
  two_nodes.timeout_seconds = 120;
  auto nodes = WorldCommunicator(two_nodes);
  ASSERT_TRUE(nodes.ok()) << nodes.status().ToString();
  struct Run {
    EpOption option;
    A2aLevels live_levels;
    Communicator* comm;
  };
  for (const Run& run :
       {Run{EpOption::kA2a, A2aLevels::kFlat, &World()}, Run{EpOption::kWhole, A2aLevels::kAuto, &World()},
        Run{EpOption::kA2a, A2aLevels::kTwoLevel, nodes->get()}}) {
    const EpOption option = run.option;
    EngineOptions from_file = FloatOptions(option, g);
    from_file.executor.placement = target;
    from_file.executor.a2a_levels = A2aLevels::kFlat;
    EngineOptions live = FloatOptions(option, g);
    live.executor.placement = std::make_shared<const Placement>(*trivial);
    live.executor.a2a_levels = run.live_levels;
    live.rebalance = true;
    live.rebalancer.trigger.interval_steps = 1000;  // only the proposal
    auto a = Engine::Create(*run.comm, model, from_file, Pool());
    auto b = Engine::Create(*run.comm, model, live, Pool());
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    ASSERT_TRUE((*b)->ProposePlacement(target).ok());
    for (int step = 0; step < 3; ++step) {
      Matrix x = SyntheticRows(kSeed, model, step, First(total), Count(total));
      Matrix y = x;
      ASSERT_TRUE((*a)->Step(&x, First(total), **routing).ok());
      auto report = (*b)->Step(&y, First(total), **routing);
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      if (run.comm->num_nodes() > 1) {
        EXPECT_GT(report->inter_node_bytes_sent, 0);
      }
      if (step == 0) {
        EXPECT_EQ(report->boundary.layers_installed, kLayers);  // the proposal switches after step 0
        EXPECT_EQ((*b)->live_placement()->current()->generation, 1);
        continue;
      }
      ASSERT_EQ(*(*b)->live_placement()->placement(), *target);
      if (option == EpOption::kA2a) {
        EXPECT_EQ(std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(float)), 0)
            << "a2a " << A2aLevelsName(run.live_levels) << " step " << step << " rank " << World().rank();
      } else {
        EXPECT_LE(NormalizedMaxError(y, x), 1e-6) << "whole step " << step;  // partial sums add in transport order
      }
    }
    ASSERT_TRUE((*a)->Close().ok());
    ASSERT_TRUE((*b)->Close().ok());
  }
}

// Two-batch overlap runs each rank's rows as two micro-batches on two lanes at once, single-batch
// overlap runs the shared expert while the dispatch is in flight: with either or both, the
// residual stream after every step equals the run without them bit for bit (the model's router, a
// shared expert, redundant slots, rows traveling in fp32 and in bf16, a live rebalance after step
// 0), and the recorder still counts what the lanes' dispatch tables sent. With partial sums and
// two-batch overlap it is equal to the tolerance of a checked run: each lane deals its picks over
// an expert's copies from the first copy on, so a row's picks may meet on other ranks than without
// overlap and be summed in another grouping.
TEST(EngineStep, OverlapGivesTheSameRowsBitForBit) {
  const ModelConfig model = TinyModel();
  const int g = World().size();
  auto weights = SyntheticWeights(model, kSeed);
  auto routing = ModelRouting(model, *weights, kLayers, "auto", Pool());
  ASSERT_TRUE(routing.ok()) << routing.status().ToString();
  const int64_t total = 7 * g + 3;  // odd shares: the micro-batches differ by a row
  enum class Rows { kFp32, kBf16, kBf16PartialSums };
  for (Rows rows : {Rows::kFp32, Rows::kBf16, Rows::kBf16PartialSums}) {
    EngineOptions plain = FloatOptions(EpOption::kA2a, g);
    plain.executor.placement = RotatedPlacement(model.num_experts, 2 * g, g);
    if (rows != Rows::kFp32) {
      plain.executor.dispatch_format = RowFormat::kBf16;
      plain.executor.combine_format = RowFormat::kBf16;
      plain.executor.combine_partial_sums = rows == Rows::kBf16PartialSums;
    }
    plain.rebalance = true;
    plain.rebalancer.trigger.interval_steps = 1000;  // only the proposal
    std::vector<EngineOptions> variants(3, plain);   // two-batch, single-batch, both
    variants[0].two_batch_overlap = true;
    variants[1].executor.single_batch_overlap = true;
    variants[2].two_batch_overlap = true;
    variants[2].executor.single_batch_overlap = true;
    auto a = Engine::Create(World(), model, plain, Pool());
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    const PlacementPtr next = RotatedPlacement(model.num_experts, 2 * g, g);
    ASSERT_TRUE((*a)->ProposePlacement(next).ok());
    std::vector<std::unique_ptr<Engine>> overlapped;
    for (const EngineOptions& o : variants) {
      auto b = Engine::Create(World(), model, o, Pool());
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      ASSERT_TRUE((*b)->ProposePlacement(next).ok());
      overlapped.push_back(std::move(*b));
    }
    for (int step = 0; step < 3; ++step) {
      Matrix x = SyntheticRows(kSeed, model, step, First(total), Count(total));
      const Matrix input = x;
      auto ra = (*a)->Step(&x, First(total), **routing);
      ASSERT_TRUE(ra.ok()) << ra.status().ToString();
      for (size_t v = 0; v < overlapped.size(); ++v) {
        Matrix y = input;
        auto rb = overlapped[v]->Step(&y, First(total), **routing);
        ASSERT_TRUE(rb.ok()) << rb.status().ToString();
        const std::string where =
            fmt::format("step {} rank {} rows {} variant {}", step, World().rank(), static_cast<int>(rows), v);
        if (rows == Rows::kBf16PartialSums && variants[v].two_batch_overlap) {
          EXPECT_LE(NormalizedMaxError(y, x), CheckTolerance(RowFormat::kBf16, RowFormat::kBf16, WeightFormat::kFp32))
              << where;
        } else {
          EXPECT_EQ(std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(float)), 0) << where;
        }
        EXPECT_EQ(ra->rows, rb->rows);
        // Each rank's recorder counts the picks it sent to every rank over the step's batches.
        for (int r = 0; r < g; ++r) {
          double sent_to_r = 0;
          for (int l = 0; l < kLayers; ++l) sent_to_r += overlapped[v]->recorder()->RankPicks(l)[r];
          auto received = World().AllreduceSum(sent_to_r);
          ASSERT_TRUE(received.ok());
          EXPECT_EQ(*received, static_cast<double>(rb->rank_picks[r])) << where << " rank " << r;
        }
      }
    }
    for (auto& b : overlapped) {
      EXPECT_EQ(b->live_placement()->current()->generation, 1);  // the lanes followed the install
      ASSERT_TRUE(b->Close().ok());
    }
    ASSERT_TRUE((*a)->Close().ok());
  }
}

// Two-batch overlap on two modeled nodes with each a2a exchange that crosses them: two levels
// (each lane builds the node membership its gateways need from its own communicator) and
// low-latency (flat, its fixed buffers per lane): the same rows bit for bit as without overlap,
// and both count the bytes that crossed between the nodes.
TEST(EngineStep, TwoBatchOverlapWithTwoLevelsAndLowLatency) {
  const ModelConfig model = TinyModel();
  const int g = World().size();
  CommOptions two_nodes;
  two_nodes.ranks_per_node = std::max(1, g / 2);
  two_nodes.timeout_seconds = 120;
  auto nodes = WorldCommunicator(two_nodes);
  ASSERT_TRUE(nodes.ok()) << nodes.status().ToString();
  Communicator& comm = **nodes;
  auto routing = SimulatedRouting(model, RoutingMode::kUniform, kSeed);
  ASSERT_TRUE(routing.ok());
  const int64_t total = 5 * g + 3;
  for (const A2aMode mode : {A2aMode::kNormal, A2aMode::kLowLatency}) {
    SCOPED_TRACE(A2aModeName(mode));
    EngineOptions plain = FloatOptions(EpOption::kA2a, g);
    plain.executor.placement = RotatedPlacement(model.num_experts, 2 * g, g);
    plain.executor.a2a_mode = mode;
    plain.executor.a2a_levels = mode == A2aMode::kNormal ? A2aLevels::kTwoLevel : A2aLevels::kAuto;
    plain.executor.max_rows_per_rank = RowBegin(total, g, 1);
    EngineOptions overlapped = plain;
    overlapped.two_batch_overlap = true;
    auto a = Engine::Create(comm, model, plain, Pool());
    auto b = Engine::Create(comm, model, overlapped, Pool());
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    const std::string levels = mode == A2aMode::kNormal ? "two-level" : "flat";
    EXPECT_NE((*b)->executor().description().find(levels), std::string::npos) << (*b)->executor().description();
    for (int step = 0; step < 2; ++step) {
      Matrix x = SyntheticRows(kSeed, model, step, First(total), Count(total));
      Matrix y = x;
      auto ra = (*a)->Step(&x, First(total), **routing);
      auto rb = (*b)->Step(&y, First(total), **routing);
      ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status().ToString() << rb.status().ToString();
      EXPECT_EQ(std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(float)), 0)
          << "step " << step << " rank " << World().rank();
      if (comm.num_nodes() > 1) {
        EXPECT_GT(ra->inter_node_bytes_sent, 0);
        EXPECT_GT(rb->inter_node_bytes_sent, 0);
      } else {
        EXPECT_EQ(rb->inter_node_bytes_sent, 0);
      }
    }
    ASSERT_TRUE((*a)->Close().ok());
    ASSERT_TRUE((*b)->Close().ok());
  }
}

TEST(EngineStep, OverlapRefusesWhatCannotOverlap) {
  const ModelConfig model = TinyModel();
  EngineOptions sliced = FloatOptions(EpOption::kSliced, World().size());
  sliced.executor.single_batch_overlap = true;
  EXPECT_FALSE(Engine::Create(World(), model, sliced, Pool()).ok());
  EngineOptions whole = FloatOptions(EpOption::kWhole, World().size());
  whole.two_batch_overlap = true;
  auto engine = Engine::Create(World(), model, whole, Pool());
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("a2a"), std::string::npos) << engine.status().ToString();
  EngineOptions tensor_parallel = FloatOptions(EpOption::kA2a, World().size());
  tensor_parallel.executor.origin = RowOrigin::kTensorParallel;
  tensor_parallel.two_batch_overlap = true;
  engine = Engine::Create(World(), model, tensor_parallel, Pool());
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("data-parallel"), std::string::npos) << engine.status().ToString();
}

TEST(EngineStep, RecorderCountsWhatTheDispatchTablesSent) {
  const ModelConfig model = TinyModel();
  const int g = World().size();
  EngineOptions o = FloatOptions(EpOption::kA2a, g);
  o.executor.placement = RotatedPlacement(model.num_experts, 2 * g, g);
  o.rebalance = true;
  o.rebalancer.trigger.interval_steps = 1000;
  auto engine = Engine::Create(World(), model, o, Pool());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto routing = SimulatedRouting(model, RoutingMode::kUniform, kSeed);
  ASSERT_TRUE(routing.ok());
  const int64_t total = 10 * g + 1;
  Matrix x = SyntheticRows(kSeed, model, 0, First(total), Count(total));
  auto report = (*engine)->Step(&x, First(total), **routing);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  // Every rank's recorder: the picks it sent to each rank; summed over senders, the picks each
  // rank computed.
  for (int r = 0; r < g; ++r) {
    double sent_to_r = 0;
    for (int l = 0; l < kLayers; ++l) sent_to_r += (*engine)->recorder()->RankPicks(l)[r];
    auto received = World().AllreduceSum(sent_to_r);
    ASSERT_TRUE(received.ok());
    EXPECT_EQ(*received, static_cast<double>(report->rank_picks[r])) << "rank " << r;
  }
  ASSERT_TRUE((*engine)->Close().ok());
}

TEST(EngineStep, RecordsTheLoadItRan) {
  const ModelConfig model = TinyModel();
  const int g = World().size();
  const std::string path = "/tmp/epmoe_engine_load_" + std::to_string(getppid()) + ".bin";
  auto routing = SimulatedRouting(model, RoutingMode::kUniform, kSeed);
  ASSERT_TRUE(routing.ok());
  const int64_t total = 4 * g + 1;
  for (RecorderMode mode : {RecorderMode::kStat, RecorderMode::kPerStep, RecorderMode::kPerToken}) {
    EngineOptions o = FloatOptions(EpOption::kSliced, g);  // no placement: recorded all the same
    o.recorder.mode = mode;
    o.record_load_path = path;
    auto engine = Engine::Create(World(), model, o, Pool());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    for (int step = 0; step < 3; ++step) {
      Matrix x = SyntheticRows(kSeed, model, step, First(total), Count(total));
      auto report = (*engine)->Step(&x, First(total), **routing);
      ASSERT_TRUE(report.ok()) << report.status().ToString();
    }
    ASSERT_TRUE((*engine)->Close().ok());
    ASSERT_TRUE(World().Barrier().ok());
    if (World().rank() == 0) {
      auto load = ReadExpertLoad(path, LoadReadOptions{});
      ASSERT_TRUE(load.ok()) << load.status().ToString();
      ASSERT_EQ(load->num_steps, mode == RecorderMode::kStat ? 1 : 3) << RecorderModeName(mode);
      // The uniform router's picks of every row, counted here.
      std::vector<int64_t> expected(static_cast<size_t>(load->num_steps) * kLayers * model.num_experts, 0);
      for (int step = 0; step < 3; ++step)
        for (int l = 0; l < kLayers; ++l) {
          Picks picks;
          ASSERT_TRUE((*routing)->Route(step, l, Matrix(total, model.hidden), 0, &picks, Pool()).ok());
          const int64_t at = mode == RecorderMode::kStat ? l : step * kLayers + l;
          for (int32_t e : picks.experts) ++expected[at * model.num_experts + e];
        }
      EXPECT_EQ(load->counts, expected) << RecorderModeName(mode);
      std::remove(path.c_str());
    }
    ASSERT_TRUE(World().Barrier().ok());
  }
}

// Two nodes and a model whose expert groups divide over them: live rebalancing places groups on
// nodes (DeepSeek's hierarchical policy), so every copy of a group's experts is on the group's node.
TEST(EngineStep, RebalancesGroupsOntoNodes) {
  const int g = World().size();
  if (g % 2 != 0) GTEST_SKIP() << "two nodes need an even rank count";
  CommOptions two_nodes;
  two_nodes.ranks_per_node = g / 2;
  two_nodes.timeout_seconds = 120;
  auto comm = WorldCommunicator(two_nodes);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  ASSERT_EQ((*comm)->num_nodes(), 2);
  ModelConfig model = TinyModel();
  model.num_expert_groups = 4;
  model.topk_groups = 2;
  EngineOptions o = FloatOptions(EpOption::kA2a, g);
  auto trivial = Placement::Trivial(kLayers, model.num_experts, g, g, 2);
  ASSERT_TRUE(trivial.ok());
  o.executor.placement = std::make_shared<const Placement>(*trivial);
  o.rebalance = true;
  o.rebalancer.trigger.interval_steps = 2;
  auto engine = Engine::Create(**comm, model, o, Pool());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto routing = SimulatedRouting(model, RoutingMode::kUniform, kSeed);
  ASSERT_TRUE(routing.ok());
  const int64_t total = 12 * g;
  for (int step = 0; step < 3; ++step) {
    Matrix x = SyntheticRows(kSeed, model, step, First(total), Count(total));
    ASSERT_TRUE((*engine)->Step(&x, First(total), **routing).ok());
  }
  ASSERT_EQ((*engine)->rebalancer()->reports().size(), 1u);
  const PlacementPtr placed = (*engine)->live_placement()->placement();
  const int per_group = model.num_experts / model.num_expert_groups;
  for (int l = 0; l < kLayers; ++l)
    for (int group = 0; group < model.num_expert_groups; ++group) {
      std::set<int> nodes;
      for (int e = group * per_group; e < (group + 1) * per_group; ++e)
        for (int32_t slot : placed->copies(l, e)) nodes.insert(placed->node_of_rank(placed->rank_of_slot(slot)));
      EXPECT_EQ(nodes.size(), 1u) << "layer " << l << " group " << group;
    }
  ASSERT_TRUE((*engine)->Close().ok());
}

TEST(EngineStep, RefusesRebalancingAnOptionWithoutPlacement) {
  EngineOptions o = FloatOptions(EpOption::kDwdp, World().size());
  o.rebalance = true;
  auto engine = Engine::Create(World(), TinyModel(), o, Pool());
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("dwdp"), std::string::npos) << engine.status().ToString();
}

}  // namespace
}  // namespace epmoe
