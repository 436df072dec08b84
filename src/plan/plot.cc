// SVG charts of a plan, written directly (no plotting dependency): line charts with axes, ticks and
// a legend, side by side in one file.
#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/format.h>

#include "epmoe/plan.h"

namespace epmoe {
namespace {

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;  // (x, y), ascending x
};

struct Chart {
  std::string title, x_label, y_label;
  bool log_x = false;
  std::vector<Series> series;
};

constexpr double kWidth = 440, kHeight = 320;
constexpr double kLeft = 60, kRight = 20, kTop = 30, kBottom = 50;

std::string Escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    switch (ch) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

std::string TickLabel(double v) {
  if (v != 0 && (std::fabs(v) >= 10000 || std::fabs(v) < 0.01)) return fmt::format("{:.0e}", v);
  if (v == std::floor(v)) return fmt::format("{:.0f}", v);
  return fmt::format("{:.2g}", v);
}

// "Nice" linear ticks covering [lo, hi].
std::vector<double> LinearTicks(double lo, double hi) {
  const double span = std::max(hi - lo, 1e-12);
  const double raw = span / 5;
  const double magnitude = std::pow(10, std::floor(std::log10(raw)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * magnitude >= raw) {
      step = m * magnitude;
      break;
    }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push_back(t);
  return ticks;
}

std::string DrawChart(const Chart& chart, double x0) {
  double xmin = INFINITY, xmax = -INFINITY, ymax = 0;
  for (const auto& s : chart.series)
    for (auto [x, y] : s.points) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymax = std::max(ymax, y);
    }
  std::string svg = fmt::format("<g transform=\"translate({},0)\">\n", x0);
  svg += fmt::format("<text x=\"{}\" y=\"18\" font-size=\"13\" text-anchor=\"middle\" font-weight=\"bold\">{}</text>\n",
                     kWidth / 2, Escape(chart.title));
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>\n", kLeft, kTop,
                     plot_w, plot_h);
  if (!std::isfinite(xmin)) {
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">no data</text>\n</g>\n",
                       kLeft + plot_w / 2, kTop + plot_h / 2);
    return svg;
  }
  const bool log_x = chart.log_x && xmin > 0;
  auto fx = [&](double x) {
    if (log_x) x = std::log2(x);
    const double lo = log_x ? std::log2(xmin) : xmin, hi = log_x ? std::log2(xmax) : xmax;
    return kLeft + (hi > lo ? (x - lo) / (hi - lo) : 0.5) * plot_w;
  };
  const double ytop = ymax > 0 ? ymax * 1.08 : 1.0;
  auto fy = [&](double y) { return kTop + plot_h - y / ytop * plot_h; };
  // Axes: ticks and labels.
  std::vector<double> xticks;
  if (log_x) {
    for (double t = std::pow(2, std::ceil(std::log2(xmin))); t <= xmax * 1.0001; t *= 2) xticks.push_back(t);
    while (xticks.size() > 9) {
      std::vector<double> thinned;
      for (size_t i = 0; i < xticks.size(); i += 2) thinned.push_back(xticks[i]);
      xticks = thinned;
    }
  } else {
    xticks = LinearTicks(xmin, xmax);
  }
  for (double t : xticks)
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\">{}</text>\n", fx(t),
                       kTop + plot_h + 14, TickLabel(t));
  for (double t : LinearTicks(0, ytop)) {
    if (t > ytop) break;
    svg += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", kLeft, kLeft + plot_w,
                       fy(t), fy(t));
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\">{}</text>\n", kLeft - 4,
                       fy(t) + 3, TickLabel(t));
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n", kLeft + plot_w / 2,
                     kHeight - 22, Escape(chart.x_label));
  svg += fmt::format("<text x=\"14\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\" transform=\"rotate(-90 14 {})\">{}</text>\n",
                     kTop + plot_h / 2, kTop + plot_h / 2, Escape(chart.y_label));
  // Lines, markers and the legend.
  int legend_row = 0;
  for (const auto& s : chart.series) {
    if (s.points.empty()) continue;
    std::string path;
    for (auto [x, y] : s.points) path += fmt::format("{:.1f},{:.1f} ", fx(x), fy(y));
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>\n", s.color, path);
    for (auto [x, y] : s.points)
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>\n", fx(x), fy(y), s.color);
    const double ly = kTop + 12 + 14 * legend_row++;
    svg += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2\"/>\n", kLeft + 8,
                       kLeft + 24, ly - 4, ly - 4, s.color);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\">{}</text>\n", kLeft + 28, ly, Escape(s.name));
  }
  svg += "</g>\n";
  return svg;
}

const char* OptionColor(PlanOption option) {
  switch (option) {
    case PlanOption::kSliced: return "#1f77b4";
    case PlanOption::kWholeAllRows: return "#ff7f0e";
    case PlanOption::kHybrid: return "#2ca02c";
    case PlanOption::kTravelingRows: return "#d62728";
    case PlanOption::kTravelingWeights: return "#9467bd";
  }
  return "#000";
}

}  // namespace

std::string PlanPlotSvg(const PlanResult& result, const ModelConfig& model,
                        const std::vector<std::pair<int, double>>& trace_copies) {
  int largest_gpus = 0;
  for (const auto& c : result.costs) largest_gpus = std::max(largest_gpus, c.gpus);

  Chart time{fmt::format("step time, {} GPUs", largest_gpus), "batch (rows per step)", "ms per step", true, {}};
  Chart copies{"copies sent per row", "GPUs (EP size)", "copies", true, {}};
  Chart balance{"balancedness of picks", "GPUs (EP size)", "mean / max picks per rank", true, {}};
  std::map<PlanOption, Series> time_series, copies_series;
  std::map<int64_t, std::map<int, double>> balance_by_batch;  // batch -> gpus -> balancedness (whole experts)
  for (const auto& c : result.costs) {
    if (!c.applicable) continue;
    Series& t = time_series[c.option];
    t.name = PlanOptionName(c.option);
    t.color = OptionColor(c.option);
    if (c.gpus == largest_gpus) t.points.emplace_back(static_cast<double>(c.batch), c.step_ms);
    if (c.option == PlanOption::kTravelingRows) balance_by_batch[c.batch][c.gpus] = c.balancedness;
    if (c.batch == result.costs.front().batch && c.option != PlanOption::kTravelingWeights) {
      Series& s = copies_series[c.option];
      s.name = PlanOptionName(c.option);
      s.color = OptionColor(c.option);
      s.points.emplace_back(c.gpus, c.copies_per_row);
    }
  }
  for (auto& [option, s] : time_series) time.series.push_back(s);
  for (auto& [option, s] : copies_series) copies.series.push_back(s);
  Series even{"even router, formula", "#7f7f7f", {}};
  if (!copies_series.empty())
    for (auto [g, unused] : copies_series.begin()->second.points)
      even.points.emplace_back(g, CopiesSentPerRow(model, static_cast<int>(g)));
  copies.series.push_back(even);
  if (!trace_copies.empty()) {
    Series traced{"trace, per-row picks", "#000000", {}};
    for (auto [g, c] : trace_copies) traced.points.emplace_back(g, c);
    copies.series.push_back(traced);
  }
  static const char* const kShades[] = {"#08306b", "#2171b5", "#6baed6", "#41ab5d", "#fd8d3c", "#e31a1c"};
  int shade = 0;
  for (const auto& [batch, by_gpus] : balance_by_batch) {
    Series s{fmt::format("batch {}", batch), kShades[shade++ % 6], {}};
    for (auto [g, b] : by_gpus) s.points.emplace_back(g, b);
    balance.series.push_back(s);
  }
  for (auto* chart : {&time, &copies, &balance})
    for (auto& s : chart->series) std::sort(s.points.begin(), s.points.end());

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      3 * kWidth, kHeight + 20);
  svg += DrawChart(time, 0) + DrawChart(copies, kWidth) + DrawChart(balance, 2 * kWidth);
  svg += fmt::format("<text x=\"8\" y=\"{}\" font-size=\"10\" fill=\"#555\">{} on {}, {}, load: {}</text>\n", kHeight + 12,
                     Escape(result.model), Escape(result.hardware),
                     result.phase == PlanPhase::kDecode ? "decode" : "prefill", Escape(result.load));
  svg += "</svg>\n";
  return svg;
}

}  // namespace epmoe
