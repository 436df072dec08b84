// SVG charts of a plan (line_chart.h): time against batch, copies per row and balancedness against
// GPUs, side by side in one file.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "epmoe/line_chart.h"
#include "epmoe/plan.h"

namespace epmoe {
namespace {

const char* OptionColor(EpOption option) {
  switch (option) {
    case EpOption::kSliced: return "#1f77b4";
    case EpOption::kWhole: return "#ff7f0e";
    case EpOption::kHybrid: return "#2ca02c";
    case EpOption::kA2a: return "#d62728";
    case EpOption::kDwdp: return "#9467bd";
  }
  return "#000";
}

}  // namespace

std::string PlanPlotSvg(const PlanResult& result, const ModelConfig& model,
                        const std::vector<std::pair<int, double>>& trace_copies) {
  int largest_gpus = 0;
  for (const auto& c : result.costs) largest_gpus = std::max(largest_gpus, c.gpus);

  auto log_x_chart = [](std::string title, std::string x_label, std::string y_label) {
    LineChart chart;
    chart.title = std::move(title);
    chart.x_label = std::move(x_label);
    chart.y_label = std::move(y_label);
    chart.log_x = true;
    return chart;
  };
  LineChart time = log_x_chart(fmt::format("step time, {} GPUs", largest_gpus), "batch (rows per step)", "ms per step");
  LineChart copies = log_x_chart("copies sent per row", "GPUs (EP size)", "copies");
  LineChart balance = log_x_chart("balancedness of picks", "GPUs (EP size)", "mean / max picks per rank");
  std::map<EpOption, LineSeries> time_series, copies_series;
  std::map<int64_t, std::map<int, double>> balance_by_batch;  // batch -> gpus -> balancedness (whole experts)
  std::set<std::pair<int64_t, int>> a2a_drawn;                // (batch, gpus): a2a is drawn in its first variant
  for (const auto& c : result.costs) {
    if (!c.applicable) continue;
    if (c.option == EpOption::kA2a && !a2a_drawn.emplace(c.batch, c.gpus).second) continue;
    LineSeries& t = time_series[c.option];
    t.name = EpOptionName(c.option);
    t.color = OptionColor(c.option);
    if (c.gpus == largest_gpus) t.points.emplace_back(static_cast<double>(c.batch), c.step_ms);
    if (c.option == EpOption::kA2a) balance_by_batch[c.batch][c.gpus] = c.balancedness;
    if (c.batch == result.costs.front().batch && c.option != EpOption::kDwdp) {
      LineSeries& s = copies_series[c.option];
      s.name = EpOptionName(c.option);
      s.color = OptionColor(c.option);
      s.points.emplace_back(c.gpus, c.copies_per_row);
    }
  }
  for (auto& [option, s] : time_series) time.series.push_back(s);
  for (auto& [option, s] : copies_series) copies.series.push_back(s);
  LineSeries even{"even router, formula", "#7f7f7f", {}};
  if (!copies_series.empty())
    for (auto [g, unused] : copies_series.begin()->second.points)
      even.points.emplace_back(g, CopiesSentPerRow(model, static_cast<int>(g)));
  copies.series.push_back(even);
  if (!trace_copies.empty()) {
    LineSeries traced{"trace, per-row picks", "#000000", {}};
    for (auto [g, c] : trace_copies) traced.points.emplace_back(g, c);
    copies.series.push_back(traced);
  }
  static const char* const kShades[] = {"#08306b", "#2171b5", "#6baed6", "#41ab5d", "#fd8d3c", "#e31a1c"};
  int shade = 0;
  for (const auto& [batch, by_gpus] : balance_by_batch) {
    LineSeries s{fmt::format("batch {}", batch), kShades[shade++ % 6], {}};
    for (auto [g, b] : by_gpus) s.points.emplace_back(g, b);
    balance.series.push_back(s);
  }
  for (auto* chart : {&time, &copies, &balance})
    for (auto& s : chart->series) std::sort(s.points.begin(), s.points.end());

  return LineChartsDocument(
      {time, copies, balance},
      fmt::format("{} on {}, {}, load: {}", result.model, result.hardware, PlanPhaseName(result.phase), result.load));
}

}  // namespace epmoe
