// MoE executors: one MoE layer run across the ranks of a Communicator, one executor per option
// (DESIGN.md, "The five ways a row meets its experts"):
//   sliced  every rank holds 1/G of every expert's intermediate dimension; rows are all-gathered,
//           each rank computes its slice of every pick, a reduce-scatter sums;
//   whole   every rank holds E/G whole experts (the placement's slots); rows are all-gathered, each
//           rank computes its experts' picks, a reduce-scatter sums;
//   hybrid  groups of m ranks (--tp-in-ep m) share a set of experts, each sliced m ways;
//   a2a     traveling rows: a row goes once to every rank holding one of its picks, with those
//           picks and their router weights; outputs are weighted on the expert side and come back
//           one per pick (the home rank sums a row's k outputs in pick order j = 0..k-1), or
//           summed per rank (combine_partial_sums: one row back per rank a row visited); with
//           two levels a row bound for another node goes there once, to a gateway rank that
//           forwards it to the ranks of its node holding its picks and returns their outputs;
//   dwdp    traveling weights: rows stay, every rank reads the experts it lacks from their owners
//           with one-sided reads of their packed bytes (values and scales), one layer ahead, into
//           a double buffer (in pieces of a layer when a layer's lacking experts exceed the bound).
// Rows start data-parallel (rank r holds rows [RowBegin(T,G,r), RowBegin(T,G,r+1)) of the batch)
// or tensor-parallel (every rank holds all T rows and gets all T outputs).
//
// Results equal the single-process MoeLayer on the same inputs (and weight format): bit-exact for
// a2a with fp32 rows and fp32 combine and for dwdp in every weight format (the math is the same,
// pick by pick); for rows traveling in bf16/q8/q4
// equal to MoeLayer on the decoded rows; for sliced, whole and hybrid to fp32 rounding (partial sums
// are added across ranks in the transport's order).
//
// Executors are created collectively (every rank of the communicator, same options) and every
// Forward is collective. An executor is not thread-safe; it uses the thread pool it was given.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/ep_options.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/layer.h"
#include "epmoe/live_placement.h"
#include "epmoe/matrix.h"
#include "epmoe/model.h"
#include "epmoe/placement.h"
#include "epmoe/rebalance_target.h"
#include "epmoe/router.h"
#include "epmoe/row_codec.h"
#include "epmoe/status.h"

namespace epmoe {

class ThreadPool;

struct ExecutorOptions {
  EpOption option = EpOption::kA2a;
  int num_layers = 1;                          // MoE layers 0..num_layers-1 (Forward's layer)
  int tp_in_ep = 1;                            // hybrid: ranks slicing each expert (divides G)
  RowOrigin origin = RowOrigin::kDataParallel;
  RowFormat dispatch_format = RowFormat::kBf16;  // how rows travel (a2a, and the all-gathers of 1-3)
  RowFormat combine_format = RowFormat::kBf16;   // how a2a outputs come back: fp32 or bf16
  // a2a: the expert side sums the weighted outputs of a row's picks it ran and returns one row per
  // (row, rank) instead of one per pick: fewer bytes back (copies instead of k per row), but the
  // sum order differs from the single process (equal to fp32 rounding, not bit-exact).
  bool combine_partial_sums = false;
  // a2a: single-batch overlap: the shared expert runs on this rank's rows while the dispatch is in
  // flight instead of after the combine (the same outputs bit for bit).
  bool single_batch_overlap = false;
  // a2a: what drives its exchanges' progress while the rank computes (ep_options.h).
  A2aProgress a2a_progress = A2aProgress::kWait;
  // a2a: how the dispatch learns what it receives (ep_options.h); resolved once, at creation
  // (ResolveA2aMode). The other options ignore it.
  A2aMode a2a_mode = A2aMode::kNormal;
  // a2a low-latency: the most rows a rank is home for in one Forward (data-parallel: the rows it
  // holds; tensor-parallel: its RowBegin share of the T rows), from which the fixed buffers are
  // sized at creation. A step over it fails on every rank, naming the ranks over it (the ranks
  // cannot agree on falling back to normal mode without the count exchange low-latency avoids).
  // 0: not given (low-latency is refused; auto runs normal).
  int64_t max_rows_per_rank = 0;
  // a2a: whether rows bound for another node cross once per node and are forwarded inside it by a
  // gateway rank (two-level), or go to each destination rank (flat); ep_options.h. The nodes are
  // the communicator's (Communicator::node_of). Both give the same outputs, bit for bit (with
  // partial sums equal to fp32 rounding: the gateway adds its node's partial rows). Resolved once,
  // at creation, with the mode (ResolveA2aLevels): low-latency is flat only.
  A2aLevels a2a_levels = A2aLevels::kAuto;
  SharedMode shared = SharedMode::kDefault;
  // Bound on this rank's exchange buffers (a2a and 1-3: rows and outputs in flight; dwdp: the
  // double buffer its reads land in). A step that would exceed it runs in rounds (dwdp: reads
  // each layer in pieces); one that cannot fit even one row per peer (dwdp: two packed experts)
  // is refused.
  int64_t max_buffer_bytes = int64_t{1} << 30;
  PackOptions pack;
  // Where each rank's experts (or slices) come from (layer.h): null takes the synthetic weights
  // of `seed`. A rank reads only the experts and slices it holds.
  std::shared_ptr<const WeightSource> weights;
  uint64_t seed = 1;
  // Placement of whole experts for a2a and whole (null: Placement::Trivial with no redundant
  // slots, so rank g holds experts [g*E/G, (g+1)*E/G)). Its ranks must equal the communicator's.
  // A rank sends its picks of an expert to the copies its DispatchTable (dispatch.h) names, dealt
  // in pick order (row, then j) each step.
  PlacementPtr placement;
  uint64_t dispatch_seed = 0;  // DispatchTable::Build's seed
};

// One rank's figures for one Forward (or their sum over layers, see Add).
struct StepStats {
  double route_us = 0;     // filled by the caller, who routes
  double pack_us = 0;      // layout, counting sort, encoding rows (a2a: also decoding them into
                           // expert order, weighting and encoding outputs for their return)
  double dispatch_us = 0;  // row exchange (count exchange included); dwdp: waiting for weights (and,
                           // without a helper thread, importing them)
  double experts_us = 0;   // grouped expert FFN
  double combine_us = 0;   // output exchange (reduce-scatter / all-reduce / return alltoallv)
  double unpack_us = 0;    // decoding outputs and summing each row's picks
  double shared_us = 0;    // shared expert
  int64_t rows = 0;              // rows this rank is home for
  int64_t row_copies = 0;        // ranks this rank's rows were delivered to, itself included (a2a:
                                 // one per destination rank; all-gather: G; rows that stay: 0)
  int64_t picks = 0;             // picks computed on this rank (a slice counts as a pick)
  int64_t expert_bytes_read = 0; // bytes of local expert weights touched (+ shared)
  int64_t bytes_sent = 0;        // to other ranks (not to itself)
  int64_t bytes_received = 0;    // from other ranks (dwdp: weights read)
  int64_t inter_node_bytes_sent = 0;      // the part of bytes_sent to ranks of other nodes
  int64_t inter_node_bytes_received = 0;  // the part of bytes_received from ranks of other nodes
  int64_t peak_buffer_bytes = 0; // largest exchange buffers held at once
  int rounds = 0;                // exchange rounds (more than 1 when the memory bound applied; dwdp:
                                 // pieces each layer's lacking experts are read in)

  // Sums times and counts; keeps the larger peak and the larger round count.
  void Add(const StepStats& other);
  // The bytes that stayed inside this rank's node.
  int64_t intra_node_bytes_sent() const { return bytes_sent - inter_node_bytes_sent; }
  int64_t intra_node_bytes_received() const { return bytes_received - inter_node_bytes_received; }
};

// The stages of a step, in order, with their names: the one list that reports iterate.
struct StageField {
  const char* name;
  double StepStats::*us;
};
inline constexpr std::array kStages{
    StageField{"route", &StepStats::route_us},     StageField{"pack", &StepStats::pack_us},
    StageField{"dispatch", &StepStats::dispatch_us}, StageField{"experts", &StepStats::experts_us},
    StageField{"combine", &StepStats::combine_us}, StageField{"unpack", &StepStats::unpack_us},
    StageField{"shared", &StepStats::shared_us}};
inline constexpr int kNumStages = static_cast<int>(kStages.size());

class MoeExecutor {
 public:
  virtual ~MoeExecutor() = default;
  virtual EpOption option() const = 0;
  // "a2a (bf16 rows, bf16 combine)" and the like.
  virtual std::string description() const = 0;
  // Bytes of expert weights this rank holds resident (dwdp: owned, their copy in the window, the
  // double buffer).
  virtual int64_t resident_weight_bytes() const = 0;

  // Runs MoE layer `layer` on this rank's rows (see RowOrigin) with their picks; out gets one
  // output row per input row. Collective. stats (may be null) is overwritten.
  virtual Status Forward(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) = 0;

  // Live rebalancing of this rank's slots (rebalancer.h): a2a and whole, whose experts follow the
  // placement; null for sliced, hybrid and dwdp. Owned by the executor; use it between Forward
  // calls only (a step's layers keep the placement they started with).
  virtual RebalanceTarget* rebalance_target() { return nullptr; }
  // The placement a2a and whole follow (null for the others): read at the start of every
  // Forward; a rebalancer installs into it between steps, after the target's Install.
  virtual std::shared_ptr<LivePlacement> live_placement() { return nullptr; }

  // A second executor of this option on `comm` (the same ranks in the same order, a communicator of
  // its own) and `pool`, over this executor's weights and live placement, with buffers of its own:
  // two micro-batches run at once, one per executor, in two threads (two-batch overlap). a2a only;
  // the others refuse. A lane has no rebalance_target (this executor's rebalancing moves its
  // experts too). Not collective.
  virtual Result<std::unique_ptr<MoeExecutor>> CreateLane(Communicator& comm, ThreadPool& pool);

  // Waits for what the executor runs in the background between Forward calls (dwdp: the read-ahead
  // of the next layer's experts), so that the time until the next Forward belongs to the caller
  // alone; what was read stays for that Forward. Not collective; no-op for the other options.
  virtual Status Settle() { return Status::Ok(); }

  // Releases what this executor shares with the other ranks (dwdp: its one-sided window), after
  // which Forward fails. Collective and bounded by the communicator's timeout: Unavailable names
  // the ranks that did not arrive, and the job should then be aborted (see Window::Close). The
  // destructor does it too when Close was not called, as a last resort whose errors are dropped.
  virtual Status Close() { return Status::Ok(); }
};

// The a2a mode that options.a2a_mode runs on `num_ranks` ranks: normal or low-latency (auto:
// low-latency when 0 < max_rows_per_rank <= kAutoLowLatencyMaxRows, the fixed buffers fit
// max_buffer_bytes and a2a_levels is not two-level, else normal). Low-latency is flat, as
// DeepEP's, so auto leaves an explicit two-level to normal mode; low-latency asked for together
// with two-level is refused (CheckExecutorShape).
A2aMode ResolveA2aMode(const ModelConfig& model, const ExecutorOptions& options, int num_ranks);

// The a2a levels that options.a2a_levels runs on `num_ranks` ranks in `num_nodes` nodes: flat or
// two-level. Flat whenever the mode resolves to low-latency; otherwise UsesTwoLevels's rule (auto:
// two-level when there are several nodes and some node holds more than one rank). So auto and
// auto pick DeepEP's pairing: low-latency (flat) for decode-sized steps, normal with two levels
// across nodes otherwise.
A2aLevels ResolveA2aLevels(const ModelConfig& model, const ExecutorOptions& options, int num_ranks, int num_nodes);

// Checks that the option can run this shape on comm.size() ranks (divisibility, formats, memory
// bound, placement) and says why not; called by CreateExecutor before any work.
Status CheckExecutorShape(const ModelConfig& model, const ExecutorOptions& options, int num_ranks);

// Peak memory of the executor of `options` on `rank` of `num_ranks` (a shape CheckExecutorShape
// accepts) for `tokens` rows per step over all ranks: its weights (dwdp: owned experts, their copy
// in the window and the double buffer) and its exchange buffers (at most max_buffer_bytes).
MemoryEstimate EstimateExecutorMemory(const ModelConfig& model, const ExecutorOptions& options, int num_ranks, int rank,
                                      int64_t tokens);

// Peak memory of `rank` in a run of `executors` on `tokens` rows per step: the executors one at a
// time (the largest counts) or all at once (at_once, as `epmoe run --interleave` holds them), with
// `check` the single-process layers of executors[0]'s weight format that every rank compares
// with, and the rank's rows.
MemoryEstimate EstimateRunMemory(const ModelConfig& model, std::span<const ExecutorOptions> executors, bool at_once,
                                 bool check, int num_ranks, int rank, int64_t tokens);

// The live placement of options.placement, or of the trivial placement (no redundant slots) when it
// is null, with this rank's dispatch table (a2a and whole follow it; a recording run of the other
// options deals its picks over it).
Result<std::shared_ptr<LivePlacement>> ResolveLivePlacement(const ModelConfig& model, const ExecutorOptions& options,
                                                            const Communicator& comm);

// Builds this rank's share of the weights of every layer. Collective.
Result<std::unique_ptr<MoeExecutor>> CreateExecutor(Communicator& comm, const ModelConfig& model,
                                                    const ExecutorOptions& options, ThreadPool& pool);

// First global row of `rank` when `total` rows are split over `ranks` data-parallel (the first
// total % ranks ranks get one more row).
int64_t RowBegin(int64_t total, int ranks, int rank);

}  // namespace epmoe
