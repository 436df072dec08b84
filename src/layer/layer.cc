#include "epmoe/layer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>

#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"

namespace epmoe {
namespace {

double MicrosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}

Status CheckRows(const ModelConfig& model, const Matrix& rows, const Picks& picks) {
  if (rows.cols != model.hidden)
    return InvalidArgument(
        fmt::format("layer: rows have {} columns, the model's hidden size is {}", rows.cols, model.hidden));
  if (picks.rows != rows.rows)
    return InvalidArgument(fmt::format("layer: {} rows but picks for {} rows", rows.rows, picks.rows));
  if (picks.k != model.top_k)
    return InvalidArgument(fmt::format("layer: picks have k = {}, the model's top_k is {}", picks.k, model.top_k));
  EPMOE_RETURN_IF_ERROR(ValidatePicks(picks, model.num_experts));
  const int64_t bad = FirstNonFinite(rows.data);
  if (bad >= 0)
    return InvalidArgument(
        fmt::format("layer: row {} column {} is {}", bad / rows.cols, bad % rows.cols, rows.data[bad]));
  return Status::Ok();
}

}  // namespace

MoeLayerWeights MakeSyntheticRouting(const ModelConfig& model, int layer, uint64_t seed, ThreadPool* pool) {
  MoeLayerWeights w;
  w.layer = layer;
  w.router = SyntheticMatrix(seed, {TensorKind::kRouter, layer, 0, model.num_experts, model.hidden}, pool);
  // bf16 values, as checkpoints store routers: RouterWeights then keeps them in bf16, as it does
  // a checkpoint's, and a synthetic step reads what a real one does.
  for (float& value : w.router.data) value = FloatFromBf16(Bf16FromFloat(value));
  if (model.correction_bias || model.router_bias) {
    const Matrix bias = SyntheticMatrix(seed, {TensorKind::kRouterBias, layer, 0, 1, model.num_experts});
    w.router_bias.assign(bias.data.begin(), bias.data.end());
  }
  if (model.shared_output_gate) {
    const Matrix gate = SyntheticMatrix(seed, {TensorKind::kSharedOutputGate, layer, 0, 1, model.hidden});
    w.shared_output_gate.assign(gate.data.begin(), gate.data.end());
  }
  return w;
}

ExpertWeights MakeSyntheticExpert(const ModelConfig& model, int layer, int expert, uint64_t seed, int64_t begin,
                                  int64_t end) {
  ExpertWeights w;
  FillSyntheticExpert(TensorKind::kExpertGate, TensorKind::kExpertUp, TensorKind::kExpertDown, model.hidden,
                      model.expert_intermediate, layer, expert, seed, begin, end, model.expert_bias, &w);
  return w;
}

ExpertWeights MakeSyntheticSharedExpert(const ModelConfig& model, int layer, int index, uint64_t seed, int64_t begin,
                                        int64_t end) {
  ExpertWeights w;
  FillSyntheticExpert(TensorKind::kSharedGate, TensorKind::kSharedUp, TensorKind::kSharedDown, model.hidden,
                      model.shared_intermediate, layer, index, seed, begin, end, false, &w);
  return w;
}

void SharedOutputScales(std::span<const float> gate, const Matrix& rows, std::vector<float>* scales) {
  scales->assign(rows.rows, 1.0f);
  if (gate.empty()) return;
  for (int64_t r = 0; r < rows.rows; ++r) {
    double logit = 0;
    for (int64_t c = 0; c < rows.cols; ++c) logit += static_cast<double>(gate[c]) * rows.at(r, c);
    (*scales)[r] = static_cast<float>(1.0 / (1.0 + std::exp(-logit)));
  }
}

Status CheckSharedOutputGate(const ModelConfig& model, const MoeLayerWeights& routing) {
  const size_t expected = model.shared_output_gate ? static_cast<size_t>(model.hidden) : 0;
  if (routing.shared_output_gate.size() != expected)
    return InvalidArgument(fmt::format("layer {}: a shared output gate of {} values, {} has {}", routing.layer,
                                       routing.shared_output_gate.size(), model.name, expected));
  return Status::Ok();
}

GatedActivation ActivationOf(const ModelConfig& model) {
  GatedActivation activation;
  if (model.activation == Activation::kSwiGluOai) {
    activation.alpha = 1.702f;
    activation.limit = static_cast<float>(model.swiglu_limit);
    activation.up_offset = 1.0f;
  }
  return activation;
}

PackOptions ForModel(const ModelConfig& model, PackOptions options) {
  options.activation = ActivationOf(model);
  return options;
}

Result<ExpertWeights> WeightSource::Expert(int layer, int expert, int64_t slice_begin, int64_t slice_end) const {
  ExpertWeights w;
  EPMOE_RETURN_IF_ERROR(ReadExpert(layer, expert, slice_begin, slice_end, &w));
  return w;
}

Result<ExpertWeights> WeightSource::SharedExpert(int layer, int index, int64_t slice_begin, int64_t slice_end) const {
  ExpertWeights w;
  EPMOE_RETURN_IF_ERROR(ReadSharedExpert(layer, index, slice_begin, slice_end, &w));
  return w;
}

namespace {

class SyntheticSource final : public WeightSource {
 public:
  SyntheticSource(const ModelConfig& model, uint64_t seed) : model_(model), seed_(seed) {}
  Result<MoeLayerWeights> Routing(int layer, ThreadPool* pool) const override {
    return MakeSyntheticRouting(model_, layer, seed_, pool);
  }
  Status ReadExpert(int layer, int expert, int64_t begin, int64_t end, ExpertWeights* out) const override {
    FillSyntheticExpert(TensorKind::kExpertGate, TensorKind::kExpertUp, TensorKind::kExpertDown, model_.hidden,
                        model_.expert_intermediate, layer, expert, seed_, begin, end, model_.expert_bias, out);
    return Status::Ok();
  }
  Status ReadSharedExpert(int layer, int index, int64_t begin, int64_t end, ExpertWeights* out) const override {
    FillSyntheticExpert(TensorKind::kSharedGate, TensorKind::kSharedUp, TensorKind::kSharedDown, model_.hidden,
                        model_.shared_intermediate, layer, index, seed_, begin, end, false, out);
    return Status::Ok();
  }

 private:
  ModelConfig model_;
  uint64_t seed_;
};

}  // namespace

std::shared_ptr<const WeightSource> SyntheticWeights(const ModelConfig& model, uint64_t seed) {
  return std::make_shared<SyntheticSource>(model, seed);
}

Result<MoeLayerWeights> LoadLayerWeights(const ModelConfig& model, const WeightSource& source, int layer,
                                         ThreadPool* pool) {
  EPMOE_ASSIGN_OR_RETURN(MoeLayerWeights w, source.Routing(layer, pool));
  w.experts.resize(model.num_experts);
  std::vector<Status> failed(model.num_experts);
  auto load = [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e)
      failed[e] = source.ReadExpert(layer, static_cast<int>(e), 0, -1, &w.experts[e]);
  };
  ParallelFor(pool, model.num_experts, 1, load);
  for (const Status& status : failed) EPMOE_RETURN_IF_ERROR(status);
  w.shared.resize(model.num_shared_experts);
  for (int s = 0; s < model.num_shared_experts; ++s)
    EPMOE_RETURN_IF_ERROR(source.ReadSharedExpert(layer, s, 0, -1, &w.shared[s]));
  return w;
}

MoeLayerWeights MakeSyntheticLayer(const ModelConfig& model, int layer, uint64_t seed, ThreadPool* pool) {
  return std::move(LoadLayerWeights(model, SyntheticSource(model, seed), layer, pool)).value();
}

Status ReferenceMoeForward(const ModelConfig& model, const MoeLayerWeights& weights, const Matrix& rows,
                           const Picks& picks, Matrix* out) {
  EPMOE_RETURN_IF_ERROR(CheckRows(model, rows, picks));
  *out = Matrix(rows.rows, model.hidden);
  const GatedActivation activation = ActivationOf(model);
  std::vector<float> y(model.hidden);
  for (int64_t r = 0; r < rows.rows; ++r) {
    std::vector<double> acc(model.hidden, 0.0);
    for (int j = 0; j < picks.k; ++j) {
      ReferenceExpertFfn(weights.experts[picks.expert(r, j)], activation, rows.row_span(r), y);
      for (int h = 0; h < model.hidden; ++h) acc[h] += static_cast<double>(picks.weight(r, j)) * y[h];
    }
    double shared_scale = 1.0;
    if (model.shared_output_gate) {
      double logit = 0;
      for (int h = 0; h < model.hidden; ++h)
        logit += static_cast<double>(weights.shared_output_gate[h]) * rows.at(r, h);
      shared_scale = 1.0 / (1.0 + std::exp(-logit));
    }
    for (const ExpertWeights& shared : weights.shared) {
      ReferenceExpertFfn(shared, activation, rows.row_span(r), y);
      for (int h = 0; h < model.hidden; ++h) acc[h] += shared_scale * y[h];
    }
    for (int h = 0; h < model.hidden; ++h) out->at(r, h) = static_cast<float>(acc[h]);
  }
  return Status::Ok();
}

PermutedPicks PermuteByExpert(const Picks& picks, int num_experts) {
  PermutedPicks p;
  p.offsets.assign(num_experts + 1, 0);
  for (int32_t e : picks.experts) ++p.offsets[e + 1];
  for (int e = 0; e < num_experts; ++e) p.offsets[e + 1] += p.offsets[e];
  std::vector<int64_t> cursor(p.offsets.begin(), p.offsets.end() - 1);
  p.source_pick.resize(picks.experts.size());
  for (size_t i = 0; i < picks.experts.size(); ++i) p.source_pick[cursor[picks.experts[i]]++] = static_cast<int64_t>(i);
  return p;
}

namespace {
// Runs body over [0, n) on the pool when there is one and the work is worth splitting.
void ForRows(int64_t n, ThreadPool* pool, const std::function<void(int64_t, int64_t)>& body) {
  if (pool != nullptr && n > 64) {
    pool->ParallelFor(n, 32, body);
  } else {
    body(0, n);
  }
}
}  // namespace

void GatherPermutedRows(const Matrix& rows, const PermutedPicks& permuted, int k, Matrix* out, ThreadPool* pool) {
  const int64_t n = static_cast<int64_t>(permuted.source_pick.size());
  out->Reshape(n, rows.cols);
  ForRows(n, pool, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* src = rows.row(permuted.source_pick[p] / k);
      std::copy(src, src + rows.cols, out->row(p));
    }
  });
}

void ComputeSharedExperts(const ExpertStore* shared, std::span<const float> output_gate, const Matrix& rows,
                          SharedOutputs* outputs, ThreadPool& pool) {
  outputs->count = 0;
  outputs->bytes_read = 0;
  if (shared == nullptr || rows.rows == 0) return;
  // Kept by the calling thread across calls, as Forward's step buffers, and named through a
  // reference for the same reason.
  thread_local Matrix in_scratch;
  Matrix& in = in_scratch;
  const int count = shared->num_experts();
  const int64_t n = rows.rows, h = rows.cols;
  // Each shared expert sees every row: the rows once per shared expert, one group each.
  std::vector<int64_t> offsets(count + 1);
  for (int s = 0; s <= count; ++s) offsets[s] = s * n;
  const float* shared_rows = rows.data.data();
  if (count > 1) {
    in.Reshape(n * count, h);
    for (int s = 0; s < count; ++s) std::copy(rows.data.begin(), rows.data.end(), in.row(s * n));
    shared_rows = in.data.data();
  }
  outputs->result.Reshape(n * count, h);
  shared->Run(shared_rows, offsets, outputs->result.data.data(), pool);
  SharedOutputScales(output_gate, rows, &outputs->scales);
  outputs->count = count;
  for (int s = 0; s < count; ++s) outputs->bytes_read += shared->expert_bytes(s);
}

void AddSharedOutputs(const SharedOutputs& outputs, Matrix* out, ThreadPool& pool) {
  if (outputs.count == 0) return;
  const int count = outputs.count;
  const int64_t n = out->rows, h = out->cols;
  ForRows(n, &pool, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* y = out->row(r);
      for (int s = 0; s < count; ++s) {
        const float* add = outputs.result.row(s * n + r);
        for (int64_t i = 0; i < h; ++i) y[i] += outputs.scales[r] * add[i];
      }
    }
  });
}

int64_t AddSharedExperts(const ExpertStore* shared, std::span<const float> output_gate, const Matrix& rows, Matrix* out,
                         ThreadPool& pool) {
  // Kept by the calling thread across calls, as Forward's step buffers.
  thread_local SharedOutputs outputs;
  ComputeSharedExperts(shared, output_gate, rows, &outputs, pool);
  AddSharedOutputs(outputs, out, pool);
  return outputs.bytes_read;
}

void CombinePermutedRows(const Matrix& expert_out, const PermutedPicks& permuted, const Picks& picks, Matrix* out,
                         ThreadPool* pool) {
  const int64_t n = static_cast<int64_t>(permuted.source_pick.size());
  std::vector<int64_t> position(n);
  for (int64_t p = 0; p < n; ++p) position[permuted.source_pick[p]] = p;
  out->Reshape(picks.rows, expert_out.cols);
  ForRows(picks.rows, pool, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* y = out->row(r);
      std::fill(y, y + out->cols, 0.0f);
      for (int j = 0; j < picks.k; ++j) {
        const float w = picks.weight(r, j);
        const float* src = expert_out.row(position[r * picks.k + j]);
        for (int64_t h = 0; h < out->cols; ++h) y[h] += w * src[h];
      }
    }
  });
}

Result<std::unique_ptr<MoeLayer>> MoeLayer::Create(const ModelConfig& model, const MoeLayerWeights& weights,
                                                   const PackOptions& given) {
  const PackOptions options = ForModel(model, given);
  EPMOE_RETURN_IF_ERROR(CheckSharedOutputGate(model, weights));
  if (static_cast<int>(weights.experts.size()) != model.num_experts)
    return InvalidArgument(
        fmt::format("layer: {} experts given, the model has {}", weights.experts.size(), model.num_experts));
  std::unique_ptr<MoeLayer> layer(new MoeLayer());
  layer->model_ = model;
  EPMOE_ASSIGN_OR_RETURN(layer->router_, RouterWeights::Pack(weights.router, options.isa));
  layer->router_bias_ = weights.router_bias;
  layer->shared_output_gate_ = weights.shared_output_gate;
  std::vector<const ExpertWeights*> routed;
  for (const auto& e : weights.experts) routed.push_back(&e);
  EPMOE_ASSIGN_OR_RETURN(layer->routed_, PackExperts(routed, options));
  if (!weights.shared.empty()) {
    std::vector<const ExpertWeights*> shared;
    for (const auto& e : weights.shared) shared.push_back(&e);
    EPMOE_ASSIGN_OR_RETURN(layer->shared_, PackExperts(shared, options));
  }
  return layer;
}

Result<std::unique_ptr<MoeLayer>> MoeLayer::Create(const ModelConfig& model, const WeightSource& source,
                                                   int layer_index, const PackOptions& given) {
  const PackOptions options = ForModel(model, given);
  EPMOE_ASSIGN_OR_RETURN(MoeLayerWeights routing, source.Routing(layer_index, options.pool));
  EPMOE_RETURN_IF_ERROR(CheckSharedOutputGate(model, routing));
  std::unique_ptr<MoeLayer> layer(new MoeLayer());
  layer->model_ = model;
  EPMOE_ASSIGN_OR_RETURN(layer->router_, RouterWeights::Pack(routing.router, options.isa));
  layer->router_bias_ = std::move(routing.router_bias);
  layer->shared_output_gate_ = std::move(routing.shared_output_gate);
  auto routed = [&](int e, ExpertWeights* out) { return source.ReadExpert(layer_index, e, 0, -1, out); };
  EPMOE_ASSIGN_OR_RETURN(layer->routed_,
                         PackExperts(model.num_experts, model.hidden, model.expert_intermediate, routed, options));
  if (model.num_shared_experts > 0) {
    auto shared = [&](int s, ExpertWeights* out) { return source.ReadSharedExpert(layer_index, s, 0, -1, out); };
    EPMOE_ASSIGN_OR_RETURN(layer->shared_, PackExperts(model.num_shared_experts, model.hidden,
                                                       model.shared_intermediate, shared, options));
  }
  return layer;
}

Status MoeLayer::Route(const Matrix& rows, Picks* picks, ThreadPool* pool) const {
  return Router(model_).Route(rows, router_, router_bias_, picks, pool);
}

Status MoeLayer::Forward(const Matrix& rows, const Picks& picks, Matrix* out, ThreadPool& pool,
                         LayerStats* stats) const {
  EPMOE_RETURN_IF_ERROR(CheckRows(model_, rows, picks));
  LayerStats local;
  auto t0 = std::chrono::steady_clock::now();
  const PermutedPicks permuted = PermuteByExpert(picks, model_.num_experts);
  // The step's buffers, kept by the calling thread across calls (as ExpertStore::Run keeps its
  // own): fresh ones cost a page fault and zeroing per 4 KB on every step (qwen3-30b-a3b at T =
  // 1024: 38 of the 233 ms of a layer's step went to gathering the rows into a fresh matrix).
  // Named through references: the pool's threads run the lambdas below, and a thread_local named
  // there would be their own (empty) one.
  thread_local Matrix gathered_scratch, expert_out_scratch;
  Matrix& gathered = gathered_scratch;
  Matrix& expert_out = expert_out_scratch;
  GatherPermutedRows(rows, permuted, picks.k, &gathered, &pool);
  local.permute_us = MicrosSince(t0);

  t0 = std::chrono::steady_clock::now();
  expert_out.Reshape(gathered.rows, model_.hidden);
  routed_->Run(gathered.data.data(), permuted.offsets, expert_out.data.data(), pool);
  local.experts_us = MicrosSince(t0);

  t0 = std::chrono::steady_clock::now();
  CombinePermutedRows(expert_out, permuted, picks, out, &pool);
  local.combine_us = MicrosSince(t0);

  int64_t shared_bytes = 0;
  if (shared_ != nullptr) {
    t0 = std::chrono::steady_clock::now();
    shared_bytes = AddSharedExperts(shared_.get(), shared_output_gate_, rows, out, pool);
    local.shared_us = MicrosSince(t0);
  }

  if (stats != nullptr) {
    local.picks = static_cast<int64_t>(picks.experts.size());
    for (int e = 0; e < model_.num_experts; ++e) {
      const int64_t count = permuted.offsets[e + 1] - permuted.offsets[e];
      if (count == 0) continue;
      ++local.experts_touched;
      local.max_picks_per_expert = std::max(local.max_picks_per_expert, count);
      local.expert_bytes_read += routed_->expert_bytes(e);
    }
    local.expert_bytes_read += shared_bytes;
    local.mean_picks_per_touched_expert =
        local.experts_touched ? static_cast<double>(local.picks) / local.experts_touched : 0.0;
    local.route_us = stats->route_us;
    *stats = local;
  }
  return Status::Ok();
}

double LayerBytesPerRow(const ModelConfig& model) {
  const double row = 4.0 * model.hidden;
  // Per pick: expert id and weight (8), permutation entry (8), the gathered row and the expert's
  // output (fp32), and the row in the kernel's input format (at most fp32).
  return 3 * row + 4.0 * model.num_experts + model.top_k * (16 + 3 * row);
}

MemoryEstimate EstimateLayerMemory(const ModelConfig& model, WeightFormat format, int layers, int64_t tokens,
                                   bool keep_fp32, int threads) {
  const double fp32_expert =
      static_cast<double>(ExpertByteCount(WeightFormat::kFp32, model.hidden, model.expert_intermediate));
  const double shared = static_cast<double>(model.num_shared_experts) *
                        static_cast<double>(ExpertByteCount(format, model.hidden, model.shared_intermediate));
  const double fp32_shared =
      static_cast<double>(model.num_shared_experts) *
      static_cast<double>(ExpertByteCount(WeightFormat::kFp32, model.hidden, model.shared_intermediate));
  MemoryEstimate m;
  m.weights = static_cast<double>(layers) *
              (model.num_experts * static_cast<double>(RoutedExpertBytes(model, format)) + shared);
  m.reference = keep_fp32 ? static_cast<double>(layers) * (model.num_experts * fp32_expert + fp32_shared)
                          : 2.0 * std::max(threads, 1) * fp32_expert;
  m.rows = static_cast<double>(tokens) * LayerBytesPerRow(model);
  return m;
}

}  // namespace epmoe
