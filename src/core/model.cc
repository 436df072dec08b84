#include "epmoe/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "epmoe/config_file.h"
#include "epmoe/enum_names.h"

namespace epmoe::embedded {
extern const std::vector<std::pair<std::string_view, std::string_view>> kModelPresets;
}

namespace epmoe {
namespace {

using nlohmann::json;

constexpr EnumNames<Scoring, 3> kScorings("scoring", {{{Scoring::kSoftmax, "softmax"},
                                                       {Scoring::kSoftmaxTopk, "softmax_topk"},
                                                       {Scoring::kSigmoid, "sigmoid"}}});
constexpr EnumNames<Activation, 2> kActivations("activation", {{{Activation::kSwiGlu, "swiglu"},
                                                                {Activation::kSwiGluOai, "swiglu_oai"}}});

// Reads field `key` of object `j` into `out`; errors name the source and the field.
template <typename T>
Status ReadField(const json& j, const char* key, std::string_view source, T* out) {
  auto it = j.find(key);
  if (it == j.end()) return InvalidArgument(fmt::format("{}: missing field '{}'", source, key));
  try {
    if constexpr (std::is_same_v<T, int>) {
      if (!it->is_number_integer())
        return InvalidArgument(fmt::format("{}: field '{}' must be an integer, got {}", source, key, it->dump()));
    } else if constexpr (std::is_same_v<T, double>) {
      if (!it->is_number())
        return InvalidArgument(fmt::format("{}: field '{}' must be a number, got {}", source, key, it->dump()));
    } else if constexpr (std::is_same_v<T, bool>) {
      if (!it->is_boolean())
        return InvalidArgument(fmt::format("{}: field '{}' must be true or false, got {}", source, key, it->dump()));
    } else {
      if (!it->is_string())
        return InvalidArgument(fmt::format("{}: field '{}' must be a string, got {}", source, key, it->dump()));
    }
    if constexpr (std::is_same_v<T, int>) {
      const int64_t value = it->get<int64_t>();
      if (value < INT32_MIN || value > INT32_MAX)
        return InvalidArgument(fmt::format("{}: field '{}' = {} is out of range", source, key, value));
      *out = static_cast<int>(value);
    } else {
      *out = it->get<T>();
    }
  } catch (const json::exception& e) {
    return InvalidArgument(fmt::format("{}: field '{}': {}", source, key, e.what()));
  }
  return Status::Ok();
}

Status Positive(std::string_view source, const char* field, double value) {
  if (value > 0) return Status::Ok();
  return InvalidArgument(fmt::format("{}: field '{}' must be positive, got {}", source, field, value));
}
Status NonNegative(std::string_view source, const char* field, double value) {
  if (value >= 0) return Status::Ok();
  return InvalidArgument(fmt::format("{}: field '{}' must not be negative, got {}", source, field, value));
}

}  // namespace

const char* ScoringName(Scoring scoring) {
  return kScorings.Name(scoring);
}
const char* ActivationName(Activation activation) {
  return kActivations.Name(activation);
}

int64_t RoutedExpertBytes(const ModelConfig& model, WeightFormat format) {
  const int64_t weights = ExpertByteCount(format, model.hidden, model.expert_intermediate);
  if (!model.expert_bias) return weights;
  return weights + (2 * int64_t{model.expert_intermediate} + model.hidden) * static_cast<int64_t>(sizeof(float));
}

Status ValidateModel(const ModelConfig& m, std::string_view source) {
  EPMOE_RETURN_IF_ERROR(Positive(source, "hidden", m.hidden));
  EPMOE_RETURN_IF_ERROR(Positive(source, "num_experts", m.num_experts));
  EPMOE_RETURN_IF_ERROR(Positive(source, "expert_intermediate", m.expert_intermediate));
  EPMOE_RETURN_IF_ERROR(Positive(source, "top_k", m.top_k));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, "num_shared_experts", m.num_shared_experts));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, "shared_intermediate", m.shared_intermediate));
  EPMOE_RETURN_IF_ERROR(Positive(source, "num_layers", m.num_layers));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, "num_dense_layers", m.num_dense_layers));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, "dense_intermediate", m.dense_intermediate));
  EPMOE_RETURN_IF_ERROR(Positive(source, "num_expert_groups", m.num_expert_groups));
  EPMOE_RETURN_IF_ERROR(Positive(source, "topk_groups", m.topk_groups));
  EPMOE_RETURN_IF_ERROR(Positive(source, "routed_scaling", m.routed_scaling));
  if (m.top_k > m.num_experts)
    return InvalidArgument(
        fmt::format("{}: field 'top_k' = {} exceeds num_experts = {}", source, m.top_k, m.num_experts));
  if (m.num_shared_experts > 0 && m.shared_intermediate == 0)
    return InvalidArgument(
        fmt::format("{}: field 'shared_intermediate' must be positive when num_shared_experts > 0", source));
  if (m.num_dense_layers >= m.num_layers)
    return InvalidArgument(fmt::format("{}: field 'num_dense_layers' = {} leaves no MoE layer of num_layers = {}",
                                       source, m.num_dense_layers, m.num_layers));
  if (m.num_dense_layers > 0 && m.dense_intermediate == 0)
    return InvalidArgument(
        fmt::format("{}: field 'dense_intermediate' must be positive when num_dense_layers > 0", source));
  if (m.num_experts % m.num_expert_groups != 0)
    return InvalidArgument(fmt::format("{}: field 'num_expert_groups' = {} does not divide num_experts = {}", source,
                                       m.num_expert_groups, m.num_experts));
  if (m.topk_groups > m.num_expert_groups)
    return InvalidArgument(fmt::format("{}: field 'topk_groups' = {} exceeds num_expert_groups = {}", source,
                                       m.topk_groups, m.num_expert_groups));
  const int per_group = m.num_experts / m.num_expert_groups;
  if (m.group_rank_experts < 1 || m.group_rank_experts > 2)
    return InvalidArgument(
        fmt::format("{}: field 'group_rank_experts' = {} (1 or 2 are modelled)", source, m.group_rank_experts));
  if (m.num_expert_groups > 1 && per_group < m.group_rank_experts)
    return InvalidArgument(
        fmt::format("{}: field 'num_expert_groups' = {} leaves fewer than {} experts per group "
                    "(groups are ranked by their best {} scores)",
                    source, m.num_expert_groups, m.group_rank_experts, m.group_rank_experts));
  if (m.topk_groups * per_group < m.top_k)
    return InvalidArgument(fmt::format("{}: field 'topk_groups' = {} allows only {} experts, fewer than top_k = {}",
                                       source, m.topk_groups, m.topk_groups * per_group, m.top_k));
  if (m.correction_bias && m.scoring != Scoring::kSigmoid)
    return InvalidArgument(fmt::format("{}: field 'correction_bias' needs scoring 'sigmoid'", source));
  if (m.correction_bias && m.router_bias)
    return InvalidArgument(
        fmt::format("{}: fields 'correction_bias' and 'router_bias' are both true (a router has "
                    "one bias: for choosing only, or added to its logits)",
                    source));
  if (m.activation == Activation::kSwiGluOai && !(m.swiglu_limit > 0))
    return InvalidArgument(fmt::format("{}: field 'swiglu_limit' must be positive for activation 'swiglu_oai', got {}",
                                       source, m.swiglu_limit));
  if (m.activation == Activation::kSwiGlu && m.swiglu_limit != 0)
    return InvalidArgument(
        fmt::format("{}: field 'swiglu_limit' = {} is for activation 'swiglu_oai' only", source, m.swiglu_limit));
  if (m.shared_output_gate && m.num_shared_experts == 0)
    return InvalidArgument(fmt::format("{}: field 'shared_output_gate' without shared experts", source));
  if (m.expert_bias && m.num_shared_experts > 0)
    return InvalidArgument(
        fmt::format("{}: field 'expert_bias' with shared experts (biases are read for routed experts only)", source));
  // Bounds that keep every derived count and byte size far from int64 overflow (the largest presets
  // are below 1e8 weights per matrix and 1e13 in all).
  constexpr double kMaxMatrixWeights = 1e10, kMaxModelWeights = 1e15;
  const double hidden = m.hidden;
  for (const auto& [field, size] : {std::pair<const char*, int>{"expert_intermediate", m.expert_intermediate},
                                    {"shared_intermediate", m.shared_intermediate},
                                    {"dense_intermediate", m.dense_intermediate}})
    if (hidden * size > kMaxMatrixWeights)
      return OutOfRange(
          fmt::format("{}: hidden {} x {} {} = {:.3g} weights in one matrix, over the {:.0e} epmoe "
                      "handles",
                      source, m.hidden, field, size, hidden * size, kMaxMatrixWeights));
  const double weights =
      3 * hidden *
      (static_cast<double>(m.num_moe_layers()) * (static_cast<double>(m.num_experts) * m.expert_intermediate +
                                                  static_cast<double>(m.num_shared_experts) * m.shared_intermediate) +
       static_cast<double>(m.num_dense_layers) * m.dense_intermediate);
  if (weights > kMaxModelWeights)
    return OutOfRange(
        fmt::format("{}: {:.3g} FFN weights in all, over the {:.0e} epmoe handles", source, weights, kMaxModelWeights));
  return Status::Ok();
}

namespace {

// Field `key`, or `fallback` when it is absent and fallback is given (a Hugging Face config.json's
// optional fields, and the fields epmoe's model JSON gained after its first presets).
template <typename T>
Status ReadOptionalField(const json& j, const char* key, std::string_view source, T* out,
                         std::optional<T> fallback = std::nullopt) {
  if (fallback && !j.contains(key)) {
    *out = *fallback;
    return Status::Ok();
  }
  return ReadField(j, key, source, out);
}

// The expert counts and sizes, shared experts and dense layers of a DeepSeek-style config.json
// (deepseek, deepseek_v2, deepseek_v3, kimi_k2, glm4_moe); MoE layers interleaved with dense ones
// (moe_layer_freq) are refused.
Status ReadDeepSeekShape(const json& j, std::string_view source, ModelConfig* out) {
  ModelConfig& m = *out;
  EPMOE_RETURN_IF_ERROR(ReadField(j, "n_routed_experts", source, &m.num_experts));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "moe_intermediate_size", source, &m.expert_intermediate));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "num_experts_per_tok", source, &m.top_k));
  EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "n_shared_experts", source, &m.num_shared_experts, std::optional<int>(0)));
  m.shared_intermediate = m.num_shared_experts > 0 ? m.expert_intermediate : 0;
  EPMOE_RETURN_IF_ERROR(
      ReadOptionalField(j, "first_k_dense_replace", source, &m.num_dense_layers, std::optional<int>(0)));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "intermediate_size", source, &m.dense_intermediate));
  if (m.num_dense_layers == 0) m.dense_intermediate = 0;
  int layer_freq = 1;
  EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "moe_layer_freq", source, &layer_freq, std::optional<int>(1)));
  if (layer_freq != 1)
    return InvalidArgument(fmt::format("{}: moe_layer_freq {}: MoE layers interleaved with dense ones are not modelled",
                                       source, layer_freq));
  return Status::Ok();
}

// The MoE part of a transformers config.json (model_type qwen3_moe, qwen2_moe, qwen3_next, olmoe,
// mixtral, gpt_oss, deepseek, deepseek_v2, deepseek_v3, kimi_k2 or glm4_moe), with the routing each
// model type's code applies.
Result<ModelConfig> ParseHfConfig(const json& j, std::string_view source) {
  std::string type;
  EPMOE_RETURN_IF_ERROR(ReadField(j, "model_type", source, &type));
  ModelConfig m;
  m.name =
      j.contains("_name_or_path") && j["_name_or_path"].is_string() && !j["_name_or_path"].get<std::string>().empty()
          ? j["_name_or_path"].get<std::string>()
          : type;
  EPMOE_RETURN_IF_ERROR(ReadField(j, "hidden_size", source, &m.hidden));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "num_hidden_layers", source, &m.num_layers));
  const bool qwen2 = type == "qwen2_moe" || type == "qwen3_next";
  if (type == "qwen3_moe" || type == "olmoe" || qwen2) {
    // Softmax over all experts, then the top k, renormalized when norm_topk_prob says so.
    EPMOE_RETURN_IF_ERROR(ReadField(j, "num_experts", source, &m.num_experts));
    EPMOE_RETURN_IF_ERROR(
        ReadField(j, type == "olmoe" ? "intermediate_size" : "moe_intermediate_size", source, &m.expert_intermediate));
    EPMOE_RETURN_IF_ERROR(ReadField(j, "num_experts_per_tok", source, &m.top_k));
    EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "norm_topk_prob", source, &m.renormalize, std::optional<bool>(false)));
    m.scoring = Scoring::kSoftmax;
    if (qwen2) {
      // One shared expert, its output scaled by sigmoid(shared_expert_gate . x)
      // (Qwen2MoeSparseMoeBlock).
      EPMOE_RETURN_IF_ERROR(ReadField(j, "shared_expert_intermediate_size", source, &m.shared_intermediate));
      m.num_shared_experts = m.shared_intermediate > 0 ? 1 : 0;
      m.shared_output_gate = m.num_shared_experts > 0;
    }
    int sparse_step = 1;
    EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "decoder_sparse_step", source, &sparse_step, std::optional<int>(1)));
    const bool dense_layers = j.contains("mlp_only_layers") && !j["mlp_only_layers"].empty();
    if (sparse_step != 1 || dense_layers)
      return InvalidArgument(fmt::format(
          "{}: decoder_sparse_step {} and mlp_only_layers {}: MoE layers interleaved with dense ones are not modelled "
          "(only dense layers first)",
          source, sparse_step, j.value("mlp_only_layers", json::array()).dump()));
  } else if (type == "mixtral" || type == "gpt_oss") {
    // Softmax over the k chosen logits.
    EPMOE_RETURN_IF_ERROR(ReadField(j, "num_local_experts", source, &m.num_experts));
    EPMOE_RETURN_IF_ERROR(ReadField(j, "intermediate_size", source, &m.expert_intermediate));
    EPMOE_RETURN_IF_ERROR(ReadField(j, j.contains("num_experts_per_tok") ? "num_experts_per_tok" : "experts_per_token",
                                    source, &m.top_k));
    m.scoring = Scoring::kSoftmaxTopk;
    if (type == "gpt_oss") {
      // transformers' GptOssTopKRouter (a linear layer with a bias) and GptOssExperts (biases on
      // every projection, the clamped SwiGLU with alpha 1.702 and up + 1).
      m.router_bias = true;
      m.expert_bias = true;
      m.activation = Activation::kSwiGluOai;
      EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "swiglu_limit", source, &m.swiglu_limit, std::optional<double>(7.0)));
    }
  } else if (type == "deepseek_v2" || type == "deepseek") {
    // DeepSeek-V2, V2-Lite, V2.5 (DeepseekV2MoEGate) and DeepSeekMoE (deepseek, greedy): softmax
    // over all experts; topk_method greedy, or group_limited_greedy (groups ranked by their best
    // score); renormalized when norm_topk_prob says so, and only then not scaled by
    // routed_scaling_factor.
    EPMOE_RETURN_IF_ERROR(ReadDeepSeekShape(j, source, &m));
    std::string method = "greedy", scoring = "softmax";
    EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "topk_method", source, &method, std::optional<std::string>("greedy")));
    EPMOE_RETURN_IF_ERROR(
        ReadOptionalField(j, "scoring_func", source, &scoring, std::optional<std::string>("softmax")));
    if (scoring != "softmax" || (method != "greedy" && method != "group_limited_greedy"))
      return InvalidArgument(
          fmt::format("{}: scoring_func '{}' with topk_method '{}' is not modelled for {} "
                      "(softmax with greedy or group_limited_greedy is)",
                      source, scoring, method, type));
    if (method == "group_limited_greedy") {
      EPMOE_RETURN_IF_ERROR(ReadField(j, "n_group", source, &m.num_expert_groups));
      EPMOE_RETURN_IF_ERROR(ReadField(j, "topk_group", source, &m.topk_groups));
      m.group_rank_experts = 1;
    }
    EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "norm_topk_prob", source, &m.renormalize, std::optional<bool>(false)));
    EPMOE_RETURN_IF_ERROR(
        ReadOptionalField(j, "routed_scaling_factor", source, &m.routed_scaling, std::optional<double>(1.0)));
    if (m.renormalize && m.top_k > 1) m.routed_scaling = 1.0;
    m.scoring = Scoring::kSoftmax;
  } else if (type == "deepseek_v3" || type == "kimi_k2" || type == "glm4_moe") {
    // Kimi K2 is DeepSeek-V3's architecture under its own model_type.
    // Sigmoid scores with a correction bias for choosing, group-limited, renormalized and scaled.
    EPMOE_RETURN_IF_ERROR(ReadDeepSeekShape(j, source, &m));
    EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "n_group", source, &m.num_expert_groups, std::optional<int>(1)));
    EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "topk_group", source, &m.topk_groups, std::optional<int>(1)));
    EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "norm_topk_prob", source, &m.renormalize, std::optional<bool>(true)));
    EPMOE_RETURN_IF_ERROR(
        ReadOptionalField(j, "routed_scaling_factor", source, &m.routed_scaling, std::optional<double>(1.0)));
    std::string scoring = "sigmoid";
    EPMOE_RETURN_IF_ERROR(
        ReadOptionalField(j, "scoring_func", source, &scoring, std::optional<std::string>("sigmoid")));
    if (scoring != "sigmoid")
      return InvalidArgument(
          fmt::format("{}: scoring_func '{}' is not modelled for {} (sigmoid is)", source, scoring, type));
    m.scoring = Scoring::kSigmoid;
    m.correction_bias = true;
  } else {
    return InvalidArgument(fmt::format(
        "{}: model_type '{}' is not read (qwen3_moe, qwen2_moe, qwen3_next, olmoe, mixtral, gpt_oss, deepseek, "
        "deepseek_v2, deepseek_v3, kimi_k2, glm4_moe are; or write an epmoe model .json, see `epmoe model show`)",
        source, type));
  }
  EPMOE_RETURN_IF_ERROR(ValidateModel(m, source));
  return m;
}

}  // namespace

Result<ModelConfig> ParseModel(std::string_view text, std::string_view source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    return InvalidArgument(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: expected a JSON object", source));
  if (j.contains("model_type")) return ParseHfConfig(j, source);
  ModelConfig m;
  std::string scoring;
  EPMOE_RETURN_IF_ERROR(ReadField(j, "name", source, &m.name));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "hidden", source, &m.hidden));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "num_experts", source, &m.num_experts));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "expert_intermediate", source, &m.expert_intermediate));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "top_k", source, &m.top_k));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "num_shared_experts", source, &m.num_shared_experts));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "shared_intermediate", source, &m.shared_intermediate));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "num_layers", source, &m.num_layers));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "num_dense_layers", source, &m.num_dense_layers));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "dense_intermediate", source, &m.dense_intermediate));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "scoring", source, &scoring));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "correction_bias", source, &m.correction_bias));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "num_expert_groups", source, &m.num_expert_groups));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "topk_groups", source, &m.topk_groups));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "renormalize", source, &m.renormalize));
  EPMOE_RETURN_IF_ERROR(ReadField(j, "routed_scaling", source, &m.routed_scaling));
  // Fields added later (gpt-oss's, Qwen2-MoE's, DeepSeek-V2's), optional: absent, a model has none
  // of them (DeepSeek-V3's group ranking).
  std::string activation = "swiglu";
  EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "router_bias", source, &m.router_bias, std::optional<bool>(false)));
  EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "activation", source, &activation, std::optional<std::string>("swiglu")));
  EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "swiglu_limit", source, &m.swiglu_limit, std::optional<double>(0.0)));
  EPMOE_RETURN_IF_ERROR(ReadOptionalField(j, "expert_bias", source, &m.expert_bias, std::optional<bool>(false)));
  EPMOE_RETURN_IF_ERROR(
      ReadOptionalField(j, "shared_output_gate", source, &m.shared_output_gate, std::optional<bool>(false)));
  EPMOE_RETURN_IF_ERROR(
      ReadOptionalField(j, "group_rank_experts", source, &m.group_rank_experts, std::optional<int>(2)));
  auto parsed_scoring = kScorings.Parse(scoring);
  if (!parsed_scoring.ok()) return parsed_scoring.status().WithContext(fmt::format("{}: field 'scoring'", source));
  m.scoring = *parsed_scoring;
  auto parsed_activation = kActivations.Parse(activation);
  if (!parsed_activation.ok())
    return parsed_activation.status().WithContext(fmt::format("{}: field 'activation'", source));
  m.activation = *parsed_activation;
  for (auto it = j.begin(); it != j.end(); ++it) {
    static const char* kKnown[] = {"name",
                                   "hidden",
                                   "num_experts",
                                   "expert_intermediate",
                                   "top_k",
                                   "num_shared_experts",
                                   "shared_intermediate",
                                   "num_layers",
                                   "num_dense_layers",
                                   "dense_intermediate",
                                   "scoring",
                                   "correction_bias",
                                   "num_expert_groups",
                                   "topk_groups",
                                   "renormalize",
                                   "routed_scaling",
                                   "router_bias",
                                   "activation",
                                   "swiglu_limit",
                                   "expert_bias",
                                   "shared_output_gate",
                                   "group_rank_experts",
                                   "description"};
    if (std::find_if(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return it.key() == k; }) ==
        std::end(kKnown))
      return InvalidArgument(fmt::format("{}: unknown field '{}'", source, it.key()));
  }
  EPMOE_RETURN_IF_ERROR(ValidateModel(m, source));
  return m;
}

std::string ModelToJson(const ModelConfig& m) {
  json j = {{"name", m.name},
            {"hidden", m.hidden},
            {"num_experts", m.num_experts},
            {"expert_intermediate", m.expert_intermediate},
            {"top_k", m.top_k},
            {"num_shared_experts", m.num_shared_experts},
            {"shared_intermediate", m.shared_intermediate},
            {"num_layers", m.num_layers},
            {"num_dense_layers", m.num_dense_layers},
            {"dense_intermediate", m.dense_intermediate},
            {"scoring", ScoringName(m.scoring)},
            {"correction_bias", m.correction_bias},
            {"num_expert_groups", m.num_expert_groups},
            {"topk_groups", m.topk_groups},
            {"renormalize", m.renormalize},
            {"routed_scaling", m.routed_scaling},
            {"router_bias", m.router_bias},
            {"activation", ActivationName(m.activation)},
            {"swiglu_limit", m.swiglu_limit},
            {"expert_bias", m.expert_bias},
            {"shared_output_gate", m.shared_output_gate},
            {"group_rank_experts", m.group_rank_experts}};
  return j.dump(2);
}

std::vector<std::string> ListModelPresets() { return BuiltinConfigNames(embedded::kModelPresets); }

namespace {

// What DeepSeek-V2's and V3's config.json share, as ReadDeepSeekShape and their routing read it.
void WriteDeepSeekFields(const ModelConfig& m, const char* model_type, json* j) {
  (*j)["model_type"] = model_type;
  (*j)["n_routed_experts"] = m.num_experts;
  (*j)["moe_intermediate_size"] = m.expert_intermediate;
  (*j)["n_shared_experts"] = m.num_shared_experts;
  (*j)["first_k_dense_replace"] = m.num_dense_layers;
  (*j)["intermediate_size"] = m.dense_intermediate;
  (*j)["n_group"] = m.num_expert_groups;
  (*j)["topk_group"] = m.topk_groups;
  (*j)["norm_topk_prob"] = m.renormalize;
  (*j)["routed_scaling_factor"] = m.routed_scaling;
}

}  // namespace

Result<std::string> ModelToHfConfig(const ModelConfig& m) {
  json j = {{"_name_or_path", m.name},
            {"hidden_size", m.hidden},
            {"num_hidden_layers", m.num_layers},
            {"num_experts_per_tok", m.top_k}};
  // Every type but deepseek_v2 ranks expert groups by their best two (or has none).
  const bool two_best = m.group_rank_experts == 2;
  // SwiGLU experts without biases behind a router without a logit bias: every type but gpt_oss.
  const bool swiglu = !m.router_bias && !m.expert_bias && m.activation == Activation::kSwiGlu;
  // No dense layers, expert groups or routed scaling: every type but the DeepSeek ones.
  const bool flat = m.num_dense_layers == 0 && m.num_expert_groups == 1 && m.routed_scaling == 1.0 && two_best;
  const bool plain = swiglu && flat && m.num_shared_experts == 0 && !m.correction_bias;
  const bool qwen2 =
      swiglu && flat && m.scoring == Scoring::kSoftmax && m.shared_output_gate && m.num_shared_experts == 1;
  const bool gpt_oss = flat && m.router_bias && m.expert_bias && m.activation == Activation::kSwiGluOai &&
                       m.scoring == Scoring::kSoftmaxTopk && !m.renormalize && m.num_shared_experts == 0;
  // DeepSeek's experts: shared ones as wide as the routed.
  const bool deepseek =
      swiglu && !m.shared_output_gate && (m.num_shared_experts == 0 || m.shared_intermediate == m.expert_intermediate);
  // DeepSeek-V2's gate: greedy (no groups), or groups ranked by their best score; scaled only when
  // not renormalized.
  const bool deepseek_v2 = deepseek && m.scoring == Scoring::kSoftmax && !m.correction_bias &&
                           (m.num_expert_groups == 1 ? two_best : m.group_rank_experts == 1) &&
                           !(m.renormalize && m.top_k > 1 && m.routed_scaling != 1.0);
  if (qwen2) {
    j["model_type"] = "qwen2_moe";
    j["num_experts"] = m.num_experts;
    j["moe_intermediate_size"] = m.expert_intermediate;
    j["shared_expert_intermediate_size"] = m.shared_intermediate;
    j["norm_topk_prob"] = m.renormalize;
  } else if (gpt_oss) {
    j["model_type"] = "gpt_oss";
    j["num_local_experts"] = m.num_experts;
    j["intermediate_size"] = m.expert_intermediate;
    j["swiglu_limit"] = m.swiglu_limit;
  } else if (m.scoring == Scoring::kSoftmax && plain) {
    j["model_type"] = "qwen3_moe";
    j["num_experts"] = m.num_experts;
    j["moe_intermediate_size"] = m.expert_intermediate;
    j["norm_topk_prob"] = m.renormalize;
  } else if (m.scoring == Scoring::kSoftmaxTopk && plain && !m.renormalize) {
    j["model_type"] = "mixtral";
    j["num_local_experts"] = m.num_experts;
    j["intermediate_size"] = m.expert_intermediate;
  } else if (deepseek_v2) {
    WriteDeepSeekFields(m, "deepseek_v2", &j);
    j["topk_method"] = m.num_expert_groups == 1 ? "greedy" : "group_limited_greedy";
    j["scoring_func"] = "softmax";
  } else if (deepseek && m.scoring == Scoring::kSigmoid && m.correction_bias && two_best) {
    WriteDeepSeekFields(m, "deepseek_v3", &j);
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
  } else {
    return InvalidArgument(fmt::format(
        "{}: its routing and experts are none of qwen3_moe's, qwen2_moe's, mixtral's, gpt_oss's, deepseek_v2's or "
        "deepseek_v3's",
        m.name));
  }
  return j.dump(2);
}

Result<ModelConfig> LoadModel(std::string_view name_or_path) {
  std::error_code error;
  const std::string path(name_or_path);
  if (std::filesystem::is_directory(path, error))
    return LoadModel((std::filesystem::path(path) / "config.json").string());
  EPMOE_ASSIGN_OR_RETURN(ConfigText config, ReadConfig(name_or_path, embedded::kModelPresets, "model preset", "models"));
  return ParseModel(config.text, config.source);
}

ModelConfig ScaledModel(const ModelConfig& model, int hidden, int intermediate) {
  ModelConfig scaled = model;
  if (hidden > 0) scaled.hidden = hidden;
  if (intermediate > 0) {
    scaled.expert_intermediate = intermediate;
    if (scaled.num_shared_experts > 0) scaled.shared_intermediate = intermediate;
    if (scaled.num_dense_layers > 0) scaled.dense_intermediate = intermediate;
  }
  return scaled;
}

}  // namespace epmoe
