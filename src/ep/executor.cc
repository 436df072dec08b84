// The executor factory, shape checks and helpers shared by every option.
#include "epmoe/executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/huge_pages.h"
#include "ep/executor_internal.h"
#include "epmoe/layer.h"
#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"

namespace epmoe {

void StepStats::Add(const StepStats& o) {
  for (const StageField& stage : kStages) this->*stage.us += o.*stage.us;
  rows += o.rows;
  row_copies += o.row_copies;
  picks += o.picks;
  expert_bytes_read += o.expert_bytes_read;
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  inter_node_bytes_sent += o.inter_node_bytes_sent;
  inter_node_bytes_received += o.inter_node_bytes_received;
  peak_buffer_bytes = std::max(peak_buffer_bytes, o.peak_buffer_bytes);
  rounds = std::max(rounds, o.rounds);
}

int64_t RowBegin(int64_t total, int ranks, int rank) {
  const int64_t base = total / ranks, extra = total % ranks;
  return rank * base + std::min<int64_t>(rank, extra);
}

namespace ep_internal {

int64_t LowLatencyMessageBytes(const ModelConfig& model, const ExecutorOptions& o) {
  const int64_t record = 8 * int64_t{model.top_k} + RowBytes(o.dispatch_format, model.hidden);
  return 8 + o.max_rows_per_rank * record;
}

std::array<int64_t, kA2aBuffers> LowLatencyBufferBytes(const ModelConfig& model, const ExecutorOptions& o, int ranks) {
  const int64_t g = ranks, k = model.top_k, h = model.hidden, rows = o.max_rows_per_rank;
  const int64_t slots = o.placement != nullptr ? o.placement->slots_per_rank() : (model.num_experts + g - 1) / g;
  const int64_t picks_per_row = std::min(k, slots), returned = RowBytes(o.combine_format, h);
  const int64_t message = LowLatencyMessageBytes(model, o);
  const int64_t received = g * rows;  // every source sends a row here at most once
  // Returns per home row: one per pick, or one per destination rank with partial sums.
  const int64_t returns = rows * (o.combine_partial_sums ? std::min(k, g) : k) * returned;
  const int64_t back_per_row = (o.combine_partial_sums ? 1 : picks_per_row) * returned;
  return {returns,
          g * message,
          g * message,
          received * h * 4,
          received * h * 4,
          received * picks_per_row * h * 4,
          received * picks_per_row * h * 4,
          (g - 1) * rows * back_per_row,
          0,
          0,
          0,
          0};
}

int64_t LowLatencyBytes(const ModelConfig& model, const ExecutorOptions& o, int ranks) {
  int64_t bytes = 0;
  for (int64_t buffer : LowLatencyBufferBytes(model, o, ranks)) bytes += buffer;
  return bytes;
}

}  // namespace ep_internal

A2aMode ResolveA2aMode(const ModelConfig& model, const ExecutorOptions& options, int num_ranks) {
  if (options.a2a_mode != A2aMode::kAuto) return options.a2a_mode;
  if (options.a2a_levels == A2aLevels::kTwoLevel) return A2aMode::kNormal;  // low-latency is flat
  const bool decode = options.max_rows_per_rank > 0 && options.max_rows_per_rank <= kAutoLowLatencyMaxRows;
  const bool fits = decode && ep_internal::LowLatencyBytes(model, options, num_ranks) <= options.max_buffer_bytes;
  return fits ? A2aMode::kLowLatency : A2aMode::kNormal;
}

A2aLevels ResolveA2aLevels(const ModelConfig& model, const ExecutorOptions& options, int num_ranks, int num_nodes) {
  if (ResolveA2aMode(model, options, num_ranks) == A2aMode::kLowLatency) return A2aLevels::kFlat;
  return UsesTwoLevels(options.a2a_levels, num_ranks, num_nodes) ? A2aLevels::kTwoLevel : A2aLevels::kFlat;
}

Status CheckExecutorShape(const ModelConfig& model, const ExecutorOptions& o, int num_ranks) {
  const std::string name = EpOptionName(o.option);
  const int g = num_ranks;
  if (g < 1) return InvalidArgument(fmt::format("{}: {} ranks", name, g));
  if (o.num_layers < 1) return InvalidArgument(fmt::format("{}: {} layers; at least 1", name, o.num_layers));
  if (o.max_buffer_bytes < 1)
    return InvalidArgument(fmt::format("{}: buffer bound of {} bytes must be positive", name, o.max_buffer_bytes));
  EPMOE_RETURN_IF_ERROR(CheckRowWidth(o.dispatch_format, model.hidden).WithContext(name + ": dispatch format"));
  if (o.combine_format != RowFormat::kFp32 && o.combine_format != RowFormat::kBf16)
    return InvalidArgument(fmt::format("{}: outputs come back in fp32 or bf16, not {}", name,
                                       RowFormatName(o.combine_format)));
  EPMOE_RETURN_IF_ERROR(CheckShape(o.pack.format, model.expert_intermediate, model.hidden));
  if (o.option != EpOption::kHybrid && o.tp_in_ep != 1)
    return InvalidArgument(fmt::format("{}: --tp-in-ep {} applies to hybrid only", name, o.tp_in_ep));
  if (o.option != EpOption::kA2a && o.single_batch_overlap)
    return InvalidArgument(fmt::format("{}: single-batch overlap runs a2a's shared expert during its dispatch", name));
  if (o.option != EpOption::kA2a && o.a2a_progress != A2aProgress::kWait)
    return InvalidArgument(fmt::format("{}: --a2a-progress {} applies to a2a's exchanges", name,
                                       A2aProgressName(o.a2a_progress)));
  const bool gathers = GathersRows(o.option);
  if (!gathers && o.shared == SharedMode::kSliced && model.num_shared_experts > 0)
    return FailedPrecondition(fmt::format("{}: the shared expert cannot be sliced (rows do not visit every rank); it is "
                                          "copied to every rank", name));
  // Ways each routed expert is sliced.
  int slices = 1;
  if (o.option == EpOption::kSliced) slices = g;
  if (o.option == EpOption::kHybrid) {
    if (o.tp_in_ep < 1 || g % o.tp_in_ep != 0)
      return FailedPrecondition(fmt::format("hybrid: --tp-in-ep {} must divide the {} ranks", o.tp_in_ep, g));
    slices = o.tp_in_ep;
    if (g / slices > model.num_experts)
      return FailedPrecondition(fmt::format("hybrid: {} expert groups for {} experts", g / slices, model.num_experts));
  }
  if (model.expert_intermediate % slices != 0)
    return FailedPrecondition(fmt::format("{}: the experts' intermediate size {} is not divisible by the {} slices",
                                          name, model.expert_intermediate, slices));
  EPMOE_RETURN_IF_ERROR(CheckShape(o.pack.format, model.hidden, model.expert_intermediate / slices)
                            .WithContext(fmt::format("{}: a slice of {} of the intermediate dimension", name,
                                                     model.expert_intermediate / slices)));
  if (gathers && model.num_shared_experts > 0 && o.shared != SharedMode::kCopied) {
    if (model.shared_intermediate % g != 0)
      return FailedPrecondition(fmt::format("{}: the shared expert's intermediate size {} is not divisible by {} ranks "
                                            "(copy it instead: --shared copied)", name, model.shared_intermediate, g));
    EPMOE_RETURN_IF_ERROR(CheckShape(o.pack.format, model.hidden, model.shared_intermediate / g)
                              .WithContext(name + ": shared expert slice"));
  }
  const bool placed = o.option == EpOption::kWhole || o.option == EpOption::kA2a;
  if (!placed && o.placement != nullptr)
    return InvalidArgument(fmt::format("{}: a placement applies to whole and a2a only", name));
  if (placed) {
    if (o.placement != nullptr) {
      const Placement& p = *o.placement;
      if (p.num_experts() != model.num_experts || p.num_ranks() != g || p.num_layers() < o.num_layers)
        return InvalidArgument(fmt::format("{}: the placement is for {} experts, {} ranks, {} layers; the run has {}, {}, "
                                           "{}", name, p.num_experts(), p.num_ranks(), p.num_layers(), model.num_experts,
                                           g, o.num_layers));
    } else if (model.num_experts % g != 0) {
      return FailedPrecondition(fmt::format("{}: {} experts cannot be split evenly over {} ranks (give a placement with "
                                            "redundant slots)", name, model.num_experts, g));
    }
  }
  if (o.max_rows_per_rank < 0)
    return InvalidArgument(
        fmt::format("{}: {} rows per rank at most: must not be negative", name, o.max_rows_per_rank));
  if (o.option == EpOption::kA2a && o.a2a_mode == A2aMode::kLowLatency && o.a2a_levels == A2aLevels::kTwoLevel)
    return InvalidArgument(
        "a2a: low-latency mode sends every rank its records straight (flat, as DeepEP's low-latency "
        "kernels), so it cannot run the two-level exchange: use --a2a-mode normal (or auto) with "
        "--a2a-levels two-level, or --a2a-levels flat (or auto) with low-latency");
  if (o.option == EpOption::kA2a && ResolveA2aMode(model, o, g) == A2aMode::kLowLatency) {
    if (o.max_rows_per_rank == 0)
      return InvalidArgument(
          "a2a low-latency: its buffers are sized from the most rows a rank sends per step, which "
          "was not given (ExecutorOptions::max_rows_per_rank; epmoe run sets it from --tokens)");
    const int64_t fixed = ep_internal::LowLatencyBytes(model, o, g);
    if (fixed > o.max_buffer_bytes)
      return OutOfRange(
          fmt::format("a2a low-latency: the fixed buffers for {} rows per rank on {} ranks need {} bytes, "
                      "over the buffer bound of {} bytes (raise the bound, send fewer rows per rank, or "
                      "use normal mode)",
                      o.max_rows_per_rank, g, fixed, o.max_buffer_bytes));
  }
  if (o.option == EpOption::kDwdp && g > 1) {
    // The double buffer holds two pieces of at least one packed expert each (the reads land in
    // place); a layer whose lacking experts do not fit is read in pieces.
    const int64_t expert = RoutedExpertBytes(model, o.pack.format);
    if (2 * expert > o.max_buffer_bytes)
      return OutOfRange(fmt::format("dwdp: the double buffer needs at least 2 packed experts of {} bytes, over the "
                                    "bound of {} bytes (raise the buffer bound)", expert, o.max_buffer_bytes));
  }
  return Status::Ok();
}

MemoryEstimate EstimateExecutorMemory(const ModelConfig& model, const ExecutorOptions& o, int num_ranks, int rank,
                                      int64_t tokens) {
  const int g = std::max(num_ranks, 1), e = model.num_experts, k = model.top_k;
  const WeightFormat format = o.pack.format;
  // Bytes of an expert cut `slices` ways along the intermediate dimension: each slice has scales of
  // its own (a row of down keeps its scale in every slice); the biases are shared out.
  const auto routed_slice = [&](int slices) {
    const double whole = static_cast<double>(RoutedExpertBytes(model, format));
    const double weights = static_cast<double>(ExpertByteCount(format, model.hidden, model.expert_intermediate));
    return static_cast<double>(ExpertByteCount(format, model.hidden, model.expert_intermediate / slices)) +
           (whole - weights) / slices;
  };
  const auto shared_slice = [&](int slices) {
    return static_cast<double>(model.num_shared_experts) *
           static_cast<double>(ExpertByteCount(format, model.hidden, model.shared_intermediate / slices));
  };
  const double layers = o.num_layers;
  const bool gathers = o.option == EpOption::kSliced || o.option == EpOption::kWhole || o.option == EpOption::kHybrid;
  const double shared = gathers && o.shared != SharedMode::kCopied ? shared_slice(g) : shared_slice(1);
  // Experts this rank computes picks of, and the ways each is sliced.
  double local_experts = 0;
  int slices = 1;
  switch (o.option) {
    case EpOption::kSliced:
      local_experts = e;
      slices = g;
      break;
    case EpOption::kHybrid:
      slices = std::max(o.tp_in_ep, 1);
      local_experts = std::ceil(static_cast<double>(e) / std::max(g / slices, 1));
      break;
    case EpOption::kWhole:
    case EpOption::kA2a:
      local_experts = o.placement != nullptr ? o.placement->slots_per_rank() : std::ceil(static_cast<double>(e) / g);
      break;
    case EpOption::kDwdp: local_experts = static_cast<double>(RowBegin(e, g, rank + 1) - RowBegin(e, g, rank)); break;
  }
  const double expert = routed_slice(slices);
  MemoryEstimate m;
  m.weights = layers * (local_experts * expert + shared);
  if (o.option == EpOption::kDwdp) {
    // The window holds a copy of the owned experts; the double buffer two pieces of the lacking.
    m.weights += layers * local_experts * expert;
    const double lacking = e - local_experts;
    if (g > 1 && lacking > 0 && expert > 0)
      m.weights += 2 * expert * std::min(lacking, std::floor(static_cast<double>(o.max_buffer_bytes) / (2 * expert)));
    return m;  // rows stay home: no exchange buffers
  }
  // Per row that reaches this rank (at most every row of the step): its record sent and received,
  // its fp32 row, partial sum and row in the kernel's input format (at most fp32), and per local
  // pick its row in, its output, and (a2a) the weighted output going back and landing home.
  const double row = 4.0 * model.hidden;
  const double record = 8.0 * k + static_cast<double>(RowBytes(o.dispatch_format, model.hidden));
  double per_row = 2 * record + 3 * row + std::min<double>(k, local_experts) * 4 * row;
  // Two levels (any levels but flat, as the nodes are not known here): a gateway also holds a row's
  // node record, its forwarded records (one per rank of the node it visits) and up to k outputs
  // landing from the node's ranks and going home.
  if (o.option == EpOption::kA2a && o.a2a_levels != A2aLevels::kFlat)
    per_row += (1 + std::min(k, g)) * record + 2.0 * k * row;
  m.exchange = std::min(static_cast<double>(o.max_buffer_bytes), static_cast<double>(tokens) * per_row);
  if (o.option == EpOption::kA2a && ResolveA2aMode(model, o, g) == A2aMode::kLowLatency) {
    // Fixed buffers, sized for the bound whatever a step sends (CheckExecutorShape keeps them
    // within max_buffer_bytes), in whole huge pages when those fit the bound too (as the executor
    // allocates them).
    double exact = 0, rounded = 0;
    for (int64_t bytes : ep_internal::LowLatencyBufferBytes(model, o, g)) {
      exact += static_cast<double>(bytes);
      rounded += static_cast<double>(HugePageBytes(bytes));
    }
    m.exchange = rounded <= static_cast<double>(o.max_buffer_bytes) ? rounded : exact;
  }
  return m;
}

MemoryEstimate EstimateRunMemory(const ModelConfig& model, std::span<const ExecutorOptions> executors, bool at_once,
                                 bool check, int num_ranks, int rank, int64_t tokens) {
  MemoryEstimate run;
  for (const ExecutorOptions& o : executors) {
    const MemoryEstimate one = EstimateExecutorMemory(model, o, num_ranks, rank, tokens);
    if (at_once) {
      run.weights += one.weights;
      run.exchange += one.exchange;
    } else if (one.weights + one.exchange > run.weights + run.exchange) {
      run.weights = one.weights;
      run.exchange = one.exchange;
    }
  }
  if (executors.empty()) return run;
  const ExecutorOptions& first = executors.front();
  const int g = std::max(num_ranks, 1);
  const int64_t rows =
      first.origin == RowOrigin::kTensorParallel ? tokens : RowBegin(tokens, g, rank + 1) - RowBegin(tokens, g, rank);
  // The rank's rows go through the router, its executor and (check) the single-process layer.
  const MemoryEstimate layers =
      EstimateLayerMemory(model, first.pack.format, first.num_layers, rows, /*keep_fp32=*/false, /*threads=*/1);
  run.rows = layers.rows;
  if (check) run.reference = layers.weights;
  return run;
}

Result<std::unique_ptr<MoeExecutor>> MoeExecutor::CreateLane(Communicator&, ThreadPool&) {
  return InvalidArgument(fmt::format("{} runs one batch at a time: two-batch overlap needs a2a", EpOptionName(option())));
}

Result<std::unique_ptr<MoeExecutor>> CreateExecutor(Communicator& comm, const ModelConfig& model,
                                                    const ExecutorOptions& given, ThreadPool& pool) {
  EPMOE_RETURN_IF_ERROR(ValidateModel(model, "executor"));
  EPMOE_RETURN_IF_ERROR(CheckExecutorShape(model, given, comm.size()));
  ExecutorOptions options = given;
  options.pack = ForModel(model, given.pack);
  switch (options.option) {
    case EpOption::kSliced:
    case EpOption::kWhole:
    case EpOption::kHybrid: return ep_internal::CreateGatherExecutor(comm, model, options, pool);
    case EpOption::kA2a: return ep_internal::CreateA2aExecutor(comm, model, options, pool);
    case EpOption::kDwdp: return ep_internal::CreateDwdpExecutor(comm, model, options, pool);
  }
  return Internal("unknown option");
}

Result<std::shared_ptr<LivePlacement>> ResolveLivePlacement(const ModelConfig& model, const ExecutorOptions& options,
                                                            const Communicator& comm) {
  PlacementPtr placement = options.placement;
  if (placement == nullptr) {
    const int ranks = comm.size();
    const int nodes = comm.num_nodes() >= 1 && ranks % comm.num_nodes() == 0 ? comm.num_nodes() : 1;
    EPMOE_ASSIGN_OR_RETURN(Placement trivial, Placement::Trivial(options.num_layers, model.num_experts, 0, ranks, nodes));
    placement = std::make_shared<const Placement>(std::move(trivial));
  }
  return LivePlacement::Create(std::move(placement), comm.rank(), options.dispatch_seed);
}

namespace ep_internal {

std::shared_ptr<const WeightSource> Weights(const ModelConfig& model, const ExecutorOptions& options) {
  return options.weights != nullptr ? options.weights : SyntheticWeights(model, options.seed);
}

Result<std::vector<std::unique_ptr<ExpertStore>>> PackSharedCopies(const ModelConfig& model,
                                                                   const ExecutorOptions& options) {
  std::vector<std::unique_ptr<ExpertStore>> stores(options.num_layers);
  if (model.num_shared_experts == 0) return stores;
  const std::shared_ptr<const WeightSource> source = Weights(model, options);
  for (int layer = 0; layer < options.num_layers; ++layer) {
    auto shared = [&](int s, ExpertWeights* out) { return source->ReadSharedExpert(layer, s, 0, -1, out); };
    EPMOE_ASSIGN_OR_RETURN(stores[layer], PackExperts(model.num_shared_experts, model.hidden, model.shared_intermediate,
                                                      shared, options.pack));
  }
  return stores;
}

Result<std::vector<std::vector<float>>> SharedOutputGates(const ModelConfig& model, const ExecutorOptions& options) {
  std::vector<std::vector<float>> gates(options.num_layers);
  if (!model.shared_output_gate) return gates;
  const std::shared_ptr<const WeightSource> source = Weights(model, options);
  for (int layer = 0; layer < options.num_layers; ++layer) {
    EPMOE_ASSIGN_OR_RETURN(MoeLayerWeights routing, source->Routing(layer, nullptr));
    EPMOE_RETURN_IF_ERROR(CheckSharedOutputGate(model, routing));
    gates[layer] = std::move(routing.shared_output_gate);
  }
  return gates;
}

Status CheckForwardInput(const ModelConfig& model, int num_layers, int layer, const Matrix& rows, const Picks& picks) {
  if (layer < 0 || layer >= num_layers)
    return InvalidArgument(fmt::format("layer {} is outside the executor's {} layers", layer, num_layers));
  if (rows.cols != model.hidden)
    return InvalidArgument(fmt::format("rows have {} columns, the model's hidden size is {}", rows.cols, model.hidden));
  if (picks.rows != rows.rows || picks.k != model.top_k)
    return InvalidArgument(fmt::format("picks for {} rows with k = {}; expected {} rows with k = {}", picks.rows, picks.k,
                                       rows.rows, model.top_k));
  EPMOE_RETURN_IF_ERROR(ValidatePicks(picks, model.num_experts));
  const int64_t bad = FirstNonFinite(rows.data);
  if (bad >= 0)
    return InvalidArgument(fmt::format("row {} column {} is {}", bad / rows.cols, bad % rows.cols, rows.data[bad]));
  return Status::Ok();
}

void AddExchangeBytes(const Communicator& comm, std::span<const int64_t> send_bytes,
                      std::span<const int64_t> recv_bytes, StepStats* st) {
  const int me = comm.rank(), my_node = comm.node_of(me);
  for (int r = 0; r < comm.size(); ++r) {
    if (r == me) continue;
    st->bytes_sent += send_bytes[r];
    st->bytes_received += recv_bytes[r];
    if (comm.node_of(r) != my_node) {
      st->inter_node_bytes_sent += send_bytes[r];
      st->inter_node_bytes_received += recv_bytes[r];
    }
  }
}

void AddAllgatherBytes(const Communicator& comm, std::span<const int64_t> bytes, StepStats* st) {
  const std::vector<int64_t> sent(comm.size(), bytes[comm.rank()]);
  AddExchangeBytes(comm, sent, bytes, st);
}

void RoundTripRows(RowFormat format, const Matrix& rows, Matrix* out) {
  *out = Matrix(rows.rows, rows.cols);
  std::vector<uint8_t> encoded(RowBytes(format, rows.cols));
  for (int64_t r = 0; r < rows.rows; ++r) {
    EncodeRow(format, rows.row(r), rows.cols, encoded.data());
    DecodeRow(format, encoded.data(), rows.cols, out->row(r));
  }
}

}  // namespace ep_internal
}  // namespace epmoe
