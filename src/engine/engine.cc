#include "epmoe/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "epmoe/balance.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

class RouterRouting final : public Routing {
 public:
  RouterRouting(const ModelConfig& model, std::vector<RouterWeights> routers, std::vector<std::vector<float>> biases)
      : router_(model), routers_(std::move(routers)), biases_(std::move(biases)) {}
  Status Route(int64_t, int layer, const Matrix& rows, int64_t, Picks* picks, ThreadPool& pool) const override {
    if (layer < 0 || layer >= static_cast<int>(routers_.size()))
      return InvalidArgument(fmt::format("routing: layer {} outside [0, {})", layer, routers_.size()));
    return router_.Route(rows, routers_[layer], biases_[layer], picks, &pool);
  }

 private:
  Router router_;
  std::vector<RouterWeights> routers_;
  std::vector<std::vector<float>> biases_;
};

class SimulatedPicks final : public Routing {
 public:
  SimulatedPicks(const ModelConfig& model, RoutingMode mode, uint64_t seed) : model_(model), mode_(mode), seed_(seed) {}
  Status Route(int64_t step, int layer, const Matrix& rows, int64_t first_row, Picks* picks,
               ThreadPool&) const override {
    *picks = mode_ == RoutingMode::kRoundRobin
                 ? RoundRobinPicks(model_, rows.rows, first_row)
                 : UniformPicks(model_, rows.rows, seed_ * 1000003 + step * 1009 + layer, first_row);
    return Status::Ok();
  }

 private:
  ModelConfig model_;
  RoutingMode mode_;
  uint64_t seed_;
};

// The rows a rank records when it holds every row (tensor-parallel): its data-parallel share, so
// the recorders of all ranks count each row once.
Picks DataParallelShare(const Picks& picks, int ranks, int rank) {
  const int k = picks.k;
  const int64_t first = RowBegin(picks.rows, ranks, rank), count = RowBegin(picks.rows, ranks, rank + 1) - first;
  auto slice = [&](const auto& values) {
    using Values = std::decay_t<decltype(values)>;
    if (values.empty()) return Values{};
    return Values(values.begin() + first * k, values.begin() + (first + count) * k);
  };
  return Picks{count, k, slice(picks.experts), slice(picks.weights)};
}

}  // namespace

Result<std::unique_ptr<Routing>> ModelRouting(const ModelConfig& model, const WeightSource& weights, int layers,
                                              const std::string& isa, ThreadPool& pool) {
  std::vector<RouterWeights> routers;
  std::vector<std::vector<float>> biases;
  for (int layer = 0; layer < layers; ++layer) {
    EPMOE_ASSIGN_OR_RETURN(MoeLayerWeights routing, weights.Routing(layer, &pool));
    EPMOE_ASSIGN_OR_RETURN(RouterWeights router, RouterWeights::Pack(routing.router, isa));
    routers.push_back(std::move(router));
    biases.push_back(std::move(routing.router_bias));
  }
  return std::unique_ptr<Routing>(new RouterRouting(model, std::move(routers), std::move(biases)));
}

Result<std::unique_ptr<Routing>> SimulatedRouting(const ModelConfig& model, RoutingMode mode, uint64_t seed) {
  if (mode != RoutingMode::kRoundRobin && mode != RoutingMode::kUniform)
    return InvalidArgument("simulated routing: round robin or uniform");
  return std::unique_ptr<Routing>(new SimulatedPicks(model, mode, seed));
}

Result<std::unique_ptr<TraceRouting>> TraceRouting::Open(const std::string& path, const ModelConfig& model, int layers,
                                                         int64_t max_steps) {
  EPMOE_ASSIGN_OR_RETURN(auto reader, TraceReader::Open(path, LoadReadOptions{}));
  const TraceInfo& info = reader->info();
  if (!info.has_picks)
    return InvalidArgument(fmt::format("trace {}: holds per-expert counts only; replay needs per-row picks", path));
  if (info.num_experts != model.num_experts || info.top_k != model.top_k)
    return InvalidArgument(fmt::format("trace {}: {} experts, top-{}; the model {} has {} experts, top-{}", path,
                                       info.num_experts, info.top_k, model.name, model.num_experts, model.top_k));
  if (info.num_layers < layers)
    return InvalidArgument(fmt::format("trace {}: {} layers, fewer than the {} to run", path, info.num_layers, layers));
  std::unique_ptr<TraceRouting> routing(new TraceRouting());
  while (routing->num_steps() < max_steps) {
    StepPicks step;
    EPMOE_ASSIGN_OR_RETURN(const bool more, reader->Next(&step));
    if (!more) break;
    for (Picks& picks : step.layers)
      if (picks.weights.empty())
        picks.weights.assign(picks.experts.size(), static_cast<float>(model.routed_scaling / model.top_k));
    routing->steps_.push_back(std::move(step));
  }
  if (routing->steps_.empty()) return InvalidArgument(fmt::format("trace {}: no steps", path));
  return routing;
}

Status TraceRouting::Route(int64_t step, int layer, const Matrix& rows, int64_t first_row, Picks* picks,
                           ThreadPool&) const {
  if (step < 0) return InvalidArgument(fmt::format("trace routing: step {}", step));
  const Picks& all = Replayed(step).layers[layer];
  if (first_row < 0 || first_row + rows.rows > all.rows)
    return InvalidArgument(fmt::format("trace routing: rows [{}, {}) outside step {}'s {} rows", first_row,
                                       first_row + rows.rows, step, all.rows));
  const int k = all.k;
  *picks = Picks{
      rows.rows, k,
      std::vector<int32_t>(all.experts.begin() + first_row * k, all.experts.begin() + (first_row + rows.rows) * k),
      std::vector<float>(all.weights.begin() + first_row * k, all.weights.begin() + (first_row + rows.rows) * k)};
  return Status::Ok();
}

double CheckTolerance(RowFormat dispatch, RowFormat combine, WeightFormat weights) {
  // Kernels that quantize activations to int8 (int8 and the 4-bit formats) turn the travel
  // format's rounding into int8 rounding steps (and slices quantize their own intermediate rows),
  // so a row that travels rounded may differ by a few activation steps: measured up to 0.04 at
  // hidden 1024, intermediate 512.
  double t = 1e-5;
  if (dispatch == RowFormat::kBf16 || combine == RowFormat::kBf16) t = 2e-2;
  const bool int8_activations =
      weights == WeightFormat::kInt8 || weights == WeightFormat::kNvfp4 || weights == WeightFormat::kMxfp4;
  if (dispatch != RowFormat::kFp32 && int8_activations) t = 8e-2;
  if (dispatch == RowFormat::kQ8) t = std::max(t, 5e-2);
  if (dispatch == RowFormat::kQ4) t = 3e-1;
  return t;
}

Engine::Engine(Communicator& comm, const ModelConfig& model, const EngineOptions& options, ThreadPool& pool)
    : comm_(comm), model_(model), options_(options), pool_(pool) {}

Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::Create(Communicator& comm, const ModelConfig& model,
                                               const EngineOptions& options, ThreadPool& pool) {
  const EpOption option = options.executor.option;
  const bool follows_placement = option == EpOption::kA2a || option == EpOption::kWhole;
  if (options.rebalance && !follows_placement)
    return InvalidArgument(
        fmt::format("rebalancing moves the experts of a2a and whole, not {} (their experts follow no placement)",
                    EpOptionName(option)));
  if (!options.metrics_file.empty() && !options.rebalance)
    return InvalidArgument("a metrics file is written by a rebalancing run");
  if (options.two_batch_overlap) {
    if (option != EpOption::kA2a)
      return InvalidArgument(
          fmt::format("two-batch overlap runs a2a's exchange beside its experts, not {}'s", EpOptionName(option)));
    if (options.executor.origin != RowOrigin::kDataParallel)
      return InvalidArgument("two-batch overlap splits each rank's own rows in two: it needs data-parallel rows");
    if (!comm.concurrent_threads())
      return FailedPrecondition(
          "two-batch overlap runs its micro-batches' exchanges from two threads, which this MPI was not started "
          "for (it needs MPI_THREAD_MULTIPLE: a program that initializes MPI itself must ask for it)");
  }
  EPMOE_RETURN_IF_ERROR(CheckExecutorShape(model, options.executor, comm.size()));
  EngineOptions engine_options = options;
  // Two lanes hold their exchange buffers at once: each gets half of the bound, and a lane's
  // micro-batch holds at most half the rank's rows (rounded up), which low-latency sizes for.
  if (options.two_batch_overlap) {
    engine_options.executor.max_buffer_bytes /= 2;
    engine_options.executor.max_rows_per_rank = (options.executor.max_rows_per_rank + 1) / 2;
  }
  std::unique_ptr<Engine> engine(new Engine(comm, model, engine_options, pool));
  EPMOE_ASSIGN_OR_RETURN(engine->executor_, CreateExecutor(comm, model, engine_options.executor, pool));
  if (options.two_batch_overlap) {
    EPMOE_ASSIGN_OR_RETURN(engine->lane_comm_, comm.Split(0, comm.rank()));
    engine->lane_pool_ = std::make_unique<ThreadPool>(pool.size());
    EPMOE_ASSIGN_OR_RETURN(engine->lane_executor_,
                           engine->executor_->CreateLane(*engine->lane_comm_, *engine->lane_pool_));
  }
  engine->live_ = engine->executor_->live_placement();
  const bool record = options.rebalance || !options.record_load_path.empty();
  if (record && engine->live_ == nullptr) {
    // Options whose experts follow no placement still record their load (per logical expert),
    // dealt over the trivial placement's slots.
    EPMOE_ASSIGN_OR_RETURN(engine->live_, ResolveLivePlacement(model, options.executor, comm));
  }
  if (record) {
    RecorderOptions rec = options.recorder;
    if (RebalanceTarget* target = engine->executor_->rebalance_target()) {
      rec.bytes_per_expert = static_cast<double>(target->expert_bytes());
    }
    EPMOE_ASSIGN_OR_RETURN(LoadRecorder recorder, LoadRecorder::Create(rec, engine->live_));
    engine->recorder_ = std::make_unique<LoadRecorder>(std::move(recorder));
  }
  if (!options.record_load_path.empty() && comm.rank() == 0) {
    TraceInfo info;
    info.num_layers = options.executor.num_layers;
    info.num_experts = model.num_experts;
    info.top_k = model.top_k;
    info.has_picks = info.has_weights = options.recorder.mode == RecorderMode::kPerToken;
    for (int layer = 0; layer < info.num_layers; ++layer) info.layer_ids.push_back(layer);
    EPMOE_ASSIGN_OR_RETURN(engine->load_file_, TraceWriter::Create(options.record_load_path, info));
  }
  if (options.rebalance) {
    RebalanceTarget* target = engine->executor_->rebalance_target();
    EPMOE_CHECK(target != nullptr && engine->live_ != nullptr);  // a2a and whole have both
    const Placement& initial = *engine->live_->placement();
    RebalancerOptions ro = options.rebalancer;
    ro.policy.shape.num_ranks = initial.num_ranks();
    ro.policy.shape.num_nodes = initial.num_nodes();
    ro.policy.shape.num_redundant = initial.num_slots() - initial.num_experts();
    // With several nodes and expert groups that divide over them, DeepSeek's hierarchical policy
    // (groups to nodes, then copies within a node) keeps a row's picks on fewer nodes.
    ro.policy.shape.num_groups = model.num_expert_groups;
    ro.policy.cost.bytes_per_expert = static_cast<double>(target->expert_bytes());
    ro.policy.cost.flops_per_row = 6.0 * model.hidden * model.expert_intermediate;
    EPMOE_ASSIGN_OR_RETURN(engine->rebalancer_, Rebalancer::Create(comm, *target, engine->live_, ro));
    if (!options.metrics_file.empty() && comm.rank() == 0) {
      EPMOE_ASSIGN_OR_RETURN(RebalanceMetrics metrics, RebalanceMetrics::Create(options.metrics_file));
      engine->metrics_ = std::make_unique<RebalanceMetrics>(std::move(metrics));
      EPMOE_RETURN_IF_ERROR(engine->metrics_->Write());
    }
  }
  if (options.check) {
    const std::shared_ptr<const WeightSource> weights =
        options.executor.weights ? options.executor.weights : SyntheticWeights(model, options.executor.seed);
    for (int layer = 0; layer < options.executor.num_layers; ++layer) {
      PackOptions pack = options.executor.pack;
      pack.pool = &pool;
      EPMOE_ASSIGN_OR_RETURN(auto reference, MoeLayer::Create(model, *weights, layer, pack));
      engine->references_.push_back(std::move(reference));
    }
  }
  return engine;
}

// One batch of this rank's rows as it goes through the layers of a step.
struct Engine::Batch {
  Matrix rows;            // in: the batch's rows; out: with every layer's output added
  int64_t first_row = 0;  // global index of rows' first row
  int64_t step = 0;
  std::vector<Picks> picks;             // per layer
  std::vector<StepStats> stats;         // per layer, route_us included
  std::vector<double> wall_us;          // per layer
  std::vector<Matrix> inputs, outputs;  // per layer, kept for the check
};

Status Engine::RunBatch(MoeExecutor& executor, ThreadPool& pool, const Routing& routing, Batch* batch) const {
  const int layers = options_.executor.num_layers;
  batch->picks.resize(layers);
  batch->stats.assign(layers, StepStats{});
  batch->wall_us.assign(layers, 0);
  if (options_.check) {
    batch->inputs.resize(layers);
    batch->outputs.resize(layers);
  }
  for (int layer = 0; layer < layers; ++layer) {
    const auto start = std::chrono::steady_clock::now();
    Picks& picks = batch->picks[layer];
    EPMOE_RETURN_IF_ERROR(routing.Route(batch->step, layer, batch->rows, batch->first_row, &picks, pool)
                              .WithContext(fmt::format("step {} layer {}: routing", batch->step, layer)));
    const double route_us = SecondsSince(start) * 1e6;
    Matrix out;
    StepStats& st = batch->stats[layer];
    EPMOE_RETURN_IF_ERROR(
        executor.Forward(layer, batch->rows, picks, &out, &st)
            .WithContext(fmt::format("{} step {} layer {}", EpOptionName(executor.option()), batch->step, layer)));
    st.route_us = route_us;
    if (options_.settle_each_step && layer + 1 == layers) {
      const auto settle = std::chrono::steady_clock::now();
      EPMOE_RETURN_IF_ERROR(executor.Settle());
      st.dispatch_us += SecondsSince(settle) * 1e6;
    }
    batch->wall_us[layer] = SecondsSince(start) * 1e6;
    if (options_.check) batch->inputs[layer] = batch->rows;
    for (size_t i = 0; i < batch->rows.data.size(); ++i) batch->rows.data[i] += out.data[i];  // residual stream
    if (options_.check) batch->outputs[layer] = std::move(out);
  }
  return Status::Ok();
}

namespace {

// a's rows, then b's.
Matrix ConcatRows(const Matrix& a, const Matrix& b) {
  Matrix both(a.rows + b.rows, a.cols);
  std::copy(a.data.begin(), a.data.end(), both.data.begin());
  std::copy(b.data.begin(), b.data.end(), both.data.begin() + static_cast<ptrdiff_t>(a.data.size()));
  return both;
}

}  // namespace

Result<StepReport> Engine::Step(Matrix* rows, int64_t first_row, const Routing& routing) {
  const int g = comm_.size(), me = comm_.rank(), layers = options_.executor.num_layers;
  const bool tensor_parallel = options_.executor.origin == RowOrigin::kTensorParallel;
  StepReport report;
  report.step = steps_done_;
  EPMOE_RETURN_IF_ERROR(comm_.Barrier());
  // The step's batches: the rank's rows, or with two-batch overlap its first half and the rest,
  // the second on the lane in a thread of its own while this thread runs the first.
  std::vector<Batch> batches(lane_executor_ ? 2 : 1);
  const int64_t first_count = lane_executor_ ? (rows->rows + 1) / 2 : rows->rows;
  batches[0].rows = lane_executor_ ? RowSlice(*rows, 0, first_count) : std::move(*rows);
  batches[0].first_row = first_row;
  if (lane_executor_) {
    batches[1].rows = RowSlice(*rows, first_count, rows->rows - first_count);
    batches[1].first_row = first_row + first_count;
  }
  for (Batch& batch : batches) batch.step = steps_done_;
  const auto start = std::chrono::steady_clock::now();
  Status second = Status::Ok();
  std::thread lane;
  if (lane_executor_) {
    lane = std::thread([&] { second = RunBatch(*lane_executor_, *lane_pool_, routing, &batches[1]); });
  }
  Status first = RunBatch(*executor_, pool_, routing, &batches[0]);
  if (lane.joinable()) lane.join();
  const double elapsed_us = SecondsSince(start) * 1e6;
  EPMOE_RETURN_IF_ERROR(first);
  EPMOE_RETURN_IF_ERROR(second);
  *rows = batches.size() == 1 ? std::move(batches[0].rows) : ConcatRows(batches[0].rows, batches[1].rows);

  // Per layer this rank's stage seconds and wall seconds (doubles), and its counts (integers).
  std::vector<double> times;
  std::vector<int64_t> counts;
  double max_error = 0, longest_sum = 0;
  for (int layer = 0; layer < layers; ++layer) {
    double longest = 0;
    for (const Batch& batch : batches) longest = std::max(longest, batch.wall_us[layer]);
    longest_sum += longest;
  }
  for (int layer = 0; layer < layers; ++layer) {
    // The recorder deals each batch's picks as its executor did: one Record call per batch.
    for (const Batch& batch : batches) {
      if (recorder_) {
        EPMOE_RETURN_IF_ERROR(recorder_->Record(
            layer, tensor_parallel ? DataParallelShare(batch.picks[layer], g, me) : batch.picks[layer]));
      }
    }
    if (!references_.empty()) {
      // Each batch against the single-process layer on its own rows (its rows do not depend on
      // the other batch's).
      double error = 0;
      for (const Batch& batch : batches) {
        Matrix expected;
        EPMOE_RETURN_IF_ERROR(
            references_[layer]->Forward(batch.inputs[layer], batch.picks[layer], &expected, pool_, nullptr));
        error = std::max(error, NormalizedMaxError(batch.outputs[layer], expected));
      }
      const double allowed = CheckTolerance(options_.executor.dispatch_format, options_.executor.combine_format,
                                            options_.executor.pack.format);
      EPMOE_ASSIGN_OR_RETURN(const int64_t any_bad, comm_.AllreduceMax(error <= allowed ? 0 : 1));
      if (any_bad)
        return Internal(
            fmt::format("check: {} step {} layer {} differs from the single-process layer on rank {}: "
                        "normalized max error {:.3g} (allowed {:.1g})",
                        EpOptionName(executor_->option()), steps_done_, layer, me, error, allowed));
      max_error = std::max(max_error, error);
    }
    StepStats st = batches[0].stats[layer];
    double wall_us = batches[0].wall_us[layer];
    if (batches.size() == 2) {
      st.Add(batches[1].stats[layer]);
      // Both lanes hold their buffers at once; the step's wall time is shared out over the layers
      // in proportion to each layer's longer micro-batch.
      st.peak_buffer_bytes = batches[0].stats[layer].peak_buffer_bytes + batches[1].stats[layer].peak_buffer_bytes;
      const double longest = std::max(batches[0].wall_us[layer], batches[1].wall_us[layer]);
      wall_us = longest_sum > 0 ? elapsed_us * longest / longest_sum : 0;
    }
    for (const StageField& stage : kStages) times.push_back(st.*stage.us);
    times.push_back(wall_us);
    counts.insert(counts.end(),
                  {st.rows, st.row_copies, st.picks, st.expert_bytes_read, st.bytes_sent, st.bytes_received,
                   st.peak_buffer_bytes, st.rounds, st.inter_node_bytes_sent, st.inter_node_bytes_received});
  }
  times.push_back(max_error);

  // Every rank's figures, in two typed all-gathers.
  const size_t time_fields = kNumStages + 1, count_fields = 10;
  std::vector<double> all_times(times.size() * g);
  std::vector<int64_t> all_counts(counts.size() * g);
  EPMOE_RETURN_IF_ERROR(comm_.AllgatherDouble(times, all_times));
  EPMOE_RETURN_IF_ERROR(comm_.AllgatherInt64(counts, all_counts));
  double picks_balance = 0, bytes_balance = 0;
  for (int layer = 0; layer < layers; ++layer) {
    std::vector<double> rank_picks(g), rank_bytes(g);
    for (int r = 0; r < g; ++r) {
      const int64_t* c = &all_counts[r * counts.size() + layer * count_fields];
      rank_picks[r] = static_cast<double>(c[2]);
      rank_bytes[r] = static_cast<double>(c[3]);
    }
    picks_balance += Balancedness(rank_picks);
    bytes_balance += Balancedness(rank_bytes);
  }
  report.picks_balancedness = layers > 0 ? picks_balance / layers : 1;
  report.bytes_balancedness = layers > 0 ? bytes_balance / layers : 1;
  int64_t row_visits = 0, copies = 0;
  report.rank_picks.assign(g, 0);
  for (int r = 0; r < g; ++r) {
    double wall = 0;
    for (int layer = 0; layer < layers; ++layer) {
      const double* t = &all_times[r * times.size() + layer * time_fields];
      for (int s = 0; s < kNumStages; ++s) report.stage_seconds[s] += t[s] / 1e6 / g;
      wall += t[kNumStages] / 1e6;
      const int64_t* c = &all_counts[r * counts.size() + layer * count_fields];
      row_visits += c[0];
      copies += c[1];
      report.rank_picks[r] += c[2];
      report.bytes_sent += c[4];
      report.bytes_received += c[5];
      report.peak_buffer_bytes = std::max(report.peak_buffer_bytes, c[6]);
      report.rounds = std::max(report.rounds, static_cast<int>(c[7]));
      report.inter_node_bytes_sent += c[8];
      report.inter_node_bytes_received += c[9];
    }
    report.seconds = std::max(report.seconds, wall);  // a step waits for its slowest rank
    report.max_error = std::max(report.max_error, all_times[(r + 1) * times.size() - 1]);
  }
  report.rows = layers > 0 ? row_visits / layers : 0;  // each layer counts the step's rows
  report.copies_per_row = row_visits > 0 ? static_cast<double>(copies) / static_cast<double>(row_visits) : 0;
  ++steps_done_;
  if (recorder_)
    EPMOE_RETURN_IF_ERROR(Boundary(report.stage_seconds, report.seconds, report.picks_balancedness, &report));
  return report;
}

Status Engine::Boundary(const StageSeconds& stages, double step_seconds, double picks_balancedness,
                        StepReport* report) {
  recorder_->EndStep();
  if (!options_.record_load_path.empty()) EPMOE_RETURN_IF_ERROR(AppendRecordedLoad(report->rows));
  if (rebalancer_ == nullptr) return Status::Ok();
  const auto start = std::chrono::steady_clock::now();
  EPMOE_ASSIGN_OR_RETURN(report->boundary, rebalancer_->AtStepBoundary(steps_done_, *recorder_));
  report->boundary_seconds = SecondsSince(start);
  if (metrics_) {
    std::vector<std::pair<std::string, double>> stage_list;
    for (int s = 0; s < kNumStages; ++s) stage_list.emplace_back(kStages[s].name, stages[s]);
    stage_list.emplace_back("rebalance", report->boundary_seconds);
    metrics_->RecordStep(step_seconds + report->boundary_seconds, stage_list);
    if (report->boundary.checked || report->boundary.started)
      windowed_balancedness_ = report->boundary.window_balancedness;
    metrics_->RecordBalance(picks_balancedness, windowed_balancedness_);
    for (; metrics_reported_ < rebalancer_->reports().size(); ++metrics_reported_)
      metrics_->RecordRebalance(rebalancer_->reports()[metrics_reported_]);
    metrics_->Update();  // best effort while steps run: a failed write warns once
  }
  return Status::Ok();
}

Status Engine::AppendRecordedLoad(int64_t rows) {
  const int layers = options_.executor.num_layers, experts = model_.num_experts, g = comm_.size();
  StepPicks step;
  if (options_.recorder.mode == RecorderMode::kPerToken) {
    // Every rank's rows of the last step, in rank order (the global order of data-parallel rows).
    const int64_t last = recorder_->steps_kept() - 1;
    for (int layer = 0; layer < layers; ++layer) {
      const Picks& mine = recorder_->TokenPicks(last, layer);
      std::vector<int64_t> rows(g);
      EPMOE_RETURN_IF_ERROR(comm_.AllgatherInt64(std::vector<int64_t>{mine.rows}, rows));
      const int k = model_.top_k;
      std::vector<int64_t> id_bytes(g), weight_bytes(g);
      for (int r = 0; r < g; ++r) {
        id_bytes[r] = rows[r] * k * static_cast<int64_t>(sizeof(int32_t));
        weight_bytes[r] = rows[r] * k * static_cast<int64_t>(sizeof(float));
      }
      Picks all;
      all.k = k;
      for (int64_t r : rows) all.rows += r;
      all.experts.resize(all.rows * k);
      all.weights.resize(all.rows * k);
      std::vector<float> weights = mine.weights;
      weights.resize(mine.rows * k, static_cast<float>(model_.routed_scaling / k));
      const std::vector<int64_t> id_offsets = PrefixOffsets(id_bytes), weight_offsets = PrefixOffsets(weight_bytes);
      EPMOE_RETURN_IF_ERROR(comm_.Allgatherv(mine.experts.data(), id_bytes[comm_.rank()], all.experts.data(), id_bytes,
                                             std::span(id_offsets).first(g)));
      EPMOE_RETURN_IF_ERROR(comm_.Allgatherv(weights.data(), weight_bytes[comm_.rank()], all.weights.data(),
                                             weight_bytes, std::span(weight_offsets).first(g)));
      step.rows = all.rows;
      step.layers.push_back(std::move(all));
    }
    CountStepPicks(layers, experts, &step);
  } else {
    std::vector<int64_t> mine;
    for (int layer = 0; layer < layers; ++layer) {
      auto picks = recorder_->ExpertPicks(layer);
      mine.insert(mine.end(), picks.begin(), picks.end());
    }
    std::vector<int64_t> all(mine.size() * g);
    EPMOE_RETURN_IF_ERROR(comm_.AllgatherInt64(mine, all));
    step.counts.assign(mine.size(), 0);
    for (int r = 0; r < g; ++r)
      for (size_t i = 0; i < mine.size(); ++i) step.counts[i] += all[r * mine.size() + i];
    step.rows = rows;
    if (options_.recorder.mode == RecorderMode::kStat) {
      if (run_load_.empty()) run_load_.assign(step.counts.size(), 0);
      for (size_t i = 0; i < step.counts.size(); ++i) run_load_[i] += step.counts[i];
      run_rows_ += rows;
      return Status::Ok();  // written once, at Close
    }
  }
  if (load_file_ == nullptr) return Status::Ok();
  return load_file_->Append(step).WithContext("--record-load");
}

Status Engine::ProposePlacement(const PlacementPtr& placement) {
  if (rebalancer_ == nullptr) return FailedPrecondition("proposing a placement needs a rebalancing engine");
  return rebalancer_->Propose(placement);
}

Status Engine::Close() {
  if (load_file_ != nullptr) {
    if (options_.recorder.mode == RecorderMode::kStat && !run_load_.empty()) {
      StepPicks sum;
      sum.rows = run_rows_;
      sum.counts = std::move(run_load_);
      EPMOE_RETURN_IF_ERROR(load_file_->Append(sum).WithContext("--record-load"));
    }
    EPMOE_RETURN_IF_ERROR(load_file_->Close().WithContext("--record-load"));
    load_file_.reset();
  }
  if (lane_executor_) EPMOE_RETURN_IF_ERROR(lane_executor_->Close());
  return executor_->Close();
}

}  // namespace epmoe
