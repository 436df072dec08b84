// Live rebalancing (Rebalancer) under mpirun with 1, 2, 4 and 8 ranks, against a toy target: every
// rank stores fp32 expert matrices per slot and a step runs MoE layers whose picks are computed on
// the rank owning the slot the home rank's dispatch table names. A rebalanced run must give the
// outputs of a direct computation (what a run that never rebalances gives) bit for bit, every step.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <thread>

#include "epmoe/comm.h"
#include "epmoe/dispatch.h"
#include "epmoe/rebalancer.h"
#include "mpi_world.h"

namespace epmoe {
namespace {

constexpr int kDim = 8;          // row width; an expert is a kDim x kDim fp32 matrix
constexpr int kRowsPerRank = 6;
constexpr int kTopK = 2;
constexpr int64_t kExpertBytes = kDim * kDim * sizeof(float);

void CheckOk(const Status& status) { EPMOE_CHECK_MSG(status.ok(), status.ToString()); }

Communicator& World() { return testing::SharedWorld(60); }

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
float UnitFloat(uint64_t seed) { return static_cast<float>(Mix(seed) % 2001) / 1000.0f - 1.0f; }

std::vector<float> ExpertMatrix(int layer, int expert) {
  std::vector<float> w(kDim * kDim);
  for (int i = 0; i < kDim * kDim; ++i) w[i] = UnitFloat((uint64_t(layer) << 40) ^ (uint64_t(expert) << 20) ^ i) / kDim;
  return w;
}

// y = W x: the same loop for the direct reference and the slots.
void ApplyExpert(const float* w, const float* x, float* y) {
  for (int i = 0; i < kDim; ++i) {
    float sum = 0;
    for (int c = 0; c < kDim; ++c) sum += w[i * kDim + c] * x[c];
    y[i] = sum;
  }
}

// This rank's slots held as bytes, with staged copies kept aside until Install. Counts what it is
// asked to do, and checks on every Install that each local slot holds its expert.
class ToyTarget : public RebalanceTarget {
 public:
  ToyTarget(PlacementPtr placement, int rank) : placement_(std::move(placement)), rank_(rank) {
    const int per_rank = placement_->slots_per_rank();
    slots_.resize(placement_->num_layers());
    for (int l = 0; l < placement_->num_layers(); ++l)
      for (int s = 0; s < per_rank; ++s) {
        const auto w = ExpertMatrix(l, placement_->phy2log(l)[rank_ * per_rank + s]);
        auto& bytes = slots_[l].emplace_back(kExpertBytes);
        std::memcpy(bytes.data(), w.data(), kExpertBytes);
      }
  }
  int64_t expert_bytes() const override { return kExpertBytes; }
  std::span<const std::byte> slot_bytes(int layer, int slot) const override {
    if (on_read) on_read();
    return slots_[layer][Local(slot)];
  }
  Status Stage(int layer, int slot, std::span<const std::byte> bytes) override {
    if (placement_->rank_of_slot(slot) != rank_) return Internal("staged a slot of another rank");
    staged_[{layer, slot}].assign(bytes.begin(), bytes.end());
    ++stages;
    return Status::Ok();
  }
  Status Install(int layer_begin, int layer_end, PlacementPtr next) override {
    for (auto it = staged_.begin(); it != staged_.end();) {
      const int layer = it->first.first;
      if (layer < layer_begin || layer >= layer_end) {
        ++it;
        continue;
      }
      slots_[layer][Local(it->first.second)] = std::move(it->second);
      it = staged_.erase(it);
    }
    placement_ = std::move(next);
    ++installs;
    for (int l = 0; l < placement_->num_layers(); ++l)
      for (int s = 0; s < placement_->slots_per_rank(); ++s) {
        const auto w = ExpertMatrix(l, placement_->phy2log(l)[rank_ * placement_->slots_per_rank() + s]);
        EXPECT_EQ(std::memcmp(slots_[l][s].data(), w.data(), kExpertBytes), 0)
            << "rank " << rank_ << " layer " << l << " slot " << s << " does not hold its expert after Install";
      }
    return Status::Ok();
  }
  void DropStaged() override { staged_.clear(); }

  const float* Weights(int layer, int slot) const {
    return reinterpret_cast<const float*>(slots_[layer][Local(slot)].data());
  }
  PlacementPtr placement() const { return placement_; }
  size_t staged() const { return staged_.size(); }

  int64_t stages = 0;
  int installs = 0;
  std::function<void()> on_read;  // called whenever a slot's bytes are read (a stalling rank blocks here)

 private:
  int Local(int slot) const { return slot - rank_ * placement_->slots_per_rank(); }
  PlacementPtr placement_;
  int rank_;
  std::vector<std::vector<std::vector<std::byte>>> slots_;  // [layer][local slot]
  std::map<std::pair<int, int>, std::vector<std::byte>> staged_;
};

// The picks of `rank`'s rows in a step: skewed towards a few experts that change every 12 steps,
// k distinct experts per row.
Picks StepPicks(int64_t step, int rank, int layer, int experts) {
  Picks picks;
  picks.rows = kRowsPerRank;
  picks.k = kTopK;
  const int popular_base = static_cast<int>((step / 12) * 3 + layer) % experts;
  for (int t = 0; t < kRowsPerRank; ++t) {
    const uint64_t seed = Mix((uint64_t(step) << 32) ^ (uint64_t(rank) << 16) ^ (uint64_t(layer) << 8) ^ t);
    int first = seed % 4 != 0 ? (popular_base + static_cast<int>((seed >> 8) % 2)) % experts
                              : static_cast<int>((seed >> 8) % experts);
    int second = static_cast<int>((seed >> 24) % experts);
    if (second == first) second = (first + 1) % experts;
    picks.experts.insert(picks.experts.end(), {first, second});
    picks.weights.insert(picks.weights.end(), {0.75f, 0.25f});
  }
  return picks;
}

std::vector<float> StepRows(int64_t step, int rank) {
  std::vector<float> x(kRowsPerRank * kDim);
  for (size_t i = 0; i < x.size(); ++i) x[i] = UnitFloat((uint64_t(step) << 36) ^ (uint64_t(rank) << 24) ^ i);
  return x;
}

// One MoE layer over every rank's rows: the owner of the slot the home rank's table names computes
// a pick; an all-reduce (one non-zero contributor per value: exact) delivers every pick's output;
// each rank sums its rows' picks in order j. rows: every rank's rows, [rank][row][kDim], updated.
void ToyLayer(Communicator& comm, const ToyTarget& target, const Placement& placement,
              const std::vector<DispatchTable>& tables, int layer, const std::vector<Picks>& picks,
              std::vector<float>& rows) {
  const int ranks = comm.size();
  std::vector<float> outputs(static_cast<size_t>(ranks) * kRowsPerRank * kTopK * kDim, 0.0f);
  for (int home = 0; home < ranks; ++home) {
    std::vector<int64_t> nth(placement.num_experts(), 0);
    for (int t = 0; t < kRowsPerRank; ++t)
      for (int j = 0; j < kTopK; ++j) {
        const int expert = picks[home].expert(t, j);
        const int slot = tables[home].SlotFor(layer, expert, nth[expert]++);
        if (placement.rank_of_slot(slot) != comm.rank()) continue;
        ApplyExpert(target.Weights(layer, slot), &rows[(home * kRowsPerRank + t) * kDim],
                    &outputs[((home * kRowsPerRank + t) * kTopK + j) * kDim]);
      }
  }
  CheckOk(comm.Allreduce(outputs.data(), static_cast<int64_t>(outputs.size())));
  for (int home = 0; home < ranks; ++home)
    for (int t = 0; t < kRowsPerRank; ++t) {
      float* row = &rows[(home * kRowsPerRank + t) * kDim];
      for (int i = 0; i < kDim; ++i) {
        float sum = 0;
        for (int j = 0; j < kTopK; ++j)
          sum += picks[home].weight(t, j) * outputs[((home * kRowsPerRank + t) * kTopK + j) * kDim + i];
        row[i] = sum;
      }
    }
}

// The same layers computed directly from the experts' weights, no placement.
std::vector<float> DirectStep(int64_t step, int ranks, int layers, int experts) {
  std::vector<float> rows;
  for (int r = 0; r < ranks; ++r) {
    const auto x = StepRows(step, r);
    rows.insert(rows.end(), x.begin(), x.end());
  }
  for (int l = 0; l < layers; ++l) {
    std::vector<float> next(rows.size());
    for (int r = 0; r < ranks; ++r) {
      const Picks picks = StepPicks(step, r, l, experts);
      for (int t = 0; t < kRowsPerRank; ++t) {
        float y[kTopK][kDim];
        for (int j = 0; j < kTopK; ++j) {
          const auto w = ExpertMatrix(l, picks.expert(t, j));
          ApplyExpert(w.data(), &rows[(r * kRowsPerRank + t) * kDim], y[j]);
        }
        for (int i = 0; i < kDim; ++i) {
          float sum = 0;
          for (int j = 0; j < kTopK; ++j) sum += picks.weight(t, j) * y[j][i];
          next[(r * kRowsPerRank + t) * kDim + i] = sum;
        }
      }
    }
    rows = std::move(next);
  }
  return rows;
}

struct Shape {
  int layers = 4;
  int experts = 0;
  int redundant = 0;
  int nodes = 1;
};
// E = 4G experts and G redundant copies (none on one rank, where they could not be distinct).
Shape TestShape(int ranks) { return {4, 4 * ranks, ranks > 1 ? ranks : 0, ranks % 2 == 0 ? 2 : 1}; }

RebalancerOptions TestOptions(const Shape& shape, int ranks) {
  RebalancerOptions options;
  options.trigger.mode = TriggerMode::kInterval;
  options.trigger.interval_steps = 5;
  options.policy.policy = Policy::kDeepseekGuarded;
  options.policy.shape.num_ranks = ranks;
  options.policy.shape.num_nodes = shape.nodes;
  options.policy.shape.num_redundant = shape.redundant;
  return options;
}

struct RunResult {
  std::vector<RebalanceReport> reports;
  int placements_seen = 0;  // distinct live placements the steps ran with
};

// Runs `steps` steps with rebalancing, checking each step's outputs against the direct ones. With
// `async`, each step lasts at least 3 ms (toy steps take microseconds; real ones last longer than
// starting rank 0's placement thread), so the test depends less on how soon the thread runs.
RunResult RunAndCheck(Communicator& comm, RebalancerOptions options, int64_t steps) {
  const int ranks = comm.size();
  const Shape shape = TestShape(ranks);
  auto initial = Placement::Trivial(shape.layers, shape.experts, shape.redundant, ranks, shape.nodes);
  CheckOk(initial.status());
  PlacementPtr start = std::make_shared<const Placement>(*initial);
  ToyTarget target(start, comm.rank());
  const std::shared_ptr<LivePlacement> live = *LivePlacement::Create(start, comm.rank());
  auto rebalancer = Rebalancer::Create(comm, target, live, options);
  CheckOk(rebalancer.status());
  RecorderOptions recorder_options;
  recorder_options.window_steps = 5;
  auto recorder = LoadRecorder::Create(recorder_options, live);
  CheckOk(recorder.status());
  RunResult result;
  PlacementPtr seen;
  std::vector<DispatchTable> tables;
  // Past `steps`, steps keep running until a rebalance in progress has switched its last chunk.
  for (int64_t step = 0; step < steps || (*rebalancer)->in_progress(); ++step) {
    // The step's snapshot: taken at its start, kept to its end.
    const PlacementPtr snapshot = target.placement();
    EXPECT_EQ(snapshot, (*rebalancer)->placement());
    if (snapshot != seen) {
      seen = snapshot;
      ++result.placements_seen;
      tables.clear();
      for (int r = 0; r < ranks; ++r) tables.push_back(*DispatchTable::Build(*snapshot, r));
    }
    std::vector<float> rows;
    for (int r = 0; r < ranks; ++r) {
      const auto x = StepRows(step, r);
      rows.insert(rows.end(), x.begin(), x.end());
    }
    for (int l = 0; l < shape.layers; ++l) {
      std::vector<Picks> picks;
      for (int r = 0; r < ranks; ++r) picks.push_back(StepPicks(step, r, l, shape.experts));
      CheckOk(recorder->Record(l, picks[comm.rank()]));
      ToyLayer(comm, target, *snapshot, tables, l, picks, rows);
    }
    recorder->EndStep();
    if (options.async) std::this_thread::sleep_for(std::chrono::milliseconds(3));
    const auto direct = DirectStep(step, ranks, shape.layers, shape.experts);
    EXPECT_EQ(std::memcmp(rows.data(), direct.data(), rows.size() * sizeof(float)), 0)
        << "rank " << comm.rank() << " step " << step << " differs from the run that never rebalances";
    auto outcome = (*rebalancer)->AtStepBoundary(step + 1, *recorder);
    CheckOk(outcome.status());
  }
  result.reports = (*rebalancer)->reports();
  EXPECT_EQ(target.staged(), 0u) << "copies staged but never installed";
  return result;
}

void ExpectRebalancedExactly(const RunResult& run, int ranks, size_t min_reports = 3) {
  std::string steps;  // decided / placement ready / installed, for a failure's message
  for (const auto& r : run.reports)
    steps += fmt::format(" {}/{}/{}", r.decided_at_step, r.placement_ready_at_step, r.installed_at_step);
  ASSERT_GE(run.reports.size(), min_reports) << "rebalances (decided/ready/installed):" << steps;
  if (ranks > 1) {
    int64_t moved = 0;
    for (const auto& r : run.reports) moved += r.bytes_moved;
    EXPECT_GT(moved, 0);
    EXPECT_GT(run.placements_seen, 2);
  }
  for (const auto& r : run.reports) {
    EXPECT_EQ(r.bytes_moved, r.remote_copies * kExpertBytes);
    EXPECT_EQ(std::accumulate(r.bytes_received_by_rank.begin(), r.bytes_received_by_rank.end(), int64_t{0}),
              r.bytes_moved);
    EXPECT_GT(r.balancedness_after, 0);
    EXPECT_LE(r.balancedness_after, 1 + 1e-12);
    EXPECT_GE(r.installed_at_step, r.decided_at_step);
  }
}

TEST(LiveRebalance, SyncAllLayersMatchesNoRebalance) {
  const int ranks = World().size();
  auto options = TestOptions(TestShape(ranks), ranks);
  const RunResult run = RunAndCheck(World(), options, 30);
  ExpectRebalancedExactly(run, ranks);
  for (const auto& r : run.reports) {
    EXPECT_EQ(r.chunks, 1);
    EXPECT_EQ(r.installed_at_step, r.decided_at_step);
  }
}

TEST(LiveRebalance, SyncChunkedMatchesNoRebalance) {
  const int ranks = World().size();
  auto options = TestOptions(TestShape(ranks), ranks);
  options.layers_per_chunk = 1;
  const RunResult run = RunAndCheck(World(), options, 30);
  ExpectRebalancedExactly(run, ranks);
  for (const auto& r : run.reports) {
    EXPECT_EQ(r.chunks, 4);
    EXPECT_EQ(r.installed_at_step, r.decided_at_step + 3);  // one chunk per step boundary
  }
}

TEST(LiveRebalance, AsyncMatchesNoRebalance) {
  const int ranks = World().size();
  auto options = TestOptions(TestShape(ranks), ranks);
  options.async = true;
  // How many rebalances fit depends on when rank 0's placement thread runs: at least two.
  const RunResult run = RunAndCheck(World(), options, 40);
  ExpectRebalancedExactly(run, ranks, 2);
}

TEST(LiveRebalance, AsyncChunkedInRoundsMatchesNoRebalance) {
  const int ranks = World().size();
  auto options = TestOptions(TestShape(ranks), ranks);
  options.async = true;
  options.layers_per_chunk = 2;
  options.max_buffer_bytes = 6 * kExpertBytes;  // a few copies per round: several rounds per chunk
  options.trigger.interval_steps = 4;
  const RunResult run = RunAndCheck(World(), options, 48);
  ExpectRebalancedExactly(run, ranks, 2);
  bool several_rounds = false;
  for (size_t i = 0; i < run.reports.size(); ++i) {
    const RebalanceReport& r = run.reports[i];
    EXPECT_EQ(r.chunks, 2);
    several_rounds = several_rounds || r.rounds > r.chunks;
    // A look that fell due while the previous rebalance was switching is taken right after it.
    if (i > 0 && r.decided_at_step % 4 != 0) {
      EXPECT_EQ(r.decided_at_step, run.reports[i - 1].installed_at_step + 1);
    }
  }
  if (ranks > 2) {
    EXPECT_TRUE(several_rounds);
  }
}

TEST(LiveRebalance, ThresholdTriggerRebalancesOnlyBelowTheThreshold) {
  const int ranks = World().size();
  if (ranks < 2) GTEST_SKIP() << "one rank is always balanced";
  auto options = TestOptions(TestShape(ranks), ranks);
  options.trigger.mode = TriggerMode::kThreshold;
  options.trigger.threshold = 0.01;  // never that unbalanced
  EXPECT_EQ(RunAndCheck(World(), options, 20).reports.size(), 0u);
  options.trigger.threshold = 1.0;  // anything short of perfect
  const RunResult run = RunAndCheck(World(), options, 20);
  ASSERT_GE(run.reports.size(), 1u);
  for (const auto& r : run.reports) EXPECT_LT(r.balancedness_before, 1.0);
}

TEST(LiveRebalance, PaybackTriggerWeighsTheSavingAgainstTheMove) {
  const int ranks = World().size();
  if (ranks < 2) GTEST_SKIP() << "one rank has nothing to save";
  auto options = TestOptions(TestShape(ranks), ranks);
  options.trigger.mode = TriggerMode::kPayback;
  options.move_bytes_per_second = 1e-3;  // a move never pays back
  EXPECT_EQ(RunAndCheck(World(), options, 20).reports.size(), 0u);
  options.move_bytes_per_second = 1e15;  // any saving pays back
  EXPECT_GE(RunAndCheck(World(), options, 20).reports.size(), 1u);
}

// Drives a Propose()d placement to its install with a recorder that has seen a few steps.
struct ProposeFixture {
  explicit ProposeFixture(Communicator& comm, bool async = false, double roll_call_seconds = 10,
                          int64_t max_buffer_bytes = int64_t{1} << 28)
      : ranks(comm.size()), shape(TestShape(ranks)) {
    start = std::make_shared<const Placement>(
        *Placement::Trivial(shape.layers, shape.experts, shape.redundant, ranks, shape.nodes));
    target = std::make_unique<ToyTarget>(start, comm.rank());
    auto options = TestOptions(shape, ranks);
    options.trigger.interval_steps = 1000;  // only proposals
    options.async = async;
    options.roll_call_seconds = roll_call_seconds;
    options.max_buffer_bytes = max_buffer_bytes;
    live = *LivePlacement::Create(start, comm.rank());
    rebalancer = std::move(Rebalancer::Create(comm, *target, live, options)).value();
    recorder = std::make_unique<LoadRecorder>(std::move(LoadRecorder::Create({}, live)).value());
    for (int l = 0; l < shape.layers; ++l) CheckOk(recorder->Record(l, StepPicks(0, comm.rank(), l, shape.experts)));
    recorder->EndStep();
  }
  // Boundaries until the proposal is installed; its report.
  RebalanceReport Drive() {
    for (int64_t step = 1; step < 100 && rebalancer->in_progress(); ++step)
      CheckOk(rebalancer->AtStepBoundary(step, *recorder).status());
    EXPECT_FALSE(rebalancer->in_progress());
    EXPECT_EQ(rebalancer->reports().size(), 1u);
    return rebalancer->reports().back();
  }
  int ranks;
  Shape shape;
  PlacementPtr start;
  std::shared_ptr<LivePlacement> live;
  std::unique_ptr<ToyTarget> target;
  std::unique_ptr<Rebalancer> rebalancer;
  std::unique_ptr<LoadRecorder> recorder;
};

TEST(LiveRebalance, UnchangedPlacementMovesZeroBytes) {
  for (bool async : {false, true}) {
    ProposeFixture f(World(), async);
    ASSERT_TRUE(f.rebalancer->Propose(f.start).ok());
    const RebalanceReport report = f.Drive();
    EXPECT_EQ(report.bytes_moved, 0);
    EXPECT_EQ(report.remote_copies + report.local_copies, 0);
    EXPECT_EQ(f.target->stages, 0);
    EXPECT_EQ(*f.rebalancer->placement(), *f.start);
  }
}

TEST(LiveRebalance, OneMovedExpertMovesExactlyItsBytes) {
  Communicator& comm = World();
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  for (bool async : {false, true}) {
    ProposeFixture f(comm, async);
    // Layer 2's last slot (on the last rank) takes the first expert the last rank does not hold.
    std::vector<std::vector<int32_t>> phy2log;
    for (int l = 0; l < f.shape.layers; ++l) phy2log.emplace_back(f.start->phy2log(l).begin(), f.start->phy2log(l).end());
    const int last = f.ranks - 1;
    int newcomer = 0;
    auto held_by_last = [&](int expert) {
      for (int32_t slot : f.start->copies(2, expert))
        if (f.start->rank_of_slot(slot) == last) return true;
      return false;
    };
    while (held_by_last(newcomer)) ++newcomer;
    phy2log[2].back() = newcomer;
    auto next = Placement::Create(f.shape.experts, f.ranks, f.shape.nodes, phy2log);
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    ASSERT_TRUE(f.rebalancer->Propose(std::make_shared<const Placement>(*next)).ok());
    const RebalanceReport report = f.Drive();
    EXPECT_EQ(report.bytes_moved, kExpertBytes);
    EXPECT_EQ(report.remote_copies, 1);
    EXPECT_EQ(report.bytes_received_by_rank[f.ranks - 1], kExpertBytes);
    auto stages = comm.AllreduceSum(static_cast<double>(f.target->stages));
    ASSERT_TRUE(stages.ok());
    EXPECT_EQ(*stages, 1.0);
    EXPECT_EQ(*f.rebalancer->placement(), *next);
  }
}

TEST(LiveRebalance, CorruptOrInconsistentPlacementIsRefusedBeforeInstall) {
  Communicator& comm = World();
  ProposeFixture f(comm);
  // Corrupt: rank 0 cannot read it (an expert id out of range), so it proposes nothing.
  std::string text = PlacementToJson(*f.start);
  const auto at = text.find("\"phy2log\":[[0");
  PlacementPtr corrupt;
  if (comm.rank() == 0) {
    ASSERT_NE(at, std::string::npos) << text.substr(0, 200);
    text.replace(at, 13, "\"phy2log\":[[99999");
    auto parsed = PlacementFromJson(text, "corrupt.json");
    ASSERT_FALSE(parsed.ok());
  }
  Status refused = f.rebalancer->Propose(corrupt);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("refused"), std::string::npos) << refused.ToString();
  // Inconsistent: a valid placement of another shape (one layer fewer).
  auto other = Placement::Trivial(f.shape.layers - 1, f.shape.experts, f.shape.redundant, f.ranks, f.shape.nodes);
  ASSERT_TRUE(other.ok());
  refused = f.rebalancer->Propose(std::make_shared<const Placement>(*other));
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("3 layers"), std::string::npos) << refused.ToString();
  EXPECT_FALSE(f.rebalancer->in_progress());
  EXPECT_EQ(f.target->stages, 0);
  EXPECT_EQ(f.target->installs, 0);
  EXPECT_EQ(f.rebalancer->placement(), f.start);
}

// Async: rank 0 computes the placement on a helper thread (slowed down here) while the steps run on;
// the placement is broadcast at a later boundary, and every step still matches the run that never
// rebalances.
TEST(LiveRebalance, AsyncPlacementOnAHelperThreadMatchesNoRebalance) {
  const int ranks = World().size();
  auto options = TestOptions(TestShape(ranks), ranks);
  options.async = true;
  options.trigger.interval_steps = 8;
  options.compute_placement = [](const ExpertLoad& load, const PolicyOptions& policy) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return ComputePlacement(load, policy);
  };
  const RunResult run = RunAndCheck(World(), options, 80);
  ExpectRebalancedExactly(run, ranks, 2);
  bool spanned_steps = false;
  for (const auto& r : run.reports) {
    EXPECT_GT(r.placement_ready_at_step, r.decided_at_step);  // never at the boundary that decided it
    EXPECT_GE(r.installed_at_step, r.placement_ready_at_step);
    EXPECT_GE(r.compute_seconds, 0.02);  // rank 0's time, told to every rank
    spanned_steps = spanned_steps || r.placement_ready_at_step >= r.decided_at_step + 2;
  }
  EXPECT_TRUE(spanned_steps) << "no step ran while rank 0 computed for 20 ms";
}

// Async: a policy that fails on rank 0's helper thread ends the rebalance on every rank, at the
// boundary where rank 0 finds out, and nothing is installed.
TEST(LiveRebalance, AsyncPolicyFailureEndsTheRebalanceOnEveryRank) {
  Communicator& comm = World();
  ProposeFixture f(comm);
  auto options = TestOptions(f.shape, f.ranks);
  options.async = true;
  options.trigger.interval_steps = 2;
  options.compute_placement = [](const ExpertLoad&, const PolicyOptions&) -> Result<Placement> {
    return Internal("the test's policy refuses");
  };
  auto rebalancer = Rebalancer::Create(comm, *f.target, f.live, options);
  ASSERT_TRUE(rebalancer.ok()) << rebalancer.status().ToString();
  auto first = (*rebalancer)->AtStepBoundary(2, *f.recorder);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(first->placing);
  EXPECT_TRUE((*rebalancer)->in_progress());
  Status failed;
  for (int64_t step = 3; step < 200 && failed.ok(); ++step) {
    if (comm.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    failed = (*rebalancer)->AtStepBoundary(step, *f.recorder).status();
  }
  ASSERT_FALSE(failed.ok());
  if (comm.rank() == 0) {
    EXPECT_NE(failed.message().find("the test's policy refuses"), std::string::npos) << failed.ToString();
  } else {
    EXPECT_NE(failed.message().find("rank 0's policy failed"), std::string::npos) << failed.ToString();
  }
  EXPECT_FALSE((*rebalancer)->in_progress());
  EXPECT_EQ(f.target->installs, 0);
  EXPECT_EQ((*rebalancer)->placement(), f.start);
}

// The stall tests come last: the other ranks leave exchanges pending on their short-timeout
// communicator for good. The stalled rank never uses it again (it waits in a barrier of the world
// until the others are done), so MPI never writes into the abandoned buffers, and it leaks its
// rebalancer and communicator (the abandoned exchanges may still refer to them).
struct StallRun {
  std::unique_ptr<Communicator> fast;  // exchanges time out after 1 s
  std::unique_ptr<ProposeFixture> fixture;
};

StallRun StartStallRun(bool async) {
  CommOptions fast_options;
  fast_options.timeout_seconds = 1;
  auto fast_world = WorldCommunicator(fast_options);
  EPMOE_CHECK_MSG(fast_world.ok(), fast_world.status().ToString());
  auto fast = (*fast_world)->Split(0, World().rank());
  EPMOE_CHECK_MSG(fast.ok(), fast.status().ToString());
  StallRun run;
  run.fast = std::move(fast).value();
  // One copy each way per exchange round, so an async move takes several boundaries.
  run.fixture = std::make_unique<ProposeFixture>(*run.fast, async, /*roll_call_seconds=*/1.0, 2 * kExpertBytes);
  return run;
}

// Proposes that every slot of layer 0 moves one rank on (every rank sends and receives).
void ProposeRotation(ProposeFixture& f) {
  std::vector<std::vector<int32_t>> phy2log;
  for (int l = 0; l < f.shape.layers; ++l) phy2log.emplace_back(f.start->phy2log(l).begin(), f.start->phy2log(l).end());
  const int per_rank = f.start->slots_per_rank();
  std::rotate(phy2log[0].begin(), phy2log[0].begin() + per_rank, phy2log[0].end());
  auto next = Placement::Create(f.shape.experts, f.ranks, f.shape.nodes, phy2log);
  ASSERT_TRUE(next.ok());
  ASSERT_TRUE(f.rebalancer->Propose(std::make_shared<const Placement>(*next)).ok());
}

// The stalled rank stops answering: it leaves the short-timeout communicator and its rebalancer
// alone for good and waits for the others in the world.
void StallForGood(StallRun& run) {
  (void)run.fixture->rebalancer.release();
  (void)run.fast.release();
  ASSERT_TRUE(World().Barrier().ok());
}

// What the ranks that did not stall check: a bounded error naming the stalled rank and `where`,
// and nothing installed or left staged.
void ExpectStallNamed(StallRun& run, const Result<BoundaryOutcome>& outcome, double seconds, int stalled,
                      const std::string& where) {
  ProposeFixture& f = *run.fixture;
  ASSERT_FALSE(outcome.ok());
  const std::string message = outcome.status().message();
  EXPECT_LT(seconds, 20);
  EXPECT_NE(message.find(fmt::format("rank(s) {} did not answer", stalled)), std::string::npos) << message;
  EXPECT_NE(message.find(where), std::string::npos) << message;
  EXPECT_NE(message.find(fmt::format("rank {} noticed", run.fast->rank())), std::string::npos) << message;
  EXPECT_EQ(f.target->staged(), 0u);
  EXPECT_FALSE(f.rebalancer->in_progress());
  (void)run.fast.release();  // abandoned exchanges may still refer to it
  ASSERT_TRUE(World().Barrier().ok());
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Sync: the last rank never reaches the boundary that would move the proposal's copies.
TEST(LiveRebalance, StalledRankIsNamedBeforeTheMove) {
  if (World().size() < 2) GTEST_SKIP() << "needs two ranks";
  StallRun run = StartStallRun(/*async=*/false);
  ProposeFixture& f = *run.fixture;
  ProposeRotation(f);
  const int stalled = f.ranks - 1;
  if (run.fast->rank() == stalled) return StallForGood(run);
  const auto start = std::chrono::steady_clock::now();
  auto outcome = f.rebalancer->AtStepBoundary(1, *f.recorder);
  ExpectStallNamed(run, outcome, SecondsSince(start), stalled, "installing layers [0, 4)");
  EXPECT_EQ(f.target->installs, 0);
  EXPECT_EQ(f.rebalancer->placement(), f.start);
}

// Async: the copies travel in several rounds; the last rank takes part in the boundary that starts
// them and stops answering before the next one.
TEST(LiveRebalance, StalledRankIsNamedWhileCopiesTravel) {
  if (World().size() < 2) GTEST_SKIP() << "needs two ranks";
  StallRun run = StartStallRun(/*async=*/true);
  ProposeFixture& f = *run.fixture;
  ProposeRotation(f);
  const int stalled = f.ranks - 1;
  auto first = f.rebalancer->AtStepBoundary(1, *f.recorder);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(f.rebalancer->in_progress()) << "the copies should still travel";
  if (run.fast->rank() == stalled) return StallForGood(run);
  const auto start = std::chrono::steady_clock::now();
  Result<BoundaryOutcome> outcome = first;
  for (int64_t step = 2; outcome.ok() && f.rebalancer->in_progress(); ++step)
    outcome = f.rebalancer->AtStepBoundary(step, *f.recorder);
  ExpectStallNamed(run, outcome, SecondsSince(start), stalled, "installing layers [0, 4)");
  EXPECT_EQ(f.target->installs, 0);
}

// Rank 0 (which computes placements and holds the roll call) stops before a trigger's look.
TEST(LiveRebalance, StalledRankZeroIsNamedAtTheTriggersLook) {
  if (World().size() < 2) GTEST_SKIP() << "needs two ranks";
  StallRun run = StartStallRun(/*async=*/false);
  ProposeFixture& f = *run.fixture;
  if (run.fast->rank() == 0) return StallForGood(run);
  const auto start = std::chrono::steady_clock::now();
  auto outcome = f.rebalancer->AtStepBoundary(1000, *f.recorder);  // the fixture's trigger looks every 1000 steps
  ExpectStallNamed(run, outcome, SecondsSince(start), 0, "at the trigger's look");
}

}  // namespace
}  // namespace epmoe
