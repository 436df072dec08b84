#include "run_eplb.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "output.h"

namespace epmoe::cli {

void AddEplbOptions(CLI::App* cmd, EplbRunOptions* o) {
  cmd->add_flag("--eplb", o->enabled,
                "Rebalance live: record the picks, place the experts anew from the load window summed over ranks and "
                "install the placement while steps run (a2a and whole)");
  cmd->add_option("--eplb-interval", o->interval, "Steps between looks of the rebalance trigger")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--eplb-trigger", o->trigger,
                  "interval: every look; threshold: when the window's balancedness is below --eplb-threshold; "
                  "payback: when the predicted saving repays the move within --eplb-payback-steps")
      ->check(CLI::IsMember({"interval", "threshold", "payback"}))
      ->capture_default_str();
  cmd->add_option("--eplb-threshold", o->threshold,
                  "threshold trigger: balancedness (mean/max picks per rank) below "
                  "which to rebalance, in (0, 1]")
      ->capture_default_str();
  cmd->add_option("--eplb-payback-steps", o->payback_steps, "payback trigger: steps the move must be repaid in")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--eplb-window", o->window, "Steps of load the policy places from (0: the interval)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--eplb-layers-per-chunk", o->layers_per_chunk,
                  "Layers switched per step boundary, so steps keep running between chunks (0: all at once)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_flag("--eplb-async", o->async,
                "Move the copies in the background (nonblocking exchanges) and switch a chunk once every rank has it");
  std::vector<std::string> policies;
  for (Policy p : AllPolicies()) policies.push_back(PolicyName(p));
  cmd->add_option("--eplb-policy", o->policy, "Placement policy")
      ->check(CLI::IsMember(policies))
      ->capture_default_str();
  cmd->add_option("--eplb-redundant", o->redundant, "Redundant expert copies per layer (E + R slots over the ranks)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--eplb-move-gbps", o->move_gbps, "payback trigger: GB/s the weight move is priced at")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--eplb-roll-call-seconds", o->roll_call_seconds,
                  "After a rebalancing exchange timed out (--comm-timeout): how long rank 0 waits for the other ranks "
                  "to answer the roll call that names the ones that stopped")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--metrics-file", o->metrics_file,
                  "With --eplb: rewrite this Prometheus text file (atomically) after every step (rank 0)");
  cmd->add_option("--placement", o->placement_file,
                  "Start from this placement (a2a and whole), as `epmoe balance --out` writes it; it must fit the "
                  "model's experts, --layers, the ranks, the nodes and --eplb-redundant");
  cmd->add_option("--record-load", o->record_load,
                  "Write the load the run recorded (rank 0) as an epmoe trace that `epmoe balance --trace` reads "
                  "(one option)");
  cmd->add_option("--eplb-record", o->record_mode,
                  "What is recorded: stat (one step, the sum over the run), per-step (picks per expert each step) or "
                  "per-token (each row's picks)")
      ->check(CLI::IsMember({"stat", "per-step", "per-token"}))
      ->capture_default_str();
}

Status SetEplbEngineOptions(const EplbRunOptions& o, const ModelConfig& model, int layers, const Communicator& comm,
                            const std::vector<EpOption>& run_options, EngineOptions* out) {
  if (!o.metrics_file.empty() && !o.enabled) return InvalidArgument("--metrics-file needs --eplb");
  const bool placed = o.enabled || !o.placement_file.empty();
  for (EpOption option : run_options)
    if (placed && option != EpOption::kA2a && option != EpOption::kWhole)
      return InvalidArgument(fmt::format("{} the a2a and whole options, not {} (use --option a2a or --option whole)",
                                         o.enabled ? "--eplb rebalances" : "--placement places the experts of",
                                         EpOptionName(option)));
  if (!o.record_load.empty() && run_options.size() != 1)
    return InvalidArgument("--record-load records one option's run: name one --option");
  if (!(o.threshold > 0 && o.threshold <= 1))
    return InvalidArgument(fmt::format("--eplb-threshold {} must be in (0, 1]", o.threshold));
  if ((model.num_experts + o.redundant) % comm.size() != 0)
    return InvalidArgument(fmt::format("--eplb-redundant {}: {} experts + {} copies do not divide over {} ranks",
                                       o.redundant, model.num_experts, o.redundant, comm.size()));
  if (!o.placement_file.empty()) {
    EPMOE_ASSIGN_OR_RETURN(Placement p, ReadPlacementFile(o.placement_file));
    auto differs = [&](const char* field, int64_t has, int64_t wants) -> Status {
      if (has == wants) return Status::Ok();
      return InvalidArgument(
          fmt::format("--placement {}: {} is {}, the run needs {}", o.placement_file, field, has, wants));
    };
    EPMOE_RETURN_IF_ERROR(differs("num_experts", p.num_experts(), model.num_experts));
    EPMOE_RETURN_IF_ERROR(differs("num_layers", p.num_layers(), layers));
    EPMOE_RETURN_IF_ERROR(differs("num_ranks", p.num_ranks(), comm.size()));
    EPMOE_RETURN_IF_ERROR(differs("num_nodes", p.num_nodes(), comm.num_nodes()));
    EPMOE_RETURN_IF_ERROR(
        differs("num_slots (experts + --eplb-redundant)", p.num_slots(), model.num_experts + o.redundant));
    out->executor.placement = std::make_shared<const Placement>(std::move(p));
  } else if (o.enabled || o.redundant > 0) {
    EPMOE_ASSIGN_OR_RETURN(Placement p,
                           Placement::Trivial(layers, model.num_experts, o.redundant, comm.size(), comm.num_nodes()));
    out->executor.placement = std::make_shared<const Placement>(std::move(p));
  }
  out->record_load_path = o.record_load;
  EPMOE_ASSIGN_OR_RETURN(out->recorder.mode, ParseRecorderMode(o.record_mode));
  out->recorder.window_steps = static_cast<int>(o.window > 0 ? o.window : std::min<int64_t>(o.interval, 100000));
  if (!o.enabled) return Status::Ok();
  out->rebalance = true;
  out->metrics_file = o.metrics_file;
  RebalancerOptions& ro = out->rebalancer;
  EPMOE_ASSIGN_OR_RETURN(ro.trigger.mode, ParseTriggerMode(o.trigger));
  ro.trigger.interval_steps = o.interval;
  ro.trigger.threshold = o.threshold;
  ro.trigger.payback_steps = o.payback_steps;
  EPMOE_ASSIGN_OR_RETURN(ro.policy.policy, ParsePolicy(o.policy));
  ro.layers_per_chunk = o.layers_per_chunk;
  ro.async = o.async;
  ro.move_bytes_per_second = o.move_gbps * 1e9;
  ro.roll_call_seconds = o.roll_call_seconds;
  return Status::Ok();
}

void EplbReport::Add(const StepReport& step) {
  const auto end = std::chrono::steady_clock::now();
  boundary_seconds_ += step.boundary_seconds;
  wall_ms_.push_back(std::chrono::duration<double, std::milli>(end - last_step_end_).count());
  last_step_end_ = end;
  balance_.push_back(step.picks_balancedness);
}

nlohmann::json EplbReport::Report(const Rebalancer& rebalancer) const {
  nlohmann::json list = nlohmann::json::array();
  for (const RebalanceReport& r : rebalancer.reports()) {
    list.push_back({{"decided_at_step", r.decided_at_step},
                    {"placement_ready_at_step", r.placement_ready_at_step},
                    {"installed_at_step", r.installed_at_step},
                    {"policy", r.policy},
                    {"chunks", r.chunks},
                    {"rounds", r.rounds},
                    {"remote_copies", r.remote_copies},
                    {"local_copies", r.local_copies},
                    {"inter_node_copies", r.inter_node_copies},
                    {"bytes_moved", r.bytes_moved},
                    {"bytes_sent_by_rank", r.bytes_sent_by_rank},
                    {"bytes_received_by_rank", r.bytes_received_by_rank},
                    {"bytes_sent_by_node", r.bytes_sent_by_node},
                    {"bytes_received_by_node", r.bytes_received_by_node},
                    {"balancedness_before", r.balancedness_before},
                    {"balancedness_after", r.balancedness_after},
                    {"compute_ms", r.compute_seconds * 1e3},
                    {"stall_ms_max_rank", r.stall_seconds_max * 1e3}});
  }
  // Balancedness of the steps' picks over the run: first and last quarter.
  auto mean_of = [&](size_t begin, size_t end) {
    double sum = 0;
    for (size_t i = begin; i < end; ++i) sum += balance_[i];
    return end > begin ? sum / static_cast<double>(end - begin) : 1.0;
  };
  const size_t quarter = std::max<size_t>(1, balance_.size() / 4);
  return {{"trigger", options_.trigger},
          {"interval", options_.interval},
          {"policy", options_.policy},
          {"redundant", options_.redundant},
          {"layers_per_chunk", options_.layers_per_chunk},
          {"async", options_.async},
          {"rebalances", list},
          {"bytes_moved_total", rebalancer.bytes_moved_total()},
          {"boundary_ms_this_rank", boundary_seconds_ * 1e3},
          {"balancedness_first_quarter", mean_of(0, std::min(quarter, balance_.size()))},
          {"balancedness_last_quarter", mean_of(balance_.size() - std::min(quarter, balance_.size()), balance_.size())},
          {"balancedness_per_step", balance_},
          {"wall_ms_per_step", wall_ms_}};
}

void PrintEplbText(const nlohmann::json& e) {
  std::printf(
      "  eplb (%s trigger, looks every %lld steps, %s, R = %d, %s%s): %zu rebalance(s), %s moved; picks balancedness "
      "%.3f in "
      "the first quarter, %.3f in the last\n",
      e["trigger"].get<std::string>().c_str(), static_cast<long long>(e["interval"].get<int64_t>()),
      e["policy"].get<std::string>().c_str(), e["redundant"].get<int>(),
      e["layers_per_chunk"].get<int>() > 0
          ? fmt::format("{} layer(s) per chunk", e["layers_per_chunk"].get<int>()).c_str()
          : "all layers at once",
      e["async"].get<bool>() ? ", async" : "", e["rebalances"].size(),
      HumanBytes(e["bytes_moved_total"].get<int64_t>()).c_str(), e["balancedness_first_quarter"].get<double>(),
      e["balancedness_last_quarter"].get<double>());
  for (const auto& r : e["rebalances"]) {
    std::printf(
        "    step %lld -> %lld: %lld copies sent between ranks (%s), %lld copied locally, balancedness %.3f -> "
        "%.3f (window), stall %.2f ms (slowest rank), placement %.2f ms\n",
        static_cast<long long>(r["decided_at_step"].get<int64_t>()),
        static_cast<long long>(r["installed_at_step"].get<int64_t>()),
        static_cast<long long>(r["remote_copies"].get<int64_t>()), HumanBytes(r["bytes_moved"].get<int64_t>()).c_str(),
        static_cast<long long>(r["local_copies"].get<int64_t>()), r["balancedness_before"].get<double>(),
        r["balancedness_after"].get<double>(), r["stall_ms_max_rank"].get<double>(), r["compute_ms"].get<double>());
  }
}

}  // namespace epmoe::cli
