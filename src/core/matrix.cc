#include "epmoe/matrix.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace epmoe {

int64_t FirstNonFinite(std::span<const float> values) {
  // Chunks of 1024 tested without an exit per value (a loop the compiler vectorizes: every weight
  // and row passes here), then the first one searched in the chunk that has one.
  constexpr size_t kChunk = 1024;
  for (size_t begin = 0; begin < values.size(); begin += kChunk) {
    const size_t end = std::min(values.size(), begin + kChunk);
    uint32_t non_finite = 0;
    for (size_t i = begin; i < end; ++i)
      non_finite |= (std::bit_cast<uint32_t>(values[i]) & 0x7F800000u) == 0x7F800000u;  // all-ones exponent
    if (non_finite == 0) continue;
    for (size_t i = begin; i < end; ++i)
      if (!std::isfinite(values[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

Matrix RowSlice(const Matrix& m, int64_t first, int64_t count) {
  Matrix slice(count, m.cols);
  std::copy(m.row(first), m.row(first) + count * m.cols, slice.data.begin());
  return slice;
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
