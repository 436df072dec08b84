#include "epmoe/rebalancer.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <thread>

#include "epmoe/balance.h"
#include "roll_call.h"

namespace epmoe {
namespace {

// Steps of the window a validating policy (auto, min-move) receives: enough to split by time and
// estimate the noise of the validation, few enough that summing them over ranks stays cheap
// (32 x layers x experts counts).
constexpr int64_t kValidatingPolicySteps = 32;

// Adds one chunk's moves to the rebalance's report.
void AddPlanToReport(const MovePlan& plan, RebalanceReport* r) {
  r->remote_copies += plan.remote_copies;
  r->local_copies += plan.local_copies;
  r->inter_node_copies += plan.inter_node_copies;
  r->bytes_moved += plan.total_bytes_moved();
  for (size_t i = 0; i < plan.bytes_sent.size(); ++i) {
    r->bytes_sent_by_rank[i] += plan.bytes_sent[i];
    r->bytes_received_by_rank[i] += plan.bytes_received[i];
  }
  for (size_t i = 0; i < plan.bytes_sent_by_node.size(); ++i) {
    r->bytes_sent_by_node[i] += plan.bytes_sent_by_node[i];
    r->bytes_received_by_node[i] += plan.bytes_received_by_node[i];
  }
}

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool SameShape(const Placement& a, const Placement& b) {
  return a.num_layers() == b.num_layers() && a.num_experts() == b.num_experts() && a.num_slots() == b.num_slots() &&
         a.num_ranks() == b.num_ranks() && a.num_nodes() == b.num_nodes();
}

std::string ShapeText(const Placement& p) {
  return fmt::format("{} layers, {} experts, {} slots, {} ranks, {} nodes", p.num_layers(), p.num_experts(),
                     p.num_slots(), p.num_ranks(), p.num_nodes());
}

// Ranks whose flag is non-zero, as "1, 3".
std::string FlaggedRanks(std::span<const int64_t> flags, int64_t value) {
  std::string out;
  for (size_t r = 0; r < flags.size(); ++r)
    if (flags[r] == value) out += fmt::format("{}{}", out.empty() ? "" : ", ", r);
  return out;
}

// Sums per step counts over a load's steps: [layer][expert].
std::vector<int64_t> LayerTotals(const ExpertLoad& load) { return SumOverSteps(load); }

// Predicted expert seconds per step of the slowest rank, summed over layers, for the window's
// average step.
double SlowestRankSecondsPerStep(const Placement& placement, const ExpertLoad& load, const CostModel& cost) {
  const auto totals = LayerTotals(load);
  const int64_t steps = std::max<int64_t>(load.num_steps, 1);
  std::vector<int64_t> average(load.num_experts);
  std::vector<double> per_rank(placement.num_ranks());
  double seconds = 0;
  for (int layer = 0; layer < load.num_layers; ++layer) {
    for (int e = 0; e < load.num_experts; ++e)
      average[e] = static_cast<int64_t>(std::llround(static_cast<double>(totals[layer * load.num_experts + e]) / steps));
    RankSeconds(placement, layer, average, cost, per_rank);
    seconds += *std::max_element(per_rank.begin(), per_rank.end());
  }
  return seconds;
}

}  // namespace

double WindowBalancedness(const Placement& placement, const ExpertLoad& load) {
  EPMOE_CHECK(load.num_layers == placement.num_layers() && load.num_experts == placement.num_experts());
  const auto totals = LayerTotals(load);
  std::vector<double> per_rank(placement.num_ranks());
  double sum = 0;
  for (int layer = 0; layer < load.num_layers; ++layer) {
    RankPicks(placement, layer,
              std::span<const int64_t>(totals.data() + static_cast<size_t>(layer) * load.num_experts,
                                       static_cast<size_t>(load.num_experts)),
              per_rank);
    sum += Balancedness(per_rank);
  }
  return load.num_layers > 0 ? sum / load.num_layers : 1.0;
}

Status ValidateRebalancerOptions(const RebalancerOptions& o) {
  EPMOE_RETURN_IF_ERROR(ValidateTriggerOptions(o.trigger));
  if (o.layers_per_chunk < 0)
    return InvalidArgument(fmt::format("layers per chunk {} must not be negative (0: all layers)", o.layers_per_chunk));
  if (o.max_buffer_bytes <= 0)
    return InvalidArgument(fmt::format("rebalance buffer bound {} bytes must be positive", o.max_buffer_bytes));
  if (!(o.move_bytes_per_second > 0))
    return InvalidArgument(fmt::format("move bandwidth {} bytes/s must be positive", o.move_bytes_per_second));
  if (!(o.ready_timeout_seconds > 0))
    return InvalidArgument(fmt::format("ready timeout {} s must be positive", o.ready_timeout_seconds));
  return Status::Ok();
}

// A rebalance between its decision and the switch of its last chunk.
struct Rebalancer::Pending {
  PlacementPtr from;  // the live placement when it was decided (the content every move reads)
  PlacementPtr to;
  bool measured = false;   // balancedness before/after known (a Propose()d placement measures at
                           // its first boundary)
  int chunk_begin = 0;     // first layer not yet installed
  int chunk_end = 0;       // end of the chunk being moved (async) or to move next
  std::unique_ptr<AsyncExpertMove> transfer;  // async: the chunk in flight
  double chunk_started_at = 0;
  double stall_seconds = 0;
  RebalanceReport report;
};

// Async: a decided rebalance whose placement rank 0 computes on a helper thread. Every rank keeps
// the window of the decision (for the balancedness after, and the payback test).
struct Rebalancer::Computing {
  // What the helper thread writes; `done` is set last (release) and read first (acquire).
  struct Shared {
    std::atomic<bool> done{false};
    std::optional<Result<Placement>> result;
    double seconds = 0;
  };
  int64_t decided_at_step = 0;
  std::shared_ptr<const ExpertLoad> load;
  double before = 1;
  TriggerInput input;
  double started_at = 0;
  double compute_seconds = 0;      // rank 0's, told to every rank by the ready exchange
  std::shared_ptr<Shared> shared;  // rank 0
  std::thread thread;              // rank 0

  ~Computing() {
    // A finished computation is joined; one still running (the rebalance failed or the run ended)
    // is left to finish on its own: it touches only its own copies (shared, load, policy).
    if (!thread.joinable()) return;
    if (shared->done.load(std::memory_order_acquire)) {
      thread.join();
    } else {
      thread.detach();
    }
  }
};

Rebalancer::Rebalancer(Communicator& comm, RebalanceTarget& target, std::shared_ptr<LivePlacement> live,
                       const RebalancerOptions& options)
    : comm_(comm), target_(target), live_placement_(std::move(live)), options_(options), trigger_(options.trigger) {}

Rebalancer::~Rebalancer() = default;

Result<std::unique_ptr<Rebalancer>> Rebalancer::Create(Communicator& comm, RebalanceTarget& target,
                                                       std::shared_ptr<LivePlacement> live,
                                                       const RebalancerOptions& options) {
  EPMOE_RETURN_IF_ERROR(ValidateRebalancerOptions(options));
  if (live == nullptr) return InvalidArgument("rebalancer: no live placement");
  const PlacementPtr initial = live->placement();
  if (initial->num_ranks() != comm.size())
    return InvalidArgument(fmt::format("rebalancer: the placement is for {} ranks, the communicator has {}",
                                       initial->num_ranks(), comm.size()));
  const BalanceShape& shape = options.policy.shape;
  if (shape.num_ranks != initial->num_ranks() || shape.num_nodes != initial->num_nodes() ||
      shape.num_redundant != initial->num_slots() - initial->num_experts())
    return InvalidArgument(fmt::format(
        "rebalancer: the policy's shape ({} ranks, {} nodes, {} redundant) differs from the placement's ({})",
        shape.num_ranks, shape.num_nodes, shape.num_redundant, ShapeText(*initial)));
  EPMOE_RETURN_IF_ERROR(ValidateBalanceShape(shape, initial->num_experts()));
  // Every rank must store copies of the same size, or the moves would not match.
  const int64_t bytes = target.expert_bytes();
  EPMOE_ASSIGN_OR_RETURN(const int64_t largest, comm.AllreduceMax(bytes));
  EPMOE_ASSIGN_OR_RETURN(const int64_t minus_smallest, comm.AllreduceMax(-bytes));
  if (largest != -minus_smallest || bytes <= 0)
    return InvalidArgument(fmt::format("rebalancer: ranks store between {} and {} bytes per expert copy (rank {}: {})",
                                       -minus_smallest, largest, comm.rank(), bytes));
  std::unique_ptr<Rebalancer> rebalancer(new Rebalancer(comm, target, std::move(live), options));
  if (comm.size() > 1) {
    EPMOE_ASSIGN_OR_RETURN(rebalancer->roll_call_, RollCall::Create(comm));
  }
  return rebalancer;
}

bool Rebalancer::in_progress() const { return pending_ != nullptr || computing_ != nullptr; }

int64_t Rebalancer::bytes_moved_total() const {
  int64_t total = 0;
  for (const auto& r : reports_) total += r.bytes_moved;
  return total;
}

Status Rebalancer::Fail(Status status) {
  target_.DropStaged();
  pending_.reset();
  computing_.reset();
  return status;
}

Status Rebalancer::Net(Status status) {
  if (status.code() == StatusCode::kUnavailable) timed_out_ = true;
  return status;
}

std::string Rebalancer::Where() const {
  if (pending_ != nullptr) {
    const int layers = Live()->num_layers();
    const int per_chunk = options_.layers_per_chunk > 0 ? options_.layers_per_chunk : layers;
    return fmt::format("installing layers [{}, {})", pending_->chunk_begin,
                       std::min(layers, pending_->chunk_begin + per_chunk));
  }
  if (computing_ != nullptr)
    return fmt::format("waiting for rank 0's placement of the rebalance decided at step {}", computing_->decided_at_step);
  return "at the trigger's look (no layer switching)";
}

Status Rebalancer::NameMissingRanks(Status status, int64_t step, const std::string& where) {
  if (!timed_out_ || roll_call_ == nullptr) return status;
  auto missing = roll_call_->Missing(options_.roll_call_seconds);
  const std::string noticed = fmt::format("rank {} noticed: {}", comm_.rank(), status.message());
  if (!missing.ok())
    return Unavailable(fmt::format("rebalance at step {}, {}: an exchange timed out and the roll call failed ({}); "
                                   "nothing installed; {}", step, where, missing.status().message(), noticed));
  if (missing->empty())
    return Unavailable(fmt::format("rebalance at step {}, {}: an exchange timed out, yet every rank answered the roll "
                                   "call (a rank was slower than the timeout); nothing installed; {}",
                                   step, where, noticed));
  return Unavailable(fmt::format("rebalance at step {}, {}: rank(s) {} did not answer (stalled or failed: no answer to "
                                 "the roll call within {} s); nothing installed; {}",
                                 step, where, RankList(*missing), options_.roll_call_seconds, noticed));
}

Status Rebalancer::Begin(PlacementPtr next, int64_t step, double before, double after, double compute_seconds) {
  auto pending = std::make_unique<Pending>();
  pending->from = Live();
  pending->to = std::move(next);
  pending->measured = true;
  pending->report.decided_at_step = step;
  pending->report.placement_ready_at_step = step;
  pending->report.balancedness_before = before;
  pending->report.balancedness_after = after;
  pending->report.compute_seconds = compute_seconds;
  pending->report.policy = PolicyName(options_.policy.policy);
  const int ranks = Live()->num_ranks(), nodes = Live()->num_nodes();
  pending->report.bytes_sent_by_rank.assign(ranks, 0);
  pending->report.bytes_received_by_rank.assign(ranks, 0);
  pending->report.bytes_sent_by_node.assign(nodes, 0);
  pending->report.bytes_received_by_node.assign(nodes, 0);
  pending_ = std::move(pending);
  return Status::Ok();
}

Status Rebalancer::Propose(const PlacementPtr& proposal) {
  // Every rank knows the same state, so all refuse together without an exchange.
  if (in_progress()) return FailedPrecondition("rebalancer: a rebalance is in progress; propose after it");
  timed_out_ = false;
  auto next = BroadcastPlacement(comm_, 0, proposal);
  if (!next.ok()) {
    const Status refused = Net(next.status()).WithContext("proposed placement refused");
    return NameMissingRanks(refused, -1, "broadcasting a proposed placement");
  }
  if (!SameShape(**next, *Live()))
    return InvalidArgument(fmt::format("proposed placement refused: it has {}, the live placement {}",
                                       ShapeText(**next), ShapeText(*Live())));
  EPMOE_RETURN_IF_ERROR(Begin(*next, -1, 1, 1, 0));
  pending_->measured = false;
  pending_->report.policy = "proposed";
  return Status::Ok();
}

Result<Placement> Rebalancer::RunPolicy(const ExpertLoad& load) const {
  PolicyOptions policy = options_.policy;
  const PlacementPtr live = Live();  // keeps policy.current alive for the call
  policy.current = live.get();
  return options_.compute_placement ? options_.compute_placement(load, policy) : ComputePlacement(load, policy);
}

Result<BoundaryOutcome> Rebalancer::AtStepBoundary(int64_t steps_done, const LoadRecorder& recorder) {
  timed_out_ = false;
  auto outcome = Boundary(steps_done, recorder);
  if (outcome.ok()) return outcome;
  const std::string where = Where();
  const Status failed = Fail(outcome.status());
  return NameMissingRanks(failed, steps_done, where);
}

Result<BoundaryOutcome> Rebalancer::Boundary(int64_t steps_done, const LoadRecorder& recorder) {
  double start = SteadySeconds();
  BoundaryOutcome outcome;
  // A look that falls due while a rebalance is being placed or switched is deferred to the first
  // boundary after it, not skipped (every rank knows the same state, so all defer alike).
  if (trigger_.ChecksAt(steps_done) && in_progress()) owed_check_step_ = steps_done;
  if (computing_ != nullptr) {
    // The ready flag exchange is also where the ranks meet, so the stall starts after it.
    EPMOE_ASSIGN_OR_RETURN(const bool ready, PlacementReady(steps_done));
    start = SteadySeconds();
    if (ready) {
      std::unique_ptr<Computing> done = std::move(computing_);
      PlacementPtr candidate;
      if (comm_.rank() == 0) candidate = std::make_shared<const Placement>(std::move(*done->shared->result).value());
      EPMOE_RETURN_IF_ERROR(Adopt(done->decided_at_step, steps_done, *done->load, done->before, done->input, candidate,
                                  done->compute_seconds, &outcome));
      outcome.window_balancedness = done->before;
    }
  } else {
    int64_t check_step = -1;
    if (pending_ == nullptr) {
      if (trigger_.ChecksAt(steps_done)) {
        check_step = steps_done;
      } else if (owed_check_step_ >= 0) {
        check_step = owed_check_step_;
      }
    }
    const bool needs_load = check_step >= 0 || (pending_ != nullptr && !pending_->measured);
    if (needs_load || pending_ != nullptr) {
      // Ranks reach the boundary at different times (the step's own imbalance); wait for all of
      // them first so that the stall measured below is the rebalancing's, not the step's.
      EPMOE_RETURN_IF_ERROR(
          Net(comm_.Barrier()).WithContext(fmt::format("rank {}, step boundary {}", comm_.rank(), steps_done)));
      start = SteadySeconds();
    }
    if (needs_load) {
      // auto and min-move validate on the later part of the window, so they need it as steps.
      ExpertLoad load =
          PolicyValidates(options_.policy.policy) ? recorder.Series(kValidatingPolicySteps) : recorder.Load();
      if (load.num_layers != Live()->num_layers() || load.num_experts != Live()->num_experts())
        return InvalidArgument(fmt::format("rebalancer: rank {} recorded {} layers x {} experts, the placement has {}",
                                           comm_.rank(), load.num_layers, load.num_experts, ShapeText(*Live())));
      EPMOE_RETURN_IF_ERROR(Net(SumOverRanks(comm_, load.counts))
                                .WithContext(fmt::format("rebalancer: summing the load window at step {}", steps_done)));
      EPMOE_RETURN_IF_ERROR(Net(SumOverRanks(comm_, load.rows))
                                .WithContext(fmt::format("rebalancer: summing the rows window at step {}", steps_done)));
      const double before = WindowBalancedness(*Live(), load);
      outcome.window_balancedness = before;
      if (pending_ != nullptr) {
        pending_->report.decided_at_step = steps_done;
        pending_->report.placement_ready_at_step = steps_done;
        pending_->report.balancedness_before = before;
        pending_->report.balancedness_after = WindowBalancedness(*pending_->to, load);
        pending_->measured = true;
        outcome.started = true;
      } else {
        outcome.checked = true;
        owed_check_step_ = -1;
        TriggerInput input;
        input.step = check_step;  // the step the look was due at (the trigger's schedule)
        input.windowed_balancedness = before;
        // Payback: would any saving do? (the interval and the spacing of rebalances); the saving
        // itself is weighed once the placement is known (Adopt).
        if (options_.trigger.mode == TriggerMode::kPayback) input.predicted_saved_us_per_step = 1;
        if (trigger_.ShouldRebalance(input))
          EPMOE_RETURN_IF_ERROR(Decide(steps_done, std::move(load), before, input, &outcome));
      }
    }
  }
  if (pending_ != nullptr) {
    EPMOE_ASSIGN_OR_RETURN(outcome.layers_installed, Advance(steps_done));
    pending_->stall_seconds += SteadySeconds() - start;
    if (pending_->chunk_begin == Live()->num_layers()) {
      EPMOE_RETURN_IF_ERROR(FinishReport(steps_done));
      outcome.finished = true;
    }
  }
  outcome.seconds = SteadySeconds() - start;
  return outcome;
}

Status Rebalancer::Decide(int64_t step, ExpertLoad load, double before, const TriggerInput& input,
                          BoundaryOutcome* outcome) {
  if (!options_.async) {
    // Rank 0 computes while the others wait in the broadcast.
    const double compute_start = SteadySeconds();
    PlacementPtr candidate;
    Status root_error;
    if (comm_.rank() == 0) {
      auto computed = RunPolicy(load);
      if (computed.ok()) {
        candidate = std::make_shared<const Placement>(std::move(computed).value());
      } else {
        root_error = computed.status();
      }
    }
    const double compute_seconds = SteadySeconds() - compute_start;
    if (!root_error.ok()) {
      // The others learn it from the empty broadcast (they refuse it); rank 0 says why.
      (void)BroadcastPlacement(comm_, 0, nullptr);
      return root_error.WithContext(fmt::format("rebalancer: policy at step {}", step));
    }
    return Adopt(step, step, load, before, input, candidate, compute_seconds, outcome);
  }
  // Async: rank 0 computes on a helper thread; steps run on until every rank learns it is ready.
  auto computing = std::make_unique<Computing>();
  computing->decided_at_step = step;
  computing->load = std::make_shared<const ExpertLoad>(std::move(load));
  computing->before = before;
  computing->input = input;
  computing->started_at = SteadySeconds();
  if (comm_.rank() == 0) {
    computing->shared = std::make_shared<Computing::Shared>();
    PolicyOptions policy = options_.policy;
    auto compute = options_.compute_placement;
    // The thread holds its own references: the window, the live placement it starts from and the
    // shared result, so nothing it reads can go away before it ends.
    computing->thread = std::thread([shared = computing->shared, window = computing->load, current = Live(), policy,
                                     compute]() mutable {
      policy.current = current.get();
      const double t0 = SteadySeconds();
      shared->result.emplace(compute ? compute(*window, policy) : ComputePlacement(*window, policy));
      shared->seconds = SteadySeconds() - t0;
      shared->done.store(true, std::memory_order_release);
    });
  }
  computing_ = std::move(computing);
  outcome->placing = true;
  return Status::Ok();
}

Result<bool> Rebalancer::PlacementReady(int64_t step) {
  Computing& c = *computing_;
  // Rank 0's flag: 0 still computing, 1 ready, 2 the policy failed, 3 not ready within the timeout.
  int64_t flag = 0, compute_us = 0;
  if (comm_.rank() == 0) {
    if (c.shared->done.load(std::memory_order_acquire)) {
      flag = c.shared->result->ok() ? 1 : 2;
      compute_us = std::llround(c.shared->seconds * 1e6);
    } else if (SteadySeconds() - c.started_at > options_.ready_timeout_seconds) {
      flag = 3;
    }
  }
  std::vector<int64_t> all(2 * static_cast<size_t>(comm_.size()));
  EPMOE_RETURN_IF_ERROR(Net(comm_.AllgatherInt64(std::vector<int64_t>{flag, compute_us}, all))
                            .WithContext(fmt::format("rank {}, step boundary {}, asking whether rank 0's placement is "
                                                     "ready", comm_.rank(), step)));
  flag = all[0];
  c.compute_seconds = static_cast<double>(all[1]) * 1e-6;
  if (flag == 2) {
    if (comm_.rank() == 0)
      return c.shared->result->status().WithContext(
          fmt::format("rebalancer: policy of the rebalance decided at step {}", c.decided_at_step));
    return Internal(fmt::format("rebalancer: rank 0's policy failed for the rebalance decided at step {} (rank 0 "
                                "reports why); nothing installed", c.decided_at_step));
  }
  if (flag == 3)
    return Unavailable(fmt::format("rebalancer: rank 0 did not compute the placement of the rebalance decided at step "
                                   "{} within {} s; nothing installed", c.decided_at_step,
                                   options_.ready_timeout_seconds));
  return flag == 1;
}

Status Rebalancer::Adopt(int64_t decided_step, int64_t step, const ExpertLoad& load, double before, TriggerInput input,
                         const PlacementPtr& candidate, double compute_seconds, BoundaryOutcome* outcome) {
  auto next = BroadcastPlacement(comm_, 0, candidate);
  if (!next.ok())
    return Net(next.status()).WithContext(fmt::format("rebalancer: new placement at step {}", step));
  if (!SameShape(**next, *Live()))
    return InvalidArgument(fmt::format("rebalancer: rank 0 computed a placement of {}, the live one has {}",
                                       ShapeText(**next), ShapeText(*Live())));
  const double after = WindowBalancedness(**next, load);
  // The policy may keep the live placement (the load has not changed enough): nothing to do.
  bool decide = !(**next == *Live());
  if (decide && options_.trigger.mode == TriggerMode::kPayback) {
    EPMOE_ASSIGN_OR_RETURN(const MovePlan plan,
                           PlanMoves(*Live(), **next, 0, Live()->num_layers(), target_.expert_bytes()));
    const CostModel& cost = options_.policy.cost;
    input.predicted_saved_us_per_step =
        1e6 * (SlowestRankSecondsPerStep(*Live(), load, cost) - SlowestRankSecondsPerStep(**next, load, cost));
    input.predicted_move_us = 1e6 * static_cast<double>(plan.total_bytes_moved()) / options_.move_bytes_per_second;
    decide = trigger_.ShouldRebalance(input);
  }
  if (!decide) return Status::Ok();
  trigger_.Rebalanced(decided_step);
  EPMOE_RETURN_IF_ERROR(Begin(*next, decided_step, before, after, compute_seconds));
  pending_->report.placement_ready_at_step = step;
  outcome->started = true;
  return Status::Ok();
}

Result<int> Rebalancer::Advance(int64_t step) {
  return options_.async ? AdvanceAsync(step) : AdvanceSync(step);
}

Result<int> Rebalancer::AdvanceSync(int64_t step) {
  Pending& p = *pending_;
  const int layers = Live()->num_layers();
  const int per_chunk = options_.layers_per_chunk > 0 ? options_.layers_per_chunk : layers;
  p.chunk_end = std::min(layers, p.chunk_begin + per_chunk);
  const std::string where = fmt::format("rebalance at step {}: rank {}, layers [{}, {})", step, comm_.rank(),
                                        p.chunk_begin, p.chunk_end);
  const int64_t expert_bytes = target_.expert_bytes();
  EPMOE_ASSIGN_OR_RETURN(MovePlan plan, PlanMoves(*p.from, *p.to, p.chunk_begin, p.chunk_end, expert_bytes));
  auto moved = MoveExperts(
      comm_, plan, expert_bytes, options_.max_buffer_bytes,
      [this](int layer, int slot) { return target_.slot_bytes(layer, slot); },
      [this](const SlotMove& move, std::span<const std::byte> bytes) {
        return target_.Stage(move.layer, move.slot, bytes);
      });
  // A rank whose exchange timed out cannot agree with the others any more; it ends here (the
  // others time out in the agreement below, or have timed out too).
  if (!moved.ok() && moved.status().code() == StatusCode::kUnavailable) return Net(moved.status()).WithContext(where);
  // Every rank says whether it staged its copies, so no rank installs a chunk another one lacks.
  std::vector<int64_t> flags(comm_.size());
  EPMOE_RETURN_IF_ERROR(
      Net(comm_.AllgatherInt64(std::vector<int64_t>{moved.ok() ? 0 : 1}, flags)).WithContext(where + ", agreeing to install"));
  if (!moved.ok()) return moved.status().WithContext(where);
  const std::string failed = FlaggedRanks(flags, 1);
  if (!failed.empty())
    return Unavailable(fmt::format("rebalance at step {}: rank(s) {} could not stage layers [{}, {}); nothing installed",
                                   step, failed, p.chunk_begin, p.chunk_end));
  const int begin = p.chunk_begin;
  p.report.rounds += moved->rounds;
  AddPlanToReport(plan, &p.report);
  EPMOE_RETURN_IF_ERROR(InstallChunk().WithContext(where));
  return p.chunk_begin - begin;
}

Status Rebalancer::StartChunkTransfer() {
  Pending& p = *pending_;
  const int layers = Live()->num_layers();
  const int per_chunk = options_.layers_per_chunk > 0 ? options_.layers_per_chunk : layers;
  p.chunk_end = std::min(layers, p.chunk_begin + per_chunk);
  const int64_t expert_bytes = target_.expert_bytes();
  EPMOE_ASSIGN_OR_RETURN(MovePlan plan, PlanMoves(*p.from, *p.to, p.chunk_begin, p.chunk_end, expert_bytes));
  AddPlanToReport(plan, &p.report);
  p.chunk_started_at = SteadySeconds();
  EPMOE_ASSIGN_OR_RETURN(
      p.transfer,
      AsyncExpertMove::Start(
          comm_, plan, expert_bytes, options_.max_buffer_bytes,
          [this](int layer, int slot) { return target_.slot_bytes(layer, slot); },
          [this](const SlotMove& move, std::span<const std::byte> bytes) {
            return target_.Stage(move.layer, move.slot, bytes);
          }));
  return Status::Ok();
}

Result<int> Rebalancer::AdvanceAsync(int64_t step) {
  Pending& p = *pending_;
  const int begin = p.chunk_begin;
  if (p.transfer == nullptr) {
    const int per_chunk = options_.layers_per_chunk > 0 ? options_.layers_per_chunk : Live()->num_layers();
    p.chunk_end = std::min(Live()->num_layers(), p.chunk_begin + per_chunk);
    const std::string where = fmt::format("rebalance at step {}: rank {}, starting layers [{}, {})", step,
                                          comm_.rank(), p.chunk_begin, p.chunk_end);
    // A local failure before the first exchange must still be agreed on, or the others would wait.
    const Status started = StartChunkTransfer();
    if (!started.ok() && started.code() == StatusCode::kUnavailable) return Net(started).WithContext(where);
    std::vector<int64_t> flags(comm_.size());
    EPMOE_RETURN_IF_ERROR(
        Net(comm_.AllgatherInt64(std::vector<int64_t>{started.ok() ? 0 : 1}, flags)).WithContext(where));
    if (!started.ok()) return started.WithContext(where);
    const std::string failed = FlaggedRanks(flags, 1);
    if (!failed.empty())
      return Unavailable(fmt::format("rebalance at step {}: rank(s) {} could not start layers [{}, {})", step, failed,
                                     p.chunk_begin, p.chunk_end));
  }
  // Flags: 0 this round arrived, 1 still travelling, 2 failed.
  const std::string where = fmt::format("rebalance at step {}: rank {}, layers [{}, {})", step, comm_.rank(),
                                        p.chunk_begin, p.chunk_end);
  auto polled = p.transfer->Poll();
  const int64_t flag = !polled.ok() ? 2 : (*polled ? 0 : 1);
  std::vector<int64_t> flags(comm_.size());
  EPMOE_RETURN_IF_ERROR(
      Net(comm_.AllgatherInt64(std::vector<int64_t>{flag}, flags)).WithContext(where + ", readiness"));
  if (!polled.ok()) return polled.status().WithContext(where);
  const std::string failed = FlaggedRanks(flags, 2);
  if (!failed.empty())
    return Unavailable(fmt::format("rebalance at step {}: rank(s) {} failed to receive layers [{}, {}); nothing "
                                   "installed", step, failed, p.chunk_begin, p.chunk_end));
  const std::string waiting = FlaggedRanks(flags, 1);
  if (!waiting.empty()) {
    if (SteadySeconds() - p.chunk_started_at > options_.ready_timeout_seconds)
      return Unavailable(fmt::format("rebalance at step {}: rank(s) {} not ready with layers [{}, {}) after {} s; "
                                     "nothing installed", step, waiting, p.chunk_begin, p.chunk_end,
                                     options_.ready_timeout_seconds));
    return 0;
  }
  // Every rank has this round: start the next one together, or switch the chunk.
  EPMOE_ASSIGN_OR_RETURN(bool another, p.transfer->StartNextRound());
  if (another) return 0;
  p.report.rounds += p.transfer->stats().rounds;
  p.transfer.reset();
  EPMOE_RETURN_IF_ERROR(InstallChunk().WithContext(where));
  // The next chunk starts travelling now, overlapping the next steps.
  if (p.chunk_begin < Live()->num_layers()) {
    const Status started = StartChunkTransfer();
    if (!started.ok()) return started.WithContext(where + ", starting the next chunk");
  }
  return p.chunk_begin - begin;
}

Status Rebalancer::InstallChunk() {
  Pending& p = *pending_;
  PlacementPtr next;
  if (p.chunk_end == Live()->num_layers()) {
    next = p.to;  // identical to the mix below once every layer has switched
  } else {
    std::vector<std::vector<int32_t>> phy2log(Live()->num_layers());
    for (int layer = 0; layer < Live()->num_layers(); ++layer) {
      const auto source = layer < p.chunk_end ? p.to->phy2log(layer) : Live()->phy2log(layer);
      phy2log[layer].assign(source.begin(), source.end());
    }
    EPMOE_ASSIGN_OR_RETURN(Placement mixed, Placement::Create(Live()->num_experts(), Live()->num_ranks(),
                                                              Live()->num_nodes(), std::move(phy2log)));
    next = std::make_shared<const Placement>(std::move(mixed));
  }
  EPMOE_RETURN_IF_ERROR(target_.Install(p.chunk_begin, p.chunk_end, next));
  // The target holds the chunk's weights now; the placement must follow in the same boundary. Its
  // shape was checked when the rebalance began, so it cannot be refused here.
  const Status installed = live_placement_->Install(std::move(next));
  EPMOE_CHECK_MSG(installed.ok(), installed.ToString());
  p.chunk_begin = p.chunk_end;
  ++p.report.chunks;
  return Status::Ok();
}

Status Rebalancer::FinishReport(int64_t step) {
  Pending& p = *pending_;
  p.report.installed_at_step = step;
  p.report.stall_seconds_this_rank = p.stall_seconds;
  auto stall_us = comm_.AllreduceMax(static_cast<int64_t>(std::llround(p.stall_seconds * 1e6)));
  if (!stall_us.ok())
    return Net(stall_us.status()).WithContext(fmt::format("rank {}, step boundary {}, reporting the stall", comm_.rank(), step));
  p.report.stall_seconds_max = static_cast<double>(*stall_us) * 1e-6;
  reports_.push_back(std::move(p.report));
  pending_.reset();
  return Status::Ok();
}

Result<RebalanceMetrics> RebalanceMetrics::Create(const std::string& path) {
  RebalanceMetrics metrics(path);
  MetricsFile& f = metrics.file_;
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_balancedness", "gauge",
                                  "Mean over max picks per rank, averaged over MoE layers (1 = perfect)"));
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_balancedness_windowed", "gauge",
                                  "Balancedness of the load window summed over ranks, at the last check"));
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_rebalances_total", "counter", "Rebalances installed"));
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_rebalance_bytes_moved_total", "counter",
                                  "Expert bytes moved between ranks by rebalancing"));
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_rebalance_stall_seconds_total", "counter",
                                  "Seconds the slowest rank spent in rebalancing step boundaries"));
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_steps_total", "counter", "Steps run"));
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_step_seconds", "summary", "Step wall time over the last 1000 steps"));
  EPMOE_RETURN_IF_ERROR(f.Declare("epmoe_stage_seconds_total", "counter", "Seconds spent per stage of the steps"));
  f.Set("epmoe_balancedness", 1);
  f.Set("epmoe_balancedness_windowed", 1);
  f.Set("epmoe_rebalances_total", 0);
  f.Set("epmoe_rebalance_bytes_moved_total", 0);
  f.Set("epmoe_rebalance_stall_seconds_total", 0);
  f.Set("epmoe_steps_total", 0);
  return metrics;
}

void RebalanceMetrics::RecordStep(double seconds, const std::vector<std::pair<std::string, double>>& stages) {
  constexpr size_t kKept = 1000;
  if (step_seconds_.size() < kKept) {
    step_seconds_.push_back(seconds);
  } else {
    step_seconds_[steps_ % kKept] = seconds;
  }
  ++steps_;
  for (const auto& [stage, value] : stages) {
    auto it = std::find_if(stage_totals_.begin(), stage_totals_.end(), [&](const auto& s) { return s.first == stage; });
    if (it == stage_totals_.end()) {
      stage_totals_.emplace_back(stage, value);
    } else {
      it->second += value;
    }
  }
}

void RebalanceMetrics::RecordBalance(double current, double windowed) {
  file_.Set("epmoe_balancedness", current);
  file_.Set("epmoe_balancedness_windowed", windowed);
}

void RebalanceMetrics::RecordRebalance(const RebalanceReport& report) {
  ++rebalances_;
  bytes_moved_ += report.bytes_moved;
  stall_seconds_ += report.stall_seconds_max;
}

Status RebalanceMetrics::Write() {
  file_.Set("epmoe_rebalances_total", static_cast<double>(rebalances_));
  file_.Set("epmoe_rebalance_bytes_moved_total", static_cast<double>(bytes_moved_));
  file_.Set("epmoe_rebalance_stall_seconds_total", stall_seconds_);
  file_.Set("epmoe_steps_total", static_cast<double>(steps_));
  if (!step_seconds_.empty()) {
    std::vector<double> sorted = step_seconds_;
    std::sort(sorted.begin(), sorted.end());
    for (double q : {0.5, 0.9, 0.99}) {
      const size_t index = std::min(sorted.size() - 1, static_cast<size_t>(q * static_cast<double>(sorted.size())));
      file_.Set("epmoe_step_seconds", sorted[index], {{"quantile", fmt::format("{}", q)}});
    }
  }
  for (const auto& [stage, value] : stage_totals_) file_.Set("epmoe_stage_seconds_total", value, {{"stage", stage}});
  return file_.Write();
}

}  // namespace epmoe
