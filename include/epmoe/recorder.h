// LoadRecorder: counts the router's picks per step and MoE layer, cheaply enough to leave on.
//
// Modes:
//   stat       keeps the last window_steps steps' per-expert counts in a ring buffer; Load()
//              returns their sum as one step (what a rebalancer places from);
//   per-step   the same ring buffer returned as the series (one step each);
//   per-token  per-step plus each row's picks (ids) per step and layer, same window.
// Every mode keeps per step the balancedness (mean/max picks per rank, averaged over the layers
// recorded in that step) and the byte-weighted balance (mean/max bytes of distinct experts read
// per rank), for the current step and the last 10, 100 and 1000 steps.
// Picks per logical expert, per physical slot and per rank of the last finished step are kept
// too: each Record call deals its picks over the slots with this rank's dispatch table, as the
// executor does with the same picks, so the per-slot counts are what this rank sent. The placement
// is read from the LivePlacement at a step's first Record and kept to its EndStep.
// Memory: window_steps * layers * experts * 4 bytes (+ the picks in per-token mode).
// Not thread-safe: one recorder per rank, fed from the thread that runs the steps.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "epmoe/live_placement.h"
#include "epmoe/load.h"
#include "epmoe/placement.h"
#include "epmoe/router.h"
#include "epmoe/status.h"

namespace epmoe {

enum class RecorderMode { kStat, kPerStep, kPerToken };
const char* RecorderModeName(RecorderMode mode);
Result<RecorderMode> ParseRecorderMode(std::string_view name);

struct RecorderOptions {
  RecorderMode mode = RecorderMode::kStat;
  int window_steps = 1000;        // steps kept (ring buffer), >= 1
  double bytes_per_expert = 1.0;  // bytes of one routed expert (byte-weighted balance)
};

// Balancedness averaged over the last n finished steps (fewer when fewer were recorded).
struct BalanceReport {
  int64_t steps = 0;                                                                  // finished steps so far
  double current = 1, last10 = 1, last100 = 1, last1000 = 1;                          // picks
  double bytes_current = 1, bytes_last10 = 1, bytes_last100 = 1, bytes_last1000 = 1;  // bytes read
};

class LoadRecorder {
 public:
  static Result<LoadRecorder> Create(const RecorderOptions& options, std::shared_ptr<const LivePlacement> placement);

  // Counts one layer's picks for the current step (a layer may be recorded several times per
  // step, e.g. per micro-batch). Refuses a layer out of range or ids outside [0, E).
  Status Record(int layer, const Picks& picks);
  // Finishes the current step: computes its per-slot and per-rank picks and balancedness.
  void EndStep();

  BalanceReport Balance() const;
  // stat: one step holding the sum over the window; per-step / per-token: the window's steps.
  ExpertLoad Load() const;
  // The window as steps in every mode, oldest first, consecutive steps summed into at most
  // `max_steps` (>= 1) steps: for policies that validate on the later part of the window.
  ExpertLoad Series(int64_t max_steps) const;
  // per-token: the picks of window step `index` (0 = oldest kept) and layer, concatenated over the
  // Record calls of that step. Empty in the other modes.
  const Picks& TokenPicks(int64_t index, int layer) const;

  // The last finished step, per layer.
  std::span<const int64_t> ExpertPicks(int layer) const;
  std::span<const double> SlotPicks(int layer) const;
  std::span<const double> RankPicks(int layer) const;

  int64_t steps_kept() const { return kept_; }
  const RecorderOptions& options() const { return options_; }

 private:
  LoadRecorder() = default;
  int64_t RingIndex(int64_t index) const {
    return (next_ - kept_ + index + options_.window_steps) % options_.window_steps;
  }

  RecorderOptions options_;
  std::shared_ptr<const LivePlacement> live_;
  LivePlacement::SnapshotPtr step_snapshot_;  // the placement of the step being recorded
  int num_layers_ = 0;
  int num_slots_ = 0;
  int num_ranks_ = 0;
  int num_experts_ = 0;
  std::vector<int64_t> current_;                   // [layer][expert] of the step being recorded
  std::vector<int64_t> current_slots_;             // [layer][slot] of the step being recorded
  std::vector<int64_t> call_counts_, call_slots_;  // one Record call's picks per expert and slot
  std::vector<int64_t> current_rows_;              // rows recorded per layer in this step
  std::vector<bool> layer_recorded_;
  std::vector<int32_t> ring_;                    // [window][layer][expert]
  std::vector<int64_t> ring_rows_;               // rows per kept step
  std::vector<std::vector<Picks>> ring_tokens_;  // per-token: [window][layer]
  std::vector<Picks> current_tokens_;
  int64_t next_ = 0;  // ring position of the next step
  int64_t kept_ = 0;
  int64_t steps_ = 0;
  std::vector<double> balance_history_;  // ring of 1000 per-step values
  std::vector<double> byte_balance_history_;
  std::vector<int64_t> last_expert_;  // [layer][expert]
  std::vector<double> last_slot_;     // [layer][slot]
  std::vector<double> last_rank_;     // [layer][rank]
};

}  // namespace epmoe
