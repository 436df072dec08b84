// One MoE layer in one process: permute picks by expert, grouped expert FFN, weight, unpermute and
// sum, plus the shared expert. Two implementations that must agree:
//   ReferenceMoeForward  a plain per-row loop in fp32/double, obviously right;
//   MoeLayer             the production path (counting-sort permutation, packed ExpertStore,
//                        threads) that the kernels and the expert-parallel executors plug into.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "epmoe/expert_ffn.h"
#include "epmoe/matrix.h"
#include "epmoe/model.h"
#include "epmoe/router.h"
#include "epmoe/status.h"

namespace epmoe {

class ThreadPool;

// The activation between a model's expert projections (gpt-oss's own, else SwiGLU).
GatedActivation ActivationOf(const ModelConfig& model);
// `options` with the model's activation: what every store of the model's experts is packed with.
PackOptions ForModel(const ModelConfig& model, PackOptions options);

// All weights of one MoE layer in fp32.
struct MoeLayerWeights {
  int layer = 0;
  Matrix router;  // [E x hidden]
  // E values, or empty: the correction bias (model.correction_bias: added to sigmoid scores for
  // choosing only) or the router's bias (model.router_bias: added to its logits).
  std::vector<float> router_bias;
  std::vector<ExpertWeights> experts;  // E routed experts
  std::vector<ExpertWeights> shared;   // num_shared_experts shared experts
  std::vector<float> shared_output_gate;  // hidden values (model.shared_output_gate), or empty
};

// With a shared output gate (model.shared_output_gate), the factor of each row's shared output:
// scales[r] = sigmoid(rows.row(r) . gate), into *scales (rows.rows values). Without one (gate
// empty), every factor is 1.
void SharedOutputScales(std::span<const float> gate, const Matrix& rows, std::vector<float>* scales);
// out[r] += scale_r * shared_s(rows[r]) for every shared expert s of the store, in order s = 0, 1,
// ..., scale_r from the layer's shared output gate (SharedOutputScales: 1 without one), on the
// pool's threads (the single-process layer and the executors). Returns the bytes of shared weights
// read (0 when there are no rows or no store). Keeps its buffers per calling thread.
int64_t AddSharedExperts(const ExpertStore* shared, std::span<const float> output_gate, const Matrix& rows, Matrix* out,
                         ThreadPool& pool);

// The shared experts' outputs of some rows, computed apart from adding them (AddSharedExperts is
// ComputeSharedExperts then AddSharedOutputs, the same sums bit for bit), so that an executor can
// run them while an exchange is in flight (single-batch overlap).
struct SharedOutputs {
  int count = 0;              // shared experts (0: none to add)
  Matrix result;              // count x rows rows: expert s's output of row r at s * rows + r
  std::vector<float> scales;  // per row (SharedOutputScales)
  int64_t bytes_read = 0;     // shared weights read
};
void ComputeSharedExperts(const ExpertStore* shared, std::span<const float> output_gate, const Matrix& rows,
                          SharedOutputs* outputs, ThreadPool& pool);
// out[r] += scale_r * output_s(r), s = 0, 1, ..., as AddSharedExperts adds them.
void AddSharedOutputs(const SharedOutputs& outputs, Matrix* out, ThreadPool& pool);
// Refuses a layer's shared output gate of another length than the model's (hidden values when the
// model has one, none otherwise).
Status CheckSharedOutputGate(const ModelConfig& model, const MoeLayerWeights& routing);

// Synthetic weights for MoE layer `layer` (see synthetic.h): deterministic from the seed.
MoeLayerWeights MakeSyntheticLayer(const ModelConfig& model, int layer, uint64_t seed, ThreadPool* pool = nullptr);
// Only its routing weights (router and its bias; no experts), the same as
// MakeSyntheticLayer's.
MoeLayerWeights MakeSyntheticRouting(const ModelConfig& model, int layer, uint64_t seed, ThreadPool* pool = nullptr);
// Expert e of layer `layer`, or the intermediate slice [begin, end) of it (still a valid expert:
// the full expert's output is the sum of its slices' outputs).
ExpertWeights MakeSyntheticExpert(const ModelConfig& model, int layer, int expert, uint64_t seed,
                                  int64_t slice_begin = 0, int64_t slice_end = -1);
ExpertWeights MakeSyntheticSharedExpert(const ModelConfig& model, int layer, int index, uint64_t seed,
                                        int64_t slice_begin = 0, int64_t slice_end = -1);

// Where a model's fp32 weights come from, MoE layer by MoE layer (layer 0 is the first MoE layer,
// after the model's dense layers): the synthetic weights of a seed, or a checkpoint (checkpoint.h).
// Every method may be called from several threads at once.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The router, its bias and the shared output gate of a layer (experts and shared experts left
  // empty).
  virtual Result<MoeLayerWeights> Routing(int layer, ThreadPool* pool) const = 0;
  // Routed expert `expert` of a layer, or the slice [slice_begin, slice_end) of its intermediate
  // dimension (slice_end -1: to the end), as MakeSyntheticExpert slices, written into *out as an
  // ExpertMaker writes (expert_ffn.h: its matrices reshaped, their memory reused).
  virtual Status ReadExpert(int layer, int expert, int64_t slice_begin, int64_t slice_end,
                            ExpertWeights* out) const = 0;
  // Shared expert `index` of a layer (0 .. num_shared_experts - 1), or a slice of it.
  virtual Status ReadSharedExpert(int layer, int index, int64_t slice_begin, int64_t slice_end,
                                  ExpertWeights* out) const = 0;

  // The same into fresh matrices.
  Result<ExpertWeights> Expert(int layer, int expert, int64_t slice_begin, int64_t slice_end) const;
  Result<ExpertWeights> SharedExpert(int layer, int index, int64_t slice_begin, int64_t slice_end) const;
};

// The synthetic weights of `seed` (MakeSyntheticRouting, MakeSyntheticExpert, ...).
std::shared_ptr<const WeightSource> SyntheticWeights(const ModelConfig& model, uint64_t seed);

// Every weight of a layer in fp32 (the reference's input): for the synthetic source, what
// MakeSyntheticLayer makes.
Result<MoeLayerWeights> LoadLayerWeights(const ModelConfig& model, const WeightSource& source, int layer,
                                         ThreadPool* pool = nullptr);

// out[r] = routed_sum(r) + shared(r), row by row, pick by pick.
Status ReferenceMoeForward(const ModelConfig& model, const MoeLayerWeights& weights, const Matrix& rows,
                           const Picks& picks, Matrix* out);

// Picks sorted by expert (stable counting sort): the permuted position p holds pick
// source_pick[p] = r*k + j; expert e owns positions [offsets[e], offsets[e+1]).
struct PermutedPicks {
  std::vector<int64_t> offsets;      // E + 1
  std::vector<int64_t> source_pick;  // permuted position -> pick index r*k + j
};
PermutedPicks PermuteByExpert(const Picks& picks, int num_experts);

// permuted.row(p) = rows.row(source_pick[p] / k). Runs on the pool's threads when one is given.
void GatherPermutedRows(const Matrix& rows, const PermutedPicks& permuted, int k, Matrix* out,
                        ThreadPool* pool = nullptr);
// out.row(r) = sum over the k picks of row r of weight * expert_out.row(position of that pick),
// summed in pick order j = 0..k-1 (deterministic). `out` is overwritten.
// The result does not depend on the pool.
void CombinePermutedRows(const Matrix& expert_out, const PermutedPicks& permuted, const Picks& picks, Matrix* out,
                         ThreadPool* pool = nullptr);

// Per-layer figures of one forward pass.
struct LayerStats {
  double route_us = 0;
  double permute_us = 0;  // counting sort and gathering rows
  double experts_us = 0;  // grouped expert FFN
  double combine_us = 0;  // weighting, unpermuting and summing the k results
  double shared_us = 0;   // shared expert
  int experts_touched = 0;
  int64_t picks = 0;
  int64_t max_picks_per_expert = 0;
  double mean_picks_per_touched_expert = 0;
  int64_t expert_bytes_read = 0;  // bytes of the touched experts' weights (+ shared experts)
};

class MoeLayer {
 public:
  // Packs the layer's experts (and shared experts) once.
  static Result<std::unique_ptr<MoeLayer>> Create(const ModelConfig& model, const MoeLayerWeights& weights,
                                                  const PackOptions& options);
  // The same layer as Create(model, LoadLayerWeights(model, source, layer), options), packed one
  // expert at a time (on options.pool's threads when given): the layer never exists in fp32, which
  // for DeepSeek-V3 takes 45 GB against 6.3 GB in nvfp4.
  static Result<std::unique_ptr<MoeLayer>> Create(const ModelConfig& model, const WeightSource& source, int layer,
                                                  const PackOptions& options);

  // The model's router on these rows (on the pool's threads when one is given).
  Status Route(const Matrix& rows, Picks* picks, ThreadPool* pool = nullptr) const;

  // out = the layer's output for rows and picks (stats may be null).
  Status Forward(const Matrix& rows, const Picks& picks, Matrix* out, ThreadPool& pool, LayerStats* stats) const;

  const ExpertStore& routed() const { return *routed_; }

 private:
  MoeLayer() = default;
  ModelConfig model_;
  RouterWeights router_;
  std::vector<float> router_bias_;
  std::vector<float> shared_output_gate_;
  std::unique_ptr<ExpertStore> routed_;
  std::unique_ptr<ExpertStore> shared_;  // null without shared experts
};

// Memory of MoE layers or executors, by what holds it, estimated before anything is allocated so
// that a run that would not fit is refused with the reason (EstimateLayerMemory below,
// EstimateRunMemory in executor.h). In bytes, as doubles: the estimate of an absurd size (a
// billion rows) must not overflow.
struct MemoryEstimate {
  double weights = 0;    // packed experts held (executors: this rank's share, dwdp's window copy and double buffer)
  double reference = 0;  // what a check compares with: the fp32 weights, or the single-process layers
  double rows = 0;       // a step's rows, router scores, picks and outputs, and the experts' per-pick rows
  double exchange = 0;   // exchange buffers (bounded by ExecutorOptions::max_buffer_bytes)
  double total() const { return weights + reference + rows + exchange; }
};

// Bytes one row takes through the router and MoeLayer::Forward: its input, output and expected
// fp32 rows and router scores, and per pick its id and weight, its place in the permutation, and
// its row gathered for the experts, in the kernel's input format and as expert output.
double LayerBytesPerRow(const ModelConfig& model);

// `layers` MoeLayers of `model` packed in `format` (routed and shared experts) running `tokens`
// rows per step. keep_fp32: every layer's fp32 weights are kept as well (the plain reference's
// input); otherwise only the experts being packed are, two per thread of `threads`.
MemoryEstimate EstimateLayerMemory(const ModelConfig& model, WeightFormat format, int layers, int64_t tokens,
                                   bool keep_fp32, int threads);

}  // namespace epmoe
