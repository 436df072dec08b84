// Every option against the single-process MoeLayer on the same inputs, under mpirun with 1, 2, 4
// and 8 ranks: both row origins, uneven rows, ranks with no rows, ranks whose experts get no picks,
// skew that triggers the memory bound, redundant placements, and shapes an option must refuse; a2a's
// two-level exchange on modeled nodes (CommOptions::ranks_per_node) of several sizes.
// Shapes are tiny (hidden 64, intermediate 32) so 8 oversubscribed ranks stay fast.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>

#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/layer.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"
#include "mpi_world.h"
#include "tiny_model.h"

namespace epmoe {
namespace {

constexpr uint64_t kSeed = 7;

Communicator& World() { return testing::SharedWorld(120); }

// The world with nodes of `ranks_per_node` consecutive ranks (the last one smaller when it does
// not divide the ranks), made once per node size; every rank asks for them in the same order.
Communicator& Nodes(int ranks_per_node) {
  static std::map<int, std::unique_ptr<Communicator>> worlds;
  std::unique_ptr<Communicator>& world = worlds[ranks_per_node];
  if (world == nullptr) {
    CommOptions options;
    options.ranks_per_node = ranks_per_node;
    options.timeout_seconds = 120;
    auto made = WorldCommunicator(options);
    EPMOE_CHECK_MSG(made.ok(), made.status().ToString());
    world = std::move(made).value();
  }
  return *world;
}

ThreadPool& Pool() {
  static ThreadPool pool(1);
  return pool;
}

using testing::TinyModel;

// gpt-oss's kind of layer: a router bias added to the logits, expert biases (sliced options carry
// the down bias on the first slice only) and the clamped activation, its limit low enough to bite.
// The intermediate size leaves mxfp4 whole blocks of 32 in each of 8 slices.
ModelConfig TinyGptOss() {
  ModelConfig m = TinyModel(0);
  m.expert_intermediate = 256;
  m.scoring = Scoring::kSoftmaxTopk;
  m.renormalize = false;
  m.router_bias = true;
  m.expert_bias = true;
  m.activation = Activation::kSwiGluOai;
  m.swiglu_limit = 0.1;
  EPMOE_CHECK(ValidateModel(m, "tiny gpt-oss").ok());
  return m;
}

// The expected output of every row: MoeLayer's routed sum on the rows as they travel (decoded),
// plus the shared experts on `shared_rows` (the original rows when the shared expert is a copy).
Matrix Expected(const ModelConfig& model, int layer, const Matrix& rows, const Picks& picks, RowFormat format,
                bool shared_on_travelled_rows, WeightFormat weights_format = WeightFormat::kFp32) {
  PackOptions pack;
  pack.format = weights_format;
  MoeLayerWeights weights = MakeSyntheticLayer(model, layer, kSeed);
  std::vector<ExpertWeights> shared = std::move(weights.shared);
  weights.shared.clear();
  auto routed = MoeLayer::Create(model, weights, pack);
  EPMOE_CHECK(routed.ok());
  Matrix travelled(rows.rows, rows.cols);
  std::vector<uint8_t> encoded(RowBytes(format, rows.cols));
  for (int64_t r = 0; r < rows.rows; ++r) {
    EncodeRow(format, rows.row(r), rows.cols, encoded.data());
    DecodeRow(format, encoded.data(), rows.cols, travelled.row(r));
  }
  Matrix out;
  EPMOE_CHECK((*routed)->Forward(travelled, picks, &out, Pool(), nullptr).ok());
  // The shared experts as MoeLayer runs them (packed store, one group per shared expert), added in
  // order after the routed sum.
  const Matrix& shared_in = shared_on_travelled_rows ? travelled : rows;
  if (!shared.empty() && rows.rows > 0) {
    std::vector<const ExpertWeights*> pointers;
    for (const ExpertWeights& s : shared) pointers.push_back(&s);
    auto store = PackExperts(pointers, pack);
    EPMOE_CHECK(store.ok());
    const int64_t n = rows.rows, count = static_cast<int64_t>(shared.size());
    Matrix in(n * count, model.hidden), result(n * count, model.hidden);
    std::vector<int64_t> offsets;
    for (int64_t s = 0; s <= count; ++s) offsets.push_back(s * n);
    for (int64_t s = 0; s < count; ++s) std::copy(shared_in.data.begin(), shared_in.data.end(), in.row(s * n));
    (*store)->Run(in.data.data(), offsets, result.data.data(), Pool());
    std::vector<float> scales;  // 1, or the shared output gate's sigmoid(row . gate)
    SharedOutputScales(weights.shared_output_gate, shared_in, &scales);
    for (int64_t s = 0; s < count; ++s)
      for (int64_t i = 0; i < n * model.hidden; ++i)
        out.data[i] += scales[i / model.hidden] * result.data[s * n * model.hidden + i];
  }
  return out;
}

Picks PicksOf(const Picks& all, int64_t first, int64_t count) {
  const int k = all.k;
  return Picks{count, k, std::vector<int32_t>(all.experts.begin() + first * k, all.experts.begin() + (first + count) * k),
               std::vector<float>(all.weights.begin() + first * k, all.weights.begin() + (first + count) * k)};
}

struct Case {
  EpOption option = EpOption::kA2a;
  RowOrigin origin = RowOrigin::kDataParallel;
  RowFormat dispatch = RowFormat::kFp32;
  RowFormat combine = RowFormat::kFp32;
  SharedMode shared_mode = SharedMode::kDefault;
  bool partial_sums = false;
  A2aMode a2a_mode = A2aMode::kNormal;
  int64_t max_rows_per_rank = 0;  // low-latency's bound
  int shared = 1;
  int64_t max_buffer_bytes = int64_t{1} << 30;
  PlacementPtr placement;
  WeightFormat weights = WeightFormat::kFp32;
  bool gpt_oss = false;             // TinyGptOss instead of TinyModel(shared)
  bool shared_output_gate = false;  // TinyModel(shared) with Qwen2-MoE's gate on the shared output
  A2aLevels levels = A2aLevels::kAuto;
  bool single_batch_overlap = false;
  A2aProgress a2a_progress = A2aProgress::kWait;
  Communicator* comm = nullptr;  // null: World()
};

// `total` rows that all pick experts (j * stride) mod E, j = 0..k-1, with weights 0.3 - 0.05 j: skew
// onto a few ranks (stride 1: the first experts; 5: experts spread over the ranks).
Picks SamePicksEveryRow(const ModelConfig& model, int64_t total, int stride) {
  Picks picks{total, model.top_k, {}, {}};
  for (int64_t r = 0; r < total; ++r) {
    for (int j = 0; j < model.top_k; ++j) {
      picks.experts.push_back((j * stride) % model.num_experts);
      picks.weights.push_back(0.3f - 0.05f * j);
    }
  }
  return picks;
}

Case CaseOf(EpOption option) {
  Case c;
  c.option = option;
  return c;
}

ExecutorOptions OptionsFor(const Case& c, int ranks) {
  ExecutorOptions o;
  o.option = c.option;
  o.num_layers = 2;
  o.origin = c.origin;
  o.dispatch_format = c.dispatch;
  o.combine_format = c.combine;
  o.shared = c.shared_mode;
  o.combine_partial_sums = c.partial_sums;
  o.a2a_mode = c.a2a_mode;
  o.max_rows_per_rank = c.max_rows_per_rank;
  o.max_buffer_bytes = c.max_buffer_bytes;
  o.seed = kSeed;
  o.placement = c.placement;
  o.pack.format = c.weights;
  o.a2a_levels = c.levels;
  o.single_batch_overlap = c.single_batch_overlap;
  o.a2a_progress = c.a2a_progress;
  if (c.option == EpOption::kHybrid) o.tp_in_ep = ranks % 2 == 0 ? 2 : 1;
  return o;
}

bool Exact(const Case& c) {
  return (c.option == EpOption::kA2a || c.option == EpOption::kDwdp) && c.combine == RowFormat::kFp32 && !c.partial_sums;
}

// Runs `steps` steps of both layers. row_counts[r]: rows of rank r (data-parallel). Checks every
// rank's outputs; returns the last step's stats of this rank.
StepStats RunAndCheck(const Case& c, const std::vector<int64_t>& row_counts, const Picks* forced_picks = nullptr,
                      int steps = 2) {
  Communicator& comm = c.comm != nullptr ? *c.comm : World();
  const int g = comm.size(), me = comm.rank();
  ModelConfig model = c.gpt_oss ? TinyGptOss() : TinyModel(c.shared);
  model.shared_output_gate = c.shared_output_gate;
  auto executor = CreateExecutor(comm, model, OptionsFor(c, g), Pool());
  EPMOE_CHECK_MSG(executor.ok(), executor.status().ToString());
  int64_t total = 0, first = 0;
  for (int r = 0; r < g; ++r) {
    if (r < me) first += row_counts[r];
    total += row_counts[r];
  }
  const bool tensor_parallel = c.origin == RowOrigin::kTensorParallel;
  const bool shared_sliced = c.option != EpOption::kA2a && c.option != EpOption::kDwdp && c.shared_mode != SharedMode::kCopied;
  StepStats stats;
  for (int step = 0; step < steps; ++step) {
    const Matrix all_rows = SyntheticRows(kSeed, model, step, 0, total);
    for (int layer = 0; layer < 2; ++layer) {
      const Picks all_picks = forced_picks ? *forced_picks : UniformPicks(model, total, kSeed + step * 10 + layer);
      const Matrix expected = Expected(model, layer, all_rows, all_picks, c.dispatch, shared_sliced, c.weights);
      Matrix out;
      Status status;
      if (tensor_parallel) {
        status = (*executor)->Forward(layer, all_rows, all_picks, &out, &stats);
      } else {
        status = (*executor)->Forward(layer, RowSlice(all_rows, first, row_counts[me]), PicksOf(all_picks, first, row_counts[me]),
                                      &out, &stats);
      }
      EXPECT_TRUE(status.ok()) << status.ToString();
      const Matrix want = tensor_parallel ? expected : RowSlice(expected, first, row_counts[me]);
      EXPECT_EQ(out.rows, want.rows);
      if (out.rows != want.rows) continue;
      if (Exact(c)) {
        EXPECT_EQ(out.data, want.data) << EpOptionName(c.option) << " layer " << layer << " rank " << me;
      } else {
        // Sliced options quantize each slice's intermediate rows on their own (quantized weight
        // formats take int8 activations, scaled per row), so they differ from the whole expert's.
        const double tolerance = c.combine == RowFormat::kBf16 || c.weights != WeightFormat::kFp32 ? 1e-2 : 1e-5;
        EXPECT_LE(NormalizedMaxError(out, want), tolerance) << EpOptionName(c.option) << " layer " << layer;
      }
    }
  }
  // Close releases what the ranks share (dwdp's window) and is collective: every option's succeeds
  // on every rank, a second Close does nothing, and dwdp refuses to run after it.
  const Status closed = (*executor)->Close();
  EXPECT_TRUE(closed.ok()) << closed.ToString();
  EXPECT_TRUE((*executor)->Close().ok());
  if (c.option == EpOption::kDwdp) {
    Matrix out;
    const Matrix rows = SyntheticRows(kSeed, model, 0, 0, 1);
    EXPECT_EQ((*executor)->Forward(0, rows, UniformPicks(model, 1, kSeed), &out, nullptr).code(),
              StatusCode::kFailedPrecondition);
  }
  return stats;
}

std::vector<int64_t> EvenishRows(int64_t total) {
  const int g = World().size();
  std::vector<int64_t> counts(g);
  for (int r = 0; r < g; ++r) counts[r] = RowBegin(total, g, r + 1) - RowBegin(total, g, r);
  return counts;
}

// Runs c on `picks` (rows split evenly) with a bound that must force several rounds, and checks the
// buffers stayed within it.
void ExpectRoundsWithinTheBound(const Case& c, const Picks& picks) {
  const StepStats st = RunAndCheck(c, EvenishRows(picks.rows), &picks, 1);
  EXPECT_GT(st.rounds, 1);
  EXPECT_LE(st.peak_buffer_bytes, c.max_buffer_bytes);
}

TEST(Executor, EveryOptionAndOriginMatchesTheSingleProcessLayer) {
  const int g = World().size();
  for (EpOption option : AllEpOptions()) {
    for (RowOrigin origin : {RowOrigin::kDataParallel, RowOrigin::kTensorParallel}) {
      SCOPED_TRACE(std::string(EpOptionName(option)) + " " + RowOriginName(origin));
      Case c;
      c.option = option;
      c.origin = origin;
      const StepStats st = RunAndCheck(c, EvenishRows(2 * g + 3));  // T not divisible by G
      EXPECT_GE(st.rounds, 1);
      if (g == 1) {
        EXPECT_EQ(st.bytes_sent, 0);
      }
    }
  }
}

TEST(Executor, GptOssBiasesAndActivationUnderEveryOption) {
  const int g = World().size();
  for (EpOption option : AllEpOptions()) {
    for (WeightFormat weights : {WeightFormat::kFp32, WeightFormat::kMxfp4}) {
      SCOPED_TRACE(std::string(EpOptionName(option)) + " " + WeightFormatName(weights));
      Case c;
      c.option = option;
      c.gpt_oss = true;
      c.shared = 0;
      c.weights = weights;
      RunAndCheck(c, EvenishRows(2 * g + 3), nullptr, 1);
    }
  }
}

// Qwen2-MoE's shared output gate, with the shared expert sliced (the gather options) and copied.
TEST(Executor, SharedOutputGateUnderEveryOption) {
  const int g = World().size();
  for (EpOption option : AllEpOptions()) {
    for (SharedMode mode : {SharedMode::kDefault, SharedMode::kCopied}) {
      if (mode == SharedMode::kCopied && (option == EpOption::kA2a || option == EpOption::kDwdp)) continue;
      SCOPED_TRACE(std::string(EpOptionName(option)) + (mode == SharedMode::kCopied ? " copied" : ""));
      Case c;
      c.option = option;
      c.shared_mode = mode;
      c.shared_output_gate = true;
      RunAndCheck(c, EvenishRows(2 * g + 3), nullptr, 1);
    }
  }
}

TEST(Executor, SharedExpertCopiedUnderTheGatherOptions) {
  for (EpOption option : {EpOption::kSliced, EpOption::kWhole, EpOption::kHybrid}) {
    SCOPED_TRACE(EpOptionName(option));
    Case c;
    c.option = option;
    c.shared_mode = SharedMode::kCopied;
    RunAndCheck(c, EvenishRows(9), nullptr, 1);
  }
}

TEST(Executor, A2aRowsTravelInEveryFormat) {
  for (RowFormat dispatch : {RowFormat::kBf16, RowFormat::kQ8, RowFormat::kQ4}) {
    for (RowFormat combine : {RowFormat::kFp32, RowFormat::kBf16}) {
      SCOPED_TRACE(std::string(RowFormatName(dispatch)) + " out, " + RowFormatName(combine) + " back");
      Case c;
      c.dispatch = dispatch;
      c.combine = combine;
      RunAndCheck(c, EvenishRows(7), nullptr, 1);
    }
  }
  // The gather options apply the dispatch format to their all-gather too.
  Case c;
  c.option = EpOption::kWhole;
  c.dispatch = RowFormat::kBf16;
  RunAndCheck(c, EvenishRows(7), nullptr, 1);
}

// The expert side puts each received row in the kernel's input format once (QuantizeRows) and runs
// the picks on copies of it (RunQuantized): bit for bit the single-process layer in every format.
TEST(Executor, A2aIsExactInEveryWeightFormat) {
  for (WeightFormat format : {WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kNvfp4}) {
    SCOPED_TRACE(WeightFormatName(format));
    Case c;
    c.weights = format;
    RunAndCheck(c, EvenishRows(2 * World().size() + 3), nullptr, 1);
  }
}

TEST(Executor, A2aPartialSumsSendFewerBytesBack) {
  const int g = World().size();
  for (RowOrigin origin : {RowOrigin::kDataParallel, RowOrigin::kTensorParallel}) {
    Case per_pick;
    per_pick.origin = origin;
    Case partial = per_pick;
    partial.partial_sums = true;
    const StepStats a = RunAndCheck(per_pick, EvenishRows(4 * g + 1), nullptr, 1);
    const StepStats b = RunAndCheck(partial, EvenishRows(4 * g + 1), nullptr, 1);  // within 1e-5
    // Never more bytes on any rank; fewer over all ranks (some row has two picks on one rank).
    EXPECT_LE(b.bytes_sent + b.bytes_received, a.bytes_sent + a.bytes_received);
    auto per_pick_total = World().AllreduceSum(static_cast<double>(a.bytes_sent));
    auto partial_total = World().AllreduceSum(static_cast<double>(b.bytes_sent));
    ASSERT_TRUE(per_pick_total.ok() && partial_total.ok());
    if (g > 1) {
      EXPECT_LT(*partial_total, *per_pick_total);
    }
  }
  // Skewed and bounded: partial sums in rounds stay right.
  const ModelConfig model = TinyModel(1);
  const int64_t total = 6 * g;
  const Picks picks = SamePicksEveryRow(model, total, 5);
  Case c;
  c.partial_sums = true;
  // A rank's own records do not pass through MPI buffers, so one rank alone needs a tighter bound.
  c.max_buffer_bytes = 10 * 1024 + g * 4 * 1024;
  ExpectRoundsWithinTheBound(c, picks);
}

TEST(Executor, RanksWithoutRows) {
  const int g = World().size();
  // Only the last rank has rows (3 of them); every other rank has none.
  std::vector<int64_t> counts(g, 0);
  counts[g - 1] = 3;
  for (EpOption option : AllEpOptions()) {
    SCOPED_TRACE(EpOptionName(option));
    Case c;
    c.option = option;
    RunAndCheck(c, counts, nullptr, 1);
  }
  // No rows anywhere.
  Case c;
  RunAndCheck(c, std::vector<int64_t>(g, 0), nullptr, 1);
}

TEST(Executor, RanksWhoseExpertsGetNoPicks) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  const int64_t total = 2 * g + 1;
  // Every row picks experts 0..3: held by rank 0 (and rank 1 with 8 ranks); the rest get nothing.
  Picks picks{total, model.top_k, {}, {}};
  for (int64_t r = 0; r < total; ++r) {
    for (int j = 0; j < model.top_k; ++j) {
      picks.experts.push_back(j);
      picks.weights.push_back(0.25f + 0.01f * j);
    }
  }
  for (EpOption option : AllEpOptions()) {
    SCOPED_TRACE(EpOptionName(option));
    Case c;
    c.option = option;
    const StepStats st = RunAndCheck(c, EvenishRows(total), &picks, 1);
    if (option == EpOption::kA2a && World().rank() >= 2) {
      EXPECT_EQ(st.picks, 0);
    }
  }
}

TEST(Executor, MemoryBoundRunsSkewInRounds) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  const int64_t total = 6 * g;
  const Picks picks = SamePicksEveryRow(model, total, 1);  // one rank receives everything
  for (EpOption option : {EpOption::kA2a, EpOption::kWhole, EpOption::kSliced}) {
    SCOPED_TRACE(EpOptionName(option));
    Case c;
    c.option = option;
    c.max_buffer_bytes = 12 * 1024 + g * 4 * 1024;  // a few rows per rank at a time
    const StepStats st = RunAndCheck(c, EvenishRows(total), &picks, 1);
    EXPECT_GT(st.rounds, 1);
    EXPECT_LE(st.peak_buffer_bytes, c.max_buffer_bytes);
    EXPECT_GT(st.peak_buffer_bytes, 0);
  }
}

// Buffers of 1 MiB or more take whole 2 MiB pages when the rounded total fits the bound, and exact
// sizes when it does not: both give the single-process result bit for bit, within the bound.
TEST(Executor, A2aLargeBuffersRoundedToHugePagesOnlyWithinTheBound) {
  const int g = World().size();
  const int64_t total = 1100 * g;  // about 4,400 picks (1.1 MB of fp32 expert outputs) per rank
  Case c;
  const StepStats roomy = RunAndCheck(c, EvenishRows(total), nullptr, 1);
  EXPECT_EQ(roomy.rounds, 1);
  // Some buffer was rounded up to whole 2 MiB pages.
  EXPECT_GE(roomy.peak_buffer_bytes, int64_t{2} << 20);
  // A bound (the same on every rank) just under what the fullest rank's rounded buffers hold: that
  // rank runs the same step in exact sizes, still in one round.
  auto fullest = World().AllreduceMax(roomy.peak_buffer_bytes);
  ASSERT_TRUE(fullest.ok()) << fullest.status().ToString();
  c.max_buffer_bytes = *fullest - 1;
  const StepStats tight = RunAndCheck(c, EvenishRows(total), nullptr, 1);
  EXPECT_EQ(tight.rounds, 1);
  EXPECT_LE(tight.peak_buffer_bytes, c.max_buffer_bytes);
  if (roomy.peak_buffer_bytes == *fullest) {
    EXPECT_LT(tight.peak_buffer_bytes, roomy.peak_buffer_bytes);
  }
}

// dwdp moves packed experts (values and scales), read straight into the double buffer's slots, so
// with a quantized weight format it equals the single-process layer packed in the same format, bit
// for bit; a bound that holds only a few experts (two halves of P) makes every layer arrive in
// pieces, still bit for bit.
TEST(Executor, DwdpMovesPackedExpertsInPieces) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  for (WeightFormat format : {WeightFormat::kFp32, WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kNvfp4}) {
    SCOPED_TRACE(WeightFormatName(format));
    const int64_t expert = ExpertByteCount(format, model.hidden, model.expert_intermediate);
    for (int64_t piece_experts : {int64_t{100}, int64_t{3}, int64_t{1}}) {
      Case c = CaseOf(EpOption::kDwdp);
      c.weights = format;
      c.max_buffer_bytes = 2 * piece_experts * expert;
      const int64_t lacking = model.num_experts - model.num_experts / g;
      const StepStats st = RunAndCheck(c, EvenishRows(2 * g + 1), nullptr, 2);
      if (g == 1) continue;
      const int64_t per_piece = std::min(piece_experts, lacking);
      EXPECT_EQ(st.rounds, (lacking + per_piece - 1) / per_piece);
      EXPECT_EQ(st.peak_buffer_bytes, 2 * per_piece * expert);
      EXPECT_LE(st.peak_buffer_bytes, c.max_buffer_bytes);
      EXPECT_EQ(st.bytes_received, lacking * expert);  // exactly the packed bytes, once
    }
  }
}

TEST(Executor, BoundBelowOneRowIsRefusedOnEveryRank) {
  Communicator& comm = World();
  const ModelConfig model = TinyModel(0);
  for (EpOption option : {EpOption::kA2a, EpOption::kWhole}) {
    Case c;
    c.option = option;
    c.shared = 0;
    c.max_buffer_bytes = 100;
    auto executor = CreateExecutor(comm, model, OptionsFor(c, comm.size()), Pool());
    ASSERT_TRUE(executor.ok());
    const int64_t n = 2;
    const int64_t first = comm.rank() * n;
    Matrix out;
    const Status status = (*executor)->Forward(0, SyntheticRows(kSeed, model, 0, first, n),
                                               UniformPicks(model, n, kSeed, first), &out, nullptr);
    EXPECT_EQ(status.code(), StatusCode::kOutOfRange) << status.ToString();
    EXPECT_NE(status.message().find("bound"), std::string::npos);
  }
}

TEST(Executor, RedundantPlacement) {
  Communicator& comm = World();
  const int g = comm.size();
  const ModelConfig model = TinyModel(1);
  // One extra copy per rank: slots E..E+G-1 hold experts 0..G-1 again.
  auto placement = Placement::Trivial(2, model.num_experts, g, g, 1);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  for (EpOption option : {EpOption::kA2a, EpOption::kWhole}) {
    SCOPED_TRACE(EpOptionName(option));
    Case c;
    c.option = option;
    c.placement = std::make_shared<const Placement>(*placement);
    RunAndCheck(c, EvenishRows(3 * g + 1), nullptr, 1);
  }
}

// Low-latency a2a (fixed buffers, no count exchange) against the single-process layer: every row
// format out and back, both row origins, partial sums, redundant slots, ranks at the bound and
// ranks without rows, and skew that sends every row to one rank.
Case LowLatency(int64_t max_rows_per_rank) {
  Case c;
  c.a2a_mode = A2aMode::kLowLatency;
  c.max_rows_per_rank = max_rows_per_rank;
  return c;
}

TEST(Executor, A2aLowLatencyMatchesTheLayer) {
  const int g = World().size();
  const std::vector<int64_t> rows = EvenishRows(2 * g + 3);
  const int64_t most = *std::max_element(rows.begin(), rows.end());  // some ranks exactly at the bound
  for (RowOrigin origin : {RowOrigin::kDataParallel, RowOrigin::kTensorParallel}) {
    for (RowFormat dispatch : {RowFormat::kFp32, RowFormat::kBf16, RowFormat::kQ8, RowFormat::kQ4}) {
      for (RowFormat combine : {RowFormat::kFp32, RowFormat::kBf16}) {
        SCOPED_TRACE(std::string(RowOriginName(origin)) + " " + RowFormatName(dispatch) + " out, " +
                     RowFormatName(combine) + " back");
        Case c = LowLatency(most);
        c.origin = origin;
        c.dispatch = dispatch;
        c.combine = combine;
        const StepStats st = RunAndCheck(c, rows, nullptr, 2);
        EXPECT_EQ(st.rounds, 1);
        EXPECT_GT(st.peak_buffer_bytes, 0);
      }
    }
  }
  Case partial = LowLatency(most);
  partial.partial_sums = true;
  RunAndCheck(partial, rows, nullptr, 1);
  Case weights = LowLatency(most);
  weights.weights = WeightFormat::kInt8;
  RunAndCheck(weights, rows, nullptr, 1);
  Case gated = LowLatency(most);
  gated.shared_output_gate = true;
  RunAndCheck(gated, rows, nullptr, 1);
  // A bound above every rank's rows, and ranks without rows.
  std::vector<int64_t> last_only(g, 0);
  last_only[g - 1] = 3;
  RunAndCheck(LowLatency(5), last_only, nullptr, 1);
  RunAndCheck(LowLatency(1), std::vector<int64_t>(g, 0), nullptr, 1);
}

TEST(Executor, A2aLowLatencyWithRedundantSlotsAndSkew) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  auto placement = Placement::Trivial(2, model.num_experts, g, g, 1);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  Case redundant = LowLatency(4);
  redundant.placement = std::make_shared<const Placement>(*placement);
  RunAndCheck(redundant, EvenishRows(3 * g + 1), nullptr, 2);
  // Every row to experts 0..k-1 (rank 0's): rank 0 receives every rank's rows at once.
  const int64_t total = 4 * g;
  Picks picks{total, model.top_k, {}, {}};
  for (int64_t r = 0; r < total; ++r) {
    for (int j = 0; j < model.top_k; ++j) {
      picks.experts.push_back(j);
      picks.weights.push_back(0.3f - 0.05f * j);
    }
  }
  const StepStats st = RunAndCheck(LowLatency(4), EvenishRows(total), &picks, 1);
  if (World().rank() == 0) {
    EXPECT_EQ(st.picks, total * std::min(model.top_k, model.num_experts / g));
  }
}

// A step over the bound fails on every rank, naming the ranks over it, and the executor runs the
// next steps within the bound correctly.
void ExpectStepOverTheBoundFailsOnEveryRank(const Case& c);

// With single-batch overlap too, where the records that landed first already ran.
TEST(Executor, A2aLowLatencyStepOverTheBoundFailsOnEveryRank) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "single-batch overlap" : "no overlap");
    Case c = LowLatency(2);
    c.single_batch_overlap = overlap;
    ExpectStepOverTheBoundFailsOnEveryRank(c);
  }
}

void ExpectStepOverTheBoundFailsOnEveryRank(const Case& c) {
  Communicator& comm = World();
  const int g = comm.size(), me = comm.rank();
  const ModelConfig model = TinyModel(1);
  auto executor = CreateExecutor(comm, model, OptionsFor(c, g), Pool());
  ASSERT_TRUE(executor.ok()) << executor.status().ToString();
  EXPECT_NE((*executor)->description().find("low-latency, buffers for 2 rows per rank"), std::string::npos)
      << (*executor)->description();
  // The last rank has 3 rows, one over; the others 1.
  std::vector<int64_t> counts(g, 1);
  counts[g - 1] = 3;
  int64_t total = 0, first = 0;
  for (int r = 0; r < g; ++r) {
    if (r < me) first += counts[r];
    total += counts[r];
  }
  const Matrix all_rows = SyntheticRows(kSeed, model, 0, 0, total);
  const Picks all_picks = UniformPicks(model, total, kSeed);
  Matrix out;
  // Twice in a row: the dispatch's receives, posted ahead, are posted again by the next step.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const Status over = (*executor)->Forward(0, RowSlice(all_rows, first, counts[me]),
                                             PicksOf(all_picks, first, counts[me]), &out, nullptr);
    EXPECT_EQ(over.code(), StatusCode::kOutOfRange) << over.ToString();
    EXPECT_NE(over.message().find("rank " + std::to_string(g - 1) + " has 3 rows this step, over the 2 rows per rank"),
              std::string::npos)
        << over.message();
  }
  // Within the bound again, for two steps: right, bit for bit.
  const std::vector<int64_t> within = EvenishRows(g);
  first = RowBegin(g, g, me);
  for (int step = 1; step <= 2; ++step) {
    const Matrix rows = SyntheticRows(kSeed, model, step, 0, g);
    const Picks picks = UniformPicks(model, g, kSeed + step);
    ASSERT_TRUE((*executor)
                    ->Forward(0, RowSlice(rows, first, within[me]), PicksOf(picks, first, within[me]), &out, nullptr)
                    .ok());
    const Matrix expected = Expected(model, 0, rows, picks, RowFormat::kFp32, false);
    EXPECT_EQ(out.data, RowSlice(expected, first, within[me]).data) << "step " << step;
  }
  EXPECT_TRUE((*executor)->Close().ok());
}

// Single-batch overlap runs this rank's own records, then each rank's as they land, while the
// rest of the dispatch is in flight (and the shared expert before them): bit for bit the
// single-process layer in normal mode (in rounds too) and low-latency mode, in every weight
// format (the kernels compute a row alike whatever rows share its expert's call), with redundant
// slots, skew onto one rank and ranks without rows; with partial sums within the tolerance.
TEST(Executor, A2aSingleBatchOverlapRunsRecordsAsTheyLand) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  const std::vector<int64_t> rows = EvenishRows(2 * g + 3);
  const int64_t most = *std::max_element(rows.begin(), rows.end());
  for (WeightFormat format : {WeightFormat::kFp32, WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kNvfp4}) {
    for (const A2aMode mode : {A2aMode::kNormal, A2aMode::kLowLatency}) {
      SCOPED_TRACE(std::string(WeightFormatName(format)) + " " + A2aModeName(mode));
      Case c = LowLatency(most);
      c.a2a_mode = mode;
      c.weights = format;
      c.single_batch_overlap = true;
      RunAndCheck(c, rows, nullptr, 2);
    }
  }
  auto placement = Placement::Trivial(2, model.num_experts, g, g, 1);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  for (const A2aMode mode : {A2aMode::kNormal, A2aMode::kLowLatency}) {
    SCOPED_TRACE(A2aModeName(mode));
    Case c = LowLatency(4 + most);
    c.a2a_mode = mode;
    c.single_batch_overlap = true;
    c.dispatch = RowFormat::kBf16;
    c.placement = std::make_shared<const Placement>(*placement);
    RunAndCheck(c, EvenishRows(3 * g + 1), nullptr, 1);
    c.placement = nullptr;
    const Picks skew = SamePicksEveryRow(model, 4 * g, 1);  // every row to rank 0
    RunAndCheck(c, EvenishRows(4 * g), &skew, 1);
    std::vector<int64_t> last_only(g, 0);
    last_only[g - 1] = 3;
    RunAndCheck(c, last_only, nullptr, 1);
    c.partial_sums = true;
    c.combine = RowFormat::kBf16;
    RunAndCheck(c, rows, nullptr, 1);
  }
  // Records at hand run before the rest land only with enough picks per slot: 24 rows per rank that
  // all pick experts 0..3 (rank 0's slots) give rank 0 its own records early, and its experts are
  // read once more for the rest; a decode step (here: fewer picks for a rank than 4 per slot)
  // runs in one group.
  for (const A2aMode mode : {A2aMode::kNormal, A2aMode::kLowLatency}) {
    SCOPED_TRACE(std::string("early groups, ") + A2aModeName(mode));
    Case plain = LowLatency(24);
    plain.a2a_mode = mode;
    Case overlapped = plain;
    overlapped.single_batch_overlap = true;
    const Picks skew = SamePicksEveryRow(model, 24 * g, 1);
    const StepStats without = RunAndCheck(plain, EvenishRows(24 * g), &skew, 1);
    const StepStats with = RunAndCheck(overlapped, EvenishRows(24 * g), &skew, 1);
    if (g > 1 && World().rank() == 0) {
      EXPECT_GT(with.expert_bytes_read, without.expert_bytes_read);
    }
    const StepStats decode_without = RunAndCheck(plain, rows, nullptr, 1);
    const StepStats decode_with = RunAndCheck(overlapped, rows, nullptr, 1);
    if (decode_without.picks < 4 * (model.num_experts / g)) {
      EXPECT_EQ(decode_with.expert_bytes_read, decode_without.expert_bytes_read);
    }
  }
  // What drives the exchanges' progress while a rank computes changes no output.
  for (const A2aProgress progress : {A2aProgress::kPoll, A2aProgress::kThread}) {
    for (const bool overlap : {false, true}) {
      for (const A2aMode mode : {A2aMode::kNormal, A2aMode::kLowLatency}) {
        SCOPED_TRACE(std::string(A2aProgressName(progress)) + " " + A2aModeName(mode) + (overlap ? " sbo" : ""));
        Case c = LowLatency(most);
        c.a2a_mode = mode;
        c.a2a_progress = progress;
        c.single_batch_overlap = overlap;
        c.weights = WeightFormat::kBf16;
        RunAndCheck(c, rows, nullptr, 2);
      }
    }
  }
  Case rounds;
  rounds.single_batch_overlap = true;
  rounds.max_buffer_bytes = 12 * 1024 + g * 4 * 1024;                      // a few rows per rank at a time
  ExpectRoundsWithinTheBound(rounds, SamePicksEveryRow(model, 6 * g, 1));  // one rank receives everything
}

TEST(Executor, A2aModeAutoAndLowLatencyRefusals) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  ExecutorOptions o = OptionsFor(Case{}, g);
  o.a2a_mode = A2aMode::kAuto;
  EXPECT_EQ(ResolveA2aMode(model, o, g), A2aMode::kNormal);  // no bound given
  o.max_rows_per_rank = 16;
  EXPECT_EQ(ResolveA2aMode(model, o, g), A2aMode::kLowLatency);
  o.max_rows_per_rank = kAutoLowLatencyMaxRows;
  EXPECT_EQ(ResolveA2aMode(model, o, g), A2aMode::kLowLatency);
  o.max_rows_per_rank = kAutoLowLatencyMaxRows + 1;
  EXPECT_EQ(ResolveA2aMode(model, o, g), A2aMode::kNormal);
  // Auto never picks buffers the bound refuses: normal then.
  o.max_rows_per_rank = 16;
  o.max_buffer_bytes = 1000;
  EXPECT_EQ(ResolveA2aMode(model, o, g), A2aMode::kNormal);
  EXPECT_TRUE(CheckExecutorShape(model, o, g).ok());
  o.max_buffer_bytes = int64_t{1} << 30;
  o.a2a_mode = A2aMode::kNormal;
  o.max_rows_per_rank = 1;
  EXPECT_EQ(ResolveA2aMode(model, o, g), A2aMode::kNormal);
  auto normal = CreateExecutor(World(), model, o, Pool());
  ASSERT_TRUE(normal.ok());
  EXPECT_NE((*normal)->description().find("a2a (normal)"), std::string::npos) << (*normal)->description();
  EXPECT_TRUE((*normal)->Close().ok());
  EXPECT_EQ(ParseA2aMode("low_latency").value(), A2aMode::kLowLatency);
  EXPECT_EQ(ParseA2aMode("fast").status().code(), StatusCode::kInvalidArgument);

  // Low-latency needs its bound, and its fixed buffers must fit the buffer bound.
  o.a2a_mode = A2aMode::kLowLatency;
  o.max_rows_per_rank = 0;
  const Status no_bound = CheckExecutorShape(model, o, g);
  EXPECT_EQ(no_bound.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_bound.message().find("--tokens"), std::string::npos) << no_bound.message();
  o.max_rows_per_rank = 1000;
  o.max_buffer_bytes = 1 << 20;
  const Status too_big = CheckExecutorShape(model, o, g);
  EXPECT_EQ(too_big.code(), StatusCode::kOutOfRange);
  EXPECT_NE(too_big.message().find("fixed buffers for 1000 rows per rank"), std::string::npos) << too_big.message();
  EXPECT_FALSE(CreateExecutor(World(), model, o, Pool()).ok());
  // Other options ignore the mode.
  o.option = EpOption::kWhole;
  EXPECT_TRUE(CheckExecutorShape(model, o, g).ok());
}

// Low-latency is flat only, as DeepEP's: asked for with two levels it is refused, auto levels
// resolve to flat under it, and auto mode leaves an explicit two-level to normal mode. Run on
// modeled nodes it splits its bytes by node like every exchange.
TEST(Executor, A2aLowLatencyIsFlatOnly) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  ExecutorOptions o = OptionsFor(LowLatency(16), g);
  o.a2a_levels = A2aLevels::kAuto;
  EXPECT_EQ(ResolveA2aLevels(model, o, 4, 2), A2aLevels::kFlat);
  o.a2a_mode = A2aMode::kNormal;
  EXPECT_EQ(ResolveA2aLevels(model, o, 4, 2), A2aLevels::kTwoLevel);
  o.a2a_mode = A2aMode::kAuto;  // decode-sized: low-latency, so flat
  EXPECT_EQ(ResolveA2aMode(model, o, 4), A2aMode::kLowLatency);
  EXPECT_EQ(ResolveA2aLevels(model, o, 4, 2), A2aLevels::kFlat);
  o.a2a_levels = A2aLevels::kTwoLevel;  // two levels asked for: auto runs normal mode
  EXPECT_EQ(ResolveA2aMode(model, o, 4), A2aMode::kNormal);
  EXPECT_EQ(ResolveA2aLevels(model, o, 4, 2), A2aLevels::kTwoLevel);
  EXPECT_TRUE(CheckExecutorShape(model, o, g).ok());
  o.a2a_mode = A2aMode::kLowLatency;
  const Status both = CheckExecutorShape(model, o, g);
  EXPECT_EQ(both.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(both.message().find("--a2a-levels two-level"), std::string::npos) << both.message();
  EXPECT_FALSE(CreateExecutor(Nodes(2), model, o, Pool()).ok());
  o.a2a_levels = A2aLevels::kFlat;
  EXPECT_TRUE(CheckExecutorShape(model, o, g).ok());

  const std::vector<int64_t> rows = EvenishRows(2 * g + 3);
  Case c = LowLatency(*std::max_element(rows.begin(), rows.end()));
  c.comm = &Nodes(2);
  auto executor = CreateExecutor(*c.comm, model, OptionsFor(c, g), Pool());
  ASSERT_TRUE(executor.ok()) << executor.status().ToString();
  EXPECT_NE((*executor)->description().find(", flat,"), std::string::npos) << (*executor)->description();
  EXPECT_TRUE((*executor)->Close().ok());
  RunAndCheck(c, rows, nullptr, 1);
  c.comm = &Nodes(1);
  const StepStats apart = RunAndCheck(c, rows, nullptr, 1);
  EXPECT_EQ(apart.inter_node_bytes_sent, apart.bytes_sent);
  EXPECT_EQ(apart.inter_node_bytes_received, apart.bytes_received);
  if (g > 1) {
    EXPECT_GT(apart.inter_node_bytes_received, 0);
  }
  c.comm = &Nodes(g);
  const StepStats together = RunAndCheck(c, rows, nullptr, 1);
  EXPECT_EQ(together.inter_node_bytes_sent, 0);
  EXPECT_EQ(together.inter_node_bytes_received, 0);
}

// A lane (two-batch overlap) resolves the exchange as its executor does and sets up what it needs
// on its own communicator: the node membership of two levels, the fixed buffers of low-latency;
// its outputs are the single-process layer's bit for bit.
TEST(Executor, A2aLaneRunsItsExecutorsExchange) {
  Communicator& nodes = Nodes(2);
  const int g = nodes.size(), me = nodes.rank();
  const ModelConfig model = TinyModel(1);
  auto lane_comm = nodes.Split(0, me);
  ASSERT_TRUE(lane_comm.ok()) << lane_comm.status().ToString();
  Case two_level;
  two_level.levels = A2aLevels::kTwoLevel;
  const std::vector<int64_t> rows = EvenishRows(3 * g + 1);
  const int64_t first = RowBegin(3 * g + 1, g, me);
  for (const Case& c : {two_level, LowLatency(*std::max_element(rows.begin(), rows.end()))}) {
    auto executor = CreateExecutor(nodes, model, OptionsFor(c, g), Pool());
    ASSERT_TRUE(executor.ok()) << executor.status().ToString();
    auto lane = (*executor)->CreateLane(**lane_comm, Pool());
    ASSERT_TRUE(lane.ok()) << lane.status().ToString();
    const std::string want = c.a2a_mode == A2aMode::kLowLatency
                                 ? "a2a (low-latency"
                                 : fmt::format("two-level over {} nodes", (*lane_comm)->num_nodes());
    EXPECT_NE((*lane)->description().find(want), std::string::npos) << (*lane)->description();
    EXPECT_EQ((*lane)->description(), (*executor)->description());
    const Matrix all_rows = SyntheticRows(kSeed, model, 0, 0, 3 * g + 1);
    const Picks all_picks = UniformPicks(model, 3 * g + 1, kSeed);
    Matrix out;
    const Status status =
        (*lane)->Forward(1, RowSlice(all_rows, first, rows[me]), PicksOf(all_picks, first, rows[me]), &out, nullptr);
    ASSERT_TRUE(status.ok()) << status.ToString();
    const Matrix expected = Expected(model, 1, all_rows, all_picks, RowFormat::kFp32, false);
    EXPECT_EQ(out.data, RowSlice(expected, first, rows[me]).data);
    EXPECT_TRUE((*lane)->Close().ok());
    EXPECT_TRUE((*executor)->Close().ok());
  }
}

TEST(Executor, A2aLevelsAutoPicksTwoLevelsOnlyForNodesOfSeveralRanks) {
  EXPECT_TRUE(UsesTwoLevels(A2aLevels::kAuto, 4, 2));
  EXPECT_FALSE(UsesTwoLevels(A2aLevels::kAuto, 4, 1));  // one node
  EXPECT_FALSE(UsesTwoLevels(A2aLevels::kAuto, 4, 4));  // a rank per node: nothing to forward
  EXPECT_TRUE(UsesTwoLevels(A2aLevels::kTwoLevel, 4, 4));
  EXPECT_FALSE(UsesTwoLevels(A2aLevels::kFlat, 4, 2));
  EXPECT_EQ(ParseA2aLevels("two-level").value(), A2aLevels::kTwoLevel);
  EXPECT_EQ(ParseA2aLevels("two").status().code(), StatusCode::kInvalidArgument);
  Communicator& nodes = Nodes(2);
  auto executor = CreateExecutor(nodes, TinyModel(1), OptionsFor(Case{}, nodes.size()), Pool());
  ASSERT_TRUE(executor.ok()) << executor.status().ToString();
  const bool two_level = nodes.num_nodes() > 1;
  EXPECT_EQ((*executor)->description().find("two-level") != std::string::npos, two_level) << (*executor)->description();
}

// Two levels on nodes of 1, 2, 3 (unequal nodes where 3 does not divide the ranks) and 4 ranks:
// bit for bit the single-process layer with fp32 rows and outputs, both origins; rows traveling in
// bf16 and q8 and outputs in bf16 as flat does; partial sums (summed again by the gateway) to fp32
// rounding.
TEST(Executor, A2aTwoLevelMatchesTheSingleProcessLayer) {
  const int g = World().size();
  for (int ranks_per_node : {1, 2, 3, 4}) {
    Communicator& nodes = Nodes(ranks_per_node);
    for (RowOrigin origin : {RowOrigin::kDataParallel, RowOrigin::kTensorParallel}) {
      for (bool partial : {false, true}) {
        SCOPED_TRACE(fmt::format("{} ranks per node, {}{}", ranks_per_node, RowOriginName(origin),
                                 partial ? ", partial sums" : ""));
        Case c;
        c.levels = A2aLevels::kTwoLevel;
        c.comm = &nodes;
        c.origin = origin;
        c.partial_sums = partial;
        RunAndCheck(c, EvenishRows(3 * g + 1), nullptr, 1);
      }
    }
    for (RowFormat dispatch : {RowFormat::kBf16, RowFormat::kQ8}) {
      for (RowFormat combine : {RowFormat::kFp32, RowFormat::kBf16}) {
        SCOPED_TRACE(fmt::format("{} ranks per node, {} out, {} back", ranks_per_node, RowFormatName(dispatch),
                                 RowFormatName(combine)));
        Case c;
        c.levels = A2aLevels::kTwoLevel;
        c.comm = &nodes;
        c.dispatch = dispatch;
        c.combine = combine;
        RunAndCheck(c, EvenishRows(7), nullptr, 1);
      }
    }
  }
}

// Redundant copies (the dispatch table deals picks over them), and skew under a small bound: the
// step runs in rounds, gateways' forwarding buffers within the bound too.
// Two levels with single-batch overlap: the direct records run while the forwarded ones travel
// when they hold enough picks (24 rows per rank that all pick experts 0..3, rank 0's: its node's
// ranks send it direct records), bit for bit the single-process layer, with and without partial
// sums and in rounds; with several nodes the experts of rank 0 are then read once more than
// without overlap.
TEST(Executor, A2aTwoLevelSingleBatchOverlapRunsDirectRecordsFirst) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  const Picks skew = SamePicksEveryRow(model, 24 * g, 1);
  for (int ranks_per_node : {1, 2, 4}) {
    Communicator& nodes = Nodes(ranks_per_node);
    for (bool partial : {false, true}) {
      SCOPED_TRACE(fmt::format("{} ranks per node{}", ranks_per_node, partial ? ", partial sums" : ""));
      Case plain;
      plain.levels = A2aLevels::kTwoLevel;
      plain.comm = &nodes;
      plain.partial_sums = partial;
      Case overlapped = plain;
      overlapped.single_batch_overlap = true;
      const StepStats without = RunAndCheck(plain, EvenishRows(24 * g), &skew, 1);
      const StepStats with = RunAndCheck(overlapped, EvenishRows(24 * g), &skew, 1);
      RunAndCheck(overlapped, EvenishRows(3 * g + 1), nullptr, 1);
      if (World().rank() == 0 && nodes.num_nodes() > 1) {  // on one node nothing is forwarded
        EXPECT_GT(with.expert_bytes_read, without.expert_bytes_read);
      }
    }
  }
  if (g == 1) return;  // nothing travels: one round
  Case rounds;
  rounds.levels = A2aLevels::kTwoLevel;
  rounds.comm = &Nodes(2);
  rounds.single_batch_overlap = true;
  rounds.max_buffer_bytes = 64 * 1024 + g * 8 * 1024;
  ExpectRoundsWithinTheBound(rounds, skew);
}

TEST(Executor, A2aTwoLevelRedundantSlotsAndRounds) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  auto placement = Placement::Trivial(2, model.num_experts, g, g, 1);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  const int64_t total = 24 * g;
  const Picks picks = SamePicksEveryRow(model, total, 5);
  for (int ranks_per_node : {2, 3}) {
    SCOPED_TRACE(fmt::format("{} ranks per node", ranks_per_node));
    Case c;
    c.levels = A2aLevels::kTwoLevel;
    c.comm = &Nodes(ranks_per_node);
    c.placement = std::make_shared<const Placement>(*placement);
    RunAndCheck(c, EvenishRows(3 * g + 1), nullptr, 1);
    c.placement = nullptr;
    for (bool partial : {false, true}) {
      c.partial_sums = partial;
      // Gateways hold forwarding buffers besides: a looser bound than flat's, still several rounds.
      c.max_buffer_bytes = 64 * 1024 + g * 8 * 1024;
      ExpectRoundsWithinTheBound(c, picks);
    }
  }
}

// Rows whose picks lie on two ranks of another node cross the network once with two levels, twice
// flat: fewer inter-node bytes over all ranks. With a rank per node there is nothing to forward:
// the same bytes as flat on every rank.
TEST(Executor, A2aTwoLevelSendsFewerInterNodeBytes) {
  const int g = World().size();
  const ModelConfig model = TinyModel(1);
  const int64_t total = 4 * g;
  Picks picks = UniformPicks(model, total, kSeed);
  if (g >= 4) {  // nodes of 2: every row picks two experts of rank 2 and two of rank 3 (node 1)
    const int per_rank = model.num_experts / g;
    for (int64_t r = 0; r < total; ++r) {
      const int32_t experts[] = {2 * per_rank, 3 * per_rank, 2 * per_rank + 1, 3 * per_rank + 1};
      for (int j = 0; j < model.top_k; ++j) picks.experts[r * model.top_k + j] = experts[j];
    }
  }
  Case flat;
  flat.levels = A2aLevels::kFlat;
  flat.comm = &Nodes(2);
  Case two = flat;
  two.levels = A2aLevels::kTwoLevel;
  const StepStats a = RunAndCheck(flat, EvenishRows(total), &picks, 1);
  const StepStats b = RunAndCheck(two, EvenishRows(total), &picks, 1);
  auto flat_inter = World().AllreduceSum(static_cast<double>(a.inter_node_bytes_sent));
  auto two_inter = World().AllreduceSum(static_cast<double>(b.inter_node_bytes_sent));
  ASSERT_TRUE(flat_inter.ok() && two_inter.ok());
  if (g >= 4) {
    EXPECT_LT(*two_inter, *flat_inter);
    EXPECT_GT(*two_inter, 0);
  } else {
    EXPECT_EQ(*two_inter, 0);  // one node
  }

  flat.comm = two.comm = &Nodes(1);
  const StepStats c = RunAndCheck(flat, EvenishRows(total), nullptr, 1);
  const StepStats d = RunAndCheck(two, EvenishRows(total), nullptr, 1);
  EXPECT_EQ(c.bytes_sent, d.bytes_sent);
  EXPECT_EQ(c.bytes_received, d.bytes_received);
  EXPECT_EQ(d.inter_node_bytes_sent, d.bytes_sent);  // every other rank is on another node
  EXPECT_EQ(d.inter_node_bytes_received, d.bytes_received);
}

// Every option splits its bytes by node: all of them cross between nodes of one rank, none on one
// node.
TEST(Executor, EveryOptionSplitsItsBytesByNode) {
  const int g = World().size();
  for (EpOption option : AllEpOptions()) {
    SCOPED_TRACE(EpOptionName(option));
    Case c = CaseOf(option);
    c.comm = &Nodes(1);
    const StepStats apart = RunAndCheck(c, EvenishRows(2 * g + 3), nullptr, 1);
    EXPECT_EQ(apart.inter_node_bytes_sent, apart.bytes_sent);
    EXPECT_EQ(apart.inter_node_bytes_received, apart.bytes_received);
    if (g > 1) {
      EXPECT_GT(apart.bytes_received, 0);
    }
    c.comm = &Nodes(g);
    const StepStats together = RunAndCheck(c, EvenishRows(2 * g + 3), nullptr, 1);
    EXPECT_EQ(together.inter_node_bytes_sent, 0);
    EXPECT_EQ(together.inter_node_bytes_received, 0);
    EXPECT_EQ(together.intra_node_bytes_received(), together.bytes_received);
  }
}

TEST(Executor, RefusesShapesBeforeAnyWork) {
  Communicator& comm = World();
  const int g = comm.size();
  ModelConfig odd = TinyModel(1);
  odd.expert_intermediate = 33;
  Case c;
  c.option = EpOption::kSliced;
  auto sliced = CreateExecutor(comm, odd, OptionsFor(c, g), Pool());
  if (g > 1 && 33 % g != 0) {
    ASSERT_FALSE(sliced.ok());
    EXPECT_EQ(sliced.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(sliced.status().message().find("not divisible"), std::string::npos) << sliced.status().message();
  } else {
    EXPECT_TRUE(sliced.ok()) << sliced.status().ToString();
  }

  const ModelConfig model = TinyModel(1);
  ExecutorOptions hybrid = OptionsFor(CaseOf(EpOption::kHybrid), g);
  hybrid.tp_in_ep = 3;
  if (g % 3 != 0) {
    EXPECT_EQ(CheckExecutorShape(model, hybrid, g).code(), StatusCode::kFailedPrecondition);
  }

  ExecutorOptions a2a = OptionsFor(Case{}, g);
  a2a.shared = SharedMode::kSliced;
  EXPECT_EQ(CheckExecutorShape(model, a2a, g).code(), StatusCode::kFailedPrecondition);
  a2a.shared = SharedMode::kDefault;
  ModelConfig narrow = model;
  narrow.hidden = 48;  // q8 blocks are 32 wide
  a2a.dispatch_format = RowFormat::kQ8;
  EXPECT_EQ(CheckExecutorShape(narrow, a2a, g).code(), StatusCode::kInvalidArgument);
  a2a.dispatch_format = RowFormat::kFp32;
  a2a.combine_format = RowFormat::kQ4;
  EXPECT_EQ(CheckExecutorShape(model, a2a, g).code(), StatusCode::kInvalidArgument);

  ModelConfig uneven = model;
  uneven.num_experts = 15;
  if (g > 1 && 15 % g != 0) {
    EXPECT_EQ(CheckExecutorShape(uneven, OptionsFor(Case{}, g), g).code(), StatusCode::kFailedPrecondition);
  }

  ExecutorOptions dwdp = OptionsFor(CaseOf(EpOption::kDwdp), g);
  dwdp.max_buffer_bytes = 1000;
  if (g > 1) {
    EXPECT_EQ(CheckExecutorShape(model, dwdp, g).code(), StatusCode::kOutOfRange);
    // The double buffer's two halves of one expert each are the least dwdp runs with.
    const int64_t expert = ExpertByteCount(dwdp.pack.format, model.hidden, model.expert_intermediate);
    dwdp.max_buffer_bytes = 2 * expert - 1;
    EXPECT_EQ(CheckExecutorShape(model, dwdp, g).code(), StatusCode::kOutOfRange);
    dwdp.max_buffer_bytes = 2 * expert;
    EXPECT_TRUE(CheckExecutorShape(model, dwdp, g).ok());
  }

  // Bad Forward input is refused, not computed.
  auto executor = CreateExecutor(comm, model, OptionsFor(Case{}, g), Pool());
  ASSERT_TRUE(executor.ok());
  Matrix out;
  EXPECT_EQ((*executor)->Forward(5, Matrix(0, model.hidden), Picks{0, model.top_k, {}, {}}, &out, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*executor)->Forward(0, Matrix(1, 8), UniformPicks(model, 1, 1), &out, nullptr).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace epmoe

namespace epmoe {
namespace {

// The memory admission's estimate of an executor against what the executor holds: its weights
// equal resident_weight_bytes, and a step's exchange buffers stay within the estimate.
TEST(Executor, MemoryEstimateMatchesWhatTheExecutorHolds) {
  Communicator& comm = World();
  const int g = comm.size(), me = comm.rank();
  const ModelConfig model = TinyModel(1);
  const int64_t total = 4 * g + 1;
  for (WeightFormat format : {WeightFormat::kFp32, WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kNvfp4}) {
    std::vector<Case> cases;
    for (EpOption option : AllEpOptions()) cases.push_back(CaseOf(option));
    Case low_latency;  // fixed buffers for the largest share of the step's rows
    low_latency.a2a_mode = A2aMode::kLowLatency;
    low_latency.max_rows_per_rank = RowBegin(total, g, 1);
    cases.push_back(low_latency);
    for (Case c : cases) {
      const EpOption option = c.option;
      SCOPED_TRACE(std::string(EpOptionName(option)) + " " + A2aModeName(c.a2a_mode) + " " + WeightFormatName(format));
      c.weights = format;
      const ExecutorOptions options = OptionsFor(c, g);
      if (!CheckExecutorShape(model, options, g).ok()) continue;  // the same on every rank
      auto executor = CreateExecutor(comm, model, options, Pool());
      ASSERT_TRUE(executor.ok()) << executor.status().ToString();
      const MemoryEstimate estimate = EstimateExecutorMemory(model, options, g, me, total);
      const double held = static_cast<double>((*executor)->resident_weight_bytes());
      EXPECT_EQ(estimate.weights, held);
      const int64_t first = RowBegin(total, g, me), rows = RowBegin(total, g, me + 1) - first;
      const Matrix all_rows = SyntheticRows(kSeed, model, 0, 0, total);
      const Picks all_picks = UniformPicks(model, total, kSeed);
      Matrix out;
      StepStats stats;
      const Status status =
          (*executor)->Forward(0, RowSlice(all_rows, first, rows), PicksOf(all_picks, first, rows), &out, &stats);
      ASSERT_TRUE(status.ok()) << status.ToString();
      if (option == EpOption::kDwdp) {
        EXPECT_EQ(estimate.exchange, 0);  // rows stay; its double buffer is among the weights
      } else {
        EXPECT_LE(static_cast<double>(stats.peak_buffer_bytes), estimate.exchange);
      }
      if (c.a2a_mode == A2aMode::kLowLatency) {
        // Held from creation whatever a step sends, and estimated whatever the step's rows.
        EXPECT_EQ(static_cast<double>(stats.peak_buffer_bytes), estimate.exchange);
        EXPECT_EQ(EstimateExecutorMemory(model, options, g, me, 1).exchange, estimate.exchange);
      }
      EXPECT_TRUE((*executor)->Close().ok());
    }
  }
  // Two levels: the gateways' forwarding buffers are within the estimate too.
  Communicator& nodes = Nodes(2);
  for (int64_t rows_per_rank : {1, 4, 40}) {
    SCOPED_TRACE(fmt::format("two levels, {} rows per rank", rows_per_rank));
    ExecutorOptions options = OptionsFor(Case{}, g);
    options.a2a_levels = A2aLevels::kTwoLevel;
    auto executor = CreateExecutor(nodes, model, options, Pool());
    ASSERT_TRUE(executor.ok()) << executor.status().ToString();
    const int64_t all = rows_per_rank * g;
    const MemoryEstimate estimate = EstimateExecutorMemory(model, options, g, me, all);
    Matrix out;
    StepStats stats;
    const Status status =
        (*executor)->Forward(0, SyntheticRows(kSeed, model, 0, me * rows_per_rank, rows_per_rank),
                             UniformPicks(model, rows_per_rank, kSeed, me * rows_per_rank), &out, &stats);
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_LE(static_cast<double>(stats.peak_buffer_bytes), estimate.exchange);
  }
}

}  // namespace
}  // namespace epmoe
