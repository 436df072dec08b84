// `epmoe layer`: T rows through N MoE layers in one process, with per-layer figures.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "epmoe/layer.h"
#include "epmoe/replay.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "output.h"
#include "system_memory.h"
#include "weights_option.h"

namespace epmoe::cli {
namespace {

struct LayerOptions {
  std::string model = "qwen3-30b-a3b";
  int64_t tokens = 64;
  int layers = 2;
  int steps = 3;
  uint64_t seed = 1;
  std::string routing = "scores";
  std::string trace;
  std::string trace_format = "auto";
  std::string weight_format = "fp32";
  std::string isa = "auto";
  std::string weights;
  int threads = 0;
  int hidden = 0;
  int intermediate = 0;
  bool check = false;
  double max_memory_gb = 0;
  std::string format = "text";
};

// Normalized max error allowed between the production path and the reference, per weight format:
// the bounds the kernels harness (tests/kernels_expert_ffn_test.cc) states for quantization plus
// kernel error. 4-bit E2M1 values are coarse (3 bits of magnitude per block scale).
double Tolerance(WeightFormat format) {
  switch (format) {
    case WeightFormat::kFp32: return 1e-4;
    case WeightFormat::kBf16: return 1.5e-2;
    case WeightFormat::kInt8: return 5e-2;
    case WeightFormat::kNvfp4: return 3e-1;
    case WeightFormat::kMxfp4: return 3.5e-1;
  }
  return 0;
}

struct LayerReport {
  std::vector<double> route_us, permute_us, experts_us, combine_us, shared_us;
  LayerStats last;
  double checksum = 0;
  double max_error = 0;
};

Status RunLayers(const LayerOptions& o, nlohmann::json* report) {
  EPMOE_ASSIGN_OR_RETURN(const ModelConfig model, LoadCommandModel(o.model, o.hidden, o.intermediate, o.layers));
  EPMOE_ASSIGN_OR_RETURN(WeightFormat format, ParseWeightFormat(o.weight_format));
  EPMOE_ASSIGN_OR_RETURN(RoutingMode routing, ParseRoutingMode(o.routing));
  if ((routing == RoutingMode::kReplay) != !o.trace.empty())
    return InvalidArgument("--routing replay and --trace FILE go together");
  std::unique_ptr<PicksReplay> replay;
  if (routing == RoutingMode::kReplay) {
    LoadReadOptions read;
    read.format = o.trace_format;
    EPMOE_ASSIGN_OR_RETURN(replay, PicksReplay::Open(o.trace, read, model));
  }
  // Packed weights of every layer stay resident. Without --check the experts are packed as they are
  // made, one per thread at a time; --check keeps every layer's fp32 weights for the reference.
  ThreadPool pool(o.threads);
  // A replayed trace's steps are read as they run: their rows are not known here.
  const int64_t admitted_rows = replay != nullptr ? 0 : o.tokens;
  EPMOE_RETURN_IF_ERROR(
      AdmitMemory(EstimateLayerMemory(model, format, o.layers, admitted_rows, o.check, pool.size()), o.max_memory_gb,
                  fmt::format("{} layers of {} in {}, {} rows per step", o.layers, model.name, WeightFormatName(format),
                              admitted_rows),
                  "use fewer --layers or --tokens, a smaller --weight-format, --hidden/--intermediate"));

  PackOptions pack{format, o.isa, &pool};
  std::vector<std::unique_ptr<MoeLayer>> layers;
  std::vector<MoeLayerWeights> reference_weights;
  EPMOE_ASSIGN_OR_RETURN(const OpenedWeights opened, OpenWeights(o.weights, model, o.layers, o.seed));
  const WeightSource* weights = opened.source.get();
  const auto load_start = std::chrono::steady_clock::now();
  for (int l = 0; l < o.layers; ++l) {
    if (o.check) {
      EPMOE_ASSIGN_OR_RETURN(MoeLayerWeights fp32, LoadLayerWeights(model, *weights, l, &pool));
      reference_weights.push_back(std::move(fp32));
      EPMOE_ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(model, reference_weights.back(), pack));
      layers.push_back(std::move(layer));
    } else {
      EPMOE_ASSIGN_OR_RETURN(auto layer, MoeLayer::Create(model, *weights, l, pack));
      layers.push_back(std::move(layer));
    }
  }
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  std::vector<LayerReport> per_layer(o.layers);
  int64_t tokens = o.tokens;
  Matrix out;  // each layer's output, written whole by Forward (reused: no page faults per step)
  for (int step = 0; step < o.steps; ++step) {
    if (replay != nullptr) {
      EPMOE_ASSIGN_OR_RETURN(tokens, replay->NextStep());
    }
    Matrix x = SyntheticRows(o.seed, model, step, 0, tokens);
    for (int l = 0; l < o.layers; ++l) {
      LayerStats stats;
      Picks picks;
      const auto t0 = std::chrono::steady_clock::now();
      switch (routing) {
        case RoutingMode::kScores: EPMOE_RETURN_IF_ERROR(layers[l]->Route(x, &picks, &pool)); break;
        case RoutingMode::kRoundRobin: picks = RoundRobinPicks(model, tokens); break;
        case RoutingMode::kUniform: picks = UniformPicks(model, tokens, o.seed * 1000003 + step * 1009 + l); break;
        case RoutingMode::kReplay: picks = replay->LayerPicks(l); break;
      }
      stats.route_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      EPMOE_RETURN_IF_ERROR(layers[l]->Forward(x, picks, &out, pool, &stats).WithContext(fmt::format("layer {}", l)));
      LayerReport& r = per_layer[l];
      if (o.check) {
        Matrix expected;
        EPMOE_RETURN_IF_ERROR(ReferenceMoeForward(model, reference_weights[l], x, picks, &expected));
        const double error = NormalizedMaxError(out, expected);
        r.max_error = std::max(r.max_error, error);
        if (!(error <= Tolerance(format)))
          return Internal(
              fmt::format("--check: layer {} step {} differs from the reference: normalized max error {:.3g} "
                          "> {:.1g}",
                          l, step, error, Tolerance(format)));
      }
      r.route_us.push_back(stats.route_us);
      r.permute_us.push_back(stats.permute_us);
      r.experts_us.push_back(stats.experts_us);
      r.combine_us.push_back(stats.combine_us);
      r.shared_us.push_back(stats.shared_us);
      r.last = stats;
      r.checksum = Checksum(out);
      // Residual stream: the next layer sees x + moe(x), as in a transformer block.
      for (size_t i = 0; i < x.data.size(); ++i) x.data[i] += out.data[i];
    }
  }

  nlohmann::json layers_json = nlohmann::json::array();
  for (int l = 0; l < o.layers; ++l) {
    const LayerReport& r = per_layer[l];
    nlohmann::json j = {
        {"layer", l},
        {"experts_touched", r.last.experts_touched},
        {"max_picks_per_expert", r.last.max_picks_per_expert},
        {"mean_picks_per_touched_expert", r.last.mean_picks_per_touched_expert},
        {"mean_picks_per_expert", model.num_experts ? static_cast<double>(r.last.picks) / model.num_experts : 0},
        {"expert_bytes_read", r.last.expert_bytes_read},
        {"median_us",
         {{"route", Median(r.route_us)},
          {"permute", Median(r.permute_us)},
          {"experts", Median(r.experts_us)},
          {"combine", Median(r.combine_us)},
          {"shared", Median(r.shared_us)}}},
        {"checksum", r.checksum}};
    if (o.check) j["max_normalized_error"] = r.max_error;
    layers_json.push_back(j);
  }
  *report = {{"model", model.name},
             {"hidden", model.hidden},
             {"expert_intermediate", model.expert_intermediate},
             {"tokens", tokens},
             {"steps", o.steps},
             {"routing", o.routing},
             {"weight_format", WeightFormatName(format)},
             {"kernel", layers.empty() ? "" : layers[0]->routed().kernel_name()},
             {"threads", pool.size()},
             {"checked", o.check},
             {"weights", opened.report},
             {"load_seconds", load_seconds},
             {"layers", layers_json}};
  return Status::Ok();
}

void PrintText(const nlohmann::json& r) {
  std::printf("%s: %lld tokens, %d steps, routing %s, %s weights (%s), %d threads\n",
              r["model"].get<std::string>().c_str(), static_cast<long long>(r["tokens"].get<int64_t>()),
              r["steps"].get<int>(), r["routing"].get<std::string>().c_str(),
              r["weight_format"].get<std::string>().c_str(), r["kernel"].get<std::string>().c_str(),
              r["threads"].get<int>());
  const std::string weights = DescribeWeights(r["weights"]);
  if (!weights.empty())
    std::printf("%s, read and packed in %.2f s\n", weights.c_str(), r["load_seconds"].get<double>());
  std::printf("%5s %8s %9s %9s %12s | %9s %9s %9s %9s %9s | %14s\n", "layer", "touched", "max/exp", "mean/exp",
              "bytes read", "route us", "perm us", "expert us", "comb us", "shared us", "checksum");
  for (const auto& l : r["layers"]) {
    const auto& t = l["median_us"];
    std::printf("%5d %8d %9lld %9.2f %12s | %9.1f %9.1f %9.1f %9.1f %9.1f | %14.6f\n", l["layer"].get<int>(),
                l["experts_touched"].get<int>(), static_cast<long long>(l["max_picks_per_expert"].get<int64_t>()),
                l["mean_picks_per_touched_expert"].get<double>(),
                HumanBytes(l["expert_bytes_read"].get<int64_t>()).c_str(), t["route"].get<double>(),
                t["permute"].get<double>(), t["experts"].get<double>(), t["combine"].get<double>(),
                t["shared"].get<double>(), l["checksum"].get<double>());
  }
  if (r["checked"].get<bool>()) std::printf("check: every layer and step matches the fp32 reference\n");
}

}  // namespace

void AddLayerCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<LayerOptions>();
  auto* cmd = app.add_subcommand("layer", "Run T rows through N MoE layers in one process and report per layer");
  cmd->add_option("--model", o->model, kModelOptionHelp)->capture_default_str();
  cmd->add_option("--tokens,-t", o->tokens, "Rows per step (T)")->check(kNonNegative)->capture_default_str();
  cmd->add_option("--layers", o->layers, "MoE layers to run")->check(kPositive)->capture_default_str();
  cmd->add_option("--steps", o->steps, "Steps (each with new rows); times are medians over steps")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the synthetic weights, rows and uniform routing")->capture_default_str();
  cmd->add_option("--routing", o->routing, "How picks are made")
      ->check(CLI::IsMember({"scores", "round_robin", "uniform", "replay"}))
      ->capture_default_str();
  cmd->add_option("--trace", o->trace,
                  "Routing trace to replay (with --routing replay): step s of the run takes trace step s, "
                  "layer l takes trace layer l mod the trace's layers; --tokens is then the trace's rows");
  cmd->add_option("--trace-format", o->trace_format, "Trace format (see `epmoe trace --help`)")->capture_default_str();
  cmd->add_option("--weight-format", o->weight_format, "Expert weight format")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--isa", o->isa,
                  "Highest instruction set for the kernels and the router (auto, or a lower one to force it)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Worker threads (0: every core this process may use)")
      ->check(kNonNegative)
      ->capture_default_str();
  AddWeightsOption(cmd, &o->weights);
  cmd->add_option("--hidden", o->hidden, "Override the model's hidden size (0: keep)")->check(kNonNegative);
  cmd->add_option("--intermediate", o->intermediate, "Override the experts' intermediate size (0: keep)")
      ->check(kNonNegative);
  cmd->add_flag("--check", o->check, "Compare every layer's output with the plain fp32 reference; fail on a mismatch");
  cmd->add_option("--max-memory-gb", o->max_memory_gb,
                  "Memory budget for weights and rows (0: 80% of available memory)")
      ->check(kNonNegative);
  AddFormatOption(cmd, &o->format, {"text", "json"});
  SetReportCallback(
      cmd, exit_code, &o->format, [o](nlohmann::json* report) { return RunLayers(*o, report); }, PrintText);
}

}  // namespace epmoe::cli
