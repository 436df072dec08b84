// A model's MoE weights read from a Hugging Face checkpoint (safetensors files), and written as
// one.
//
// Checkpoint is a WeightSource (layer.h): MoeLayer::Create and the expert-parallel executors read
// each expert (or slice) they hold straight from the mapped files, convert it to fp32 and pack it
// into their weight format, one expert at a time; nothing else of the checkpoint is read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/layer.h"
#include "epmoe/model.h"
#include "epmoe/safetensors.h"
#include "epmoe/status.h"

namespace epmoe {

class ThreadPool;

// How a checkpoint names the MoE tensors of transformer layer N (MoE layer l is N = l + the model's
// dense layers) and expert E:
//   kMlpExperts      DeepSeek-V3, GLM, Qwen3-MoE, OLMoE: model.layers.N.mlp.gate.weight,
//                    mlp.gate.e_score_correction_bias, mlp.experts.E.{gate,up,down}_proj.weight,
//                    mlp.shared_experts.{gate,up,down}_proj.weight; Qwen2-MoE and Qwen3-Next
//                    (model.shared_output_gate): mlp.shared_expert.{gate,up,down}_proj.weight and
//                    mlp.shared_expert_gate.weight [1 x hidden]
//   kBlockSparseMoe  Mixtral: model.layers.N.block_sparse_moe.gate.weight,
//                    block_sparse_moe.experts.E.{w1,w3,w2}.weight (gate, up, down)
//   kGptOss          gpt-oss: model.layers.N.mlp.router.{weight,bias}, and every expert of
//                    the layer in mlp.experts.gate_up_proj_{blocks,scales,bias} (gate and up
//                    rows interleaved; MXFP4: [E, 2I, H/32, 16] U8 codes, [E, 2I, H/32] U8
//                    E8M0 scales) and mlp.experts.down_proj_{blocks,scales,bias}; or,
//                    dequantized, gate_up_proj [E, H, 2I] and down_proj [E, I, H] in a float
//                    dtype, as transformers holds them
// The shared experts of a model are one MLP of num_shared_experts x shared_intermediate rows in a
// checkpoint; shared expert s is its slice [s x shared_intermediate, (s + 1) x
// shared_intermediate).
enum class CheckpointNaming { kMlpExperts, kBlockSparseMoe, kGptOss };
// "mlp.experts", "block_sparse_moe", "gpt_oss"
const char* CheckpointNamingName(CheckpointNaming naming);
Result<CheckpointNaming> ParseCheckpointNaming(std::string_view name);

class Checkpoint final : public WeightSource {
 public:
  // Opens `path`: a .safetensors file, or a folder of them (the files its
  // model.safetensors.index.json names, else every *.safetensors file in it). Finds the naming and
  // checks that every tensor MoE layers 0 .. num_layers - 1 of `model` need is there, once, with
  // the model's shape and a dtype it reads: F32, BF16, F16; F8_E4M3 / F8_E5M2 with its scales
  // beside it (`<name>_scale_inv`, DeepSeek-V3's 128 x 128 blocks, or `<name minus
  // .weight>.weight_scale`, one per tensor or per row), every scale multiplying its block; or NVFP4
  // as NVIDIA's ModelOpt writes it (U8 codes, two a byte, an F8_E4M3 `.weight_scale` per 16 and a
  // `.weight_scale_2` for the tensor); or gpt-oss's MXFP4. Each weight is read as its dequantized
  // value (exactly: packed as mxfp4 again, gpt-oss's experts keep their values). Errors name the
  // file and tensor.
  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& path, const ModelConfig& model, int num_layers);
  ~Checkpoint() override;

  CheckpointNaming naming() const;
  int num_files() const;
  int64_t file_bytes() const;  // all files' sizes

  Result<MoeLayerWeights> Routing(int layer, ThreadPool* pool) const override;
  Status ReadExpert(int layer, int expert, int64_t slice_begin, int64_t slice_end, ExpertWeights* out) const override;
  Status ReadSharedExpert(int layer, int index, int64_t slice_begin, int64_t slice_end,
                          ExpertWeights* out) const override;

 private:
  struct State;  // the mapped files and the tensors the layers need, checked
  explicit Checkpoint(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// What a checkpoint holds, found from its tensor names and shapes alone (no model needed): which
// model preset it fits, or what a model .json for it must say.
struct CheckpointSummary {
  int files = 0;
  int64_t file_bytes = 0;
  int64_t tensors = 0;
  std::vector<std::pair<std::string, int64_t>> bytes_by_dtype;  // dtype name, bytes; largest first
  bool has_experts = false;  // false: no expert tensors in a naming this reader knows
  CheckpointNaming naming = CheckpointNaming::kMlpExperts;
  std::vector<int> moe_layers;  // transformer layers that have expert 0, ascending
  int num_experts = 0;          // experts of the first MoE layer
  int64_t hidden = 0;           // from expert 0's gate of the first MoE layer
  int64_t expert_intermediate = 0;
  std::string expert_dtype;         // of that tensor ("NVFP4" / "MXFP4" for packed codes)
  int64_t shared_intermediate = 0;  // all shared experts of the first MoE layer together (0: none)
  bool correction_bias = false;
  bool router_bias = false;  // gpt-oss's router and expert biases
  bool expert_bias = false;
  bool shared_output_gate = false;  // Qwen2-MoE's mlp.shared_expert_gate
};
Result<CheckpointSummary> SummarizeCheckpoint(const std::string& path);
// Whether `model` has the summarized checkpoint's MoE shapes and its MoE layers are all there. A
// checkpoint may have more: DeepSeek-V3's multi-token-prediction module is a MoE layer after the
// model's last.
bool CheckpointFits(const ModelConfig& model, const CheckpointSummary& summary);

// Writes MoE layers 0 .. num_layers - 1 of `source` (router and its bias, experts, shared experts)
// into folder `dir` as a checkpoint named as `naming` says, its values in `dtype` (F32, BF16 or
// F16; or U8 with the gpt_oss naming: its experts in MXFP4 as gpt-oss ships them, the rest BF16):
// safetensors files of whole experts (gpt_oss: of whole layers), up to about 1 GB each, the
// model.safetensors.index.json that names each tensor's file, and a config.json of the model with
// the layers written (ModelToHfConfig; none for routing it cannot express). Files are written whole
// or not at all (each through a temporary name). `pool` converts experts in parallel (may be null).
Status WriteCheckpoint(const std::string& dir, const ModelConfig& model, const WeightSource& source, int num_layers,
                       TensorDtype dtype, CheckpointNaming naming, ThreadPool* pool = nullptr);

}  // namespace epmoe
