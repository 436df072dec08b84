// `epmoe run`'s placement flags: live rebalancing of the a2a and whole executors (--eplb), the
// placement a run starts from (--placement) and the load it records (--record-load); and the
// report of a rebalancing run. Used by cmd_run.cc only.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/engine.h"
#include "epmoe/executor.h"
#include "epmoe/model.h"
#include "epmoe/rebalancer.h"

namespace epmoe::cli {

struct EplbRunOptions {
  bool enabled = false;
  int64_t interval = 20;  // steps between looks of the trigger
  std::string trigger = "interval";
  double threshold = 0.8;
  int64_t payback_steps = 1000;
  int window = 0;            // recorder window in steps (0: the interval)
  int layers_per_chunk = 0;  // 0: all layers at once
  bool async = false;
  std::string policy = "deepseek";
  int redundant = 0;
  double move_gbps = 10;          // payback: bytes moved per second, in GB/s
  double roll_call_seconds = 10;  // after a timed-out exchange: rank 0's wait for the others' answers
  std::string metrics_file;
  std::string placement_file;        // --placement: the placement the run starts from
  std::string record_load;           // --record-load: where the recorded load is written
  std::string record_mode = "stat";  // --eplb-record
};

void AddEplbOptions(CLI::App* command, EplbRunOptions* options);

// Fills the engine's placement, rebalancing and recording options from the flags: refuses --eplb
// and --placement with options whose experts follow no placement, and bad values; the initial
// placement is --placement's file (checked against the model, ranks and nodes) or the trivial one
// with --eplb-redundant copies.
Status SetEplbEngineOptions(const EplbRunOptions& options, const ModelConfig& model, int layers,
                            const Communicator& comm, const std::vector<EpOption>& run_options, EngineOptions* out);

// One option's rebalancing over a run: what its steps did, and the rebalancer's reports.
class EplbReport {
 public:
  explicit EplbReport(const EplbRunOptions& options) : options_(options) {}
  void Add(const StepReport& step);
  // {"rebalances": [...], "bytes_moved_total", "balancedness_per_step", "wall_ms_per_step", ...}
  nlohmann::json Report(const Rebalancer& rebalancer) const;

 private:
  EplbRunOptions options_;
  double boundary_seconds_ = 0;  // this rank's time in step boundaries
  std::vector<double> balance_;  // picks balancedness per step
  // This rank's wall time from the end of one step to the end of the next (the step, its
  // bookkeeping and the rebalancing boundary: what a caller waits per step).
  std::chrono::steady_clock::time_point last_step_end_ = std::chrono::steady_clock::now();
  std::vector<double> wall_ms_;
};

// Text lines for one option's "eplb" object.
void PrintEplbText(const nlohmann::json& eplb);

}  // namespace epmoe::cli
