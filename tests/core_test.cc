// Model presets, weight-format sizes, synthetic weights, the thread pool and ExpertLoad.
#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "epmoe/caches.h"
#include "epmoe/cpu.h"
#include "epmoe/load.h"
#include "epmoe/matrix.h"
#include "epmoe/model.h"
#include "epmoe/statistics.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"

namespace epmoe {
namespace {

TEST(ModelPresets, EveryPresetLoadsAndValidates) {
  const auto names = ListModelPresets();
  EXPECT_EQ(names.size(), 9u);
  for (const auto& name : names) {
    auto m = LoadModel(name);
    ASSERT_TRUE(m.ok()) << name << ": " << m.status().ToString();
    EXPECT_EQ(m->name, name);
  }
}

TEST(ModelPresets, ValuesFromTheIssue) {
  auto glm = LoadModel("glm-5.3");
  ASSERT_TRUE(glm.ok());
  EXPECT_EQ(glm->hidden, 6144);
  EXPECT_EQ(glm->num_experts, 256);
  EXPECT_EQ(glm->expert_intermediate, 2048);
  EXPECT_EQ(glm->top_k, 8);
  EXPECT_EQ(glm->num_shared_experts, 1);
  EXPECT_EQ(glm->num_moe_layers(), 75);
  EXPECT_EQ(glm->dense_intermediate, 12288);
  EXPECT_EQ(glm->scoring, Scoring::kSigmoid);
  EXPECT_TRUE(glm->correction_bias);
  EXPECT_DOUBLE_EQ(glm->routed_scaling, 2.5);

  auto ds = LoadModel("deepseek-v3");
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(ds->hidden, 7168);
  EXPECT_EQ(ds->num_expert_groups, 8);
  EXPECT_EQ(ds->topk_groups, 4);
  EXPECT_EQ(ds->num_layers, 61);
  EXPECT_EQ(ds->dense_intermediate, 18432);

  auto mixtral = LoadModel("mixtral-8x7b");
  ASSERT_TRUE(mixtral.ok());
  EXPECT_EQ(mixtral->scoring, Scoring::kSoftmaxTopk);
  EXPECT_EQ(mixtral->top_k, 2);
  auto olmoe = LoadModel("olmoe-1b-7b");
  ASSERT_TRUE(olmoe.ok());
  EXPECT_FALSE(olmoe->renormalize);
  auto gpt = LoadModel("gpt-oss-120b");
  ASSERT_TRUE(gpt.ok());
  EXPECT_EQ(gpt->top_k, 4);
  EXPECT_EQ(gpt->expert_intermediate, 2880);
}

TEST(ModelPresets, UnknownNameListsTheKnownOnes) {
  auto m = LoadModel("no-such-model");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("qwen3-30b-a3b"), std::string::npos);
}

TEST(ModelPresets, JsonRoundTrip) {
  auto m = LoadModel("deepseek-v3");
  ASSERT_TRUE(m.ok());
  auto again = ParseModel(ModelToJson(*m), "round trip");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(ModelToJson(*again), ModelToJson(*m));
}

// A preset file with one mistake must be refused with a message naming the file and the field.
struct BadPreset {
  const char* what;
  std::function<void(nlohmann::json&)> edit;
  const char* field;
};

class BadPresetFile : public ::testing::TestWithParam<BadPreset> {};

TEST_P(BadPresetFile, IsRefusedNamingFileAndField) {
  auto base = LoadModel("deepseek-v3");
  ASSERT_TRUE(base.ok());
  nlohmann::json j = nlohmann::json::parse(ModelToJson(*base));
  GetParam().edit(j);
  const auto path =
      std::filesystem::temp_directory_path() / ("epmoe_bad_preset_" + std::string(GetParam().what) + ".json");
  std::ofstream(path) << j.dump();
  auto m = LoadModel(path.string());
  std::filesystem::remove(path);
  ASSERT_FALSE(m.ok()) << GetParam().what;
  EXPECT_NE(m.status().message().find(path.string()), std::string::npos) << m.status().message();
  EXPECT_NE(m.status().message().find(GetParam().field), std::string::npos) << m.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    Mistakes, BadPresetFile,
    ::testing::Values(BadPreset{"missing", [](nlohmann::json& j) { j.erase("top_k"); }, "top_k"},
                      BadPreset{"zero", [](nlohmann::json& j) { j["hidden"] = 0; }, "hidden"},
                      BadPreset{"negative", [](nlohmann::json& j) { j["num_experts"] = -4; }, "num_experts"},
                      BadPreset{"k_over_e", [](nlohmann::json& j) { j["top_k"] = 300; }, "top_k"},
                      BadPreset{"groups", [](nlohmann::json& j) { j["num_expert_groups"] = 7; }, "num_expert_groups"},
                      BadPreset{"topk_groups", [](nlohmann::json& j) { j["topk_groups"] = 9; }, "topk_groups"},
                      BadPreset{"wrong_type", [](nlohmann::json& j) { j["hidden"] = "big"; }, "hidden"},
                      BadPreset{"scoring", [](nlohmann::json& j) { j["scoring"] = "tanh"; }, "scoring"},
                      BadPreset{"unknown", [](nlohmann::json& j) { j["hiden"] = 3; }, "hiden"},
                      BadPreset{"dense", [](nlohmann::json& j) { j["num_dense_layers"] = 61; }, "num_dense_layers"}),
    [](const auto& info) { return std::string(info.param.what); });

TEST(ModelPresets, NotJsonAndMissingFileAreRefused) {
  const auto path = std::filesystem::temp_directory_path() / "epmoe_not_json.json";
  std::ofstream(path) << "{ hidden: 12";
  auto m = LoadModel(path.string());
  std::filesystem::remove(path);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("not valid JSON"), std::string::npos);
  EXPECT_EQ(LoadModel("/nonexistent/model.json").status().code(), StatusCode::kNotFound);
}

// Hugging Face config.json files (their MoE fields as the models publish them) read as the presets
// of the same models, apart from the name.
TEST(HfConfig, ReadsAsThePresetOfTheSameModel) {
  const std::pair<const char*, const char*> configs[] = {
      {"qwen3-30b-a3b",
       R"({"_name_or_path": "Qwen/Qwen3-30B-A3B", "model_type": "qwen3_moe", "hidden_size": 2048,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
           "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32})"},
      {"olmoe-1b-7b",
       R"({"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_experts": 64,
           "num_experts_per_tok": 8, "norm_topk_prob": false, "num_hidden_layers": 16})"},
      {"mixtral-8x7b",
       R"({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32})"},
      {"gpt-oss-120b",
       R"({"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
           "num_local_experts": 128, "experts_per_token": 4, "num_hidden_layers": 36,
           "swiglu_limit": 7.0})"},
      {"qwen3-next-80b-a3b",
       R"({"model_type": "qwen3_next", "_name_or_path": "Qwen/Qwen3-Next-80B-A3B-Instruct", "hidden_size": 2048,
           "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
           "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": true, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "num_hidden_layers": 48})"},
      {"deepseek-v2-lite",
       R"({"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
           "num_hidden_layers": 27, "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy",
           "n_group": 1, "topk_group": 1, "norm_topk_prob": false, "routed_scaling_factor": 1.0,
           "scoring_func": "softmax"})"},
      {"deepseek-v3",
       R"({"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
           "num_experts_per_tok": 8, "num_hidden_layers": 61, "first_k_dense_replace": 3,
           "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "norm_topk_prob": true,
           "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc"})"},
  };
  for (const auto& [preset_name, text] : configs) {
    SCOPED_TRACE(preset_name);
    auto parsed = ParseModel(text, "config.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    ModelConfig preset = *LoadModel(preset_name);
    preset.name = parsed->name;
    EXPECT_EQ(ModelToJson(*parsed), ModelToJson(preset));
  }
  EXPECT_EQ(ParseModel(configs[0].second, "config.json")->name, "Qwen/Qwen3-30B-A3B");
  EXPECT_EQ(ParseModel(configs[1].second, "config.json")->name, "olmoe");
}

// gpt-oss's fields: optional in epmoe's JSON (absent: none of them), checked together.
TEST(ModelPresets, GptOssFields) {
  const ModelConfig gpt = *LoadModel("gpt-oss-20b");
  EXPECT_TRUE(gpt.router_bias);
  EXPECT_TRUE(gpt.expert_bias);
  EXPECT_EQ(gpt.activation, Activation::kSwiGluOai);
  EXPECT_EQ(gpt.swiglu_limit, 7.0);
  EXPECT_EQ(RoutedExpertBytes(gpt, WeightFormat::kMxfp4),
            ExpertByteCount(WeightFormat::kMxfp4, 2880, 2880) + (2 * 2880 + 2880) * 4);
  const ModelConfig qwen = *LoadModel("qwen3-30b-a3b");  // its preset predates the fields
  EXPECT_FALSE(qwen.router_bias || qwen.expert_bias);
  EXPECT_EQ(qwen.activation, Activation::kSwiGlu);
  EXPECT_EQ(RoutedExpertBytes(qwen, WeightFormat::kInt8), ExpertByteCount(WeightFormat::kInt8, 2048, 768));

  ModelConfig both = *LoadModel("deepseek-v3");
  both.router_bias = true;
  EXPECT_NE(ValidateModel(both, "m").message().find("'router_bias'"), std::string::npos);
  ModelConfig no_limit = gpt;
  no_limit.swiglu_limit = 0;
  EXPECT_NE(ValidateModel(no_limit, "m").message().find("'swiglu_limit'"), std::string::npos);
  ModelConfig stray_limit = qwen;
  stray_limit.swiglu_limit = 7;
  EXPECT_NE(ValidateModel(stray_limit, "m").message().find("'swiglu_limit'"), std::string::npos);
  ModelConfig shared = gpt;
  shared.num_shared_experts = 1;
  shared.shared_intermediate = 2880;
  EXPECT_NE(ValidateModel(shared, "m").message().find("'expert_bias'"), std::string::npos);
  ModelConfig round = *ParseModel(ModelToJson(gpt), "json");
  EXPECT_EQ(ModelToJson(round), ModelToJson(gpt));
  std::string gelu = ModelToJson(gpt);
  gelu.replace(gelu.find("swiglu_oai"), 10, "gelu");
  EXPECT_NE(ParseModel(gelu, "m.json").status().message().find("unknown activation 'gelu'"), std::string::npos);
}

// Every preset written as a config.json reads back to itself.
TEST(HfConfig, EveryPresetRoundTrips) {
  for (const std::string& name : ListModelPresets()) {
    SCOPED_TRACE(name);
    const ModelConfig preset = *LoadModel(name);
    auto text = ModelToHfConfig(preset);
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    auto parsed = ParseModel(*text, "config.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(ModelToJson(*parsed), ModelToJson(preset));
  }
  ModelConfig grouped_softmax = *LoadModel("qwen3-30b-a3b");
  grouped_softmax.num_expert_groups = 4;  // no model type has group-limited softmax routing
  EXPECT_FALSE(ModelToHfConfig(grouped_softmax).ok());
}

// DeepSeek-V2 (236B): group-limited greedy, groups ranked by their best score; not renormalized, so
// scaled by routed_scaling_factor. It writes back as deepseek_v2 and reads the same again.
TEST(HfConfig, DeepSeekV2GroupLimitedGreedy) {
  auto v2 = ParseModel(
      R"({"model_type": "deepseek_v2", "hidden_size": 5120, "intermediate_size": 12288,
          "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6,
          "num_hidden_layers": 60, "first_k_dense_replace": 1, "topk_method": "group_limited_greedy",
          "n_group": 8, "topk_group": 3, "norm_topk_prob": false, "routed_scaling_factor": 16.0,
          "scoring_func": "softmax"})",
      "config.json");
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  EXPECT_EQ(v2->num_expert_groups, 8);
  EXPECT_EQ(v2->topk_groups, 3);
  EXPECT_EQ(v2->group_rank_experts, 1);
  EXPECT_EQ(v2->scoring, Scoring::kSoftmax);
  EXPECT_FALSE(v2->renormalize);
  EXPECT_DOUBLE_EQ(v2->routed_scaling, 16.0);
  EXPECT_EQ(v2->num_shared_experts, 2);
  EXPECT_EQ(v2->shared_intermediate, 1536);
  auto written = ModelToHfConfig(*v2);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  EXPECT_EQ(ModelToJson(*ParseModel(*written, "written")), ModelToJson(*v2));
  // Renormalized, DeepSeek-V2 does not scale (DeepseekV2MoEGate), whatever the factor says.
  auto normalized = ParseModel(
      R"({"model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "norm_topk_prob": true,
          "routed_scaling_factor": 2.5})",
      "config.json");
  ASSERT_TRUE(normalized.ok()) << normalized.status().ToString();
  EXPECT_DOUBLE_EQ(normalized->routed_scaling, 1.0);
  EXPECT_NE(ParseModel(R"({"model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 64,
                            "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                            "num_hidden_layers": 2, "scoring_func": "sigmoid"})",
                       "config.json")
                .status()
                .message()
                .find("scoring_func 'sigmoid' with topk_method 'greedy' is not modelled"),
            std::string::npos);
}

// Kimi K2's config.json: DeepSeek-V3's architecture and fields under model_type kimi_k2.
TEST(HfConfig, KimiK2ReadsAsDeepSeekV3) {
  auto kimi = ParseModel(
      R"({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
          "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
          "n_shared_experts": 1, "num_experts_per_tok": 8, "num_hidden_layers": 61, "first_k_dense_replace": 1,
          "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.827,
          "scoring_func": "sigmoid", "topk_method": "noaux_tc"})",
      "config.json");
  ASSERT_TRUE(kimi.ok()) << kimi.status().ToString();
  EXPECT_EQ(kimi->num_experts, 384);
  EXPECT_EQ(kimi->top_k, 8);
  EXPECT_EQ(kimi->num_shared_experts, 1);
  EXPECT_EQ(kimi->shared_intermediate, 2048);
  EXPECT_EQ(kimi->num_dense_layers, 1);
  EXPECT_EQ(kimi->num_moe_layers(), 60);
  EXPECT_EQ(kimi->scoring, Scoring::kSigmoid);
  EXPECT_TRUE(kimi->correction_bias && kimi->renormalize);
  EXPECT_DOUBLE_EQ(kimi->routed_scaling, 2.827);
}

TEST(HfConfig, AFolderIsReadThroughItsConfigJson) {
  const auto dir = std::filesystem::temp_directory_path() / "epmoe_hf_config";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
      "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32})";
  auto m = LoadModel(dir.string());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->num_experts, 8);
  EXPECT_EQ(m->scoring, Scoring::kSoftmaxTopk);
}

TEST(HfConfig, RefusesWhatIsNotModelled) {
  const std::pair<const char*, const char*> refused[] = {
      {R"({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32})", "model_type 'llama' is not read"},
      {R"({"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
           "num_experts_per_tok": 2, "num_hidden_layers": 4, "mlp_only_layers": [1]})",
       "interleaved with dense ones"},
      {R"({"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "scoring_func": "softmax"})",
       "scoring_func 'softmax' is not modelled"},
      {R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 32, "num_experts_per_tok": 2,
           "num_hidden_layers": 4})",
       "missing field 'num_local_experts'"},
      {R"({"model_type": "olmoe", "hidden_size": 64, "intermediate_size": 32, "num_experts": 2,
           "num_experts_per_tok": 4, "num_hidden_layers": 4})",
       "exceeds num_experts"},
  };
  for (const auto& [text, message] : refused) {
    auto m = ParseModel(text, "config.json");
    ASSERT_FALSE(m.ok()) << text;
    EXPECT_NE(m.status().message().find(message), std::string::npos) << m.status().message();
  }
}

TEST(CpuIdentity, GenerationFollowsFamilyAndModel) {
  const auto generation = [](const char* vendor, int family, int model) {
    CpuIdentity cpu;
    cpu.vendor = vendor;
    cpu.family = family;
    cpu.model = model;
    return CoreGeneration(cpu);
  };
  EXPECT_EQ(generation("AuthenticAMD", 0x17, 0x31), "Zen 2");  // Rome
  EXPECT_EQ(generation("AuthenticAMD", 0x19, 0x01), "Zen 3");  // Milan
  EXPECT_EQ(generation("AuthenticAMD", 0x19, 0x11), "Zen 4");  // Genoa
  EXPECT_EQ(generation("AuthenticAMD", 0x19, 0xa0), "Zen 4");  // Bergamo
  EXPECT_EQ(generation("AuthenticAMD", 0x19, 0x21), "Zen 3");  // Vermeer
  EXPECT_EQ(generation("AuthenticAMD", 0x1a, 0x02), "Zen 5");  // Turin
  EXPECT_EQ(generation("AuthenticAMD", 0x15, 0x01), "");
  EXPECT_EQ(generation("GenuineIntel", 0x6, 0x8f), "");  // Sapphire Rapids: not named
  EXPECT_EQ(DescribeCpu({.vendor = "AuthenticAMD", .name = "AMD EPYC", .family = 0x1a, .model = 2, .stepping = 1}),
            "AMD EPYC (AuthenticAMD family 0x1a model 0x2 stepping 1, Zen 5)");
  EXPECT_EQ(DescribeCpu({.vendor = "GenuineIntel", .name = "", .family = 6, .model = 0xcf, .stepping = 2}),
            "unnamed CPU (GenuineIntel family 0x6 model 0xcf stepping 2)");
  EXPECT_EQ(DescribeCpu({}), "unknown CPU");
}

TEST(CpuIdentity, ThisCpuIsDetected) {
  const CpuIdentity& cpu = DetectCpuIdentity();
#if defined(__x86_64__)
  EXPECT_EQ(cpu.vendor.size(), 12u);
  EXPECT_GT(cpu.family, 0);
  // The brand string has no surrounding spaces left.
  if (!cpu.name.empty()) {
    EXPECT_NE(cpu.name.front(), ' ');
    EXPECT_NE(cpu.name.back(), ' ');
  }
#else
  EXPECT_TRUE(cpu.vendor.empty());
#endif
  EXPECT_EQ(&cpu, &DetectCpuIdentity());
}

TEST(WeightFormats, ExactBytesPerMatrix) {
  // 2048 x 768 matrix = 1,572,864 weights.
  EXPECT_EQ(ByteCount(WeightFormat::kFp32, 768, 2048), 6291456);
  EXPECT_EQ(ByteCount(WeightFormat::kBf16, 768, 2048), 3145728);
  EXPECT_EQ(ByteCount(WeightFormat::kInt8, 768, 2048), 1572864 + 768 * 4);
  EXPECT_EQ(ByteCount(WeightFormat::kNvfp4, 768, 2048), 1572864 / 16 * 9 + 4);
  EXPECT_EQ(ByteCount(WeightFormat::kMxfp4, 768, 2048), 1572864 / 32 * 17);
  // GLM-5.3: 256 experts x 3 x 6144 x 2048 at 4 bits without scales is the seeds' 4.83 GB per layer;
  // NVFP4 with its scales stores 9/8 of that plus one fp32 per matrix.
  EXPECT_EQ(ExpertByteCount(WeightFormat::kNvfp4, 6144, 2048), 3 * (6144LL * 2048 / 16 * 9 + 4));
}

TEST(WeightFormats, BlockFormatsRefuseRaggedShapes) {
  EXPECT_TRUE(CheckShape(WeightFormat::kNvfp4, 10, 32).ok());
  EXPECT_FALSE(CheckShape(WeightFormat::kNvfp4, 10, 24).ok());
  EXPECT_FALSE(CheckShape(WeightFormat::kMxfp4, 10, 48).ok());
  EXPECT_TRUE(CheckShape(WeightFormat::kInt8, 10, 7).ok());
  EXPECT_FALSE(ParseWeightFormat("fp8").ok());
  EXPECT_EQ(*ParseWeightFormat("mxfp4"), WeightFormat::kMxfp4);
}

TEST(Statistics, MedianAndNearestRankQuantile) {
  EXPECT_EQ(Median({}), 0);
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(Quantile({}, 0.5), 0);
  std::vector<double> twenty;
  for (int i = 20; i >= 1; --i) twenty.push_back(i);  // unsorted: 20 .. 1
  EXPECT_EQ(Quantile(twenty, 0), 1);
  EXPECT_EQ(Quantile(twenty, 0.05), 1);  // 1 of 20 values at or below
  EXPECT_EQ(Quantile(twenty, 0.06), 2);
  EXPECT_EQ(Quantile(twenty, 0.5), 10);
  EXPECT_EQ(Quantile(twenty, 0.95), 19);
  EXPECT_EQ(Quantile(twenty, 1), 20);
}

// Two levels equally common (a memory at 30 - 35 or 57 - 62 GB/s): the median of all falls between
// them, the densest band's median in one (the slower, the first of equal bands), and in the
// commoner one when there is one; one level gives its median.
TEST(Statistics, DensestBandMedianLiesInOneLevel) {
  EXPECT_EQ(DensestBandMedian({}, 0.15), 0);
  std::vector<double> two_levels = {58, 31, 60, 33, 62, 35, 57, 32, 34, 61, 59, 30};
  EXPECT_EQ(Median(two_levels), 46);
  EXPECT_EQ(DensestBandMedian(two_levels, 0.15), 32.5);
  two_levels.insert(two_levels.end(), {56, 63});  // now 8 fast
  EXPECT_EQ(DensestBandMedian(two_levels, 0.15), 59.5);
  EXPECT_EQ(DensestBandMedian({40, 41, 39, 42, 38}, 0.15), 40);
  EXPECT_EQ(DensestBandMedian({5}, 0.15), 5);
}

// NaN and infinities of either sign found wherever they are: first or last of a 1024-value chunk,
// after a finite chunk, in a short tail; -1 when every value is finite (the largest float is).
TEST(MatrixTest, FirstNonFiniteFindsTheFirst) {
  std::vector<float> values(5000, 1.0f);
  values[4321] = std::numeric_limits<float>::max();
  EXPECT_EQ(FirstNonFinite(values), -1);
  EXPECT_EQ(FirstNonFinite(std::span<const float>()), -1);
  for (int64_t at : {0, 1023, 1024, 2047, 3000, 4999}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> v = values;
      v[at] = bad;
      if (at + 7 < 5000) v[at + 7] = bad;  // a later one does not count
      EXPECT_EQ(FirstNonFinite(v), at) << at << " " << bad;
    }
  }
}

TEST(Synthetic, ValuesDoNotDependOnTheBlockAsked) {
  const SyntheticTensor t{TensorKind::kExpertDown, 3, 17, 40, 24};
  const Matrix full = SyntheticMatrix(9, t);
  std::vector<float> block(5 * 7);
  FillSynthetic(9, t, 10, 5, 6, 7, block.data());
  for (int r = 0; r < 5; ++r)
    for (int c = 0; c < 7; ++c) EXPECT_EQ(block[r * 7 + c], full.at(10 + r, 6 + c));
  // Other seeds, layers and experts give other values; amplitude is 1/sqrt(fan_in).
  EXPECT_NE(SyntheticMatrix(10, t).data, full.data);
  SyntheticTensor other = t;
  other.index = 18;
  EXPECT_NE(SyntheticMatrix(9, other).data, full.data);
  for (float v : full.data) EXPECT_LE(std::fabs(v), 1.0f / std::sqrt(24.0f));
}

TEST(Synthetic, PoolDoesNotChangeValues) {
  ThreadPool pool(3);
  const SyntheticTensor t{TensorKind::kRouter, 0, 0, 300, 16};
  EXPECT_EQ(SyntheticMatrix(1, t, &pool).data, SyntheticMatrix(1, t).data);
}

TEST(ThreadPoolTest, ParallelForCoversEveryIndexOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> hits(1000);
    pool.ParallelFor(1000, 7, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    pool.ParallelFor(0, 1, [&](int64_t, int64_t) { ADD_FAILURE() << "called for n = 0"; });
    std::atomic<int> calls{0};
    pool.RunOnAll([&](int) { calls++; });
    EXPECT_EQ(calls.load(), threads);
  }
}

// The between-chunks hook runs on the calling thread only, after chunks it took (each chunk when
// it runs the loop alone), and not at all once cleared.
TEST(ThreadPoolTest, BetweenChunksHookRunsOnTheCallingThread) {
  for (int threads : {1, 2, 4}) {
    SCOPED_TRACE(threads);
    ThreadPool pool(threads);
    const std::thread::id caller = std::this_thread::get_id();
    int calls = 0;  // written by the calling thread only
    pool.set_between_chunks([&] {
      EXPECT_EQ(std::this_thread::get_id(), caller);
      ++calls;
    });
    std::atomic<int> chunks{0};
    pool.ParallelFor(100, 10, [&](int64_t, int64_t) { chunks++; });
    EXPECT_EQ(chunks.load(), 10);
    if (threads == 1) {
      EXPECT_EQ(calls, 10);
    } else {
      EXPECT_LE(calls, 10);  // only the chunks the caller took
    }
    const int before = calls;
    pool.RunOnAll([&](int thread) { pool.ChunkDone(thread); });
    EXPECT_EQ(calls, before + 1);  // thread 0 is the caller
    const int after_run_on_all = calls;
    pool.set_between_chunks(nullptr);
    pool.ParallelFor(100, 10, [&](int64_t, int64_t) {});
    EXPECT_EQ(calls, after_run_on_all);
  }
}

TEST(ThreadPoolTest, UsableCoresAreTheAffinityMask) {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  ASSERT_EQ(sched_getaffinity(0, sizeof(cpus), &cpus), 0);
  EXPECT_EQ(UsableCores(), CPU_COUNT(&cpus));
  EXPECT_GE(UsableCores(), 1);
  const std::vector<int> listed = UsableCpus();
  EXPECT_EQ(static_cast<int>(listed.size()), CPU_COUNT(&cpus));
  for (int cpu : listed) EXPECT_TRUE(CPU_ISSET(cpu, &cpus)) << cpu;
  EXPECT_EQ(ThreadPool(0).size(), UsableCores());
}

// A pool asked for every core takes the cores the calling thread may run on (as under mpirun's
// --bind-to or a cpuset), not the machine's: bound to one CPU, one thread.
TEST(ThreadPoolTest, AllCoresMeansTheBoundOnes) {
  std::thread bound([] {
    cpu_set_t all, one;
    CPU_ZERO(&all);
    ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
    int first = 0;
    while (!CPU_ISSET(first, &all)) ++first;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);  // this thread only
    EXPECT_EQ(UsableCores(), 1);
    ThreadPool pool(0);
    EXPECT_EQ(pool.size(), 1);
    std::atomic<int> calls{0};
    pool.RunOnAll([&](int) { calls++; });
    EXPECT_EQ(calls.load(), 1);
  });
  bound.join();
}

// A sysfs CPU directory of `cpus` CPUs with L1 data and instruction caches and an L2 of their own,
// and an L3 shared by each `per_l3` consecutive CPUs.
std::filesystem::path FakeCpuDirectory(const std::string& name, int cpus, int per_l3, const std::string& l3_size) {
  const auto root = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(root);
  auto write = [](const std::filesystem::path& path, const std::string& text) {
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text << "\n";
  };
  for (int cpu = 0; cpu < cpus; ++cpu) {
    const auto cache = root / ("cpu" + std::to_string(cpu)) / "cache";
    const int first = cpu / per_l3 * per_l3;
    const struct {
      const char *level, *type, *size;
      std::string shared;
    } entries[] = {{"1", "Data", "48K", std::to_string(cpu)},
                   {"1", "Instruction", "32K", std::to_string(cpu)},
                   {"2", "Unified", "2048K", std::to_string(cpu)},
                   {"3", "Unified", l3_size.c_str(), std::to_string(first) + "-" + std::to_string(first + per_l3 - 1)}};
    for (int i = 0; i < 4; ++i) {
      const auto entry = cache / ("index" + std::to_string(i));
      write(entry / "level", entries[i].level);
      write(entry / "type", entries[i].type);
      write(entry / "size", entries[i].size);
      write(entry / "shared_cpu_list", entries[i].shared);
    }
  }
  return root;
}

TEST(Caches, EachSharedLastLevelCacheCountsOnce) {
  const auto root = FakeCpuDirectory("epmoe_cpus_two_l3", 4, 2, "32768K");
  const std::vector<int> all = {0, 1, 2, 3}, first_two = {0, 1}, one_each = {1, 2};
  EXPECT_EQ(LastLevelCacheBytes(root.string(), all), int64_t{64} << 20);
  EXPECT_EQ(LastLevelCacheBytes(root.string(), first_two), int64_t{32} << 20);
  EXPECT_EQ(LastLevelCacheBytes(root.string(), one_each), int64_t{64} << 20);
  const auto big = FakeCpuDirectory("epmoe_cpus_one_l3", 16, 16, "300M");
  const std::vector<int> sixteen = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  EXPECT_EQ(LastLevelCacheBytes(big.string(), sixteen), int64_t{300} << 20);
  std::filesystem::remove_all(root);
  std::filesystem::remove_all(big);
}

TEST(Caches, UnknownCachesCountZero) {
  const std::vector<int> cpus = {0, 1};
  EXPECT_EQ(LastLevelCacheBytes("/nonexistent/epmoe/cpu", cpus), 0);
  const auto root = FakeCpuDirectory("epmoe_cpus_bad_size", 2, 2, "lots");
  // An L3 of no readable size: the last level known is each CPU's own L2.
  EXPECT_EQ(LastLevelCacheBytes(root.string(), cpus), int64_t{4} << 20);
  std::filesystem::remove_all(root);
}

TEST(Caches, BuffersBeyondTheCachesAreFourTimesThemAtLeast) {
  const int64_t here = LastLevelCacheBytes("/sys/devices/system/cpu", UsableCpus());
  EXPECT_EQ(LastLevelCacheBytes(), here);
  EXPECT_EQ(BytesBeyondCaches(1), std::max<int64_t>(1, 4 * here));
  EXPECT_EQ(BytesBeyondCaches(int64_t{1} << 40), int64_t{1} << 40);
}

// Calls back to back (the workers still polling) and after pauses longer than the polling window
// (the workers asleep), on pools with fewer and more threads than the machine has cores: every call
// runs on every thread once and returns only when all are done.
TEST(ThreadPoolTest, CallsWhileWorkersPollAndAfterTheySleep) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int threads : {2, cores + 2}) {
    ThreadPool pool(threads);
    for (int call = 0; call < 200; ++call) {
      std::atomic<int> calls{0};
      std::vector<int> ran(threads, 0);
      pool.RunOnAll([&](int thread) {
        ran[thread] += 1;
        calls++;
      });
      EXPECT_EQ(calls.load(), threads);
      EXPECT_EQ(ran, std::vector<int>(threads, 1));
      if (call % 50 == 49) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
}

TEST(ExpertLoadTest, SliceSumAndValidate) {
  ExpertLoad load(3, 2, 4, 2);
  for (int64_t s = 0; s < 3; ++s)
    for (int l = 0; l < 2; ++l)
      for (int e = 0; e < 4; ++e) load.at(s, l)[e] = s * 100 + l * 10 + e;
  ASSERT_TRUE(ValidateExpertLoad(load, "test").ok());
  const ExpertLoad tail = SliceSteps(load, 1, 3);
  EXPECT_EQ(tail.num_steps, 2);
  EXPECT_EQ(tail.at(0, 1)[2], 112);
  const auto sum = SumOverSteps(load);
  EXPECT_EQ(sum[1 * 4 + 3], 13 + 113 + 213);
  load.at(2, 1)[3] = -1;
  const Status s = ValidateExpertLoad(load, "test");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("step 2 layer 1 expert 3"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace epmoe
