// `epmoe run`: MoE layers across the ranks of an MPI job (start it under mpirun; one process is a
// world of one rank). Runs one option, or every option on identical inputs, and rank 0 prints the
// per-step median and p90 time, the stage breakdown, traffic and balance side by side.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "epmoe/comm.h"
#include "epmoe/engine.h"
#include "epmoe/executor.h"
#include "epmoe/load_figures.h"
#include "epmoe/statistics.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "output.h"
#include "run_eplb.h"
#include "system_memory.h"
#include "weights_option.h"

namespace epmoe::cli {
namespace {

struct RunOptions {
  std::string model = "qwen3-30b-a3b";
  std::vector<std::string> options = {"a2a"};  // in the order given; "all" alone for every option
  int64_t tokens = 64;
  int steps = 5;
  int warmup = 0;  // the first steps, left out of every figure
  int layers = 2;
  std::string routing = "uniform";
  std::string trace;
  std::string origin = "data-parallel";
  int tp_in_ep = 0;
  std::string dispatch_format = "bf16";
  std::string combine_format = "bf16";
  bool partial_sums = false;
  bool tbo = false;
  bool sbo = false;
  std::string a2a_mode = "normal";
  std::string a2a_levels = "auto";
  std::string a2a_progress = "wait";
  std::string weight_format = "fp32";
  std::string isa = "auto";
  std::string weights;
  std::string shared = "default";
  double max_buffer_mb = 1024;
  int ranks_per_node = 0;
  double comm_timeout = 600;
  double max_memory_gb = 0;
  int threads = 1;
  int hidden = 0;
  int intermediate = 0;
  uint64_t seed = 1;
  bool check = false;
  bool no_progress = false;
  bool interleave = false;
  std::string format = "text";
  EplbRunOptions eplb;
};

class ProgressBar {
 public:
  ProgressBar(bool enabled, int64_t total) : enabled_(enabled && isatty(STDERR_FILENO)), total_(total) {}
  ~ProgressBar() {
    if (shown_) std::fprintf(stderr, "\r%*s\r", 72, "");
  }
  void Update(int64_t done, const std::string& what) {
    if (!enabled_) return;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (seconds < 2.0) return;  // short runs print nothing
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * done / std::max<int64_t>(1, total_));
    std::fprintf(stderr, "\r[%s%s] %3d%% %-30s", std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, ' ').c_str(), static_cast<int>(100 * done / std::max<int64_t>(1, total_)),
                 what.c_str());
    std::fflush(stderr);
    shown_ = true;
  }

 private:
  bool enabled_;
  int64_t total_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

struct OptionResult {
  std::string name, description, refused;
  std::string a2a_mode;  // a2a: the mode that ran (normal or low-latency)
  std::vector<double> step_ms;
  std::vector<std::vector<double>> stage_ms = std::vector<std::vector<double>>(kNumStages);  // [stage][step]
  double copies_per_row = 0, picks_balance = 0, bytes_balance = 0, peak_buffer = 0, rounds = 0, max_error = 0;
  double sent_per_rank_step = 0, received_per_rank_step = 0;
  double inter_node_sent_per_rank_step = 0, inter_node_received_per_rank_step = 0;
  int64_t resident_bytes = 0;
  nlohmann::json eplb;  // with --eplb
};

// The executor options of `option` on `ranks` ranks: hybrid slices each expert --tp-in-ep ways
// (default 2 when G is even), the others ignore that flag; a2a and dwdp copy the shared expert.
ExecutorOptions OptionExecutorOptions(const ExecutorOptions& base, const RunOptions& o, EpOption option, int ranks) {
  ExecutorOptions eo = base;
  eo.option = option;
  eo.single_batch_overlap = o.sbo && option == EpOption::kA2a;  // the other options have no dispatch to hide it in
  if (option != EpOption::kA2a) eo.a2a_progress = A2aProgress::kWait;
  if (option == EpOption::kHybrid) {
    eo.tp_in_ep = o.tp_in_ep > 0 ? o.tp_in_ep : (ranks % 2 == 0 && ranks > 1 ? 2 : 1);
  } else if (o.tp_in_ep > 0) {
    eo.tp_in_ep = 1;
  }
  if (option == EpOption::kA2a || option == EpOption::kDwdp) eo.shared = SharedMode::kDefault;
  return eo;
}

// One option's engine over the steps, and the sums its step reports add up to. Steps of different
// options may alternate (--interleave) because each run keeps its own engine.
class OptionRun {
 public:
  static Result<std::unique_ptr<OptionRun>> Start(Communicator& comm, const RunOptions& o, const ModelConfig& model,
                                                  const EngineOptions& options, ThreadPool& pool,
                                                  OptionResult* result) {
    auto run = std::unique_ptr<OptionRun>(new OptionRun(comm, o, model, result));
    EPMOE_ASSIGN_OR_RETURN(run->engine_, Engine::Create(comm, model, options, pool));
    result->description = run->engine_->executor().description();
    if (options.two_batch_overlap) result->description += ", two micro-batches at once (--tbo)";
    if (options.executor.single_batch_overlap) result->description += ", shared expert during the dispatch (--sbo)";
    EPMOE_ASSIGN_OR_RETURN(result->resident_bytes, comm.AllreduceMax(run->engine_->executor().resident_weight_bytes()));
    if (options.rebalance) run->eplb_.emplace(o.eplb);
    run->tensor_parallel_ = options.executor.origin == RowOrigin::kTensorParallel;
    return run;
  }

  // A step left out of every figure (--warmup): it pays the one-time costs (first touches of the
  // buffers, connections opening) that would otherwise weigh on the timed steps.
  Status Warm(int step, const Routing& routing, int64_t tokens) { return RunStep(step, routing, tokens).status(); }

  Status Step(int step, const Routing& routing, int64_t tokens) {
    EPMOE_ASSIGN_OR_RETURN(const StepReport report, RunStep(step, routing, tokens));
    result_->step_ms.push_back(report.seconds * 1e3);
    for (int s = 0; s < kNumStages; ++s) result_->stage_ms[s].push_back(report.stage_seconds[s] * 1e3);
    rows_ += static_cast<double>(report.rows);
    copies_ += report.copies_per_row * static_cast<double>(report.rows);
    sent_ += static_cast<double>(report.bytes_sent);
    received_ += static_cast<double>(report.bytes_received);
    inter_node_sent_ += static_cast<double>(report.inter_node_bytes_sent);
    inter_node_received_ += static_cast<double>(report.inter_node_bytes_received);
    picks_balance_ += report.picks_balancedness;
    bytes_balance_ += report.bytes_balancedness;
    result_->peak_buffer = std::max(result_->peak_buffer, static_cast<double>(report.peak_buffer_bytes));
    result_->rounds = std::max(result_->rounds, static_cast<double>(report.rounds));
    result_->max_error = std::max(result_->max_error, report.max_error);
    if (eplb_) eplb_->Add(report);
    ++steps_;
    return Status::Ok();
  }

  Status Finish() {
    const int g = comm_.size();
    if (eplb_) result_->eplb = eplb_->Report(*engine_->rebalancer());
    result_->copies_per_row = rows_ > 0 ? copies_ / rows_ : 0;
    result_->sent_per_rank_step = steps_ ? sent_ / g / steps_ : 0;
    result_->received_per_rank_step = steps_ ? received_ / g / steps_ : 0;
    result_->inter_node_sent_per_rank_step = steps_ ? inter_node_sent_ / g / steps_ : 0;
    result_->inter_node_received_per_rank_step = steps_ ? inter_node_received_ / g / steps_ : 0;
    result_->picks_balance = steps_ ? picks_balance_ / steps_ : 1;
    result_->bytes_balance = steps_ ? bytes_balance_ / steps_ : 1;
    return engine_->Close();
  }

 private:
  OptionRun(Communicator& comm, const RunOptions& o, const ModelConfig& model, OptionResult* result)
      : comm_(comm), o_(o), model_(model), result_(result) {}

  Result<StepReport> RunStep(int step, const Routing& routing, int64_t tokens) {
    const int g = comm_.size(), me = comm_.rank();
    const int64_t first = tensor_parallel_ ? 0 : RowBegin(tokens, g, me);
    const int64_t count = tensor_parallel_ ? tokens : RowBegin(tokens, g, me + 1) - first;
    Matrix x = SyntheticRows(o_.seed, model_, step, first, count);
    return engine_->Step(&x, first, routing);
  }

  Communicator& comm_;
  const RunOptions& o_;
  const ModelConfig& model_;
  OptionResult* result_;
  std::unique_ptr<Engine> engine_;
  std::optional<EplbReport> eplb_;
  bool tensor_parallel_ = false;  // every rank holds every row
  double copies_ = 0, rows_ = 0, sent_ = 0, received_ = 0, picks_balance_ = 0, bytes_balance_ = 0;
  double inter_node_sent_ = 0, inter_node_received_ = 0;
  int steps_ = 0;
};

Status Run(const RunOptions& o, nlohmann::json* report, bool* is_root) {
  CommOptions co;
  co.ranks_per_node = o.ranks_per_node;
  co.timeout_seconds = o.comm_timeout;
  EPMOE_ASSIGN_OR_RETURN(auto comm, WorldCommunicator(co));
  *is_root = comm->rank() == 0;
  const int g = comm->size();
  EPMOE_ASSIGN_OR_RETURN(const ModelConfig model, LoadCommandModel(o.model, o.hidden, o.intermediate, o.layers));
  if (!o.trace.empty() && o.routing != "uniform")
    return InvalidArgument("--trace replays the trace's picks; do not combine it with --routing");
  ExecutorOptions base;
  base.num_layers = o.layers;
  EPMOE_ASSIGN_OR_RETURN(base.origin, ParseRowOrigin(o.origin));
  EPMOE_ASSIGN_OR_RETURN(base.dispatch_format, ParseRowFormat(o.dispatch_format));
  EPMOE_ASSIGN_OR_RETURN(base.combine_format, ParseRowFormat(o.combine_format));
  base.combine_partial_sums = o.partial_sums;
  EPMOE_ASSIGN_OR_RETURN(base.a2a_mode, ParseA2aMode(o.a2a_mode));
  EPMOE_ASSIGN_OR_RETURN(base.a2a_levels, ParseA2aLevels(o.a2a_levels));
  EPMOE_ASSIGN_OR_RETURN(base.a2a_progress, ParseA2aProgress(o.a2a_progress));
  EPMOE_ASSIGN_OR_RETURN(base.pack.format, ParseWeightFormat(o.weight_format));
  base.pack.isa = o.isa;
  EPMOE_ASSIGN_OR_RETURN(base.shared, ParseSharedMode(o.shared));
  base.max_buffer_bytes = static_cast<int64_t>(o.max_buffer_mb * 1e6);
  base.seed = o.seed;
  EPMOE_ASSIGN_OR_RETURN(const OpenedWeights opened, OpenWeights(o.weights, model, o.layers, o.seed));
  base.weights = opened.source;
  std::unique_ptr<TraceRouting> trace;
  const int steps = o.steps;                 // timed
  const int all_steps = o.warmup + o.steps;  // a shorter trace is replayed from its start
  if (!o.trace.empty()) {
    EPMOE_ASSIGN_OR_RETURN(trace, TraceRouting::Open(o.trace, model, o.layers, all_steps));
  }
  auto tokens = [&](int step) { return trace ? trace->rows(step) : o.tokens; };
  // Low-latency a2a sizes its buffers once for the most rows a rank holds in any step (the first
  // rank's share of the largest step).
  int64_t most_tokens = 0;
  for (int step = 0; step < (trace ? all_steps : 1); ++step) most_tokens = std::max(most_tokens, tokens(step));
  base.max_rows_per_rank = std::max<int64_t>(1, RowBegin(most_tokens, g, 1));

  std::vector<EpOption> options;
  const bool all = o.options.size() == 1 && o.options[0] == "all";
  if (all) {
    options = AllEpOptions();
  } else {
    for (const std::string& name : o.options) {
      if (name == "all") return InvalidArgument("--option: all cannot be listed with other options");
      EPMOE_ASSIGN_OR_RETURN(EpOption one, ParseEpOption(name));
      if (std::find(options.begin(), options.end(), one) != options.end())
        return InvalidArgument(fmt::format("--option: {} is listed twice", name));
      options.push_back(one);
    }
  }
  EngineOptions engine_options;
  EPMOE_RETURN_IF_ERROR(SetEplbEngineOptions(o.eplb, model, o.layers, *comm, options, &engine_options));
  base.placement = engine_options.executor.placement;
  engine_options.check = o.check;
  engine_options.settle_each_step = o.interleave;
  // Refuse what cannot run, before any work: a named option fails the command, `all` skips it.
  std::vector<OptionResult> results(options.size());
  for (size_t i = 0; i < options.size(); ++i) {
    results[i].name = EpOptionName(options[i]);
    const ExecutorOptions executor_options = OptionExecutorOptions(base, o, options[i], g);
    if (options[i] == EpOption::kA2a) results[i].a2a_mode = A2aModeName(ResolveA2aMode(model, executor_options, g));
    const Status fits = CheckExecutorShape(model, executor_options, g);
    if (!fits.ok()) {
      if (!all) return fits;
      results[i].refused = fits.message();
    }
  }

  std::vector<ExecutorOptions> admitted;
  for (size_t i = 0; i < options.size(); ++i)
    if (results[i].refused.empty()) admitted.push_back(OptionExecutorOptions(base, o, options[i], g));
  EPMOE_RETURN_IF_ERROR(AdmitJobMemory(
      *comm, EstimateRunMemory(model, admitted, o.interleave, o.check, g, comm->rank(), o.tokens), o.max_memory_gb,
      "use fewer --tokens or --layers, a smaller --weight-format, --hidden/--intermediate, fewer ranks per machine"));

  ThreadPool pool(o.threads);
  std::unique_ptr<Routing> routing;
  if (!trace) {
    EPMOE_ASSIGN_OR_RETURN(const RoutingMode mode, ParseRoutingMode(o.routing));
    if (mode == RoutingMode::kScores) {
      EPMOE_ASSIGN_OR_RETURN(routing, ModelRouting(model, *base.weights, o.layers, o.isa, pool));
    } else {
      EPMOE_ASSIGN_OR_RETURN(routing, SimulatedRouting(model, mode, o.seed));
    }
  }
  const Routing& picks = trace ? static_cast<const Routing&>(*trace) : *routing;

  ProgressBar progress(!o.no_progress && comm->rank() == 0, static_cast<int64_t>(options.size()) * all_steps);
  int64_t done = 0;
  auto start = [&](size_t i) -> Result<std::unique_ptr<OptionRun>> {
    EngineOptions eo = engine_options;
    eo.executor = OptionExecutorOptions(base, o, options[i], g);
    eo.two_batch_overlap = o.tbo && options[i] == EpOption::kA2a;  // the other options run one batch
    return OptionRun::Start(*comm, o, model, eo, pool, &results[i]);
  };
  // Step s of option i; the first o.warmup steps are left out of the figures.
  auto step = [&](size_t i, OptionRun& run, int s) -> Status {
    if (s < o.warmup) {
      EPMOE_RETURN_IF_ERROR(run.Warm(s, picks, tokens(s)));
    } else {
      EPMOE_RETURN_IF_ERROR(run.Step(s, picks, tokens(s)));
    }
    ++done;
    if (comm->rank() == 0)
      progress.Update(done, s < o.warmup ? fmt::format("{} warm-up step {}/{}", results[i].name, s + 1, o.warmup)
                                         : fmt::format("{} step {}/{}", results[i].name, s - o.warmup + 1, steps));
    return Status::Ok();
  };
  if (o.interleave) {
    // Every option's engine at once; step s of each option in turn, so drift of a shared machine
    // (memory or cores taken by others for seconds) falls on all options alike. Step s starts at
    // option s mod n, so every option runs equally often in every place of the round.
    std::vector<std::unique_ptr<OptionRun>> runs(options.size());
    for (size_t i = 0; i < options.size(); ++i) {
      if (!results[i].refused.empty()) continue;
      EPMOE_ASSIGN_OR_RETURN(runs[i], start(i));
    }
    for (int s = 0; s < all_steps; ++s)
      for (size_t j = 0; j < options.size(); ++j) {
        const size_t i = (static_cast<size_t>(s) + j) % options.size();
        if (runs[i]) EPMOE_RETURN_IF_ERROR(step(i, *runs[i], s));
      }
    for (auto& run : runs)
      if (run) EPMOE_RETURN_IF_ERROR(run->Finish());
  } else {
    // One option at a time: only its weights are held.
    for (size_t i = 0; i < options.size(); ++i) {
      if (!results[i].refused.empty()) continue;
      EPMOE_ASSIGN_OR_RETURN(auto run, start(i));
      for (int s = 0; s < all_steps; ++s) EPMOE_RETURN_IF_ERROR(step(i, *run, s));
      EPMOE_RETURN_IF_ERROR(run->Finish());
    }
  }

  nlohmann::json rows = nlohmann::json::array();
  for (const OptionResult& r : results) {
    nlohmann::json j = {{"option", r.name}};
    if (!r.a2a_mode.empty()) j["a2a_mode"] = r.a2a_mode;
    if (!r.refused.empty()) {
      j["refused"] = r.refused;
      rows.push_back(j);
      continue;
    }
    nlohmann::json stages;
    for (int s = 0; s < kNumStages; ++s) stages[kStages[s].name] = Median(r.stage_ms[s]);
    j.update({{"description", r.description},
              {"step_ms_median", Median(r.step_ms)},
              {"step_ms_p90", Quantile(r.step_ms, 0.9)},
              {"step_ms", r.step_ms},
              {"stage_ms_median", stages},
              {"bytes_sent_per_rank_step", r.sent_per_rank_step},
              {"bytes_received_per_rank_step", r.received_per_rank_step},
              {"inter_node_bytes_sent_per_rank_step", r.inter_node_sent_per_rank_step},
              {"inter_node_bytes_received_per_rank_step", r.inter_node_received_per_rank_step},
              {"intra_node_bytes_sent_per_rank_step", r.sent_per_rank_step - r.inter_node_sent_per_rank_step},
              {"intra_node_bytes_received_per_rank_step",
               r.received_per_rank_step - r.inter_node_received_per_rank_step},
              {"copies_per_row", r.copies_per_row},
              {"balancedness_picks", r.picks_balance},
              {"balancedness_bytes", r.bytes_balance},
              {"peak_buffer_bytes", r.peak_buffer},
              {"max_rounds", r.rounds},
              {"resident_weight_bytes_max_rank", r.resident_bytes}});
    if (o.check) j["max_normalized_error"] = r.max_error;
    if (!r.eplb.is_null()) j["eplb"] = r.eplb;
    rows.push_back(j);
  }
  // The levels a2a ran (flat whenever its mode resolved to low-latency).
  const A2aLevels ran_levels =
      ResolveA2aLevels(model, OptionExecutorOptions(base, o, EpOption::kA2a, g), g, comm->num_nodes());
  *report = {{"model", model.name},
             {"hidden", model.hidden},
             {"expert_intermediate", model.expert_intermediate},
             {"num_experts", model.num_experts},
             {"top_k", model.top_k},
             {"ranks", g},
             {"nodes", comm->num_nodes()},
             {"communicator", comm->description()},
             {"tokens", tokens(0)},
             {"steps", steps},
             {"warmup_steps", o.warmup},
             {"interleaved", o.interleave},
             {"layers", o.layers},
             {"routing", o.trace.empty() ? o.routing : "trace " + o.trace},
             {"row_origin", o.origin},
             {"dispatch_format", o.dispatch_format},
             {"combine_format", o.combine_format},
             {"a2a_mode_requested", o.a2a_mode},
             {"a2a_levels", A2aLevelsName(ran_levels)},
             {"a2a_levels_requested", o.a2a_levels},
             {"a2a_progress", o.a2a_progress},
             {"weight_format", o.weight_format},
             {"weights", opened.report},
             {"threads_per_rank", pool.size()},
             {"expected_a2a_copies_per_row_uniform", ExpectedRanksPerRow(model.num_experts, model.top_k, g)},
             {"checked", o.check},
             {"options", rows}};
  return Status::Ok();
}

void PrintText(const nlohmann::json& r) {
  std::printf("%s (hidden %d, intermediate %d, E %d, top-%d): %d rank(s) on %d node(s), %s\n",
              r["model"].get<std::string>().c_str(), r["hidden"].get<int>(), r["expert_intermediate"].get<int>(),
              r["num_experts"].get<int>(), r["top_k"].get<int>(), r["ranks"].get<int>(), r["nodes"].get<int>(),
              r["communicator"].get<std::string>().c_str());
  std::printf(
      "T = %lld rows per step, %d steps x %d layers%s, routing %s, %s rows, %s weights, rows travel %s, "
      "outputs return %s, %d thread(s) per rank\n",
      static_cast<long long>(r["tokens"].get<int64_t>()), r["steps"].get<int>(), r["layers"].get<int>(),
      r["warmup_steps"].get<int>() > 0 ? fmt::format(" after {} warm-up steps", r["warmup_steps"].get<int>()).c_str()
                                       : "",
      r["routing"].get<std::string>().c_str(), r["row_origin"].get<std::string>().c_str(),
      r["weight_format"].get<std::string>().c_str(), r["dispatch_format"].get<std::string>().c_str(),
      r["combine_format"].get<std::string>().c_str(), r["threads_per_rank"].get<int>());
  const std::string weights = DescribeWeights(r["weights"]);
  if (!weights.empty()) std::printf("%s\n", weights.c_str());
  std::printf("%-7s %9s %9s |", "option", "step ms", "p90 ms");
  for (const StageField& stage : kStages) std::printf(" %8s", stage.name);
  std::printf(" | %10s %10s %7s %6s %6s %10s %6s", "sent/rank", "inter-node", "copies", "bal.p", "bal.b", "peak buf",
              "rounds");
  const bool checked = r["checked"].get<bool>();
  std::printf(checked ? " %9s\n" : "\n", "max err");
  for (const auto& o : r["options"]) {
    if (o.contains("refused")) {
      std::printf("%-7s refused: %s\n", o["option"].get<std::string>().c_str(),
                  o["refused"].get<std::string>().c_str());
      continue;
    }
    std::printf("%-7s %9.3f %9.3f |", o["option"].get<std::string>().c_str(), o["step_ms_median"].get<double>(),
                o["step_ms_p90"].get<double>());
    for (const StageField& stage : kStages) std::printf(" %8.3f", o["stage_ms_median"][stage.name].get<double>());
    std::printf(" | %10s %10s %7.2f %6.2f %6.2f %10s %6d",
                HumanBytes(static_cast<int64_t>(o["bytes_sent_per_rank_step"].get<double>())).c_str(),
                HumanBytes(static_cast<int64_t>(o["inter_node_bytes_sent_per_rank_step"].get<double>())).c_str(),
                o["copies_per_row"].get<double>(), o["balancedness_picks"].get<double>(),
                o["balancedness_bytes"].get<double>(),
                HumanBytes(static_cast<int64_t>(o["peak_buffer_bytes"].get<double>())).c_str(),
                static_cast<int>(o["max_rounds"].get<double>()));
    if (checked) std::printf(" %9.2g", o["max_normalized_error"].get<double>());
    std::printf("\n");
    if (o.contains("a2a_mode")) std::printf("        %s\n", o["description"].get<std::string>().c_str());
    if (o.contains("eplb")) PrintEplbText(o["eplb"]);
  }
  std::printf(
      "stage times: median over steps of the mean over ranks, summed over layers (ms); step ms: slowest rank\n");
  std::printf(
      "sent/rank: bytes a rank sends per step, inter-node: the part sent to other nodes (a2a exchange: %s, from "
      "--a2a-levels %s); copies: ranks each row is delivered to (a2a expects %.2f under uniform routing); bal.p / "
      "bal.b: mean / max picks and expert bytes per rank\n",
      r["a2a_levels"].get<std::string>().c_str(), r["a2a_levels_requested"].get<std::string>().c_str(),
      r["expected_a2a_copies_per_row_uniform"].get<double>());
  if (checked) std::printf("check: every option matches the single-process layer within its tolerance\n");
}

}  // namespace

void AddRunCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<RunOptions>();
  auto* cmd = app.add_subcommand(
      "run", "Run MoE layers across MPI ranks (start under mpirun) with one option or all of them side by side");
  cmd->add_option("--model", o->model, kModelOptionHelp)->capture_default_str();
  cmd->add_option("--option", o->options,
                  "How rows meet experts: one, several comma separated (run in that order), or all")
      ->delimiter(',')
      ->check(CLI::IsMember({"sliced", "whole", "hybrid", "a2a", "dwdp", "all"}))
      ->capture_default_str();
  cmd->add_option("--tokens,-t", o->tokens, "Rows per step over all ranks (T)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--steps", o->steps, "Steps (new rows each); times are medians over steps")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup,
                  "The first N steps run as any other but are left out of every figure (they pay one-time costs); "
                  "live EPLB and --record-load still see them")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--layers", o->layers, "MoE layers per step")->check(kPositive)->capture_default_str();
  cmd->add_option("--routing", o->routing, "How picks are made")
      ->check(CLI::IsMember({"scores", "round_robin", "uniform"}))
      ->capture_default_str();
  cmd->add_option("--trace", o->trace, "Replay per-row picks from a routing trace (any format `epmoe trace` reads)");
  cmd->add_option("--origin", o->origin,
                  "Rows start data-parallel (T/G per rank) or tensor-parallel (all on every rank)")
      ->check(CLI::IsMember({"data-parallel", "tensor-parallel", "dp", "tp"}))
      ->capture_default_str();
  cmd->add_option("--tp-in-ep", o->tp_in_ep, "hybrid: ranks slicing each expert (0: 2 when G is even, else 1)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--dispatch-format", o->dispatch_format, "How rows travel")
      ->check(CLI::IsMember({"fp32", "bf16", "q8", "q4"}))
      ->capture_default_str();
  cmd->add_option("--combine-format", o->combine_format, "How a2a outputs come back")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_flag("--partial-sums", o->partial_sums,
                "a2a: sum a row's picks on each expert rank and send one row back per rank (fewer bytes; not "
                "bit-exact with the single process)");
  cmd->add_flag("--tbo", o->tbo,
                "a2a: two-batch overlap: each rank's rows in two micro-batches, one's exchange in flight while the "
                "other's experts run (same outputs; the other options of --option run one batch)");
  cmd->add_option("--a2a-mode", o->a2a_mode,
                  fmt::format("a2a: normal (row counts exchanged first, buffers sized to them), low-latency (buffers "
                              "sized once for the most rows a rank holds at --tokens, no count exchange; for decode) "
                              "or auto (low-latency up to {} rows per rank, normal with --a2a-levels two-level)",
                              kAutoLowLatencyMaxRows))
      ->check(CLI::IsMember({"normal", "low-latency", "low_latency", "auto"}))
      ->capture_default_str();
  cmd->add_flag("--sbo", o->sbo,
                "a2a: single-batch overlap: the shared expert runs while the dispatch is in flight (same outputs; "
                "the other options of --option run as without)");
  cmd->add_option("--a2a-levels", o->a2a_levels,
                  "a2a: rows bound for another node cross once per node to a gateway rank that forwards them inside "
                  "it (two-level), or once per destination rank (flat); auto: two-level when there are several nodes "
                  "and some node holds more than one rank. Low-latency mode is flat only (two-level with it is "
                  "refused; auto gives flat)")
      ->check(CLI::IsMember({"auto", "flat", "two-level"}))
      ->capture_default_str();
  cmd->add_option("--a2a-progress", o->a2a_progress,
                  "a2a: what moves the exchanges on while a rank computes: wait (only its waits on them), poll (also "
                  "its compute loops, between chunks) or thread (a thread of its own; needs MPI_THREAD_MULTIPLE)")
      ->check(CLI::IsMember({"wait", "poll", "thread"}))
      ->capture_default_str();
  cmd->add_option("--weight-format", o->weight_format, "Expert weight format")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--isa", o->isa, "Highest instruction set for the kernels and the router")->capture_default_str();
  AddWeightsOption(cmd, &o->weights);
  cmd->add_option("--shared", o->shared, "Shared expert under sliced/whole/hybrid (a2a and dwdp always copy it)")
      ->check(CLI::IsMember({"default", "sliced", "copied"}))
      ->capture_default_str();
  cmd->add_option("--max-buffer-mb", o->max_buffer_mb, "Bound on a rank's exchange buffers (MB); beyond it, rounds")
      ->check(kPositive)
      ->check(CLI::Range(0.0, 1e9))  // 1 PB: larger values overflow the bound's bytes
      ->capture_default_str();
  cmd->add_option("--ranks-per-node", o->ranks_per_node, "Model nodes of this many ranks (0: real shared-memory nodes)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--max-memory-gb", o->max_memory_gb,
                  "Memory budget of the ranks on one machine together, refused before any work (0: 80% of "
                  "available memory)")
      ->check(kNonNegative);
  cmd->add_option("--comm-timeout", o->comm_timeout, "Seconds an exchange may wait for a peer (0: forever)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Worker threads per rank (0: every core the rank is bound to)")
      ->check(kThreadCount)
      ->capture_default_str();
  cmd->add_option("--hidden", o->hidden, "Override the model's hidden size (0: keep)")->check(kNonNegative);
  cmd->add_option("--intermediate", o->intermediate, "Override the experts' intermediate size (0: keep)")
      ->check(kNonNegative);
  cmd->add_option("--seed", o->seed, "Seed of the synthetic weights, rows and uniform routing")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_flag("--check", o->check, "Compare every layer with the single-process layer; fail on a mismatch");
  cmd->add_flag("--interleave", o->interleave,
                "With several options: run step 1 of each, then step 2 of each, ... (holds every option's weights "
                "at once), so a shared machine's drift falls on all options alike");
  cmd->add_flag("--no-progress", o->no_progress, "No progress bar");
  AddEplbOptions(cmd, &o->eplb);
  AddFormatOption(cmd, &o->format, {"text", "json"});
  cmd->callback([o, exit_code] {
    nlohmann::json report;
    bool is_root = true;
    const Status status = Run(*o, &report, &is_root);
    if (!status.ok()) {
      *exit_code = ReportJobError(status, o->comm_timeout);
      return;
    }
    if (is_root) {
      if (o->format == "json") {
        std::printf("%s\n", report.dump(2).c_str());
      } else {
        PrintText(report);
      }
    }
    *exit_code = 0;
  });
}

}  // namespace epmoe::cli
