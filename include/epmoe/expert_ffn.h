// Expert FFN: the local experts of one layer in a kernel's layout, run over grouped rows.
//
// An expert is a gated FFN: out = down( act(gate x, up x) ), gate and up [I x H], down [H x I]; act
// is SwiGLU, silu(g) * u, or gpt-oss's clamped form (GatedActivation), and gpt-oss's experts add a
// bias after each projection.
// ExpertStore holds a set of experts packed once (at load) in one weight format; Run applies each
// expert to its contiguous group of rows. Slices of experts (a range of the intermediate dimension)
// are experts too, so sliced options reuse the same store. An ExpertStore is immutable after
// packing except for ImportExpert (live rebalancing, between runs); Run is thread-safe (it uses the
// pool it is given for its parallelism).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/matrix.h"
#include "epmoe/status.h"
#include "epmoe/synthetic.h"
#include "epmoe/weight_format.h"

namespace epmoe {

class ThreadPool;

// One expert's fp32 weights: the source every format is packed from, and the reference's input.
// Biases are optional, each either empty or full length. A slice of an expert (a range of the
// intermediate dimension) carries its range of the gate and up biases and, only when it starts at
// 0, the down bias, so that the slices' outputs still sum to the expert's.
struct ExpertWeights {
  Matrix gate;  // [intermediate x hidden]
  Matrix up;    // [intermediate x hidden]
  Matrix down;  // [hidden x intermediate]
  std::vector<float> gate_bias = {};  // intermediate values, or empty
  std::vector<float> up_bias = {};    // intermediate values, or empty
  std::vector<float> down_bias = {};  // hidden values, or empty
  int64_t hidden() const { return gate.cols; }
  int64_t intermediate() const { return gate.rows; }
};

// What an expert applies between its projections, elementwise, to gate g and up u (after their
// biases): g' * sigmoid(alpha * g') * (u' + up_offset), where g' = min(g, limit) and
// u' = clamp(u, -limit, limit). The defaults are SwiGLU, silu(g) * u; gpt-oss's experts take
// alpha 1.702, limit 7 and up_offset 1 (ActivationOf in layer.h maps a model to its own).
struct GatedActivation {
  float alpha = 1.0f;
  float limit = std::numeric_limits<float>::infinity();
  float up_offset = 0.0f;
};

// The synthetic weights (synthetic.h) of expert `index` of a layer, or of the slice [begin, end) of
// its intermediate dimension (end -1: to the end), written into *out as an ExpertMaker writes: its
// gate, up and down of the given tensor kinds and, when `biased`, its biases (ExpertWeights: a
// slice carries the down bias only when it starts at 0).
void FillSyntheticExpert(TensorKind gate, TensorKind up, TensorKind down, int64_t hidden, int64_t inter, int layer,
                         int index, uint64_t seed, int64_t begin, int64_t end, bool biased, ExpertWeights* out);

// Plain per-row expert FFN in fp32 with double accumulation: the reference every kernel is tested
// against.
void ReferenceExpertFfn(const ExpertWeights& expert, const GatedActivation& activation, std::span<const float> row,
                        std::span<float> out);

class ExpertStore {
 public:
  virtual ~ExpertStore() = default;

  virtual WeightFormat format() const = 0;
  virtual int num_experts() const = 0;
  virtual int64_t hidden() const = 0;
  virtual int64_t intermediate() const = 0;
  // Exact bytes of expert e's weights as stored, scales and biases (fp32) included.
  virtual int64_t expert_bytes(int expert) const = 0;
  // Which kernel runs (e.g. "fp32/reference"), for reports.
  virtual std::string kernel_name() const = 0;

  // rows: [offsets[E] x hidden]; rows offsets[e] .. offsets[e+1]-1 belong to expert e (E + 1
  // offsets, non-decreasing, offsets[0] == 0). Writes each row's expert output to the same row of
  // out ([offsets[E] x hidden]). Experts with no rows are not read. An `out` larger than the
  // last-level caches is written past them (non-temporal stores, where out's rows start on 64-byte
  // boundaries, as a Matrix's do), so that its writes do not evict the weights being read.
  virtual void Run(const float* rows, std::span<const int64_t> offsets, float* out, ThreadPool& pool) const = 0;
  // Run in two halves, so rows can travel in the kernel's own input format: QuantizeRows writes
  // `count` rows as the kernel takes them (activation_row_bytes() each: fp32, bf16, or int8 with
  // the row's scale, see PackExperts), and RunQuantized(q, offsets, out) then gives exactly what
  // Run(rows, offsets, out) gives, bit for bit.
  virtual int64_t activation_row_bytes() const = 0;
  virtual void QuantizeRows(const float* rows, int64_t count, std::byte* out, ThreadPool& pool) const = 0;
  virtual void RunQuantized(const std::byte* rows, std::span<const int64_t> offsets, float* out,
                            ThreadPool& pool) const = 0;

  // Live rebalancing (moving one packed expert to another rank's store of the same format, shape
  // and kernel). ExportExpert writes expert e as stored, expert_bytes(e) bytes: for gate, up and
  // down in turn, its values, its scales and (nvfp4) its tensor scale, then the gate, up and down
  // biases it has, in fp32. ImportExpert replaces
  // expert e with such bytes; it is the one change to a packed store and must not run during Run
  // (callers import between steps). Both refuse an expert out of range or a wrong length.
  virtual Status ExportExpert(int expert, std::span<std::byte> out) const = 0;
  virtual Status ImportExpert(int expert, std::span<const std::byte> bytes) = 0;
  // Expert e's stored bytes in place, as writable contiguous ranges whose concatenation, in order,
  // is exactly what ExportExpert writes, so a caller can read exported bytes straight into the store
  // (DWDP's one-sided reads) instead of through a staging copy and ImportExpert. The caller writes
  // only bytes exported by a store of the same format, shape and kernel (kernel_name()); writing is
  // the same change as ImportExpert and must not happen during Run. Refuses an expert out of range.
  virtual Result<std::vector<std::span<std::byte>>> MutableExpertParts(int expert) = 0;
};

struct PackOptions {
  WeightFormat format = WeightFormat::kFp32;
  // Highest instruction set the kernel may use: "auto" (best the CPU has), or a name from the
  // kernel list (e.g. "avx2", "reference") to force a lower one; EPMOE_ISA lowers both (cpu.h).
  // A kernel that cannot run the shape (avx512 needs hidden and intermediate sizes that are
  // multiples of 16, its channel block) gives way to the next lower instruction set; the reference
  // runs every shape. kernel_name() says which one runs.
  std::string isa = "auto";
  // Optional: quantizes and packs the experts in parallel on this pool.
  ThreadPool* pool = nullptr;
  // What Run applies between the projections (MoeLayer and the executors set their model's).
  GatedActivation activation = {};
};

// Packs the given experts (all with the same shape) into one store: quantizes each matrix (see
// quantize.h) and repacks it once into the chosen kernel's layout. Refuses shapes the format
// cannot hold (see CheckShape: block formats are not padded), NaN or Inf weights or biases, biases
// of the wrong length, unknown or unsupported instruction sets, and empty or mismatched inputs.
//
// Run quantizes activations inside the call, as each kernel's dot product wants them:
// reference keeps fp32 rows (weights are dequantized to fp32); avx512 and avx2 quantize rows to
// int8 per row (scale max|x| / 127) for int8 and the 4-bit formats (VNNI, or AVX2's VPMADDUBSW);
// for bf16 weights avx512 rounds rows to bf16 and avx2 keeps them in fp32; fp32 weights take fp32
// rows.
Result<std::unique_ptr<ExpertStore>> PackExperts(std::span<const ExpertWeights* const> experts,
                                                 const PackOptions& options);

// Writes expert e's fp32 weights into *out for the PackExperts below. *out holds an earlier
// expert's weights, or none: a maker reshapes its matrices (Matrix::Reshape) and overwrites every
// value, so that each thread's buffers are reused from expert to expert (fresh ones cost a page
// fault and zeroing per 4 KB, which made packing from a checkpoint over twice as slow). Called
// from the pool's threads at once (each expert once), so it must not use that pool.
using ExpertMaker = std::function<Status(int expert, ExpertWeights* out)>;

// Packs `count` experts of the given shape, made one at a time by `make`: only the experts being
// packed exist in fp32, so a layer much larger in fp32 than in its format packs in its format's
// memory (DeepSeek-V3's 256 routed experts: 45 GB in fp32, 6.3 GB in nvfp4). An expert of another
// shape, or an error from `make`, fails the pack naming the expert.
Result<std::unique_ptr<ExpertStore>> PackExperts(int count, int64_t hidden, int64_t intermediate,
                                                 const ExpertMaker& make, const PackOptions& options);

}  // namespace epmoe
