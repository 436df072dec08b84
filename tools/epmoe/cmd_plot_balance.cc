// `epmoe plot-balance`: an SVG of balancedness over time from `epmoe run --eplb --format json`
// reports (e.g. EPLB off against on), written by the project's own line-chart writer.
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
#include "epmoe/line_chart.h"
#include "output.h"

namespace epmoe::cli {
namespace {

struct PlotBalanceOptions {
  std::string out;
  std::vector<std::string> runs;  // LABEL=PATH
  int smooth = 25;
  std::string title = "balancedness of picks per step";
  double y_min = -1;  // < 0: chosen from the data
  std::string format = "text";
};

// The per-step picks balancedness of the first option with an "eplb" object in a run report.
Result<std::vector<double>> ReadBalance(const std::string& path) {
  EPMOE_ASSIGN_OR_RETURN(const nlohmann::json report, ReadRunReport(path));
  for (const auto& option : report["options"]) {
    if (!option.is_object() || !option.contains("eplb")) continue;
    const auto& steps = option["eplb"].value("balancedness_per_step", nlohmann::json());
    if (!steps.is_array())
      return IoError(fmt::format("{}: \"eplb\" has no \"balancedness_per_step\" array", path));
    std::vector<double> values;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (!steps[i].is_number())
        return IoError(fmt::format("{}: balancedness_per_step[{}] is not a number", path, i));
      const double v = steps[i].get<double>();
      if (!(v >= 0 && v <= 1))
        return IoError(fmt::format("{}: balancedness_per_step[{}] = {} is outside [0, 1]", path, i, v));
      values.push_back(v);
    }
    if (values.empty()) return IoError(fmt::format("{}: balancedness_per_step is empty", path));
    return values;
  }
  return IoError(fmt::format("{}: no option has an \"eplb\" object (run with --eplb; --eplb-interval larger than "
                             "--steps records without rebalancing)", path));
}

// Mean of the `window` values ending at each step (fewer at the start).
std::vector<double> TrailingMean(const std::vector<double>& values, int window) {
  std::vector<double> out(values.size());
  double sum = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    sum += values[i];
    if (i >= static_cast<size_t>(window)) sum -= values[i - window];
    out[i] = sum / static_cast<double>(std::min<size_t>(i + 1, window));
  }
  return out;
}

Status RunPlotBalance(const PlotBalanceOptions& o, nlohmann::json* report) {
  static const char* const kColors[] = {"#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#7f7f7f"};
  LineChart chart;
  chart.title = o.title;
  chart.x_label = "step";
  chart.y_label = fmt::format("mean / max picks per rank ({}-step mean)", o.smooth);
  chart.markers = false;
  double lowest = 1;
  nlohmann::json series = nlohmann::json::array();
  for (size_t i = 0; i < o.runs.size(); ++i) {
    const auto equals = o.runs[i].find('=');
    if (equals == std::string::npos || equals == 0 || equals + 1 == o.runs[i].size())
      return InvalidArgument(fmt::format("--run {}: expected LABEL=PATH", o.runs[i]));
    const std::string label = o.runs[i].substr(0, equals), path = o.runs[i].substr(equals + 1);
    EPMOE_ASSIGN_OR_RETURN(const std::vector<double> values, ReadBalance(path));
    const std::vector<double> smoothed = TrailingMean(values, o.smooth);
    LineSeries line{label, kColors[i % 6], {}};
    double sum = 0;
    for (size_t s = 0; s < smoothed.size(); ++s) {
      line.points.emplace_back(static_cast<double>(s + 1), smoothed[s]);
      lowest = std::min(lowest, smoothed[s]);
      sum += values[s];
    }
    chart.series.push_back(std::move(line));
    series.push_back({{"label", label}, {"path", path}, {"steps", values.size()},
                      {"mean_balancedness", sum / static_cast<double>(values.size())},
                      {"min_smoothed", *std::min_element(smoothed.begin(), smoothed.end())}});
  }
  chart.y_min = o.y_min >= 0 ? o.y_min : std::max(0.0, std::floor(lowest * 10 - 1) / 10);
  // Balancedness never exceeds 1: the band above it holds the legend (14 px a line of 240).
  chart.y_max = 1 + (1 - chart.y_min) * (14.0 * static_cast<double>(o.runs.size()) + 8) / 240;
  EPMOE_RETURN_IF_ERROR(WriteFileAtomically(
      o.out, LineChartsDocument({chart}, fmt::format("per-step picks balancedness, averaged over the MoE layers; "
                                                     "mean of the last {} steps",
                                                     o.smooth))));
  *report = {{"out", o.out}, {"smooth_steps", o.smooth}, {"y_min", chart.y_min}, {"y_max", chart.y_max},
             {"series", series}};
  return Status::Ok();
}

void PrintText(const nlohmann::json& r) {
  std::printf("wrote %s (%zu series, %d-step mean, y axis from %.2f)\n", r["out"].get<std::string>().c_str(),
              r["series"].size(), r["smooth_steps"].get<int>(), r["y_min"].get<double>());
  for (const auto& s : r["series"])
    std::printf("  %-24s %6zu steps, mean balancedness %.3f, lowest %d-step mean %.3f\n",
                s["label"].get<std::string>().c_str(), s["steps"].get<size_t>(), s["mean_balancedness"].get<double>(),
                r["smooth_steps"].get<int>(), s["min_smoothed"].get<double>());
}

}  // namespace

void AddPlotBalanceCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<PlotBalanceOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plot-balance", "Plot balancedness over time (SVG) from `epmoe run --eplb --format json` reports");
  cmd->add_option("out", o->out, "SVG file to write")->required();
  cmd->add_option("--run", o->runs, "LABEL=PATH of a run report (repeat: one line each)")->required();
  cmd->add_option("--smooth", o->smooth, "Steps in the trailing mean drawn")->check(kPositive)->capture_default_str();
  cmd->add_option("--title", o->title, "Chart title")->capture_default_str();
  cmd->add_option("--y-min", o->y_min, "Bottom of the y axis (default: from the data)")
      ->check(CLI::Range(0.0, 1.0));
  AddFormatOption(cmd, &o->format, {"text", "json"});
  SetReportCallback(
      cmd, exit_code, &o->format, [o](nlohmann::json* report) { return RunPlotBalance(*o, report); }, PrintText);
}

}  // namespace epmoe::cli
