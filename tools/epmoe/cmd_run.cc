// `epmoe run`: MoE layers across the ranks of an MPI job (start it under mpirun; one process is a
// world of one rank). Runs one option, or every option on identical inputs, and rank 0 prints the
// per-step median and p90 time, the stage breakdown, traffic and balance side by side.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/layer.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "epmoe/trace.h"
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
  int layers = 2;
  std::string routing = "uniform";
  std::string trace;
  std::string origin = "data-parallel";
  int tp_in_ep = 0;
  std::string dispatch_format = "bf16";
  std::string combine_format = "bf16";
  bool partial_sums = false;
  std::string weight_format = "fp32";
  std::string isa = "auto";
  std::string weights;
  std::string shared = "default";
  double max_buffer_mb = 1024;
  int ranks_per_node = 0;
  double comm_timeout = 600;
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

// Figures of one rank for one layer of one step, flattened for an all-gather.
constexpr int kFields = 16;
std::vector<double> Flatten(const StepStats& s, double wall_us) {
  return {s.route_us,
          s.pack_us,
          s.dispatch_us,
          s.experts_us,
          s.combine_us,
          s.unpack_us,
          s.shared_us,
          static_cast<double>(s.rows),
          static_cast<double>(s.row_copies),
          static_cast<double>(s.picks),
          static_cast<double>(s.expert_bytes_read),
          static_cast<double>(s.bytes_sent),
          static_cast<double>(s.bytes_received),
          static_cast<double>(s.peak_buffer_bytes),
          static_cast<double>(s.rounds),
          wall_us};
}
enum Field {
  kRoute,
  kPack,
  kDispatch,
  kExperts,
  kCombine,
  kUnpack,
  kShared,
  kRows,
  kCopies,
  kPicks,
  kBytesRead,
  kSent,
  kReceived,
  kPeak,
  kRounds,
  kWall
};
const char* const kStageNames[] = {"route", "pack", "dispatch", "experts", "combine", "unpack", "shared"};

// Gathers every rank's figures: result[rank][layer * kFields + field].
Result<std::vector<std::vector<double>>> GatherFigures(Communicator& comm, const std::vector<double>& mine) {
  std::vector<int64_t> send(mine.size()), recv(mine.size() * comm.size());
  for (size_t i = 0; i < mine.size(); ++i) send[i] = std::bit_cast<int64_t>(mine[i]);
  EPMOE_RETURN_IF_ERROR(comm.AllgatherInt64(send, recv));
  std::vector<std::vector<double>> out(comm.size(), std::vector<double>(mine.size()));
  for (int r = 0; r < comm.size(); ++r)
    for (size_t i = 0; i < mine.size(); ++i) out[r][i] = std::bit_cast<double>(recv[r * mine.size() + i]);
  return out;
}

// Normalized max error allowed against the reference (the same weight format, rows as given):
// what the rows' travel format and the fp32 summation order can change. Kernels that quantize
// activations to int8 (int8 and the 4-bit formats) turn the travel format's rounding into int8
// rounding steps (and slices quantize their own intermediate rows), so a row that travels rounded
// may differ by a few activation steps: measured up to 0.04 at hidden 1024, intermediate 512.
double Tolerance(RowFormat dispatch, RowFormat combine, WeightFormat weights) {
  double t = 1e-5;
  if (dispatch == RowFormat::kBf16 || combine == RowFormat::kBf16) t = 2e-2;
  const bool int8_activations =
      weights == WeightFormat::kInt8 || weights == WeightFormat::kNvfp4 || weights == WeightFormat::kMxfp4;
  if (dispatch != RowFormat::kFp32 && int8_activations) t = 8e-2;
  if (dispatch == RowFormat::kQ8) t = std::max(t, 5e-2);
  if (dispatch == RowFormat::kQ4) t = 3e-1;
  return t;
}

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

// The rows and picks of every step and layer: synthetic, routed by the model's router, or replayed.
class Inputs {
 public:
  Status Init(const RunOptions& o, const ModelConfig& model, const WeightSource& weights, ThreadPool& pool) {
    model_ = model;
    o_ = o;
    if (!o.trace.empty()) {
      EPMOE_ASSIGN_OR_RETURN(reader_, TraceReader::Open(o.trace, LoadReadOptions{}));
      const TraceInfo& info = reader_->info();
      if (!info.has_picks)
        return InvalidArgument(
            fmt::format("--trace {}: holds per-expert counts only; `epmoe run` replays per-row picks", o.trace));
      if (info.num_experts != model.num_experts || info.top_k != model.top_k)
        return InvalidArgument(fmt::format("--trace {}: {} experts, top-{}; the model {} has {} experts, top-{}",
                                           o.trace, info.num_experts, info.top_k, model.name, model.num_experts,
                                           model.top_k));
      if (info.num_layers < o.layers)
        return InvalidArgument(
            fmt::format("--trace {}: {} layers, fewer than --layers {}", o.trace, info.num_layers, o.layers));
      for (int s = 0; s < o.steps; ++s) {
        StepPicks step;
        EPMOE_ASSIGN_OR_RETURN(const bool more, reader_->Next(&step));
        if (!more) break;
        for (Picks& p : step.layers) {
          if (p.weights.empty())
            p.weights.assign(p.experts.size(), static_cast<float>(model.routed_scaling / model.top_k));
        }
        steps_.push_back(std::move(step));
      }
      if (steps_.empty()) return InvalidArgument(fmt::format("--trace {}: no steps", o.trace));
    } else if (o.routing == "scores") {
      for (int l = 0; l < o.layers; ++l) {
        EPMOE_ASSIGN_OR_RETURN(MoeLayerWeights routing, weights.Routing(l, &pool));
        EPMOE_ASSIGN_OR_RETURN(RouterWeights router, RouterWeights::Pack(routing.router, o.isa));
        routers_.push_back(std::move(router));
        router_biases_.push_back(std::move(routing.router_bias));
      }
    }
    return Status::Ok();
  }
  // A trace shorter than --steps is replayed from its start again, as `epmoe layer` does.
  int steps() const { return o_.steps; }
  int64_t tokens(int step) const { return steps_.empty() ? o_.tokens : Replayed(step).rows; }

  // Picks of global rows [first, first + rows.rows) of `step`, layer `layer` (the router's logits
  // on the pool's threads).
  Status PicksFor(int step, int layer, const Matrix& rows, int64_t first, Picks* picks, ThreadPool& pool) const {
    if (!steps_.empty()) {
      const Picks& all = Replayed(step).layers[layer];
      const int k = all.k;
      *picks =
          Picks{rows.rows, k,
                std::vector<int32_t>(all.experts.begin() + first * k, all.experts.begin() + (first + rows.rows) * k),
                std::vector<float>(all.weights.begin() + first * k, all.weights.begin() + (first + rows.rows) * k)};
      return Status::Ok();
    }
    if (o_.routing == "scores") {
      return Router(model_).Route(rows, routers_[layer], router_biases_[layer], picks, &pool);
    }
    if (o_.routing == "round_robin") {
      *picks = RoundRobinPicks(model_, rows.rows, first);
    } else {
      *picks = UniformPicks(model_, rows.rows, o_.seed * 1000003 + step * 1009 + layer, first);
    }
    return Status::Ok();
  }

 private:
  const StepPicks& Replayed(int step) const { return steps_[static_cast<size_t>(step) % steps_.size()]; }

  ModelConfig model_;
  RunOptions o_;
  std::unique_ptr<TraceReader> reader_;
  std::vector<StepPicks> steps_;
  // "scores" routing: each layer's router and its bias.
  std::vector<RouterWeights> routers_;
  std::vector<std::vector<float>> router_biases_;
};

struct OptionResult {
  std::string name, description, refused;
  std::vector<double> step_ms;
  std::vector<std::vector<double>> stage_ms;  // [stage][step]: mean over ranks, summed over layers
  double sent_per_rank_step = 0, received_per_rank_step = 0, copies_per_row = 0, picks_balance = 0, bytes_balance = 0,
         peak_buffer = 0, rounds = 0, max_error = 0;
  int64_t resident_bytes = 0;
  nlohmann::json eplb;  // with --eplb
};

// The executor options of `option` on `ranks` ranks: hybrid slices each expert --tp-in-ep ways
// (default 2 when G is even), the others ignore that flag; a2a and dwdp copy the shared expert.
ExecutorOptions OptionExecutorOptions(const ExecutorOptions& base, const RunOptions& o, EpOption option, int ranks) {
  ExecutorOptions eo = base;
  eo.option = option;
  if (option == EpOption::kHybrid) {
    eo.tp_in_ep = o.tp_in_ep > 0 ? o.tp_in_ep : (ranks % 2 == 0 && ranks > 1 ? 2 : 1);
  } else if (o.tp_in_ep > 0) {
    eo.tp_in_ep = 1;
  }
  if (option == EpOption::kA2a || option == EpOption::kDwdp) eo.shared = SharedMode::kDefault;
  return eo;
}

// One option's executor over the steps: Start builds it (and its EPLB session), Step runs one step
// and adds its figures to the result, Finish turns the sums into per-step figures and closes the
// executor (collective). Steps of
// different options may alternate (--interleave) because each run keeps its own executor and state.
class OptionRun {
 public:
  static Result<std::unique_ptr<OptionRun>> Start(Communicator& comm, const RunOptions& o, const ModelConfig& model,
                                                  EpOption option, const ExecutorOptions& base, ThreadPool& pool,
                                                  OptionResult* result) {
    auto run = std::unique_ptr<OptionRun>(new OptionRun(comm, o, model, pool, result));
    ExecutorOptions& eo = run->eo_;
    eo = OptionExecutorOptions(base, o, option, comm.size());
    result->name = EpOptionName(option);
    EPMOE_ASSIGN_OR_RETURN(run->executor_, CreateExecutor(comm, model, eo, pool));
    if (o.eplb.enabled) {
      EPMOE_ASSIGN_OR_RETURN(run->eplb_, EplbSession::Create(comm, o.eplb, model, *run->executor_, eo.placement));
    }
    result->description = run->executor_->description();
    EPMOE_ASSIGN_OR_RETURN(result->resident_bytes, comm.AllreduceMax(run->executor_->resident_weight_bytes()));
    result->stage_ms.assign(7, {});
    return run;
  }

  // settle: wait for the executor's background work before the step ends (see
  // MoeExecutor::Settle), so that none of it runs into the next option's step.
  Status Step(int step, const Inputs& inputs, const std::vector<std::unique_ptr<MoeLayer>>& references,
              bool settle) {
    const int g = comm_.size(), me = comm_.rank();
    const bool tensor_parallel = eo_.origin == RowOrigin::kTensorParallel;
    OptionResult* result = result_;
    const int64_t total = inputs.tokens(step);
    const int64_t first = tensor_parallel ? 0 : RowBegin(total, g, me);
    const int64_t count = tensor_parallel ? total : RowBegin(total, g, me + 1) - first;
    Matrix x = SyntheticRows(o_.seed, model_, step, first, count);
    std::vector<double> figures;
    EPMOE_RETURN_IF_ERROR(comm_.Barrier());
    for (int layer = 0; layer < o_.layers; ++layer) {
      const auto t0 = std::chrono::steady_clock::now();
      Picks picks;
      EPMOE_RETURN_IF_ERROR(inputs.PicksFor(step, layer, x, first, &picks, pool_));
      const double route_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (eplb_) EPMOE_RETURN_IF_ERROR(eplb_->Record(layer, picks, tensor_parallel));
      Matrix out;
      StepStats st;
      EPMOE_RETURN_IF_ERROR(executor_->Forward(layer, x, picks, &out, &st)
                                .WithContext(fmt::format("{} step {} layer {}", result->name, step, layer)));
      st.route_us = route_us;
      if (settle && layer + 1 == o_.layers) {
        // The read-ahead the last layer started is the next step's first layer's: in a run of
        // consecutive steps it would be waited for there, so it is this step's time (as waiting
        // for experts), not the gap before the next option's step.
        const auto s0 = std::chrono::steady_clock::now();
        EPMOE_RETURN_IF_ERROR(executor_->Settle());
        st.dispatch_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s0).count();
      }
      const double wall = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (!references.empty()) {
        Matrix expected;
        EPMOE_RETURN_IF_ERROR(references[layer]->Forward(x, picks, &expected, pool_, nullptr));
        const double error = NormalizedMaxError(out, expected);
        const double allowed = Tolerance(eo_.dispatch_format, eo_.combine_format, eo_.pack.format);
        EPMOE_ASSIGN_OR_RETURN(const int64_t any_bad, comm_.AllreduceMax(error <= allowed ? 0 : 1));
        result->max_error = std::max(result->max_error, error);
        if (any_bad)
          return Internal(fmt::format(
              "--check: {} step {} layer {} differs from the single-process layer on rank {}: "
              "normalized max error {:.3g} (allowed {:.1g})",
              result->name, step, layer, me, error, allowed));
      }
      const auto f = Flatten(st, wall);
      figures.insert(figures.end(), f.begin(), f.end());
      for (size_t i = 0; i < x.data.size(); ++i) x.data[i] += out.data[i];  // residual stream
    }
    EPMOE_ASSIGN_OR_RETURN(auto all, GatherFigures(comm_, figures));
    double step_us = 0;
    std::vector<double> stage_us(7, 0);
    for (int r = 0; r < g; ++r) {
      double wall = 0;
      for (int l = 0; l < o_.layers; ++l) {
        const double* f = &all[r][l * kFields];
        wall += f[kWall];
        for (int s = 0; s < 7; ++s) stage_us[s] += f[s] / g;
        rows_ += f[kRows];
        copies_ += f[kCopies];
        sent_ += f[kSent];
        received_ += f[kReceived];
        result->peak_buffer = std::max(result->peak_buffer, f[kPeak]);
        result->rounds = std::max(result->rounds, f[kRounds]);
      }
      step_us = std::max(step_us, wall);  // a step waits for its slowest rank
    }
    for (int l = 0; l < o_.layers; ++l) {
      double max_picks = 0, sum_picks = 0, max_bytes = 0, sum_bytes = 0;
      for (int r = 0; r < g; ++r) {
        const double* f = &all[r][l * kFields];
        max_picks = std::max(max_picks, f[kPicks]);
        sum_picks += f[kPicks];
        max_bytes = std::max(max_bytes, f[kBytesRead]);
        sum_bytes += f[kBytesRead];
      }
      picks_balance_ += max_picks > 0 ? sum_picks / g / max_picks : 1.0;
      bytes_balance_ += max_bytes > 0 ? sum_bytes / g / max_bytes : 1.0;
      ++balance_samples_;
    }
    if (eplb_) {
      double step_balance = 0;
      for (int l = 0; l < o_.layers; ++l) {
        double most = 0, sum = 0;
        for (int r = 0; r < g; ++r) {
          most = std::max(most, all[r][l * kFields + kPicks]);
          sum += all[r][l * kFields + kPicks];
        }
        step_balance += most > 0 ? sum / g / most : 1.0;
      }
      std::vector<std::pair<std::string, double>> stages;
      for (int s = 0; s < 7; ++s) stages.emplace_back(kStageNames[s], stage_us[s] / 1e6);
      EPMOE_RETURN_IF_ERROR(eplb_->EndStep(step + 1, step_us / 1e6, stages, step_balance / o_.layers));
    }
    result->step_ms.push_back(step_us / 1000);
    for (int s = 0; s < 7; ++s) result->stage_ms[s].push_back(stage_us[s] / 1000);
    return Status::Ok();
  }

  Status Finish(int steps) {
    const int g = comm_.size();
    OptionResult* result = result_;
    if (eplb_) result->eplb = eplb_->Report();
    result->copies_per_row = rows_ > 0 ? copies_ / rows_ : 0;
    result->sent_per_rank_step = sent_ / g / steps;
    result->received_per_rank_step = received_ / g / steps;
    result->picks_balance = balance_samples_ ? picks_balance_ / balance_samples_ : 1;
    result->bytes_balance = balance_samples_ ? bytes_balance_ / balance_samples_ : 1;
    EPMOE_ASSIGN_OR_RETURN(const int64_t max_error_bits, comm_.AllreduceMax(std::bit_cast<int64_t>(result->max_error)));
    result->max_error = std::bit_cast<double>(max_error_bits);  // non-negative doubles order as their bits
    return executor_->Close();
  }

 private:
  OptionRun(Communicator& comm, const RunOptions& o, const ModelConfig& model, ThreadPool& pool, OptionResult* result)
      : comm_(comm), o_(o), model_(model), pool_(pool), result_(result) {}

  Communicator& comm_;
  const RunOptions& o_;
  const ModelConfig& model_;
  ThreadPool& pool_;
  OptionResult* result_;
  ExecutorOptions eo_;
  std::unique_ptr<MoeExecutor> executor_;
  std::unique_ptr<EplbSession> eplb_;
  double copies_ = 0, rows_ = 0, sent_ = 0, received_ = 0, picks_balance_ = 0, bytes_balance_ = 0;
  int balance_samples_ = 0;
};

Status Run(const RunOptions& o, nlohmann::json* report, bool* is_root) {
  CommOptions co;
  co.ranks_per_node = o.ranks_per_node;
  co.timeout_seconds = o.comm_timeout;
  EPMOE_ASSIGN_OR_RETURN(auto comm, WorldCommunicator(co));
  *is_root = comm->rank() == 0;
  const int g = comm->size();
  EPMOE_ASSIGN_OR_RETURN(const ModelConfig model, LoadCommandModel(o.model, o.hidden, o.intermediate, o.layers));
  EPMOE_RETURN_IF_ERROR(CheckRowsFitInMemory(o.tokens, model.hidden));
  if (!o.trace.empty() && o.routing != "uniform")
    return InvalidArgument("--trace replays the trace's picks; do not combine it with --routing");
  ExecutorOptions base;
  base.num_layers = o.layers;
  EPMOE_ASSIGN_OR_RETURN(base.origin, ParseRowOrigin(o.origin));
  EPMOE_ASSIGN_OR_RETURN(base.dispatch_format, ParseRowFormat(o.dispatch_format));
  EPMOE_ASSIGN_OR_RETURN(base.combine_format, ParseRowFormat(o.combine_format));
  base.combine_partial_sums = o.partial_sums;
  EPMOE_ASSIGN_OR_RETURN(base.pack.format, ParseWeightFormat(o.weight_format));
  base.pack.isa = o.isa;
  base.shared = o.shared == "sliced"   ? SharedMode::kSliced
                : o.shared == "copied" ? SharedMode::kCopied
                                       : SharedMode::kDefault;
  base.max_buffer_bytes = static_cast<int64_t>(o.max_buffer_mb * 1e6);
  base.seed = o.seed;
  EPMOE_ASSIGN_OR_RETURN(const OpenedWeights opened, OpenWeights(o.weights, model, o.layers, o.seed));
  base.weights = opened.source;

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
  if (o.eplb.enabled || !o.eplb.metrics_file.empty()) {
    EPMOE_ASSIGN_OR_RETURN(base.placement, EplbInitialPlacement(o.eplb, model, o.layers, *comm, options));
  }
  // Refuse what cannot run, before any work: a named option fails the command, `all` skips it.
  std::vector<OptionResult> results(options.size());
  for (size_t i = 0; i < options.size(); ++i) {
    results[i].name = EpOptionName(options[i]);
    const Status fits = CheckExecutorShape(model, OptionExecutorOptions(base, o, options[i], g), g);
    if (!fits.ok()) {
      if (!all) return fits;
      results[i].refused = fits.message();
    }
  }

  ThreadPool pool(o.threads);
  Inputs inputs;
  EPMOE_RETURN_IF_ERROR(inputs.Init(o, model, *base.weights, pool));
  std::vector<std::unique_ptr<MoeLayer>> references;
  if (o.check) {
    for (int l = 0; l < o.layers; ++l) {
      PackOptions pack = base.pack;
      pack.pool = &pool;
      EPMOE_ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(model, *base.weights, l, pack));
      references.push_back(std::move(layer));
    }
  }
  ProgressBar progress(!o.no_progress && comm->rank() == 0, static_cast<int64_t>(options.size()) * inputs.steps());
  int64_t done = 0;
  auto start = [&](size_t i) -> Result<std::unique_ptr<OptionRun>> {
    return OptionRun::Start(*comm, o, model, options[i], base, pool, &results[i]);
  };
  auto step = [&](size_t i, OptionRun& run, int s) -> Status {
    EPMOE_RETURN_IF_ERROR(run.Step(s, inputs, references, /*settle=*/o.interleave));
    ++done;
    if (comm->rank() == 0) progress.Update(done, fmt::format("{} step {}/{}", results[i].name, s + 1, inputs.steps()));
    return Status::Ok();
  };
  if (o.interleave) {
    // Every option's executor at once; step s of each option in turn, so drift of a shared machine
    // (memory or cores taken by others for seconds) falls on all options alike. Step s starts at
    // option s mod n, so every option runs equally often in every place of the round.
    std::vector<std::unique_ptr<OptionRun>> runs(options.size());
    for (size_t i = 0; i < options.size(); ++i) {
      if (!results[i].refused.empty()) continue;
      EPMOE_ASSIGN_OR_RETURN(runs[i], start(i));
    }
    for (int s = 0; s < inputs.steps(); ++s)
      for (size_t j = 0; j < options.size(); ++j) {
        const size_t i = (static_cast<size_t>(s) + j) % options.size();
        if (runs[i]) EPMOE_RETURN_IF_ERROR(step(i, *runs[i], s));
      }
    for (auto& run : runs)
      if (run) EPMOE_RETURN_IF_ERROR(run->Finish(inputs.steps()));
  } else {
    // One option at a time: only its weights are held.
    for (size_t i = 0; i < options.size(); ++i) {
      if (!results[i].refused.empty()) continue;
      EPMOE_ASSIGN_OR_RETURN(auto run, start(i));
      for (int s = 0; s < inputs.steps(); ++s) EPMOE_RETURN_IF_ERROR(step(i, *run, s));
      EPMOE_RETURN_IF_ERROR(run->Finish(inputs.steps()));
    }
  }

  nlohmann::json rows = nlohmann::json::array();
  for (const OptionResult& r : results) {
    nlohmann::json j = {{"option", r.name}};
    if (!r.refused.empty()) {
      j["refused"] = r.refused;
      rows.push_back(j);
      continue;
    }
    nlohmann::json stages;
    for (int s = 0; s < 7; ++s) stages[kStageNames[s]] = Median(r.stage_ms[s]);
    j.update({{"description", r.description},
              {"step_ms_median", Median(r.step_ms)},
              {"step_ms_p90", Quantile(r.step_ms, 0.9)},
              {"step_ms", r.step_ms},
              {"stage_ms_median", stages},
              {"bytes_sent_per_rank_step", r.sent_per_rank_step},
              {"bytes_received_per_rank_step", r.received_per_rank_step},
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
  *report = {{"model", model.name},
             {"hidden", model.hidden},
             {"expert_intermediate", model.expert_intermediate},
             {"num_experts", model.num_experts},
             {"top_k", model.top_k},
             {"ranks", g},
             {"nodes", comm->num_nodes()},
             {"communicator", comm->description()},
             {"tokens", inputs.tokens(0)},
             {"steps", inputs.steps()},
             {"interleaved", o.interleave},
             {"layers", o.layers},
             {"routing", o.trace.empty() ? o.routing : "trace " + o.trace},
             {"row_origin", o.origin},
             {"dispatch_format", o.dispatch_format},
             {"combine_format", o.combine_format},
             {"weight_format", o.weight_format},
             {"weights", opened.report},
             {"threads_per_rank", pool.size()},
             {"expected_a2a_copies_per_row_uniform", ExpectedCopiesPerRow(model.num_experts, model.top_k, g)},
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
      "T = %lld rows per step, %d steps x %d layers, routing %s, %s rows, %s weights, rows travel %s, "
      "outputs return %s, %d thread(s) per rank\n",
      static_cast<long long>(r["tokens"].get<int64_t>()), r["steps"].get<int>(), r["layers"].get<int>(),
      r["routing"].get<std::string>().c_str(), r["row_origin"].get<std::string>().c_str(),
      r["weight_format"].get<std::string>().c_str(), r["dispatch_format"].get<std::string>().c_str(),
      r["combine_format"].get<std::string>().c_str(), r["threads_per_rank"].get<int>());
  const std::string weights = DescribeWeights(r["weights"]);
  if (!weights.empty()) std::printf("%s\n", weights.c_str());
  std::printf("%-7s %9s %9s | %8s %8s %8s %8s %8s %8s %8s | %10s %7s %6s %6s %10s %6s", "option", "step ms", "p90 ms",
              "route", "pack", "dispatch", "experts", "combine", "unpack", "shared", "sent/rank", "copies", "bal.p",
              "bal.b", "peak buf", "rounds");
  const bool checked = r["checked"].get<bool>();
  std::printf(checked ? " %9s\n" : "\n", "max err");
  for (const auto& o : r["options"]) {
    if (o.contains("refused")) {
      std::printf("%-7s refused: %s\n", o["option"].get<std::string>().c_str(),
                  o["refused"].get<std::string>().c_str());
      continue;
    }
    const auto& s = o["stage_ms_median"];
    std::printf(
        "%-7s %9.3f %9.3f | %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f | %10s %7.2f %6.2f %6.2f %10s %6d",
        o["option"].get<std::string>().c_str(), o["step_ms_median"].get<double>(), o["step_ms_p90"].get<double>(),
        s["route"].get<double>(), s["pack"].get<double>(), s["dispatch"].get<double>(), s["experts"].get<double>(),
        s["combine"].get<double>(), s["unpack"].get<double>(), s["shared"].get<double>(),
        HumanBytes(static_cast<int64_t>(o["bytes_sent_per_rank_step"].get<double>())).c_str(),
        o["copies_per_row"].get<double>(), o["balancedness_picks"].get<double>(), o["balancedness_bytes"].get<double>(),
        HumanBytes(static_cast<int64_t>(o["peak_buffer_bytes"].get<double>())).c_str(),
        static_cast<int>(o["max_rounds"].get<double>()));
    if (checked) std::printf(" %9.2g", o["max_normalized_error"].get<double>());
    std::printf("\n");
    if (o.contains("eplb")) PrintEplbText(o["eplb"]);
  }
  std::printf(
      "stage times: median over steps of the mean over ranks, summed over layers (ms); step ms: slowest rank\n");
  std::printf(
      "copies: ranks each row is delivered to (a2a expects %.2f under uniform routing); bal.p / bal.b: mean / "
      "max picks and expert bytes per rank\n",
      r["expected_a2a_copies_per_row_uniform"].get<double>());
  if (checked) std::printf("check: every option matches the single-process layer within its tolerance\n");
}

}  // namespace

void AddRunCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<RunOptions>();
  auto* cmd = app.add_subcommand(
      "run", "Run MoE layers across MPI ranks (start under mpirun) with one option or all of them side by side");
  cmd->add_option("--model", o->model, kModelOptionHelp)->capture_default_str();
  cmd->add_option("--option", o->options, "How rows meet experts: one, several comma separated (run in that order), or all")
      ->delimiter(',')
      ->check(CLI::IsMember({"sliced", "whole", "hybrid", "a2a", "dwdp", "all"}))
      ->capture_default_str();
  cmd->add_option("--tokens,-t", o->tokens, "Rows per step over all ranks (T)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--steps", o->steps, "Steps (new rows each); times are medians over steps")
      ->check(kPositive)
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
      // Every rank reaches the same refusal; rank 0 says it once. A peer that stopped answering is
      // reported by the rank that noticed, and the job is ended.
      if (is_root || status.code() == StatusCode::kUnavailable) *exit_code = ReportError(status);
      *exit_code = 1;
      if (status.code() == StatusCode::kUnavailable) AbortJob(1);
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
