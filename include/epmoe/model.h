// Model presets: the shape and routing rules of an MoE model, loaded from JSON.
//
// Presets live in configs/models/<name>.json and are compiled into the binary, so
// LoadModel("qwen3-30b-a3b") works anywhere; a path to a .json file loads that file instead.
// ModelConfig is a plain value (thread-compatible).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

// How router logits become expert scores.
enum class Scoring {
  kSoftmax,      // softmax over all experts, then top-k (Qwen3, OLMoE)
  kSoftmaxTopk,  // top-k of the logits, then softmax over the k chosen (Mixtral, gpt-oss)
  kSigmoid,      // sigmoid; a per-expert correction bias is added for choosing only (DeepSeek-V3)
};
const char* ScoringName(Scoring scoring);

// What an expert applies between its projections, to gate g and up u (each after its bias, where
// the model has them).
enum class Activation {
  kSwiGlu,     // silu(g) * u (most models)
  kSwiGluOai,  // gpt-oss: g' * sigmoid(1.702 g') * (u' + 1), g' = min(g, L), u' = clamp(u, -L, L)
};
const char* ActivationName(Activation activation);

struct ModelConfig {
  std::string name;
  int hidden = 0;               // d: numbers per row
  int num_experts = 0;          // E: routed (logical) experts per MoE layer
  int expert_intermediate = 0;  // intermediate size of one routed expert
  int top_k = 0;                // k: experts picked per row
  int num_shared_experts = 0;   // experts every row goes through (no routing)
  int shared_intermediate = 0;  // intermediate size of the shared expert(s), each
  // The shared experts' output is scaled per row by sigmoid(row . w), w a per-layer weight vector
  // (Qwen2-MoE, Qwen3-Next: shared_expert_gate).
  bool shared_output_gate = false;
  int num_layers = 0;           // all transformer layers
  int num_dense_layers = 0;     // the first layers, with a dense FFN instead of MoE
  int dense_intermediate = 0;   // intermediate size of a dense layer's FFN (0 if none)
  Scoring scoring = Scoring::kSoftmax;
  bool correction_bias = false;  // sigmoid only: a bias added to scores for choosing
  int num_expert_groups = 1;     // experts split into this many groups (1: no group limit)
  int topk_groups = 1;           // groups a row may choose from
  int group_rank_experts = 2;    // groups are ranked by the sum of their best this many scores
                                 // (DeepSeek-V3: 2; DeepSeek-V2's group-limited greedy: 1, the max)
  bool renormalize = false;      // scale the k weights of a row to sum to 1
  double routed_scaling = 1.0;   // routed experts' weighted sum is multiplied by this
  bool router_bias = false;      // the router's logits have a bias of their own (gpt-oss)
  Activation activation = Activation::kSwiGlu;
  double swiglu_limit = 0;   // kSwiGluOai: the clamp L (gpt-oss: 7); 0 otherwise
  // Every routed expert projection (gate, up, down) adds a bias (gpt-oss).
  bool expert_bias = false;

  int num_moe_layers() const { return num_layers - num_dense_layers; }
};

// Exact bytes of one routed expert's weights stored in `format`, scales and (expert_bias) its fp32
// biases included.
int64_t RoutedExpertBytes(const ModelConfig& model, WeightFormat format);

// Checks every field; the message names the field (and `source`, e.g. the file).
Status ValidateModel(const ModelConfig& model, std::string_view source);

// Loads a preset by name (see ListModelPresets) or a JSON file by path (anything ending in .json or
// containing '/'), or a folder's config.json. Every field must be present except those added for
// gpt-oss (router_bias, activation, swiglu_limit, expert_bias), Qwen2-MoE (shared_output_gate) and
// DeepSeek-V2 (group_rank_experts, 2 when absent): absent, a model has none of them. Errors name
// the file and the field.
Result<ModelConfig> LoadModel(std::string_view name_or_path);
// Parses preset JSON text; `source` names it in errors. A Hugging Face config.json (it has a
// "model_type": qwen3_moe, qwen2_moe, qwen3_next, olmoe, mixtral, gpt_oss, deepseek, deepseek_v2,
// deepseek_v3, kimi_k2 or glm4_moe) is read too: its MoE
// sizes and the routing that model type's transformers code applies; the name is its
// "_name_or_path", else its model_type.
Result<ModelConfig> ParseModel(std::string_view json_text, std::string_view source);
std::string ModelToJson(const ModelConfig& model);
// The model as a Hugging Face config.json that ParseModel reads back to the same values (its MoE
// fields only), as qwen3_moe, mixtral or deepseek_v3, the model types whose routing it has; refused
// for routing none of them has.
Result<std::string> ModelToHfConfig(const ModelConfig& model);
std::vector<std::string> ListModelPresets();

// The same model with hidden and intermediate sizes replaced (0 keeps a size): tests and quick runs
// use real routing shapes at reduced widths.
ModelConfig ScaledModel(const ModelConfig& model, int hidden, int intermediate);

}  // namespace epmoe
