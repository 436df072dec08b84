// RebalanceTrigger: decides at a step boundary whether to compute and install a new placement.
//
//   interval   every `interval_steps` steps;
//   threshold  when the windowed balancedness (mean/max picks per rank, 1 = perfect) falls below
//              `threshold`, checked every `interval_steps` steps;
//   payback    when the cost model predicts that the time saved per step repays the weight
//              movement within `payback_steps` steps: saved_us_per_step * payback_steps > move_us,
//              checked every `interval_steps` steps.
// In every mode a rebalance needs at least `min_steps_between` steps since the previous one (the
// recorder needs fresh data). Thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "epmoe/status.h"

namespace epmoe {

enum class TriggerMode { kInterval, kThreshold, kPayback };
const char* TriggerModeName(TriggerMode mode);
Result<TriggerMode> ParseTriggerMode(std::string_view name);

struct TriggerOptions {
  TriggerMode mode = TriggerMode::kInterval;
  int64_t interval_steps = 100;    // how often the trigger looks (> 0)
  double threshold = 0.8;          // threshold mode: rebalance below this balancedness, in (0, 1]
  int64_t payback_steps = 1000;    // payback mode: movement must be repaid within this many steps (> 0)
  int64_t min_steps_between = 1;   // at least this many steps between two rebalances (>= 1)
};
Status ValidateTriggerOptions(const TriggerOptions& options);

// What the caller knows at a step boundary; fields a mode does not use may be left at 0.
struct TriggerInput {
  int64_t step = 0;                   // steps completed so far
  double windowed_balancedness = 1;   // threshold mode
  double predicted_saved_us_per_step = 0;  // payback mode: current minus predicted step time
  double predicted_move_us = 0;            // payback mode: time to move the changed copies
};

class RebalanceTrigger {
 public:
  explicit RebalanceTrigger(const TriggerOptions& options) : options_(options) {}

  // True when a rebalance should start now. Does not record it: call Rebalanced() when one ran.
  bool ShouldRebalance(const TriggerInput& input) const;
  // Whether this step is one at which the mode looks at all (callers skip computing inputs otherwise).
  bool ChecksAt(int64_t step) const;
  void Rebalanced(int64_t step) { last_rebalance_step_ = step; }

 private:
  TriggerOptions options_;
  int64_t last_rebalance_step_ = 0;
};

}  // namespace epmoe
