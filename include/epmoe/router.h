// Router (gating): which k experts each row meets, and with what weight.
//
// Scoring follows the model preset (softmax, softmax over the chosen, or sigmoid with a correction
// bias used for choosing only, as DeepSeek-V3 does; gpt-oss adds a bias to the logits first); then
// grouped top-k when the preset limits groups (groups ranked by the sum of their best
// group_rank_experts scores, the best topk_groups kept), optional renormalization, and the routed
// scaling factor. Ties break toward the lower expert id. Rows or
// scores holding NaN or Inf are refused with the row and column named.
// Simulated routing (round robin, uniform) and replayed picks produce the same Picks type.
// Router is immutable after construction and thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "epmoe/cpu.h"
#include "epmoe/matrix.h"
#include "epmoe/model.h"
#include "epmoe/status.h"

namespace epmoe {

class ThreadPool;

// The router's choice for a batch: row r's j-th pick is experts[r*k + j] with weights[r*k + j].
// Within a row, picks are ordered by descending choosing score (ties: lower id first).
struct Picks {
  int64_t rows = 0;
  int k = 0;
  std::vector<int32_t> experts;
  std::vector<float> weights;

  int32_t expert(int64_t row, int j) const { return experts[row * k + j]; }
  float weight(int64_t row, int j) const { return weights[row * k + j]; }
};

// Checks shape, ids in [0, num_experts), no repeated expert within a row, finite weights.
Status ValidatePicks(const Picks& picks, int num_experts);

// Picks per expert: counts[e] = number of picks of expert e.
std::vector<int64_t> CountPicks(const Picks& picks, int num_experts);

enum class RoutingMode {
  kScores,      // the model's router on the rows
  kRoundRobin,  // row r, pick j -> expert (r*k + j) mod E: spread evenly over experts and ranks
  kUniform,     // k distinct experts per row, uniformly at random from a seed
  kReplay,      // picks and weights from a routing trace
};
const char* RoutingModeName(RoutingMode mode);
Result<RoutingMode> ParseRoutingMode(std::string_view name);

// A router's weight matrix [E x hidden], packed once for the logits: 16 experts per 64-byte vector,
// four such blocks interleaved input by input, so that a tile of rows reads one stream. Kept in
// bf16 when every weight is a bf16 value (checkpoints store routers so; synthetic routers are drawn
// so), which halves what a decode step reads, else in fp32: exact either way. A logit is the fp32
// sum of its inputs' products in input order, one fused multiply-add each, so it has the same bits
// on every instruction set and for any batch, tiling and thread count: ranks routing their own rows
// pick as one process routing them all. Immutable after packing; thread-safe.
class RouterWeights {
 public:
  RouterWeights() = default;
  // `isa`: "auto" (the best this CPU has) or a named instruction set, lowered to EPMOE_ISA (cpu.h).
  // Fails on an empty matrix or an instruction set that cannot run here.
  static Result<RouterWeights> Pack(const Matrix& weight, std::string_view isa = "auto");

  int64_t experts() const { return experts_; }
  int64_t hidden() const { return hidden_; }
  bool bf16() const { return bf16_; }
  Isa isa() const { return isa_; }
  // What computing logits reads of the weights (experts padded to a multiple of 16).
  int64_t bytes() const { return static_cast<int64_t>(packed_.size()); }

  // logits = rows x weight^T ([rows x E]; rows.cols must be hidden()), on the pool's threads when
  // one is given: tiles of up to 32 rows x 64 experts handed out to them.
  void Logits(const Matrix& rows, Matrix* logits, ThreadPool* pool = nullptr) const;

 private:
  int64_t experts_ = 0, hidden_ = 0;
  bool bf16_ = false;
  Isa isa_ = Isa::kReference;
  std::vector<uint8_t, CacheLineAllocator<uint8_t>> packed_;
};

class Router {
 public:
  explicit Router(const ModelConfig& model);

  // logits: [rows x E] router outputs. correction_bias: E values (sigmoid presets with a
  // correction bias) or empty. Rows are routed on the pool's threads when one is given (the picks
  // do not depend on it).
  Status RouteLogits(const Matrix& logits, std::span<const float> correction_bias, Picks* picks,
                     ThreadPool* pool = nullptr) const;

  // rows: [T x hidden]; weights: the router's [E x hidden]. Computes the logits (RouterWeights::
  // Logits) and routes them. `bias` is the layer's router bias (MoeLayerWeights::router_bias): with
  // model.router_bias added to the logits (E values), else RouteLogits' correction bias.
  Status Route(const Matrix& rows, const RouterWeights& weights, std::span<const float> bias, Picks* picks,
               ThreadPool* pool = nullptr) const;

 private:
  ModelConfig model_;
};

// Simulated routing. Weights are 1/k each (times the routed scaling factor) for round robin, and a
// seeded random split of 1 (times the scaling factor) for uniform. `first_row` is the global index of
// the first row, so that ranks holding parts of a batch agree with a single process.
Picks RoundRobinPicks(const ModelConfig& model, int64_t rows, int64_t first_row = 0);
Picks UniformPicks(const ModelConfig& model, int64_t rows, uint64_t seed, int64_t first_row = 0);

}  // namespace epmoe
