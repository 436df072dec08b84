#include "epmoe/line_chart.h"

#include <gtest/gtest.h>

namespace epmoe {
namespace {

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

LineChart TwoPointChart() {
  LineChart chart;
  chart.title = "a < b & c";
  chart.x_label = "step";
  chart.y_label = "balancedness";
  chart.series.push_back({"off", "#d62728", {{0, 0.5}, {10, 1.0}}});
  return chart;
}

TEST(LineChart, DrawsSeriesLegendAndEscapedText) {
  const std::string svg = LineChartSvg(TwoPointChart(), 0);
  EXPECT_EQ(Count(svg, "<polyline"), 1u);
  EXPECT_EQ(Count(svg, "<circle"), 2u);
  EXPECT_NE(svg.find("a &lt; b &amp; c"), std::string::npos);
  EXPECT_NE(svg.find(">off</text>"), std::string::npos);
}

TEST(LineChart, MarkersOffAndYMinMoveTheLine) {
  LineChart chart = TwoPointChart();
  chart.markers = false;
  const std::string from_zero = LineChartSvg(chart, 0);
  EXPECT_EQ(Count(from_zero, "<circle"), 0u);
  // The plot area spans y 30..270: from 0, y = 0.5 of a top at 1.08 sits at 270 - 0.5 / 1.08 * 240.
  EXPECT_NE(from_zero.find("60.0,158.9 "), std::string::npos) << from_zero;
  chart.y_min = 0.5;  // now y = 0.5 is the bottom edge
  const std::string from_half = LineChartSvg(chart, 0);
  EXPECT_NE(from_half.find("60.0,270.0 "), std::string::npos) << from_half;
  chart.y_max = 2.5;  // and y = 1.0 a quarter of the way up
  const std::string to_top = LineChartSvg(chart, 0);
  EXPECT_NE(to_top.find("420.0,210.0 "), std::string::npos) << to_top;
}

TEST(LineChart, EmptyChartSaysNoDataAndDocumentHoldsEveryChart) {
  LineChart empty;
  empty.title = "nothing";
  EXPECT_NE(LineChartSvg(empty, 0).find("no data"), std::string::npos);
  const std::string doc = LineChartsDocument({TwoPointChart(), empty}, "footer <1>");
  EXPECT_EQ(doc.rfind("<svg", 0), 0u);
  EXPECT_EQ(Count(doc, "<g transform"), 2u);
  EXPECT_NE(doc.find("translate(440,0)"), std::string::npos);
  EXPECT_NE(doc.find("footer &lt;1&gt;"), std::string::npos);
  EXPECT_NE(doc.find("width=\"880\""), std::string::npos);
}

}  // namespace
}  // namespace epmoe
