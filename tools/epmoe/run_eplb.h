// `epmoe run --eplb`: live rebalancing of the a2a and whole executors during a run (the flags, the
// initial placement with its redundant slots, and one Rebalancer per run with its recorder, report
// and metrics file). Used by cmd_run.cc only.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/model.h"
#include "epmoe/rebalancer.h"

namespace epmoe::cli {

struct EplbRunOptions {
  bool enabled = false;
  int64_t interval = 20;            // steps between looks of the trigger
  std::string trigger = "interval";
  double threshold = 0.8;
  int64_t payback_steps = 1000;
  int window = 0;                   // recorder window in steps (0: the interval)
  int layers_per_chunk = 0;         // 0: all layers at once
  bool async = false;
  std::string policy = "deepseek";
  int redundant = 0;
  double move_gbps = 10;            // payback: bytes moved per second, in GB/s
  double roll_call_seconds = 10;    // after a timed-out exchange: rank 0's wait for the others' answers
  std::string metrics_file;
};

void AddEplbOptions(CLI::App* command, EplbRunOptions* options);

// Refuses --eplb with options whose experts do not follow a placement, and bad values; returns
// the placement the executors start from (the trivial one with the redundant slots).
Result<PlacementPtr> EplbInitialPlacement(const EplbRunOptions& options, const ModelConfig& model, int layers,
                                          const Communicator& comm, const std::vector<EpOption>& run_options);

// One rebalancing run of one executor. Not thread-safe.
class EplbSession {
 public:
  static Result<std::unique_ptr<EplbSession>> Create(Communicator& comm, const EplbRunOptions& options,
                                                     const ModelConfig& model, MoeExecutor& executor,
                                                     PlacementPtr initial);
  // This rank's rows' picks of one layer (tensor-parallel rows: every rank passes all rows and
  // records its data-parallel share, so the sum over ranks counts each row once).
  Status Record(int layer, const Picks& picks, bool tensor_parallel);
  // After step `steps_done` (counted from 1): the step's wall seconds (slowest rank), the stages'
  // seconds and the picks balancedness of the step (all ranks' figures). Collective.
  Status EndStep(int64_t steps_done, double step_seconds, const std::vector<std::pair<std::string, double>>& stages,
                 double picks_balancedness);
  // {"rebalances": [...], "bytes_moved_total", "balancedness_per_step", "wall_ms_per_step", ...}
  nlohmann::json Report() const;

 private:
  EplbSession(Communicator& comm, const EplbRunOptions& options) : comm_(comm), options_(options) {}
  Communicator& comm_;
  EplbRunOptions options_;
  std::unique_ptr<Rebalancer> rebalancer_;
  std::optional<LoadRecorder> recorder_;
  std::optional<RebalanceMetrics> metrics_;  // rank 0 with --metrics-file
  size_t reported_ = 0;                       // rebalances already in the metrics
  double boundary_seconds_ = 0;               // this rank's time in step boundaries
  double windowed_balancedness_ = 1;          // at the trigger's last look
  std::vector<double> balance_;               // picks balancedness per step
  // This rank's wall time from the end of one step's boundary to the end of the next (the step,
  // its bookkeeping and the rebalancing boundary: what a caller waits per step).
  std::chrono::steady_clock::time_point last_step_end_ = std::chrono::steady_clock::now();
  std::vector<double> wall_ms_;
};

// Text lines for one option's "eplb" object.
void PrintEplbText(const nlohmann::json& eplb);

}  // namespace epmoe::cli
