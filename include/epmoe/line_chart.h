// Line charts as SVG, written directly (no plotting dependency): a frame, axes with "nice" ticks,
// one polyline per series and a legend. Used by the planner's plots and `epmoe plot-balance`.
// Pure functions (thread-safe).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace epmoe {

struct LineSeries {
  std::string name;
  std::string color;                              // any SVG color, e.g. "#1f77b4"
  std::vector<std::pair<double, double>> points;  // (x, y), ascending x
};

struct LineChart {
  std::string title, x_label, y_label;
  bool log_x = false;    // base-2 logarithmic x axis (when every x > 0)
  bool markers = true;   // a dot at every point (off for long series)
  double y_min = 0;      // bottom of the y axis
  double y_max = 0;      // top of the y axis when above y_min; else 8% above the largest y (the
                         // legend sits in the top left corner: leave room there)
  std::vector<LineSeries> series;
};

// Size of one chart drawn by LineChartSvg.
inline constexpr double kLineChartWidth = 440, kLineChartHeight = 320;

// One chart as an SVG group (<g>...</g>) shifted right by x0, to place inside an <svg> element.
std::string LineChartSvg(const LineChart& chart, double x0);

// A whole SVG document with the charts side by side and an optional footer line of small text.
std::string LineChartsDocument(const std::vector<LineChart>& charts, const std::string& footer);

// Text escaped for SVG/XML content and attribute values.
std::string SvgEscape(const std::string& text);

}  // namespace epmoe
