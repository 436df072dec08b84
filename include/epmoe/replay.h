// PicksReplay: a routing trace's picks, step after step, as the router's output for a model.
//
// Used by `epmoe layer` (`epmoe run` replays through TraceRouting, engine.h): run step s takes
// trace step s (wrapping around to the first step after the last), and MoE layer l takes trace
// layer l mod the trace's layers. A
// trace with fewer experts than the model is accepted (its ids are valid expert ids); its top-k must
// equal the model's. Picks without router weights get 1/k each times the routed scaling factor.
// Not thread-safe.
#pragma once

#include <memory>
#include <string>

#include "epmoe/model.h"
#include "epmoe/router.h"
#include "epmoe/trace.h"

namespace epmoe {

class PicksReplay {
 public:
  // Opens the trace and checks it against the model; errors name the trace and both shapes.
  static Result<std::unique_ptr<PicksReplay>> Open(const std::string& path, const LoadReadOptions& options,
                                                   const ModelConfig& model);

  // Moves to the next step (the first call moves to step 0); returns the step's row count.
  Result<int64_t> NextStep();
  // Picks of MoE layer `layer` in the current step.
  Picks LayerPicks(int layer) const;

  const TraceInfo& info() const { return reader_->info(); }

 private:
  PicksReplay() = default;
  std::string path_;
  LoadReadOptions options_;
  ModelConfig model_;
  std::unique_ptr<TraceReader> reader_;
  StepPicks step_;
  int64_t steps_read_ = 0;
};

}  // namespace epmoe
