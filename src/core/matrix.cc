#include "epmoe/matrix.h"

#include <algorithm>
#include <cmath>

namespace epmoe {

int64_t FirstNonFinite(std::span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

double Checksum(const Matrix& m) {
  double sum = 0;
  for (float v : m.data) sum += v;
  return sum;
}

double NormalizedMaxError(const Matrix& actual, const Matrix& expected) {
  if (actual.rows != expected.rows || actual.cols != expected.cols) return INFINITY;
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < expected.data.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(actual.data[i]) - expected.data[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(expected.data[i])));
  }
  return max_diff / std::max(max_ref, 1e-30);
}

}  // namespace epmoe
