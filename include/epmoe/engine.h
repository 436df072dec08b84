// Engine: one expert-parallel run on this rank, the object a host engine (or `epmoe run`) drives
// step by step (DESIGN.md, "The step above the layers"). It owns the executor of one option, the
// live placement it follows, the load recorder, the rebalancer and its metrics, and the reference
// layers of a checked run. Step() runs every MoE layer on this rank's rows: routes (through a
// Routing), records, exchanges, runs the experts, combines, adds the shared expert and the
// residual, then handles the step boundary (a rebalancing chunk installs there) and returns the
// step's figures gathered over every rank.
//
// Created collectively and every Step is collective (every rank, same options, same step count).
// Not thread-safe: one thread drives an Engine (with async rebalancing rank 0 computes placements
// on a helper thread of the Rebalancer's).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/layer.h"
#include "epmoe/live_placement.h"
#include "epmoe/model.h"
#include "epmoe/rebalancer.h"
#include "epmoe/recorder.h"
#include "epmoe/router.h"
#include "epmoe/status.h"
#include "epmoe/trace.h"

namespace epmoe {

class ThreadPool;

// Where a layer's picks come from: called by Step for each layer with the rows as they enter it.
class Routing {
 public:
  virtual ~Routing() = default;
  // Picks of global rows [first_row, first_row + rows.rows) of step `step`, layer `layer`.
  virtual Status Route(int64_t step, int layer, const Matrix& rows, int64_t first_row, Picks* picks,
                       ThreadPool& pool) const = 0;
};

// The model's router (scores of the router weights, the model's gating) for layers [0, layers).
Result<std::unique_ptr<Routing>> ModelRouting(const ModelConfig& model, const WeightSource& weights, int layers,
                                              const std::string& isa, ThreadPool& pool);
// Simulated picks: RoutingMode::kRoundRobin, or kUniform (random, from seed, step and layer).
Result<std::unique_ptr<Routing>> SimulatedRouting(const ModelConfig& model, RoutingMode mode, uint64_t seed);

// Picks replayed from a routing trace with per-row picks, read whole (at most max_steps steps;
// the model must have the trace's experts and top-k, at least `layers` layers). A run longer than
// the trace replays it from its start again, as `epmoe layer` does.
class TraceRouting final : public Routing {
 public:
  static Result<std::unique_ptr<TraceRouting>> Open(const std::string& path, const ModelConfig& model, int layers,
                                                    int64_t max_steps);
  Status Route(int64_t step, int layer, const Matrix& rows, int64_t first_row, Picks* picks,
               ThreadPool& pool) const override;
  int64_t num_steps() const { return static_cast<int64_t>(steps_.size()); }
  int64_t rows(int64_t step) const { return Replayed(step).rows; }

 private:
  TraceRouting() = default;
  const StepPicks& Replayed(int64_t step) const { return steps_[static_cast<size_t>(step) % steps_.size()]; }
  std::vector<StepPicks> steps_;
};

struct EngineOptions {
  ExecutorOptions executor;  // the option, layers, formats, weights and initial placement
  // Live rebalancing (a2a and whole): record the picks and install better placements while steps
  // run. rebalancer.policy.shape and .cost and recorder.bytes_per_expert are filled in by Create.
  bool rebalance = false;
  RebalancerOptions rebalancer;
  RecorderOptions recorder;
  // Rank 0 writes the load the run recorded to this file, as an epmoe binary trace that `epmoe
  // balance --trace` reads (empty: none), by recorder.mode: stat, one step holding the sum over
  // the run's steps; per_step, each step's picks per expert; per_token, each step's picks of every
  // row (in global row order). Complete after Close.
  std::string record_load_path;
  // Rank 0 rewrites this Prometheus text file after every step (with rebalance; empty: none).
  std::string metrics_file;
  // Wait at the end of each step for what the executor runs in the background (dwdp's read-ahead
  // of the next step's first layer), counted as that step's dispatch time, so that none of it runs
  // into what the caller does between steps (another engine's step, when options alternate).
  bool settle_each_step = false;
  // Compare every layer's output with the single-process layer on the same rows and picks; a
  // step whose normalized max error exceeds CheckTolerance fails, naming the layer and rank.
  bool check = false;
  // Two-batch overlap (a2a, data-parallel rows): each rank's rows of a step are split in two
  // micro-batches (the first half and the rest, SGLang's split by tokens) that run through every
  // layer at once, each on its own executor lane (MoeExecutor::CreateLane: the same weights; a
  // communicator, thread pool, half the buffer bound and half the rows bound of its own) in a
  // thread of its own, so one micro-batch's exchange is in flight while the other's experts run; a
  // lane waiting on its exchange polls MPI's progress engine, which moves the other's messages too.
  // Outputs are the same bit for bit as without (partial sums: to rounding).
  bool two_batch_overlap = false;
};

// What a rank did in one step, stage by stage (the stage list of executor.h).
using StageSeconds = std::array<double, kNumStages>;

// One step's figures, gathered over every rank (the same on every rank).
struct StepReport {
  int64_t step = 0;                            // counted from 0
  double seconds = 0;                          // the slowest rank's wall time over the layers
  StageSeconds stage_seconds{};                // mean over ranks, summed over layers
  double picks_balancedness = 1;               // mean/max picks per rank, averaged over layers
  double bytes_balancedness = 1;               // mean/max expert bytes read per rank, averaged over layers
  std::vector<int64_t> rank_picks;             // picks each rank computed, summed over layers
  int64_t rows = 0;                            // rows of the step (each counted at its home rank)
  double copies_per_row = 0;                   // ranks a row was delivered to, averaged over rows and layers
  int64_t bytes_sent = 0, bytes_received = 0;  // over all ranks and layers
  int64_t inter_node_bytes_sent = 0;           // the part of bytes_sent between nodes
  int64_t inter_node_bytes_received = 0;       // the part of bytes_received between nodes
  int64_t peak_buffer_bytes = 0;               // the largest on any rank
  int rounds = 0;                              // the most exchange rounds of any layer and rank
  double max_error = 0;                        // with check: the largest normalized error of any layer and rank
  BoundaryOutcome boundary;                    // with rebalance: what the step boundary did
  double boundary_seconds = 0;                 // this rank's time in the step boundary
};

class Engine {
 public:
  // Builds this rank's share of the weights (and the references with check). Refuses what cannot
  // run (CheckExecutorShape, rebalancing of an option without placement) before any work.
  static Result<std::unique_ptr<Engine>> Create(Communicator& comm, const ModelConfig& model,
                                                const EngineOptions& options, ThreadPool& pool);
  ~Engine();

  // One step on this rank's rows (data-parallel: its share, whose first global row is first_row;
  // tensor-parallel: every row, first_row 0): each layer adds its output to *rows (the residual
  // stream). Collective.
  Result<StepReport> Step(Matrix* rows, int64_t first_row, const Routing& routing);

  // Releases what the executor shares with the other ranks; Step fails afterwards. Collective.
  Status Close();

  const MoeExecutor& executor() const { return *executor_; }
  int64_t steps_done() const { return steps_done_; }
  // The placement a2a and whole follow; for the other options the trivial one a recording run's
  // recorder deals over; null when neither.
  std::shared_ptr<const LivePlacement> live_placement() const { return live_; }
  // Null unless rebalancing or recording the load.
  const LoadRecorder* recorder() const { return recorder_ ? recorder_.get() : nullptr; }
  const Rebalancer* rebalancer() const { return rebalancer_.get(); }
  // Proposes a placement to install from the next step boundaries on (Rebalancer::Propose).
  // Collective; only rank 0's is read.
  Status ProposePlacement(const PlacementPtr& placement);

 private:
  Engine(Communicator& comm, const ModelConfig& model, const EngineOptions& options, ThreadPool& pool);
  struct Batch;
  // Runs every layer on one batch of this rank's rows with `executor` and `pool`, keeping what the
  // step needs afterwards (picks, figures, and with check each layer's input and output).
  Status RunBatch(MoeExecutor& executor, ThreadPool& pool, const Routing& routing, Batch* batch) const;
  Status Boundary(const StageSeconds& stages, double step_seconds, double picks_balancedness, StepReport* report);
  Status AppendRecordedLoad(int64_t rows);

  Communicator& comm_;
  ModelConfig model_;
  EngineOptions options_;
  ThreadPool& pool_;
  std::unique_ptr<MoeExecutor> executor_;
  // With two_batch_overlap: the second micro-batch's communicator, pool and executor lane.
  std::unique_ptr<Communicator> lane_comm_;
  std::unique_ptr<ThreadPool> lane_pool_;
  std::unique_ptr<MoeExecutor> lane_executor_;
  std::shared_ptr<LivePlacement> live_;
  std::unique_ptr<LoadRecorder> recorder_;
  std::unique_ptr<Rebalancer> rebalancer_;
  std::unique_ptr<RebalanceMetrics> metrics_;          // rank 0 with a metrics file
  size_t metrics_reported_ = 0;                        // rebalances already in the metrics
  double windowed_balancedness_ = 1;                   // at the trigger's last look
  std::vector<std::unique_ptr<MoeLayer>> references_;  // with check
  std::unique_ptr<TraceWriter> load_file_;             // rank 0 with record_load_path
  std::vector<int64_t> run_load_;                      // stat: [layer][expert] summed over ranks and steps
  int64_t run_rows_ = 0;                               // stat: rows summed over steps
  int64_t steps_done_ = 0;
};

// Normalized max error a checked run allows against the single-process layer (the same weight
// format, rows as given): what the rows' travel format and the fp32 summation order can change.
double CheckTolerance(RowFormat dispatch, RowFormat combine, WeightFormat weights);

}  // namespace epmoe
