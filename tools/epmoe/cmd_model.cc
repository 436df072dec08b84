// `epmoe model list` and `epmoe model show NAME|PATH`: presets and the sizes derived from them.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "epmoe/model.h"
#include "epmoe/weight_format.h"
#include "output.h"

namespace epmoe::cli {
namespace {

struct ShowOptions {
  std::string model;
  std::string format = "text";
};

int ShowModel(const ShowOptions& options) {
  auto model = LoadModel(options.model);
  if (!model.ok()) return ReportError(model.status());
  const ModelConfig& m = *model;
  const int64_t weights_per_expert = 3LL * m.hidden * m.expert_intermediate;
  const int64_t weights_per_shared = 3LL * m.hidden * m.shared_intermediate;
  nlohmann::json sizes = nlohmann::json::array();
  for (WeightFormat f : AllWeightFormats()) {
    const bool storable =
        CheckShape(f, m.expert_intermediate, m.hidden).ok() && CheckShape(f, m.hidden, m.expert_intermediate).ok();
    const int64_t expert = RoutedExpertBytes(m, f);
    const int64_t shared = m.num_shared_experts * ExpertByteCount(f, m.hidden, m.shared_intermediate);
    const int64_t layer = m.num_experts * expert + shared;
    sizes.push_back({{"format", WeightFormatName(f)},
                     {"storable", storable},
                     {"bytes_per_expert", expert},
                     {"bytes_per_layer_routed", m.num_experts * expert},
                     {"bytes_per_layer_shared", shared},
                     {"bytes_per_layer", layer},
                     {"bytes_all_moe_layers", layer * m.num_moe_layers()}});
  }
  nlohmann::json out = nlohmann::json::parse(ModelToJson(m));
  out["derived"] = {{"moe_layers", m.num_moe_layers()},
                    {"weights_per_expert", weights_per_expert},
                    {"weights_per_shared_expert", weights_per_shared},
                    {"routed_weights_per_layer", weights_per_expert * m.num_experts},
                    {"routed_weights_all_layers", weights_per_expert * m.num_experts * m.num_moe_layers()},
                    {"active_expert_weights_per_row_per_layer",
                     weights_per_expert * m.top_k + weights_per_shared * m.num_shared_experts},
                    {"dense_ffn_weights_per_layer", 3LL * m.hidden * m.dense_intermediate},
                    {"sizes", sizes}};
  if (options.format == "json") {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("%s\n", ModelToJson(m).c_str());
  std::printf("\nderived:\n");
  std::printf("  MoE layers:                 %d (of %d; %d dense)\n", m.num_moe_layers(), m.num_layers,
              m.num_dense_layers);
  std::printf("  weights per routed expert:  %s (3 x %d x %d)\n", HumanCount(weights_per_expert).c_str(), m.hidden,
              m.expert_intermediate);
  if (m.num_shared_experts > 0)
    std::printf("  weights per shared expert:  %s\n", HumanCount(weights_per_shared).c_str());
  std::printf("  routed weights per layer:   %s; all MoE layers: %s\n",
              HumanCount(weights_per_expert * m.num_experts).c_str(),
              HumanCount(weights_per_expert * m.num_experts * m.num_moe_layers()).c_str());
  std::printf("\n  %-6s %14s %16s %16s %18s\n", "format", "bytes/expert", "bytes/layer", "shared/layer",
              "all MoE layers");
  for (const auto& s : sizes) {
    std::printf("  %-6s %14s %16s %16s %18s%s\n", s["format"].get<std::string>().c_str(),
                HumanBytes(s["bytes_per_expert"].get<int64_t>()).c_str(),
                HumanBytes(s["bytes_per_layer"].get<int64_t>()).c_str(),
                HumanBytes(s["bytes_per_layer_shared"].get<int64_t>()).c_str(),
                HumanBytes(s["bytes_all_moe_layers"].get<int64_t>()).c_str(),
                s["storable"].get<bool>() ? "" : "  (shape not a multiple of the block)");
  }
  return 0;
}

}  // namespace

void AddModelCommand(CLI::App& app, int* exit_code) {
  auto* model = app.add_subcommand("model", "List model presets or show one with its derived sizes");
  model->require_subcommand(1);

  auto* list = model->add_subcommand("list", "List the built-in model presets");
  list->callback([exit_code] {
    for (const auto& name : ListModelPresets()) std::printf("%s\n", name.c_str());
    *exit_code = 0;
  });

  auto options = std::make_shared<ShowOptions>();
  auto* show = model->add_subcommand("show", "Print a preset and its sizes in every weight format");
  show->add_option("model", options->model, "Preset name (see `epmoe model list`) or path to a .json file")->required();
  AddFormatOption(show, &options->format, {"text", "json"});
  show->callback([options, exit_code] { *exit_code = ShowModel(*options); });
}

}  // namespace epmoe::cli
