// `--weights PATH` of `epmoe layer` and `epmoe run`: the experts and routers of a checkpoint, or
// the synthetic ones of a seed.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "epmoe/layer.h"
#include "epmoe/model.h"
#include "epmoe/status.h"

namespace epmoe::cli {

// The help of `--model`, in every command that takes one as LoadModel reads it.
inline constexpr char kModelOptionHelp[] =
    "Model: a preset name, a .json path, or a Hugging Face model folder (its config.json)";

// The model of `--model` (a preset, a .json file or a checkpoint folder's config.json) with the
// sizes of `--hidden` / `--intermediate` (0 keeps them), refused when it has fewer MoE layers than
// `--layers`.
Result<ModelConfig> LoadCommandModel(const std::string& name_or_path, int hidden, int intermediate, int layers);

// Adds `--weights PATH` to a command.
void AddWeightsOption(CLI::App* command, std::string* path);

struct OpenedWeights {
  std::shared_ptr<const WeightSource> source;
  nlohmann::json
      report;  // what was opened: {"source": "synthetic", "seed"} or the checkpoint's path, naming, files, bytes
};

// The checkpoint at `path` (MoE layers 0 .. layers - 1 of `model`, checked), or the synthetic
// weights of `seed` when the path is empty.
Result<OpenedWeights> OpenWeights(const std::string& path, const ModelConfig& model, int layers, uint64_t seed);

// "weights: PATH (NAMING naming, N files, SIZE)" for a checkpoint's report, "" for synthetic ones.
std::string DescribeWeights(const nlohmann::json& report);

}  // namespace epmoe::cli
