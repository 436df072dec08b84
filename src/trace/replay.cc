#include "epmoe/replay.h"

#include <fmt/format.h>

namespace epmoe {

Result<std::unique_ptr<PicksReplay>> PicksReplay::Open(const std::string& path, const LoadReadOptions& options,
                                                       const ModelConfig& model) {
  std::unique_ptr<PicksReplay> replay(new PicksReplay());
  replay->path_ = path;
  replay->options_ = options;
  replay->model_ = model;
  EPMOE_ASSIGN_OR_RETURN(replay->reader_, TraceReader::Open(path, options));
  const TraceInfo& info = replay->reader_->info();
  if (!info.has_picks)
    return InvalidArgument(fmt::format("{}: holds per-expert counts only; replay needs each row's picks", path));
  if (info.num_experts > model.num_experts || info.top_k != model.top_k)
    return InvalidArgument(fmt::format(
        "{}: the trace has {} experts and top-{}, the model {} has {} experts and top-{}; give a model (a .json "
        "preset) with the trace's shape",
        path, info.num_experts, info.top_k, model.name, model.num_experts, model.top_k));
  if (info.num_steps == 0) return InvalidArgument(fmt::format("{}: the trace has no steps", path));
  return replay;
}

Result<int64_t> PicksReplay::NextStep() {
  EPMOE_ASSIGN_OR_RETURN(bool more, reader_->Next(&step_));
  if (!more) {
    if (steps_read_ == 0) return InvalidArgument(fmt::format("{}: the trace has no steps", path_));
    EPMOE_ASSIGN_OR_RETURN(reader_, TraceReader::Open(path_, options_));
    EPMOE_ASSIGN_OR_RETURN(more, reader_->Next(&step_));
    if (!more) return IoError(fmt::format("{}: no step on reading it again", path_));
  }
  ++steps_read_;
  return step_.layers.empty() ? int64_t{0} : step_.layers[0].rows;
}

Picks PicksReplay::LayerPicks(int layer) const {
  Picks picks = step_.layers[layer % static_cast<int>(step_.layers.size())];
  if (picks.weights.empty()) {
    picks.weights.assign(picks.experts.size(), static_cast<float>(model_.routed_scaling / model_.top_k));
  }
  return picks;
}

}  // namespace epmoe
