#include "weights_option.h"

#include <fmt/format.h>

#include "epmoe/checkpoint.h"
#include "output.h"

namespace epmoe::cli {

Result<ModelConfig> LoadCommandModel(const std::string& name_or_path, int hidden, int intermediate, int layers) {
  EPMOE_ASSIGN_OR_RETURN(ModelConfig model, LoadModel(name_or_path));
  model = ScaledModel(model, hidden, intermediate);
  EPMOE_RETURN_IF_ERROR(ValidateModel(model, "--hidden/--intermediate"));
  if (layers > model.num_moe_layers())
    return InvalidArgument(
        fmt::format("--layers {} exceeds the {} MoE layers of {}", layers, model.num_moe_layers(), model.name));
  return model;
}

void AddWeightsOption(CLI::App* command, std::string* path) {
  command->add_option("--weights", *path,
                      "Read the routers and experts from a Hugging Face checkpoint: a .safetensors file or a folder "
                      "of them (see `epmoe checkpoint`); --model must have its shapes. Default: synthetic weights");
}

Result<OpenedWeights> OpenWeights(const std::string& path, const ModelConfig& model, int layers, uint64_t seed) {
  if (path.empty()) return OpenedWeights{SyntheticWeights(model, seed), {{"source", "synthetic"}, {"seed", seed}}};
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(path, model, layers));
  nlohmann::json report = {{"source", "checkpoint"},
                           {"path", path},
                           {"naming", CheckpointNamingName(checkpoint->naming())},
                           {"files", checkpoint->num_files()},
                           {"file_bytes", checkpoint->file_bytes()}};
  return OpenedWeights{std::move(checkpoint), std::move(report)};
}

std::string DescribeWeights(const nlohmann::json& report) {
  if (report["source"] != "checkpoint") return "";
  return fmt::format("weights: {} ({} naming, {} files, {})", report["path"].get<std::string>(),
                     report["naming"].get<std::string>(), report["files"].get<int>(),
                     HumanBytes(report["file_bytes"].get<int64_t>()));
}

}  // namespace epmoe::cli
