#include "epmoe/line_chart.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace epmoe {
namespace {

constexpr double kLeft = 60, kRight = 20, kTop = 30, kBottom = 50;

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

}  // namespace

std::string SvgEscape(const std::string& text) {
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

std::string LineChartSvg(const LineChart& chart, double x0) {
  constexpr double kWidth = kLineChartWidth, kHeight = kLineChartHeight;
  double xmin = INFINITY, xmax = -INFINITY, ymax = 0;
  for (const auto& s : chart.series)
    for (auto [x, y] : s.points) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymax = std::max(ymax, y);
    }
  std::string svg = fmt::format("<g transform=\"translate({},0)\">\n", x0);
  svg += fmt::format("<text x=\"{}\" y=\"18\" font-size=\"13\" text-anchor=\"middle\" font-weight=\"bold\">{}</text>\n",
                     kWidth / 2, SvgEscape(chart.title));
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
  const double ybottom = chart.y_min;
  const double ytop = chart.y_max > ybottom ? chart.y_max : ymax > ybottom ? ymax * 1.08 : ybottom + 1.0;
  auto fy = [&](double y) { return kTop + plot_h - (y - ybottom) / (ytop - ybottom) * plot_h; };
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
  for (double t : LinearTicks(ybottom, ytop)) {
    if (t > ytop) break;
    svg += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", kLeft, kLeft + plot_w,
                       fy(t), fy(t));
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\">{}</text>\n", kLeft - 4,
                       fy(t) + 3, TickLabel(t));
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n", kLeft + plot_w / 2,
                     kHeight - 22, SvgEscape(chart.x_label));
  svg += fmt::format("<text x=\"14\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\" transform=\"rotate(-90 14 {})\">{}</text>\n",
                     kTop + plot_h / 2, kTop + plot_h / 2, SvgEscape(chart.y_label));
  // Lines, markers and the legend.
  int legend_row = 0;
  for (const auto& s : chart.series) {
    if (s.points.empty()) continue;
    std::string path;
    for (auto [x, y] : s.points) path += fmt::format("{:.1f},{:.1f} ", fx(x), fy(y));
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"{}\" points=\"{}\"/>\n", s.color,
                       chart.markers ? 2 : 1.5, path);
    if (chart.markers)
      for (auto [x, y] : s.points)
        svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>\n", fx(x), fy(y), s.color);
    const double ly = kTop + 12 + 14 * legend_row++;
    svg += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"2\"/>\n", kLeft + 8,
                       kLeft + 24, ly - 4, ly - 4, s.color);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\">{}</text>\n", kLeft + 28, ly, SvgEscape(s.name));
  }
  svg += "</g>\n";
  return svg;
}

std::string LineChartsDocument(const std::vector<LineChart>& charts, const std::string& footer) {
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      static_cast<double>(std::max<size_t>(charts.size(), 1)) * kLineChartWidth, kLineChartHeight + 20);
  for (size_t i = 0; i < charts.size(); ++i) svg += LineChartSvg(charts[i], static_cast<double>(i) * kLineChartWidth);
  if (!footer.empty())
    svg += fmt::format("<text x=\"8\" y=\"{}\" font-size=\"10\" fill=\"#555\">{}</text>\n", kLineChartHeight + 12,
                       SvgEscape(footer));
  svg += "</svg>\n";
  return svg;
}

}  // namespace epmoe
