// `epmoe trace convert|gen|stats|show`: routing traces in epmoe's binary format, importers for
// real traces, synthetic generators and statistics. See docs/traces.md.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "epmoe/model.h"
#include "epmoe/trace.h"
#include "epmoe/trace_gen.h"
#include "epmoe/trace_stats.h"
#include "output.h"

namespace epmoe::cli {
namespace {

const std::vector<std::string> kReadFormats = {"auto", "epmoe", "flame-csv", "flame-topk-csv", "jsonl",
                                               "expert-counts-csv", "sglang-json", "counts-csv"};
const std::vector<std::string> kWriteFormats = {"auto", "epmoe", "jsonl", "topk-csv", "counts-csv", "sglang-json"};

// Flags that say how to read a trace (LoadReadOptions).
void AddReadOptions(CLI::App* command, LoadReadOptions* options) {
  command->add_option("--from", options->format, "Input format (auto detects from the path and first bytes)")
      ->check(CLI::IsMember(kReadFormats));
  command->add_option("--phase", options->phase,
                      "Regroup per-token traces: decode (steps of --batch concurrent rows) or prefill (chunks of "
                      "--batch tokens); auto keeps the source's steps")
      ->check(CLI::IsMember({"auto", "decode", "prefill"}));
  command->add_option("--batch", options->batch, "Rows per decode step or tokens per prefill chunk (0: the source's)")
      ->check(kNonNegative);
  command->add_option("--filter", options->filter,
                      "Series of a count file, e.g. model=olmoe,domain=arxiv,selection=topk");
  command->add_option("--experts", options->num_experts,
                      "Experts per layer when the source does not say (0: largest id + 1)")
      ->check(kNonNegative);
  command
      ->add_option("--on-missing", options->on_missing,
                   "Per-token traces, a token without a record for every layer: error, or drop-token (counted)")
      ->check(CLI::IsMember({"error", "drop-token"}))
      ->capture_default_str();
}

std::string Shape(const TraceInfo& info) {
  return fmt::format("{} steps, {} layers, {} experts, top-{}{}", info.num_steps, info.num_layers, info.num_experts,
                     info.top_k == 0 ? std::string("?") : std::to_string(info.top_k),
                     info.has_picks ? (info.has_weights ? ", picks with weights" : ", picks") : ", counts only");
}

struct ConvertOptions {
  std::string input, output, to = "auto";
  LoadReadOptions read;
};

int Convert(const ConvertOptions& o) {
  auto reader = TraceReader::Open(o.input, o.read);
  if (!reader.ok()) return ReportError(reader.status());
  std::string to = o.to;
  if (to == "auto") {
    const std::string ext = std::filesystem::path(o.output).extension().string();
    if (ext == ".jsonl") to = "jsonl";
    else if (ext == ".json") to = "sglang-json";
    else if (ext == ".csv") to = (*reader)->has_picks() ? "topk-csv" : "counts-csv";
    else to = "epmoe";
  }
  const TraceInfo info = (*reader)->info();
  Status status = WriteTrace(reader->get(), o.output, to);
  if (!status.ok()) return ReportError(status);
  std::printf("%s (%s) -> %s (%s): %s\n", o.input.c_str(), info.format.c_str(), o.output.c_str(), to.c_str(),
              Shape(info).c_str());
  return 0;
}

struct GenOptions {
  std::string output;
  std::string model;
  TraceGenOptions gen;
};

int Generate(GenOptions o, bool layers_given, bool experts_given, bool k_given) {
  if (!o.model.empty()) {
    auto model = LoadModel(o.model);
    if (!model.ok()) return ReportError(model.status());
    if (!experts_given) o.gen.num_experts = model->num_experts;
    if (!k_given) o.gen.top_k = model->top_k;
    if (!layers_given) o.gen.num_layers = model->num_moe_layers();
  }
  Status status = GenerateTraceFile(o.gen, o.output);
  if (!status.ok()) return ReportError(status);
  std::printf("%s: %s trace, %lld steps x %lld rows, %d layers, %d experts, top-%d, seed %llu\n", o.output.c_str(),
              o.gen.distribution.c_str(), static_cast<long long>(o.gen.steps), static_cast<long long>(o.gen.batch),
              o.gen.num_layers, o.gen.num_experts, o.gen.top_k, static_cast<unsigned long long>(o.gen.seed));
  return 0;
}

struct StatsOptions {
  std::string input;
  int ranks = 8;
  int hottest = 5;
  std::string format = "text";
  LoadReadOptions read;
};

int Stats(const StatsOptions& o) {
  auto reader = TraceReader::Open(o.input, o.read);
  if (!reader.ok()) return ReportError(reader.status());
  const int ranks = o.ranks;
  auto stats = ComputeTraceStats(reader->get(), ranks, o.hottest);
  if (!stats.ok()) return ReportError(stats.status().WithContext("--ranks"));
  const TraceStats& s = *stats;
  const bool picks = s.info.has_picks;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerTraceStats& l : s.layers) {
    nlohmann::json hot = nlohmann::json::array();
    for (const auto& [expert, count] : l.hottest) hot.push_back({{"expert", expert}, {"picks", count}});
    nlohmann::json layer{{"layer", l.layer_id},
                         {"picks", l.picks},
                         {"experts_touched_per_step", l.experts_touched_mean},
                         {"max_over_mean_per_step", l.max_over_mean_mean},
                         {"max_over_mean_total", l.max_over_mean_total},
                         {"balancedness", l.balancedness_mean},
                         {"hottest", hot}};
    if (picks) {
      layer["ranks_per_row"] = l.ranks_per_row_mean;
      layer["copies_per_row"] = l.copies_per_row_mean;
    }
    layers.push_back(layer);
  }
  if (o.format == "json") {
    nlohmann::json out{{"file", o.input},
                       {"format", s.info.format},
                       {"description", s.info.description},
                       {"steps", s.steps},
                       {"rows", s.rows},
                       {"layers", s.info.num_layers},
                       {"experts", s.info.num_experts},
                       {"top_k", s.info.top_k},
                       {"has_picks", picks},
                       {"has_weights", s.info.has_weights},
                       {"ranks", s.ranks},
                       {"balancedness", s.balancedness_mean},
                       {"per_layer", layers}};
    if (picks) {
      out["ranks_per_row"] = s.ranks_per_row_mean;
      out["copies_per_row"] = s.copies_per_row_mean;
    }
    if (s.uniform_ranks_per_row > 0) out["uniform_ranks_per_row"] = s.uniform_ranks_per_row;
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  TraceInfo shown = s.info;
  shown.num_steps = s.steps;
  std::string rows = s.rows > 0 ? HumanCount(s.rows) : "?";
  while (!rows.empty() && rows.back() == ' ') rows.pop_back();
  std::printf("%s (%s): %s, %s rows\n", o.input.c_str(), s.info.format.c_str(), Shape(shown).c_str(), rows.c_str());
  if (!s.info.description.empty()) std::printf("  %s\n", s.info.description.c_str());
  std::printf("G = %d ranks, trivial placement (expert e on rank e*G/E), rows split evenly over ranks\n\n", s.ranks);
  std::printf("%6s %12s %9s %10s %10s %9s %9s %9s  %s\n", "layer", "picks", "touched", "max/mean", "max/mean",
              "balanced", "ranks", "copies", "hottest experts (picks)");
  std::printf("%6s %12s %9s %10s %10s %9s %9s %9s\n", "", "", "per step", "per step", "all steps", "ness",
              "per row", "per row");
  for (const LayerTraceStats& l : s.layers) {
    std::string hot;
    for (const auto& [expert, count] : l.hottest) hot += fmt::format("{}{}({})", hot.empty() ? "" : " ", expert, count);
    std::printf("%6d %12s %9.1f %10.2f %10.2f %9.3f %9s %9s  %s\n", l.layer_id, HumanCount(l.picks).c_str(),
                l.experts_touched_mean, l.max_over_mean_mean, l.max_over_mean_total, l.balancedness_mean,
                picks ? fmt::format("{:.2f}", l.ranks_per_row_mean).c_str() : "-",
                picks ? fmt::format("{:.2f}", l.copies_per_row_mean).c_str() : "-", hot.c_str());
  }
  std::printf("\nmean over layers: balancedness %.3f", s.balancedness_mean);
  if (picks) std::printf(", ranks per row %.2f, copies per row %.2f", s.ranks_per_row_mean, s.copies_per_row_mean);
  if (s.uniform_ranks_per_row > 0) std::printf(" (uniform routing: %.2f ranks per row)", s.uniform_ranks_per_row);
  std::printf("\n");
  return 0;
}

struct ShowOptions {
  std::string input;
  int64_t step = 0;
  int layer = 0;
  int64_t rows = 8;
  std::string format = "text";
  LoadReadOptions read;
};

int Show(const ShowOptions& o) {
  auto opened = TraceReader::Open(o.input, o.read);
  if (!opened.ok()) return ReportError(opened.status());
  TraceReader& reader = **opened;
  const TraceInfo info = reader.info();
  if (o.layer >= info.num_layers)
    return ReportError(InvalidArgument(fmt::format("--layer {} out of range: the trace has {} layers", o.layer,
                                                   info.num_layers)));
  StepPicks step;
  for (int64_t s = 0; s <= o.step; ++s) {
    auto more = reader.Next(&step);
    if (!more.ok()) return ReportError(more.status());
    if (!*more)
      return ReportError(InvalidArgument(fmt::format("--step {} out of range: the trace has {} steps", o.step, s)));
  }
  const int E = info.num_experts, k = info.top_k;
  const std::vector<int64_t> counts(step.counts.begin() + static_cast<size_t>(o.layer) * E,
                                    step.counts.begin() + static_cast<size_t>(o.layer + 1) * E);
  const int64_t shown_rows = info.has_picks ? std::min(o.rows, step.rows) : 0;
  if (o.format == "json") {
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t r = 0; r < shown_rows; ++r) {
      const Picks& p = step.layers[o.layer];
      nlohmann::json row{{"row", r}, {"experts", std::vector<int32_t>(p.experts.begin() + r * k, p.experts.begin() + (r + 1) * k)}};
      if (info.has_weights)
        row["weights"] = std::vector<float>(p.weights.begin() + r * k, p.weights.begin() + (r + 1) * k);
      rows.push_back(row);
    }
    nlohmann::json out{{"step", o.step}, {"layer", info.layer_ids[o.layer]}, {"rows", step.rows},
                       {"counts", counts}, {"picks", rows}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("%s (%s): step %lld, layer %d (index %d), %lld rows\n", o.input.c_str(), info.format.c_str(),
              static_cast<long long>(o.step), info.layer_ids[o.layer], o.layer, static_cast<long long>(step.rows));
  for (int64_t r = 0; r < shown_rows; ++r) {
    const Picks& p = step.layers[o.layer];
    std::string line;
    for (int j = 0; j < k; ++j)
      line += info.has_weights ? fmt::format(" {}:{:.4f}", p.expert(r, j), p.weight(r, j))
                               : fmt::format(" {}", p.expert(r, j));
    std::printf("  row %lld:%s\n", static_cast<long long>(r), line.c_str());
  }
  std::string count_line;
  for (int e = 0; e < E; ++e) count_line += fmt::format("{}{}", e ? " " : "", counts[e]);
  std::printf("picks per expert: %s\n", count_line.c_str());
  return 0;
}

}  // namespace

void AddTraceCommand(CLI::App& app, int* exit_code) {
  auto* trace = app.add_subcommand("trace", "Routing traces: convert, generate, statistics, show");
  trace->require_subcommand(1);

  auto convert = std::make_shared<ConvertOptions>();
  auto* c = trace->add_subcommand("convert", "Convert a trace (any supported format) to binary, CSV or JSON");
  c->add_option("input", convert->input, "Trace file or folder (FLAME-MoE CSV folders: one step, or posNN/ steps)")
      ->required();
  c->add_option("output", convert->output, "Output file")->required();
  AddReadOptions(c, &convert->read);
  c->add_option("--to", convert->to,
                "Output format (auto: .jsonl -> jsonl, .json -> sglang-json, .csv -> topk-csv or counts-csv, "
                "else epmoe binary)")
      ->check(CLI::IsMember(kWriteFormats));
  c->callback([convert, exit_code] { *exit_code = Convert(*convert); });

  auto gen = std::make_shared<GenOptions>();
  auto* g = trace->add_subcommand("gen", "Generate a synthetic trace (binary format)");
  g->add_option("output", gen->output, "Output file")->required();
  g->add_option("--dist", gen->gen.distribution, "Popularity: uniform, zipf, gaussian or round-robin")
      ->check(CLI::IsMember({"uniform", "zipf", "gaussian", "round-robin"}));
  g->add_option("--model", gen->model, "Take experts, top-k and MoE layers from a model preset");
  auto* layers = g->add_option("--layers", gen->gen.num_layers, "MoE layers")->check(kPositive);
  auto* experts = g->add_option("--experts", gen->gen.num_experts, "Experts per layer")->check(kPositive);
  auto* top_k = g->add_option("--top-k", gen->gen.top_k, "Picks per row")->check(kPositive);
  g->add_option("--steps", gen->gen.steps, "Steps")->check(kNonNegative);
  g->add_option("--batch", gen->gen.batch, "Rows per step")->check(kPositive);
  g->add_option("--seed", gen->gen.seed, "Seed");
  g->add_option("--zipf-s", gen->gen.zipf_exponent, "Zipf exponent s (popularity of the r-th expert ~ 1/(r+1)^s)")
      ->check(CLI::Range(0.0, 100.0));
  g->add_option("--temperature", gen->gen.temperature, "Gaussian: softmax temperature of N(0,1) logits")
      ->check(CLI::PositiveNumber);
  g->add_option("--drift-every", gen->gen.drift_every, "Change the popular set every N steps (0: never)")
      ->check(kNonNegative);
  g->add_option("--correlation", gen->gen.correlation,
                "Chance that a row keeps each expert its request picked the step before (0..1)")
      ->check(CLI::Range(0.0, 1.0));
  g->add_option("--request-steps", gen->gen.request_steps, "Mean steps a request stays in the batch")
      ->check(kPositive);
  g->callback([gen, layers, experts, top_k, exit_code] {
    *exit_code = Generate(*gen, layers->count() > 0, experts->count() > 0, top_k->count() > 0);
  });

  auto stats = std::make_shared<StatsOptions>();
  auto* s = trace->add_subcommand("stats", "Per-layer statistics: touched experts, skew, balancedness, ranks per row");
  s->add_option("input", stats->input, "Trace file or folder")->required();
  s->add_option("--ranks", stats->ranks, "G: ranks for balancedness and ranks/copies per row")->check(kPositive);
  s->add_option("--hottest", stats->hottest, "Hottest experts listed per layer")->check(kNonNegative);
  AddReadOptions(s, &stats->read);
  AddFormatOption(s, &stats->format, {"text", "json"});
  s->callback([stats, exit_code] { *exit_code = Stats(*stats); });

  auto show = std::make_shared<ShowOptions>();
  auto* w = trace->add_subcommand("show", "Print one step of one layer: each row's picks and the counts per expert");
  w->add_option("input", show->input, "Trace file or folder")->required();
  w->add_option("--step", show->step, "Step index")->check(kNonNegative);
  w->add_option("--layer", show->layer, "Layer index (0-based, in the trace's order)")->check(kNonNegative);
  w->add_option("--rows", show->rows, "Rows to print")->check(kNonNegative);
  AddReadOptions(w, &show->read);
  AddFormatOption(w, &show->format, {"text", "json"});
  w->callback([show, exit_code] { *exit_code = Show(*show); });
}

}  // namespace epmoe::cli
