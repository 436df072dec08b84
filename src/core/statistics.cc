#include "epmoe/statistics.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace epmoe {

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t index = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::min(values.size() - 1, index == 0 ? 0 : index - 1)];
}

double DensestBandMedian(std::vector<double> values, double relative) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  auto band = [&](double c) {
    return std::pair(std::lower_bound(values.begin(), values.end(), c * (1 - relative)),
                     std::upper_bound(values.begin(), values.end(), c * (1 + relative)));
  };
  auto best = band(values.front());
  for (const double c : values) {
    const auto b = band(c);
    if (b.second - b.first > best.second - best.first) best = b;
  }
  return Median(std::vector<double>(best.first, best.second));
}

}  // namespace epmoe
