// `epmoe checkpoint show PATH`: what a Hugging Face checkpoint (safetensors) holds and which model
// preset fits it. `epmoe checkpoint write`: a model's synthetic weights as such a checkpoint, to
// try `--weights` without a downloaded model and to compare its runs with synthetic ones.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "epmoe/checkpoint.h"
#include "epmoe/layer.h"
#include "epmoe/thread_pool.h"
#include "output.h"
#include "weights_option.h"

namespace epmoe::cli {
namespace {

struct WriteOptions {
  std::string model = "qwen3-30b-a3b";
  int hidden = 0;
  int intermediate = 0;
  int layers = 1;
  uint64_t seed = 1;
  std::string dtype = "bf16";
  std::string naming = "auto";
  std::string out;
  int threads = 0;
  std::string format = "text";
};

Status Write(const WriteOptions& o, nlohmann::json* report) {
  EPMOE_ASSIGN_OR_RETURN(const ModelConfig model, LoadCommandModel(o.model, o.hidden, o.intermediate, o.layers));
  // Mixtral's checkpoints name experts block_sparse_moe.experts.E.w1, gpt-oss's are its own; the
  // other presets' mlp.experts.E.gate_proj.
  const std::string naming_name = o.naming != "auto"                  ? o.naming
                                  : model.name.starts_with("mixtral") ? "block_sparse_moe"
                                  : model.expert_bias                 ? "gpt_oss"
                                                                      : "mlp.experts";
  EPMOE_ASSIGN_OR_RETURN(const CheckpointNaming naming, ParseCheckpointNaming(naming_name));
  // mxfp4: gpt-oss's experts as U8 blocks and scales.
  const TensorDtype dtype = o.dtype == "f32"     ? TensorDtype::kF32
                            : o.dtype == "f16"   ? TensorDtype::kF16
                            : o.dtype == "mxfp4" ? TensorDtype::kU8
                                                 : TensorDtype::kBf16;
  ThreadPool pool(o.threads);
  const auto start = std::chrono::steady_clock::now();
  EPMOE_RETURN_IF_ERROR(
      WriteCheckpoint(o.out, model, *SyntheticWeights(model, o.seed), o.layers, dtype, naming, &pool));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EPMOE_ASSIGN_OR_RETURN(auto written, Checkpoint::Open(o.out, model, o.layers));
  *report = {{"path", o.out},
             {"model", model.name},
             {"hidden", model.hidden},
             {"expert_intermediate", model.expert_intermediate},
             {"layers", o.layers},
             {"seed", o.seed},
             {"dtype", dtype == TensorDtype::kU8 ? "MXFP4" : TensorDtypeName(dtype)},
             {"naming", CheckpointNamingName(naming)},
             {"files", written->num_files()},
             {"file_bytes", written->file_bytes()},
             {"seconds", seconds}};
  return Status::Ok();
}

void PrintWritten(const nlohmann::json& r) {
  std::printf(
      "%s: %d MoE layer(s) of %s (hidden %d, intermediate %d), seed %llu, %s, %s naming: %d file(s), %s, "
      "in %.1f s\n",
      r["path"].get<std::string>().c_str(), r["layers"].get<int>(), r["model"].get<std::string>().c_str(),
      r["hidden"].get<int>(), r["expert_intermediate"].get<int>(),
      static_cast<unsigned long long>(r["seed"].get<uint64_t>()), r["dtype"].get<std::string>().c_str(),
      r["naming"].get<std::string>().c_str(), r["files"].get<int>(), HumanBytes(r["file_bytes"].get<int64_t>()).c_str(),
      r["seconds"].get<double>());
}

struct ShowOptions {
  std::string path;
  std::string format = "text";
};

Status Show(const ShowOptions& o, nlohmann::json* report) {
  EPMOE_ASSIGN_OR_RETURN(const CheckpointSummary s, SummarizeCheckpoint(o.path));
  nlohmann::json dtypes = nlohmann::json::array();
  for (const auto& [dtype, bytes] : s.bytes_by_dtype) dtypes.push_back({{"dtype", dtype}, {"bytes", bytes}});
  *report = {{"path", o.path},       {"files", s.files},         {"file_bytes", s.file_bytes},
             {"tensors", s.tensors}, {"bytes_by_dtype", dtypes}, {"has_experts", s.has_experts}};
  if (!s.has_experts) return Status::Ok();
  nlohmann::json fitting = nlohmann::json::array();
  for (const std::string& name : ListModelPresets()) {
    auto preset = LoadModel(name);
    if (preset.ok() && CheckpointFits(*preset, s)) fitting.push_back(name);
  }
  (*report)["naming"] = CheckpointNamingName(s.naming);
  (*report)["moe_layers"] = s.moe_layers.size();
  (*report)["first_moe_layer"] = s.moe_layers.front();
  (*report)["num_experts"] = s.num_experts;
  (*report)["hidden"] = s.hidden;
  (*report)["expert_intermediate"] = s.expert_intermediate;
  (*report)["expert_dtype"] = s.expert_dtype;
  (*report)["shared_intermediate"] = s.shared_intermediate;
  (*report)["correction_bias"] = s.correction_bias;
  (*report)["router_bias"] = s.router_bias;
  (*report)["expert_bias"] = s.expert_bias;
  (*report)["shared_output_gate"] = s.shared_output_gate;
  (*report)["presets"] = fitting;
  // A downloaded folder's config.json is a model too (`--model FOLDER`).
  if (std::filesystem::exists(std::filesystem::path(o.path) / "config.json")) {
    auto config = LoadModel(o.path);
    (*report)["config_json"] = config.ok()
                                   ? nlohmann::json{{"model", config->name}, {"fits", CheckpointFits(*config, s)}}
                                   : nlohmann::json{{"error", config.status().message()}};
  }
  return Status::Ok();
}

void PrintShow(const nlohmann::json& r) {
  std::printf("%s: %d file(s), %s, %lld tensors\n", r["path"].get<std::string>().c_str(), r["files"].get<int>(),
              HumanBytes(r["file_bytes"].get<int64_t>()).c_str(), static_cast<long long>(r["tensors"].get<int64_t>()));
  for (const auto& d : r["bytes_by_dtype"])
    std::printf("  %-8s %s\n", d["dtype"].get<std::string>().c_str(), HumanBytes(d["bytes"].get<int64_t>()).c_str());
  if (!r["has_experts"].get<bool>()) {
    std::printf(
        "no expert tensors in a naming epmoe reads (mlp.experts.E.gate_proj, block_sparse_moe.experts.E.w1, "
        "mlp.experts.gate_up_proj[_blocks])\n");
    return;
  }
  std::printf(
      "MoE: %s naming, %d layers from transformer layer %d, %d experts of hidden %lld x intermediate %lld "
      "(%s), shared experts' intermediate %lld%s, correction bias %s%s\n",
      r["naming"].get<std::string>().c_str(), r["moe_layers"].get<int>(), r["first_moe_layer"].get<int>(),
      r["num_experts"].get<int>(), static_cast<long long>(r["hidden"].get<int64_t>()),
      static_cast<long long>(r["expert_intermediate"].get<int64_t>()), r["expert_dtype"].get<std::string>().c_str(),
      static_cast<long long>(r["shared_intermediate"].get<int64_t>()),
      r["shared_output_gate"].get<bool>() ? " (its output gated)" : "", r["correction_bias"].get<bool>() ? "yes" : "no",
      r["expert_bias"].get<bool>() ? ", router and expert biases" : "");
  for (const auto& name : r["presets"]) std::printf("fits --model %s\n", name.get<std::string>().c_str());
  if (r.contains("config_json")) {
    const nlohmann::json& config = r["config_json"];
    if (config.contains("error")) {
      std::printf("its config.json is not a model epmoe reads: %s\n", config["error"].get<std::string>().c_str());
    } else {
      std::printf("its config.json (%s) %s --model %s\n", config["model"].get<std::string>().c_str(),
                  config["fits"].get<bool>() ? "fits:" : "does not fit it:", r["path"].get<std::string>().c_str());
    }
  } else if (r["presets"].empty()) {
    std::printf("no preset has these shapes: give --model a .json with them (see `epmoe model show`)\n");
  }
}

}  // namespace

void AddCheckpointCommand(CLI::App& app, int* exit_code) {
  auto* checkpoint = app.add_subcommand("checkpoint", "Hugging Face checkpoints (safetensors) of MoE layers");
  checkpoint->require_subcommand(1);
  auto o = std::make_shared<WriteOptions>();
  auto* cmd = checkpoint->add_subcommand(
      "write",
      "Write a model's synthetic MoE layers (routers, experts, shared experts) as a checkpoint folder that "
      "`epmoe layer|run --weights` read");
  cmd->add_option("--model", o->model, kModelOptionHelp)->capture_default_str();
  cmd->add_option("--hidden", o->hidden, "Override the model's hidden size (0: keep)")->check(kNonNegative);
  cmd->add_option("--intermediate", o->intermediate, "Override the experts' intermediate size (0: keep)")
      ->check(kNonNegative);
  cmd->add_option("--layers", o->layers, "MoE layers to write (the first ones)")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the synthetic weights")->check(kNonNegative)->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "Value type of the tensors (mxfp4: gpt-oss's experts as it ships them)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--naming", o->naming,
                  "Tensor names: mlp.experts (DeepSeek-V3, GLM, Qwen3, OLMoE), block_sparse_moe "
                  "(Mixtral), gpt_oss, or auto (by the model)")
      ->check(CLI::IsMember({"auto", "mlp.experts", "block_sparse_moe", "gpt_oss"}))
      ->capture_default_str();
  cmd->add_option("--out", o->out, "Folder to write (created; files in it are replaced)")->required();
  cmd->add_option("--threads", o->threads, "Worker threads (0: every core this process may use)")
      ->check(kThreadCount)
      ->capture_default_str();
  AddFormatOption(cmd, &o->format, {"text", "json"});
  SetReportCallback(
      cmd, exit_code, &o->format, [o](nlohmann::json* report) { return Write(*o, report); }, PrintWritten);

  auto show = std::make_shared<ShowOptions>();
  auto* show_cmd = checkpoint->add_subcommand(
      "show",
      "What a checkpoint holds (files, value types, MoE layers, experts and their shapes) and which "
      "model presets fit it");
  show_cmd->add_option("path", show->path, "A .safetensors file or a folder of them")->required();
  AddFormatOption(show_cmd, &show->format, {"text", "json"});
  SetReportCallback(
      show_cmd, exit_code, &show->format, [show](nlohmann::json* report) { return Show(*show, report); }, PrintShow);
}

}  // namespace epmoe::cli
