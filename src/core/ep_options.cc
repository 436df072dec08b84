#include "epmoe/ep_options.h"

#include "epmoe/enum_names.h"

namespace epmoe {
namespace {
constexpr EnumNames<EpOption, 5> kEpOptions("option", {{{EpOption::kSliced, "sliced"},
                                                        {EpOption::kWhole, "whole"},
                                                        {EpOption::kHybrid, "hybrid"},
                                                        {EpOption::kA2a, "a2a"},
                                                        {EpOption::kDwdp, "dwdp"}}});
constexpr EnumNames<A2aMode, 3> kA2aModes(
    "a2a mode", {{{A2aMode::kNormal, "normal"}, {A2aMode::kLowLatency, "low-latency"}, {A2aMode::kAuto, "auto"}}});
constexpr EnumNames<A2aProgress, 3> kA2aProgress(
    "a2a progress", {{{A2aProgress::kWait, "wait"}, {A2aProgress::kPoll, "poll"}, {A2aProgress::kThread, "thread"}}});
constexpr EnumNames<RowOrigin, 2> kRowOrigins("row origin", {{{RowOrigin::kDataParallel, "data-parallel"},
                                                              {RowOrigin::kTensorParallel, "tensor-parallel"}}});
constexpr EnumNames<SharedMode, 3> kSharedModes("shared expert mode", {{{SharedMode::kDefault, "default"},
                                                                        {SharedMode::kSliced, "sliced"},
                                                                        {SharedMode::kCopied, "copied"}}});
constexpr EnumNames<A2aLevels, 3> kA2aLevels(
    "a2a levels", {{{A2aLevels::kAuto, "auto"}, {A2aLevels::kFlat, "flat"}, {A2aLevels::kTwoLevel, "two-level"}}});
}  // namespace

const char* EpOptionName(EpOption option) {
  return kEpOptions.Name(option);
}
std::vector<EpOption> AllEpOptions() {
  return kEpOptions.All();
}
Result<EpOption> ParseEpOption(std::string_view name) {
  return kEpOptions.Parse(name, {{"1", EpOption::kSliced},
                                 {"2", EpOption::kWhole},
                                 {"3", EpOption::kHybrid},
                                 {"4", EpOption::kA2a},
                                 {"5", EpOption::kDwdp},
                                 {"rows", EpOption::kA2a},
                                 {"weights", EpOption::kDwdp}});
}
int EpOptionNumber(EpOption option) {
  return static_cast<int>(option) + 1;
}
bool GathersRows(EpOption option) {
  return option == EpOption::kSliced || option == EpOption::kWhole || option == EpOption::kHybrid;
}

const char* A2aModeName(A2aMode mode) {
  return kA2aModes.Name(mode);
}
Result<A2aMode> ParseA2aMode(std::string_view name) {
  return kA2aModes.Parse(name, {{"low_latency", A2aMode::kLowLatency}});
}

const char* A2aProgressName(A2aProgress progress) {
  return kA2aProgress.Name(progress);
}
Result<A2aProgress> ParseA2aProgress(std::string_view name) {
  return kA2aProgress.Parse(name);
}

const char* RowOriginName(RowOrigin origin) {
  return kRowOrigins.Name(origin);
}
Result<RowOrigin> ParseRowOrigin(std::string_view name) {
  return kRowOrigins.Parse(name, {{"dp", RowOrigin::kDataParallel}, {"tp", RowOrigin::kTensorParallel}});
}

const char* SharedModeName(SharedMode mode) {
  return kSharedModes.Name(mode);
}
Result<SharedMode> ParseSharedMode(std::string_view name) {
  return kSharedModes.Parse(name, {{"auto", SharedMode::kDefault}});
}
bool SharedIsSliced(EpOption option, SharedMode mode) {
  return mode == SharedMode::kDefault ? GathersRows(option) : mode == SharedMode::kSliced;
}

const char* A2aLevelsName(A2aLevels levels) {
  return kA2aLevels.Name(levels);
}
Result<A2aLevels> ParseA2aLevels(std::string_view name) {
  return kA2aLevels.Parse(name);
}
bool UsesTwoLevels(A2aLevels levels, int num_ranks, int num_nodes) {
  if (levels == A2aLevels::kAuto) return num_nodes > 1 && num_nodes < num_ranks;
  return levels == A2aLevels::kTwoLevel;
}

}  // namespace epmoe
