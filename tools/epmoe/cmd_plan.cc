// `epmoe plan`: predicted kernel, communication and step time per option and EP size on a hardware
// profile, from a trace or an even router, with the derived sizes of the model; `epmoe hardware`
// lists and shows the profiles; AddPlanCommand also registers `epmoe calibrate`.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "epmoe/atomic_file.h"
#include "epmoe/hardware.h"
#include "epmoe/model.h"
#include "epmoe/plan.h"
#include "epmoe/trace.h"
#include "output.h"
#include "weights_option.h"

namespace epmoe::cli {

// `epmoe calibrate` (cmd_calibrate.cc) is registered with the planner's commands.
void AddCalibrateCommand(CLI::App& app, int* exit_code);

namespace {

using nlohmann::json;

struct PlanFlags {
  std::string model;
  int hidden = 0;  // overrides of the model's shape (0: keep), as `epmoe run` has them
  int intermediate = 0;
  std::string hardware;
  std::string trace;
  std::string trace_format = "auto";
  std::string trace_filter;
  std::string phase = "decode";
  std::vector<int64_t> batches;
  std::vector<int> gpus = {8};
  std::vector<std::string> options = {"sliced", "whole", "hybrid", "a2a", "dwdp"};
  std::string expert_weights = "nvfp4";
  std::string shared_weights = "bf16";
  std::string dense_weights = "int8";
  std::string rows = "bf16";
  std::string combine = "bf16";
  std::string a2a_combine = "partial-sums";
  std::string shared = "default";
  std::string dense = "sliced";
  int samples = 16;
  uint64_t seed = 1;
  std::string placement = "trivial";
  int redundant = 0;
  std::vector<std::string> a2a_levels = {"auto"};
  std::vector<std::string> a2a_modes = {"auto"};
  bool tbo = false;
  bool sbo = false;
  std::string format = "text";
  std::string plot;
  std::vector<std::string> measured;
};

// Options the model prices within this fraction of each other are predicted equal: it does not
// claim to order them (its inputs are not that precise).
constexpr double kPredictedTie = 0.005;

// One-sided sign test: the chance that a fair coin gives at least `wins` heads in `n` tosses.
double SignTestP(int wins, int n) {
  double p = 0;
  for (int k = wins; k <= n; ++k)
    p += std::exp(std::lgamma(n + 1.0) - std::lgamma(k + 1.0) - std::lgamma(n - k + 1.0) - n * std::log(2.0));
  return p;
}

// `epmoe run --format json` output of one or more runs against the plan: measured and predicted time
// per MoE layer for each option they have, and whether the orders agree. A run's steps pair the
// options (step s of every option ran on the same rows; with --interleave also back to back), so a
// pair's measured order counts as established when one option was faster in so many of the paired
// steps of all runs that a coin would do that with probability <= 5% (sign test); pairs the
// measurement does not separate are reported, not judged. Several runs (e.g. the options listed in
// opposite orders) pool their steps: where an option's weights sit in memory depends on when the run
// allocated them, which favours some options by a few percent within one run.
Status CompareWithRuns(const PlanResult& plan, const ModelConfig& model, WeightFormat experts,
                       const std::vector<std::string>& paths, json* out) {
  // The run's options and the plan's share one set of names (ep_options.h).
  const std::vector<EpOption> options = AllEpOptions();
  const int kOptions = static_cast<int>(options.size());
  int ranks = 0, layers = 0;
  int64_t tokens = 0;
  bool interleaved = true;
  // Per option, per run: its step times (empty when that run lacks the option), or its median alone
  // when the run has no per-step times.
  std::vector<std::vector<std::vector<double>>> steps(kOptions, std::vector<std::vector<double>>(paths.size()));
  std::vector<bool> per_step(paths.size(), true);
  // Reads run r into the above; a field of the wrong type throws (caught below).
  auto read_run = [&](size_t r, const json& run) -> Status {
    const std::string& path = paths[r];
    for (const char* field : {"ranks", "tokens", "layers"})
      if (!run.contains(field))
        return InvalidArgument(fmt::format("{}: missing field '{}' (expected `epmoe run --format json`)", path, field));
    if (r == 0) {
      ranks = run["ranks"].get<int>();
      tokens = run["tokens"].get<int64_t>();
      layers = run["layers"].get<int>();
      if (layers < 1) return InvalidArgument(fmt::format("{}: field 'layers' must be positive", path));
    } else if (run["ranks"].get<int>() != ranks || run["tokens"].get<int64_t>() != tokens ||
               run["layers"].get<int>() != layers) {
      return InvalidArgument(
          fmt::format("{}: {} ranks, {} tokens, {} layers; {} has {}, {}, {}: compare runs of one shape", path,
                      run["ranks"].get<int>(), run["tokens"].get<int64_t>(), run["layers"].get<int>(), paths[0], ranks,
                      tokens, layers));
    }
    // The run must have run the model and weights the plan prices.
    const std::pair<const char*, int64_t> shape[] = {{"hidden", model.hidden},
                                                     {"expert_intermediate", model.expert_intermediate},
                                                     {"num_experts", model.num_experts},
                                                     {"top_k", model.top_k}};
    for (const auto& [field, planned] : shape)
      if (run.contains(field) && run[field].get<int64_t>() != planned)
        return InvalidArgument(
            fmt::format("{}: the run has {} {}, the plan's model {} (give --hidden/--intermediate as "
                        "the run had them)",
                        path, field, run[field].get<int64_t>(), planned));
    if (run.contains("weight_format") && run["weight_format"].get<std::string>() != WeightFormatName(experts))
      return InvalidArgument(fmt::format("{}: the run's experts are {}, the plan's --weights {}", path,
                                         run["weight_format"].get<std::string>(), WeightFormatName(experts)));
    interleaved = interleaved && run.value("interleaved", false);
    for (const auto& measured : run.at("options")) {
      const Result<EpOption> option = ParseEpOption(measured.value("option", ""));
      if (!option.ok() || !measured.contains("step_ms_median")) continue;
      auto& times = steps[std::find(options.begin(), options.end(), *option) - options.begin()][r];
      if (measured.contains("step_ms")) {
        times = measured["step_ms"].get<std::vector<double>>();
      } else {
        times = {measured["step_ms_median"].get<double>()};
        per_step[r] = false;
      }
    }
    return Status::Ok();
  };
  for (size_t r = 0; r < paths.size(); ++r) {
    EPMOE_ASSIGN_OR_RETURN(const json run, ReadRunReport(paths[r]));
    try {
      EPMOE_RETURN_IF_ERROR(read_run(r, run));
    } catch (const json::exception& e) {
      return InvalidArgument(fmt::format("{}: {} (expected `epmoe run --format json`)", paths[r], e.what()));
    }
  }
  json rows = json::array();
  std::vector<int> row_option;  // index into options of each row of `rows`
  for (int i = 0; i < kOptions; ++i) {
    std::vector<double> pooled;
    for (const auto& times : steps[i]) pooled.insert(pooled.end(), times.begin(), times.end());
    if (pooled.empty()) continue;
    const double measured_us = Median(pooled) * 1000.0 / layers;
    // An option priced in several variants (a2a) is compared in its first: the run's flags.
    for (const auto& c : plan.costs) {
      if (c.option != options[i] || c.gpus != ranks || c.batch != tokens || !c.applicable) continue;
      rows.push_back({{"option", EpOptionName(c.option)},
                      {"measured_us_per_layer", measured_us},
                      {"predicted_us_per_layer", c.layer_us},
                      {"predicted_over_measured", c.layer_us / measured_us},
                      {"steps", pooled.size()}});
      row_option.push_back(i);
      break;
    }
  }
  if (rows.empty())
    return InvalidArgument(
        fmt::format("{}: no option of the run ({} ranks, {} tokens) is in the plan: give --gpus {} --batch {}",
                    paths[0], ranks, tokens, ranks, tokens));
  auto order = [&](const char* key) {
    std::vector<std::pair<double, std::string>> v;
    for (const auto& r : rows) v.emplace_back(r[key].get<double>(), r["option"].get<std::string>());
    std::sort(v.begin(), v.end());
    std::vector<std::string> names_in_order;
    for (const auto& [t, n] : v) names_in_order.push_back(n);
    return names_in_order;
  };
  int within = 0;
  for (const auto& r : rows)
    if (std::abs(r["predicted_over_measured"].get<double>() - 1.0) <= 0.25) ++within;
  json pairs = json::array();
  int separated = 0, agreeing = 0, separated_predicted_equal = 0;
  for (size_t a = 0; a < rows.size(); ++a) {
    for (size_t b = a + 1; b < rows.size(); ++b) {
      // Step s of option a against step s of option b, in every run that has both per step.
      int a_faster = 0, b_faster = 0;
      bool paired = false;
      for (size_t r = 0; r < paths.size(); ++r) {
        const auto& ta = steps[row_option[a]][r];
        const auto& tb = steps[row_option[b]][r];
        if (!per_step[r] || ta.empty() || ta.size() != tb.size()) continue;
        paired = true;
        for (size_t s = 0; s < ta.size(); ++s) {
          a_faster += ta[s] < tb[s];
          b_faster += tb[s] < ta[s];
        }
      }
      if (!paired) continue;
      const int n = a_faster + b_faster;
      const bool a_first = a_faster >= b_faster;
      const double p = SignTestP(std::max(a_faster, b_faster), n);
      const json& fast = rows[a_first ? a : b];
      const json& slow = rows[a_first ? b : a];
      const double fast_predicted = fast["predicted_us_per_layer"].get<double>();
      const double slow_predicted = slow["predicted_us_per_layer"].get<double>();
      const bool is_separated = n > 0 && p <= 0.05;
      // The model orders two options only when it prices them kPredictedTie apart.
      const bool predicted_equal =
          std::abs(fast_predicted - slow_predicted) <= kPredictedTie * std::max(fast_predicted, slow_predicted);
      if (is_separated && predicted_equal) ++separated_predicted_equal;
      if (is_separated && !predicted_equal) {
        ++separated;
        agreeing += fast_predicted < slow_predicted;
      }
      pairs.push_back({{"faster", fast["option"]},
                       {"slower", slow["option"]},
                       {"steps_faster", std::max(a_faster, b_faster)},
                       {"steps", n},
                       {"sign_test_p", p},
                       {"separated", is_separated},
                       {"predicted_faster", predicted_equal                   ? json("neither")
                                            : fast_predicted < slow_predicted ? fast["option"]
                                                                              : slow["option"]}});
    }
  }
  *out = {{"runs", paths},
          {"ranks", ranks},
          {"tokens", tokens},
          {"layers", layers},
          {"options", rows},
          {"interleaved", interleaved},
          {"measured_order", order("measured_us_per_layer")},
          {"predicted_order", order("predicted_us_per_layer")},
          {"within_25_percent", within},
          {"pairs", pairs},
          {"pairs_separated", separated},
          {"pairs_separated_as_predicted", agreeing},
          {"pairs_separated_predicted_equal", separated_predicted_equal}};
  (*out)["same_order_of_medians"] = (*out)["measured_order"] == (*out)["predicted_order"];
  (*out)["same_order"] = !pairs.empty() ? separated == agreeing : (*out)["same_order_of_medians"].get<bool>();
  return Status::Ok();
}

void PrintComparison(const json& cmp) {
  auto join = [](const json& names, const char* separator) {
    std::string text;
    for (const auto& n : names) text += (text.empty() ? "" : separator) + n.get<std::string>();
    return text;
  };
  std::printf("\ncalibration check against %s (%d ranks, %lld tokens, %d layers): time per MoE layer\n",
              join(cmp["runs"], ", ").c_str(), cmp["ranks"].get<int>(),
              static_cast<long long>(cmp["tokens"].get<int64_t>()), cmp["layers"].get<int>());
  std::printf("  %-8s %14s %14s %10s\n", "option", "measured us", "predicted us", "pred/meas");
  for (const auto& r : cmp["options"])
    std::printf("  %-8s %14.1f %14.1f %10.2f\n", r["option"].get<std::string>().c_str(),
                r["measured_us_per_layer"].get<double>(), r["predicted_us_per_layer"].get<double>(),
                r["predicted_over_measured"].get<double>());
  std::printf("  measured order (medians):  %s\n  predicted order:           %s\n",
              join(cmp["measured_order"], " < ").c_str(), join(cmp["predicted_order"], " < ").c_str());
  const std::string tie = fmt::format("priced within {:.1f}% by the model", 100 * kPredictedTie);
  for (const auto& p : cmp["pairs"])
    std::printf("  %-7s faster than %-7s in %2d of %2d %s steps (sign test p = %.3f): %s\n",
                p["faster"].get<std::string>().c_str(), p["slower"].get<std::string>().c_str(),
                p["steps_faster"].get<int>(), p["steps"].get<int>(),
                cmp["interleaved"].get<bool>() ? "interleaved" : "paired", p["sign_test_p"].get<double>(),
                !p["separated"].get<bool>()            ? "not separated"
                : p["predicted_faster"] == p["faster"] ? "predicted so"
                : p["predicted_faster"] == "neither"   ? tie.c_str()
                                                       : "predicted the other way");
  if (cmp["pairs"].empty())
    std::printf("  same order: %s (the run has no per-step times; medians compared)",
                cmp["same_order"].get<bool>() ? "yes" : "no");
  else
    std::printf(
        "  same order: %s (of %d pairs, %d separated by the steps and ordered by the model, %d of them as "
        "predicted; %d separated by the steps but priced within %.1f%% by the model)",
        cmp["same_order"].get<bool>() ? "yes" : "no", static_cast<int>(cmp["pairs"].size()),
        cmp["pairs_separated"].get<int>(), cmp["pairs_separated_as_predicted"].get<int>(),
        cmp["pairs_separated_predicted_equal"].get<int>(), 100 * kPredictedTie);
  std::printf("; within 25%%: %d of %zu\n", cmp["within_25_percent"].get<int>(), cmp["options"].size());
}

std::string Label(const OptionCost& c) {
  if (c.option == EpOption::kHybrid && !c.applicable) return EpOptionName(c.option);
  return CostLabel(c.option, c.slices, c.a2a);
}
std::string Label(const PlanWinner& w) {
  return CostLabel(w.option, w.slices, w.a2a);
}
// Whether `c` is the line that won its batch and EP size.
bool Wins(const PlanWinner* w, const OptionCost& c) {
  return w != nullptr && c.applicable && w->option == c.option && w->slices == c.slices && w->a2a == c.a2a;
}

json DerivedJson(const ModelConfig& m, const PlanConfig& config) {
  const ModelBytes b = ComputeModelBytes(m, config.formats);
  const int64_t wpe = WeightsPerExpert(m);
  json per_gpus = json::array();
  for (int g : config.gpus) {
    json memory = json::object();
    for (EpOption o : AllEpOptions())
      memory[EpOptionName(o)] = ComputeMemoryPerRank(m, config.formats, o, g, config.shared, config.dense).total();
    per_gpus.push_back({{"gpus", g},
                        {"expected_ranks_per_row", ExpectedRanksPerRow(m.num_experts, m.top_k, g)},
                        {"copies_sent_per_row_a2a", CopiesSentPerRow(m, g)},
                        {"copies_sent_per_row_all_gather", g - 1},
                        {"dwdp_bytes_per_rank_per_layer", DwdpBytesPerRankPerLayer(m, config.formats.experts, g)},
                        {"memory_per_rank_bytes", memory}});
  }
  json touched = json::array();
  for (int64_t t : config.batches)
    touched.push_back({{"batch", t}, {"even_router_touched_share", EvenTouchedShare(m, t)}});
  return {{"weights_per_expert", wpe},
          {"four_bit_bytes_per_expert", FourBitBytes(wpe)},
          {"four_bit_bytes_per_layer", FourBitBytes(wpe) * m.num_experts},
          {"four_bit_bytes_all_moe_layers", FourBitBytes(wpe) * m.num_experts * m.num_moe_layers()},
          {"expert_format", WeightFormatName(config.formats.experts)},
          {"bytes_per_expert", b.expert},
          {"bytes_per_layer_routed", b.routed_layer},
          {"bytes_all_moe_layers_routed", b.routed_model},
          {"shared_format", WeightFormatName(config.formats.shared)},
          {"bytes_per_layer_shared", b.shared_layer},
          {"dense_format", WeightFormatName(config.formats.dense)},
          {"bytes_per_dense_layer", b.dense_layer},
          {"row_bytes_bf16", RowBytes(RowFormat::kBf16, m.hidden)},
          {"row_bytes_q4", RowBytes(RowFormat::kQ4, m.hidden)},
          {"all_to_all_bytes_per_token_per_layer_bf16", AllToAllBytesPerToken(m, 2)},
          {"touched", touched},
          {"per_gpus", per_gpus}};
}

void PrintDerived(const ModelConfig& m, const json& d, bool markdown) {
  const char* bullet = markdown ? "- " : "  ";
  std::printf("%s%s", markdown ? "" : "derived from the preset:\n", "");
  std::printf("%sweights per expert: %s; at 4 bits without scales: %s per expert, %s per layer, %s for %d MoE layers\n",
              bullet, HumanCount(d["weights_per_expert"]).c_str(), HumanBytes(d["four_bit_bytes_per_expert"]).c_str(),
              HumanBytes(d["four_bit_bytes_per_layer"]).c_str(), HumanBytes(d["four_bit_bytes_all_moe_layers"]).c_str(),
              m.num_moe_layers());
  std::printf(
      "%sin %s with scales: %s per expert, %s per layer, %s all MoE layers; shared expert (%s) %s per layer; "
      "dense layer (%s) %s\n",
      bullet, d["expert_format"].get<std::string>().c_str(), HumanBytes(d["bytes_per_expert"]).c_str(),
      HumanBytes(d["bytes_per_layer_routed"]).c_str(), HumanBytes(d["bytes_all_moe_layers_routed"]).c_str(),
      d["shared_format"].get<std::string>().c_str(), HumanBytes(d["bytes_per_layer_shared"]).c_str(),
      d["dense_format"].get<std::string>().c_str(), HumanBytes(d["bytes_per_dense_layer"]).c_str());
  std::printf("%sbytes per row: bf16 %lld, q4 %lld; all-to-all per token per layer (2 x k x hidden x 2 B): %lld B\n",
              bullet, static_cast<long long>(d["row_bytes_bf16"].get<int64_t>()),
              static_cast<long long>(d["row_bytes_q4"].get<int64_t>()),
              static_cast<long long>(d["all_to_all_bytes_per_token_per_layer_bf16"].get<int64_t>()));
  std::string touched;
  for (const auto& t : d["touched"])
    touched += fmt::format("{}{} rows {:.1f}%", touched.empty() ? "" : ", ", t["batch"].get<int64_t>(),
                           100 * t["even_router_touched_share"].get<double>());
  std::printf("%sexperts an even router touches per step: %s\n", bullet, touched.c_str());
  for (const auto& g : d["per_gpus"]) {
    std::string memory;
    for (auto it = g["memory_per_rank_bytes"].begin(); it != g["memory_per_rank_bytes"].end(); ++it)
      memory += fmt::format("{}{} {}", memory.empty() ? "" : ", ", it.key(), HumanBytes(it.value().get<int64_t>()));
    const std::string traced =
        g.contains("copies_sent_per_row_trace_picks")
            ? fmt::format(", {:.2f} in the trace's per-row picks", g["copies_sent_per_row_trace_picks"].get<double>())
            : "";
    std::printf(
        "%s%d GPUs: ranks per row %.2f, copies sent per row %.2f (even router%s; all-gather %d), DWDP fetch %s "
        "per rank per layer; weights per rank: %s\n",
        bullet, g["gpus"].get<int>(), g["expected_ranks_per_row"].get<double>(),
        g["copies_sent_per_row_a2a"].get<double>(), traced.c_str(), g["copies_sent_per_row_all_gather"].get<int>(),
        HumanBytes(g["dwdp_bytes_per_rank_per_layer"]).c_str(), memory.c_str());
  }
}

json CostJson(const OptionCost& c) {
  json j = {{"option", EpOptionName(c.option)},
            {"option_number", EpOptionNumber(c.option)},
            {"gpus", c.gpus},
            {"batch", c.batch},
            {"applicable", c.applicable}};
  if (c.option == EpOption::kA2a)
    j["a2a"] = {{"levels", A2aLevelsName(c.a2a.levels)},
                {"mode", A2aModeName(c.a2a.mode)},
                {"tbo", c.a2a.tbo},
                {"sbo", c.a2a.sbo},
                {"label", Label(c)}};
  if (!c.applicable) {
    j["not_applicable"] = c.not_applicable;
    return j;
  }
  j.update({{"slices", c.slices},
            {"kernel_us", c.kernel_us},
            {"kernel_mean_us", c.kernel_mean_us},
            {"comm_us", c.comm_us},
            {"exposed_comm_us", c.exposed_comm_us},
            {"inter_node_mb_per_rank", c.inter_node_mb},
            {"intra_node_mb_per_rank", c.intra_node_mb},
            {"layer_us", c.layer_us},
            {"dense_layer_us", c.dense_us},
            {"step_ms", c.step_ms},
            {"read_us", c.read_us},
            {"arith_us", c.arith_us},
            {"fixed_us", c.fixed_us},
            {"rows_us", c.rows_us},
            {"imbalance_us", c.imbalance_us},
            {"read_gb_per_layer", c.read_gb},
            {"copies_per_row", c.copies_per_row},
            {"balancedness", c.balancedness},
            {"memory_bytes_per_rank", c.memory_bytes},
            {"fits", c.fits},
            {"dominant", c.dominant}});
  return j;
}

const PlanWinner* WinnerFor(const PlanResult& r, int64_t batch, int gpus) {
  for (const auto& w : r.winners)
    if (w.batch == batch && w.gpus == gpus) return &w;
  return nullptr;
}

void PrintText(const PlanResult& r, const ModelConfig& m, const json& derived) {
  std::printf("%s on %s, %s, load: %s\n", r.model.c_str(), r.hardware.c_str(), PlanPhaseName(r.phase), r.load.c_str());
  PrintDerived(m, derived, false);
  std::printf(
      "times per MoE layer are the slowest rank's; step = all MoE and dense FFN layers (attention not modeled)\n");
  int width = 10;  // the option column fits the longest label
  for (const auto& c : r.costs) width = std::max(width, static_cast<int>(Label(c).size()));
  int64_t batch = -1;
  int gpus = -1;
  auto finish_group = [&] {
    if (gpus < 0) return;
    if (const PlanWinner* w = WinnerFor(r, batch, gpus))
      std::printf("  winner: %s, %.2f ms per step. %s\n", Label(*w).c_str(), w->step_ms, w->why.c_str());
  };
  for (const auto& c : r.costs) {
    if (c.batch != batch || c.gpus != gpus) {
      finish_group();
      batch = c.batch;
      gpus = c.gpus;
      std::printf("\nbatch %lld rows, %d GPUs (%.1f rows per GPU)\n", static_cast<long long>(batch), gpus,
                  static_cast<double>(batch) / gpus);
      std::printf("  %-*s %9s %9s %10s %9s %9s %8s %8s %8s %7s %8s %10s  %s\n", width, "option", "kernel us", "comm us",
                  "exposed us", "layer us", "step ms", "inter MB", "intra MB", "read GB", "copies", "balance",
                  "weights/GPU", "dominant");
    }
    if (!c.applicable) {
      std::printf("  %-*s not applicable: %s\n", width, Label(c).c_str(), c.not_applicable.c_str());
      continue;
    }
    std::printf("  %-*s %9.1f %9.1f %10.1f %9.1f %9.2f %8.3f %8.3f %8.3f %7.2f %8.2f %10s  %s%s\n", width,
                Label(c).c_str(), c.kernel_us, c.comm_us, c.exposed_comm_us, c.layer_us, c.step_ms, c.inter_node_mb,
                c.intra_node_mb, c.read_gb, c.copies_per_row, c.balancedness, HumanBytes(c.memory_bytes).c_str(),
                c.dominant.c_str(), c.fits ? "" : " (does not fit in memory)");
  }
  finish_group();
}

void PrintMarkdown(const PlanResult& r, const ModelConfig& m, const json& derived) {
  std::printf("**%s on %s, %s, load: %s**\n\n", r.model.c_str(), r.hardware.c_str(), PlanPhaseName(r.phase),
              r.load.c_str());
  PrintDerived(m, derived, true);
  std::printf(
      "\n| batch | GPUs | option | kernel us | comm us | exposed us | layer us | step ms | inter MB | intra MB | "
      "read GB | copies | balance | weights/GPU | dominant |\n"
      "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (const auto& c : r.costs) {
    if (!c.applicable) {
      std::printf("| %lld | %d | %s | | | | | | | | | | | | not applicable: %s |\n", static_cast<long long>(c.batch),
                  c.gpus, Label(c).c_str(), c.not_applicable.c_str());
      continue;
    }
    const bool wins = Wins(WinnerFor(r, c.batch, c.gpus), c);
    std::printf(
        "| %lld | %d | %s%s%s | %.1f | %.1f | %.1f | %.1f | %.2f | %.3f | %.3f | %.3f | %.2f | %.2f | %s | %s%s |\n",
        static_cast<long long>(c.batch), c.gpus, wins ? "**" : "", Label(c).c_str(), wins ? "**" : "", c.kernel_us,
        c.comm_us, c.exposed_comm_us, c.layer_us, c.step_ms, c.inter_node_mb, c.intra_node_mb, c.read_gb,
        c.copies_per_row, c.balancedness, HumanBytes(c.memory_bytes).c_str(), c.dominant.c_str(),
        c.fits ? "" : " (does not fit)");
  }
  std::printf("\n");
  for (const auto& w : r.winners)
    std::printf("- batch %lld, %d GPUs: **%s**, %.2f ms per step. %s\n", static_cast<long long>(w.batch), w.gpus,
                Label(w).c_str(), w.step_ms, w.why.c_str());
}

void PrintCsv(const PlanResult& r) {
  std::printf(
      "model,hardware,phase,batch,gpus,option,slices,a2a_levels,a2a_mode,tbo,sbo,applicable,kernel_us,"
      "kernel_mean_us,comm_us,exposed_comm_us,layer_us,dense_layer_us,step_ms,inter_node_mb,intra_node_mb,read_gb,"
      "copies_per_row,balancedness,memory_bytes,fits,dominant,winner\n");
  for (const auto& c : r.costs) {
    const bool a2a = c.option == EpOption::kA2a;
    std::printf(
        "%s,%s,%s,%lld,%d,%s,%d,%s,%s,%d,%d,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.4f,%.5f,%.5f,%.5f,%.4f,%.4f,%lld,%d,%s,%"
        "d\n",
        r.model.c_str(), r.hardware.c_str(), PlanPhaseName(r.phase), static_cast<long long>(c.batch), c.gpus,
        EpOptionName(c.option), c.slices, a2a ? A2aLevelsName(c.a2a.levels) : "", a2a ? A2aModeName(c.a2a.mode) : "",
        c.a2a.tbo ? 1 : 0, c.a2a.sbo ? 1 : 0, c.applicable ? 1 : 0, c.kernel_us, c.kernel_mean_us, c.comm_us,
        c.exposed_comm_us, c.layer_us, c.dense_us, c.step_ms, c.inter_node_mb, c.intra_node_mb, c.read_gb,
        c.copies_per_row, c.balancedness, static_cast<long long>(c.memory_bytes), c.fits ? 1 : 0,
        c.applicable ? c.dominant.c_str() : "", Wins(WinnerFor(r, c.batch, c.gpus), c) ? 1 : 0);
  }
}

int RunPlanCommand(const PlanFlags& f) {
  auto model = LoadModel(f.model);
  if (!model.ok()) return ReportError(model.status());
  *model = ScaledModel(*model, f.hidden, f.intermediate);
  if (Status s = ValidateModel(*model, "--hidden/--intermediate"); !s.ok()) return ReportError(s);
  auto hardware = LoadHardware(f.hardware);
  if (!hardware.ok()) return ReportError(hardware.status());
  PlanConfig config;
  auto phase = ParsePlanPhase(f.phase);
  if (!phase.ok()) return ReportError(phase.status().WithContext("--phase"));
  config.phase = *phase;
  config.batches = f.batches;
  if (config.batches.empty())
    config.batches = config.phase == PlanPhase::kDecode ? std::vector<int64_t>{8, 64, 256} : std::vector<int64_t>{8192};
  config.gpus = f.gpus;
  config.options.clear();
  for (const auto& name : f.options) {
    auto option = ParseEpOption(name);
    if (!option.ok()) return ReportError(option.status().WithContext("--options"));
    config.options.push_back(*option);
  }
  auto experts = ParseWeightFormat(f.expert_weights);
  if (!experts.ok()) return ReportError(experts.status().WithContext("--weights"));
  auto shared_format = ParseWeightFormat(f.shared_weights);
  if (!shared_format.ok()) return ReportError(shared_format.status().WithContext("--shared-weights"));
  auto dense_format = ParseWeightFormat(f.dense_weights);
  if (!dense_format.ok()) return ReportError(dense_format.status().WithContext("--dense-weights"));
  config.formats = {*experts, *shared_format, *dense_format};
  // "nvfp4" and "fp4" are the planner's former names of the 4-bit rows.
  auto rows = ParseRowFormat(f.rows == "nvfp4" || f.rows == "fp4" ? "q4" : f.rows);
  if (!rows.ok()) return ReportError(rows.status().WithContext("--rows"));
  config.rows = *rows;
  auto combine = ParseRowFormat(f.combine);
  if (!combine.ok()) return ReportError(combine.status().WithContext("--combine-format"));
  config.combine = *combine;
  config.a2a_partial_sums = f.a2a_combine == "partial-sums";
  auto shared = ParseSharedMode(f.shared);
  if (!shared.ok()) return ReportError(shared.status().WithContext("--shared"));
  auto dense = ParseSharedMode(f.dense);
  if (!dense.ok()) return ReportError(dense.status().WithContext("--dense"));
  config.shared = *shared;
  config.dense = *dense;
  config.samples = f.samples;
  config.seed = f.seed;
  config.placement = f.placement;
  config.redundant = f.redundant;
  config.a2a_levels.clear();
  for (const auto& name : f.a2a_levels) {
    auto levels = ParseA2aLevels(name);
    if (!levels.ok()) return ReportError(levels.status().WithContext("--a2a-levels"));
    config.a2a_levels.push_back(*levels);
  }
  config.a2a_modes.clear();
  for (const auto& name : f.a2a_modes) {
    auto mode = ParseA2aMode(name);
    if (!mode.ok()) return ReportError(mode.status().WithContext("--a2a-mode"));
    config.a2a_modes.push_back(*mode);
  }
  config.tbo = f.tbo;
  config.sbo = f.sbo;

  ExpertLoad trace_load;
  std::string load_description = fmt::format("even router ({} sampled layer loads per batch)", f.samples);
  if (!f.trace.empty()) {
    LoadReadOptions read;
    read.format = f.trace_format;
    read.filter = f.trace_filter;
    auto loaded = ReadExpertLoad(f.trace, read);
    if (!loaded.ok()) return ReportError(loaded.status());
    trace_load = std::move(*loaded);
    load_description = fmt::format("trace {} ({} steps x {} layers, up to {} layer loads per batch)", f.trace,
                                   trace_load.num_steps, trace_load.num_layers, f.samples);
  }
  if (f.placement != "trivial")
    load_description += fmt::format(
        "; whole experts placed by {} with {} redundant copies per layer, fitted on the first "
        "half of the {} and priced on the rest",
        f.placement, f.redundant, f.trace.empty() ? "sampled loads" : "trace");
  // Copies per row from the trace's own per-row picks, when it has them.
  std::vector<std::pair<int, double>> trace_copies;
  if (!f.trace.empty()) {
    LoadReadOptions read;
    read.format = f.trace_format;
    read.filter = f.trace_filter;
    auto reader = TraceReader::Open(f.trace, read);
    if (!reader.ok()) return ReportError(reader.status());
    if ((*reader)->has_picks()) {
      std::vector<int> gpus;
      for (int g : config.gpus)
        if (g <= (*reader)->num_experts()) gpus.push_back(g);
      if (!gpus.empty()) {
        auto copies = TraceCopiesPerRow(**reader, gpus, int64_t{1} << 20);
        if (!copies.ok()) return ReportError(copies.status());
        for (size_t i = 0; i < gpus.size(); ++i) trace_copies.emplace_back(gpus[i], (*copies)[i]);
      }
    }
  }
  auto result = RunPlan(*model, *hardware, config, f.trace.empty() ? nullptr : &trace_load, load_description);
  if (!result.ok()) return ReportError(result.status());
  json derived = DerivedJson(*model, config);
  for (auto& entry : derived["per_gpus"])
    for (auto [g, c] : trace_copies)
      if (entry["gpus"].get<int>() == g) entry["copies_sent_per_row_trace_picks"] = c;
  json comparison;
  if (!f.measured.empty()) {
    if (Status s = CompareWithRuns(*result, *model, config.formats.experts, f.measured, &comparison); !s.ok())
      return ReportError(s);
  }

  if (!f.plot.empty()) {
    if (Status s = WriteFileAtomically(f.plot, PlanPlotSvg(*result, *model, trace_copies)); !s.ok())
      return ReportError(s);
  }
  if (f.format == "json") {
    json j = {{"model", result->model},
              {"hardware", result->hardware},
              {"phase", PlanPhaseName(result->phase)},
              {"load", result->load},
              {"derived", derived}};
    if (!comparison.is_null()) j["calibration_check"] = comparison;
    j["costs"] = json::array();
    for (const auto& c : result->costs) j["costs"].push_back(CostJson(c));
    j["winners"] = json::array();
    for (const auto& w : result->winners)
      j["winners"].push_back({{"batch", w.batch},
                              {"gpus", w.gpus},
                              {"option", EpOptionName(w.option)},
                              {"slices", w.slices},
                              {"label", Label(w)},
                              {"step_ms", w.step_ms},
                              {"why", w.why}});
    std::printf("%s\n", j.dump(2).c_str());
  } else if (f.format == "md") {
    PrintMarkdown(*result, *model, derived);
  } else if (f.format == "csv") {
    PrintCsv(*result);
  } else {
    PrintText(*result, *model, derived);
  }
  if (!comparison.is_null() && f.format != "json" && f.format != "csv") PrintComparison(comparison);
  return 0;
}

}  // namespace

void AddPlanCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<PlanFlags>();
  auto* cmd =
      app.add_subcommand("plan", "Predict each option's kernel, communication and step time on a hardware profile");
  cmd->add_option("--model", f->model, kModelOptionHelp)->required();
  cmd->add_option("--hidden", f->hidden, "Override the model's hidden size (0: keep)")->check(kNonNegative);
  cmd->add_option("--intermediate", f->intermediate, "Override the experts' intermediate size (0: keep)")
      ->check(kNonNegative);
  cmd->add_option("--hardware", f->hardware, "Hardware profile name (see `epmoe hardware list`) or .json path")
      ->required();
  cmd->add_option("--trace", f->trace, "Routing trace (any format `epmoe trace` reads); default: an even router");
  cmd->add_option("--trace-format", f->trace_format, "Trace format (auto detects)")->capture_default_str();
  cmd->add_option("--trace-filter", f->trace_filter,
                  "Series of a multi-series count file, e.g. model=olmoe,domain=arxiv,selection=topk");
  cmd->add_option("--phase", f->phase, "decode or prefill")->capture_default_str();
  cmd->add_option("--batch", f->batches,
                  "Rows per step over the whole EP group, comma separated (default: decode 8,64,256; prefill 8192)")
      ->delimiter(',')
      ->check(kPositive);
  cmd->add_option("--gpus", f->gpus, "EP sizes, comma separated")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--options", f->options,
                  "Options to price, as `epmoe run --option` names them: sliced, whole, hybrid, a2a, dwdp (or 1-5; "
                  "the former names rows and weights are accepted for a2a and dwdp)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--weights", f->expert_weights, "Routed experts' weight format")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--shared-weights", f->shared_weights, "Shared expert's weight format")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--dense-weights", f->dense_weights, "Dense FFN layers' weight format")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option(
         "--rows", f->rows,
         "How rows travel under a2a, as `epmoe run --dispatch-format` names them: fp32, bf16, q8, q4 (nvfp4 "
         "and fp4, the former names, mean q4); results return in --combine-format, the all-gather of 1-3 moves bf16")
      ->capture_default_str();
  cmd->add_option("--combine-format", f->combine, "How a2a's outputs come back, as `epmoe run --combine-format`")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--a2a-combine", f->a2a_combine,
                  "a2a's combine: partial-sums (one summed row back per rank a row visited, as GPU runtimes and "
                  "`epmoe run --partial-sums`) or per-pick (one output per pick, `epmoe run`'s default)")
      ->check(CLI::IsMember({"partial-sums", "per-pick"}))
      ->capture_default_str();
  cmd->add_option("--shared", f->shared,
                  "Shared expert, as `epmoe run --shared`: default (sliced under 1-3, copied under a2a and dwdp), "
                  "sliced, copied (auto, the former name, means default)")
      ->capture_default_str();
  cmd->add_option("--dense", f->dense, "Dense layers: sliced, copied or default (as --shared)")->capture_default_str();
  cmd->add_option("--samples", f->samples, "Layer loads priced per batch")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the even router and of batch thinning")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option(
         "--placement", f->placement,
         "Whole experts' placement: trivial, or a balancer policy (deepseek, deepseek-guarded, per-step, cost) "
         "fitted on half of the trace")
      ->check(CLI::IsMember({"trivial", "deepseek", "deepseek-guarded", "per-step", "cost"}))
      ->capture_default_str();
  cmd->add_option("--redundant", f->redundant, "Redundant expert copies per layer for --placement")
      ->check(CLI::Range(0, 1 << 16))
      ->capture_default_str();
  cmd->add_option("--a2a-levels", f->a2a_levels,
                  "a2a across nodes, as `epmoe run --a2a-levels`: flat, two-level (once per node, forwarded inside "
                  "it) or auto (two-level with several nodes of several ranks); comma separated: a line each")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--a2a-mode", f->a2a_modes,
                  "a2a exchange, as `epmoe run --a2a-mode`: normal (counts exchanged first), low-latency (no count "
                  "step, flat) or auto (low-latency in decode, normal in prefill); comma separated: a line each")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_flag("--tbo", f->tbo, "Also price each a2a line with two-batch overlap (as `epmoe run --tbo`)");
  cmd->add_flag("--sbo", f->sbo, "Also price each a2a line with single-batch overlap (as `epmoe run --sbo`)");
  AddFormatOption(cmd, &f->format, {"text", "md", "csv", "json"});
  cmd->add_option("--measured", f->measured,
                  "Compare with `epmoe run --option all --format json` output (same model shape, ranks, tokens); "
                  "several runs, comma separated, pool their steps")
      ->delimiter(',');
  cmd->add_option("--plot", f->plot, "Write an SVG: time against batch, copies per row and balancedness against GPUs");
  cmd->callback([f, exit_code] { *exit_code = RunPlanCommand(*f); });

  auto* hw = app.add_subcommand("hardware", "List hardware profiles or show one");
  hw->require_subcommand(1);
  hw->add_subcommand("list", "List the built-in hardware profiles")->callback([exit_code] {
    for (const auto& name : ListHardwareProfiles()) std::printf("%s\n", name.c_str());
    *exit_code = 0;
  });
  auto name = std::make_shared<std::string>();
  auto* show = hw->add_subcommand("show", "Print a profile (built-in name or .json path) after validating it");
  show->add_option("profile", *name, "Profile name or path")->required();
  show->callback([name, exit_code] {
    auto profile = LoadHardware(*name);
    if (!profile.ok()) {
      *exit_code = ReportError(profile.status());
      return;
    }
    std::printf("%s\n", HardwareToJson(*profile).c_str());
    *exit_code = 0;
  });
  AddCalibrateCommand(app, exit_code);
}

}  // namespace epmoe::cli
