#include "epmoe/rebalance_trigger.h"

#include <fmt/format.h>

#include "epmoe/enum_names.h"

namespace epmoe {

namespace {
constexpr EnumNames<TriggerMode, 3> kTriggerModes("rebalance trigger", {{{TriggerMode::kInterval, "interval"},
                                                                         {TriggerMode::kThreshold, "threshold"},
                                                                         {TriggerMode::kPayback, "payback"}}});
}  // namespace

const char* TriggerModeName(TriggerMode mode) {
  return kTriggerModes.Name(mode);
}
Result<TriggerMode> ParseTriggerMode(std::string_view name) {
  return kTriggerModes.Parse(name);
}

Status ValidateTriggerOptions(const TriggerOptions& o) {
  if (o.interval_steps <= 0)
    return InvalidArgument(fmt::format("rebalance interval {} must be positive", o.interval_steps));
  if (!(o.threshold > 0 && o.threshold <= 1))
    return InvalidArgument(fmt::format("rebalance threshold {} must be in (0, 1]", o.threshold));
  if (o.payback_steps <= 0)
    return InvalidArgument(fmt::format("rebalance payback steps {} must be positive", o.payback_steps));
  if (o.min_steps_between < 1)
    return InvalidArgument(fmt::format("steps between rebalances {} must be at least 1", o.min_steps_between));
  return Status::Ok();
}

bool RebalanceTrigger::ChecksAt(int64_t step) const { return step > 0 && step % options_.interval_steps == 0; }

bool RebalanceTrigger::ShouldRebalance(const TriggerInput& in) const {
  if (!ChecksAt(in.step) || in.step - last_rebalance_step_ < options_.min_steps_between) return false;
  switch (options_.mode) {
    case TriggerMode::kInterval: return true;
    case TriggerMode::kThreshold: return in.windowed_balancedness < options_.threshold;
    case TriggerMode::kPayback:
      return in.predicted_saved_us_per_step > 0 &&
             in.predicted_saved_us_per_step * static_cast<double>(options_.payback_steps) > in.predicted_move_us;
  }
  return false;
}

}  // namespace epmoe
