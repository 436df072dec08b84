// Rebalancer: live rebalancing of a running expert-parallel job. At step boundaries it decides
// (RebalanceTrigger) whether to place the experts anew, has rank 0 compute the new placement from
// the recorder's window summed over all ranks, agrees on it (BroadcastPlacement: validated on every
// rank), and installs it in chunks of layers, one chunk per step boundary, moving only the copies
// that change (PlanMoves, MoveExperts or AsyncExpertMove). The running executor is reached through
// RebalanceTarget, so the protocol is independent of the way rows meet their experts.
// With `async`, rank 0 computes the placement on a helper thread while steps keep running; at each
// later boundary every rank learns (one small all-gather) whether it is ready, and it is broadcast
// at the first boundary where it is. It is computed from the window as it was at the trigger's look
// (the boundary the rebalance was decided at), not from the steps run while it was computed.
//
// Generation safety: a step uses the placement snapshot it took at its start; the Rebalancer only
// calls Install between steps, on every rank at the same step boundary, and only once every rank
// has staged all copies of the chunk (agreed collectively). A rank that fails or stalls turns into
// an error naming the rank and the layers; nothing of that chunk is installed anywhere (a rank that
// timed out cannot tell what the others did: the caller must then abort the job, Communicator::Abort).
// When an exchange times out, the ranks that noticed hold a roll call (bounded, over private
// two-rank communicators made at Create) and the error names the rank(s) that did not answer.
// Not thread-safe: one Rebalancer per rank, driven by the thread that runs the steps (with async,
// rank 0's policy runs on a helper thread the Rebalancer starts; it reads only its own copies of the
// window and the live placement, and a thread still running when the Rebalancer goes is detached).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/eplb_policy.h"
#include "epmoe/live_placement.h"
#include "epmoe/load.h"
#include "epmoe/metrics.h"
#include "epmoe/placement.h"
#include "epmoe/rebalance_target.h"
#include "epmoe/rebalance_trigger.h"
#include "epmoe/recorder.h"
#include "epmoe/status.h"
#include "epmoe/weight_mover.h"

namespace epmoe {

class RollCall;  // src/rebalance/roll_call.h

struct RebalancerOptions {
  TriggerOptions trigger;
  // policy.shape must match the live placement (ranks, nodes, redundant = P - E); policy.current is
  // set by the Rebalancer (min-move places from the live placement).
  PolicyOptions policy;
  int layers_per_chunk = 0;                  // layers installed per step boundary; 0: all at once
  bool async = false;                        // copies travel in the background between steps
  int64_t max_buffer_bytes = int64_t{1} << 28;  // send + receive buffers of one exchange round
  // Payback trigger: the movement is priced at this many bytes per second and the saving per step
  // with policy.cost (the slowest rank's predicted expert time, per layer, averaged over the window).
  double move_bytes_per_second = 10e9;
  // Async: a chunk whose copies are not ready on every rank this long after it started fails,
  // naming the ranks that were not ready; so does a placement rank 0 has not computed by then.
  double ready_timeout_seconds = 600;
  // After an exchange timed out: how long rank 0 waits for the other ranks' answers to the roll
  // call that finds who stopped answering (the ranks that noticed wait at most about twice that).
  double roll_call_seconds = 10;
  // The placement policy, run on rank 0 only (on a helper thread with `async`, so it must be
  // thread-safe): ComputePlacement when empty. An engine may plug in its own.
  std::function<Result<Placement>(const ExpertLoad&, const PolicyOptions&)> compute_placement;
};
Status ValidateRebalancerOptions(const RebalancerOptions& options);

// One finished rebalance (the same on every rank except stall_seconds_this_rank).
struct RebalanceReport {
  int64_t decided_at_step = 0;      // step boundary at which it was decided
  int64_t placement_ready_at_step = 0;  // boundary at which every rank had the placement (async:
                                        // later than decided_at_step; sync: the same)
  int64_t installed_at_step = 0;    // step boundary at which its last chunk switched
  int chunks = 0;
  int rounds = 0;                   // exchange rounds over all chunks (bounded buffers)
  int64_t remote_copies = 0;        // copies that crossed between ranks, all ranks
  int64_t local_copies = 0;         // copies filled from the same rank's old slots, all ranks
  int64_t inter_node_copies = 0;
  int64_t bytes_moved = 0;          // over the network, all ranks
  std::vector<int64_t> bytes_sent_by_rank, bytes_received_by_rank;
  std::vector<int64_t> bytes_sent_by_node, bytes_received_by_node;
  // Window balancedness (picks summed over ranks, mean/max per rank averaged over layers) under the
  // old and the new placement.
  double balancedness_before = 1, balancedness_after = 1;
  double compute_seconds = 0;            // rank 0's placement computation (on its helper thread with async)
  double stall_seconds_max = 0;          // longest time any rank spent inside the boundaries of it
  double stall_seconds_this_rank = 0;
  std::string policy;
};

// What one step boundary did.
struct BoundaryOutcome {
  bool checked = false;          // the trigger looked at this boundary
  bool placing = false;          // async: a rebalance was decided here, rank 0 computes its placement
  bool started = false;          // a rebalance started here (sync: decided here; async: its placement
                                 // arrived here)
  int layers_installed = 0;      // layers that switched at this boundary
  bool finished = false;         // the last chunk of a rebalance switched here (see last_report)
  double window_balancedness = 1;  // when checked or started: the window's balancedness under the live
                                   // placement (when started, the window of the decision)
  double seconds = 0;            // time this rank spent in the boundary
};

class Rebalancer {
 public:
  // `live` holds the placement the target runs now; the Rebalancer is its writer (it installs each
  // chunk's placement right after the target's Install). The communicator and target must outlive
  // the Rebalancer. Collective (every rank, same options): refuses, on every rank, targets whose
  // expert_bytes() differ between ranks; makes the roll call's size - 1 two-rank communicators.
  static Result<std::unique_ptr<Rebalancer>> Create(Communicator& comm, RebalanceTarget& target,
                                                    std::shared_ptr<LivePlacement> live,
                                                    const RebalancerOptions& options);
  ~Rebalancer();

  // Call on every rank after each step, with the number of steps completed so far and the rank's
  // recorder (its window covers that rank's picks). Collective. A look of the trigger that falls
  // due while a rebalance is being placed or switched is taken at the first boundary after it. After a
  // boundary that installed layers, the live placement holds the new one.
  // A policy that returns the live placement unchanged starts no rebalance.
  Result<BoundaryOutcome> AtStepBoundary(int64_t steps_done, const LoadRecorder& recorder);

  // Proposes a placement to install from the next boundary on, instead of one the policy computes
  // (an operator's file, tests). Only rank 0's `proposal` is read; a null one, a corrupt one or one
  // whose shape differs from the live placement is refused on every rank and nothing changes.
  // Collective; refused while a rebalance is in progress.
  Status Propose(const PlacementPtr& proposal);

  PlacementPtr placement() const { return Live(); }  // the live placement (mixed while chunks switch)
  bool in_progress() const;  // a rebalance is being placed (async) or switched
  const std::vector<RebalanceReport>& reports() const { return reports_; }
  int64_t bytes_moved_total() const;

 private:
  struct Pending;
  struct Computing;
  Rebalancer(Communicator& comm, RebalanceTarget& target, std::shared_ptr<LivePlacement> live,
             const RebalancerOptions& options);
  PlacementPtr Live() const { return live_placement_->placement(); }
  Result<BoundaryOutcome> Boundary(int64_t steps_done, const LoadRecorder& recorder);
  Status Decide(int64_t step, ExpertLoad load, double before, const TriggerInput& input, BoundaryOutcome* outcome);
  Result<bool> PlacementReady(int64_t step);
  Status Adopt(int64_t decided_step, int64_t step, const ExpertLoad& load, double before, TriggerInput input,
               const PlacementPtr& candidate, double compute_seconds, BoundaryOutcome* outcome);
  Result<Placement> RunPolicy(const ExpertLoad& load) const;
  Status Net(Status status);  // marks a transport timeout (then the error runs a roll call)
  Status NameMissingRanks(Status status, int64_t step, const std::string& where);
  std::string Where() const;
  Status Begin(PlacementPtr next, int64_t step, double before, double after, double compute_seconds);
  Result<int> Advance(int64_t step);           // layers installed at this boundary
  Result<int> AdvanceSync(int64_t step);
  Result<int> AdvanceAsync(int64_t step);
  Status StartChunkTransfer();
  Status InstallChunk();
  Status FinishReport(int64_t step);
  Status Fail(Status status);

  Communicator& comm_;
  RebalanceTarget& target_;
  std::shared_ptr<LivePlacement> live_placement_;
  RebalancerOptions options_;
  RebalanceTrigger trigger_;
  std::unique_ptr<Pending> pending_;
  std::unique_ptr<Computing> computing_;  // async: rank 0 computing the placement of a decided rebalance
  std::unique_ptr<RollCall> roll_call_;   // null on one rank
  bool timed_out_ = false;                // an exchange of this boundary timed out
  int64_t owed_check_step_ = -1;  // a look that fell due during a rebalance, taken after it
  std::vector<RebalanceReport> reports_;
};

// Window balancedness of `placement` on `load` summed over its steps: per layer mean/max of the
// per-rank picks (copies split evenly), averaged over layers. Pure.
double WindowBalancedness(const Placement& placement, const ExpertLoad& load);

// Prometheus metrics of a rebalancing run (metrics.h): balancedness current and windowed,
// rebalances total, bytes moved total, step time quantiles (over the last 1000 steps) and
// seconds per stage. One writer (rank 0); not thread-safe.
class RebalanceMetrics {
 public:
  static Result<RebalanceMetrics> Create(const std::string& path);
  // One finished step: its wall time and per-stage seconds ({"dispatch", 0.001}, ...).
  void RecordStep(double seconds, const std::vector<std::pair<std::string, double>>& stages);
  void RecordBalance(double current, double windowed);
  void RecordRebalance(const RebalanceReport& report);
  // Writes the file: the first write, before any step, so that a path that cannot be written is
  // refused at the start. Update() is the best-effort write of a running job (metrics.h).
  Status Write();
  void Update();
  const MetricsFile& file() const { return file_; }

 private:
  explicit RebalanceMetrics(const std::string& path) : file_(path) {}
  void SetTotals();  // the series Write and Update compute from the recorded steps
  MetricsFile file_;
  std::vector<double> step_seconds_;  // ring of the last 1000 steps
  int64_t steps_ = 0;
  int64_t rebalances_ = 0;
  int64_t bytes_moved_ = 0;
  double stall_seconds_ = 0;
  std::vector<std::pair<std::string, double>> stage_totals_;
};

}  // namespace epmoe
