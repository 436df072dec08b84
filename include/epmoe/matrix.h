// Matrix: a dense row-major fp32 matrix, the type of a batch of rows and of reference weights.
// A plain value (thread-compatible); rows are contiguous, `cols` floats each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <vector>

namespace epmoe {

// Allocates on 64-byte boundaries, a cache line: a matrix's rows then start on one wherever their
// width allows, which the kernels' non-temporal stores need (OutputWrites in kernels/kernel.h;
// glibc's large blocks start 16 bytes into a page).
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlignment); }
  friend bool operator==(const CacheLineAllocator&, const CacheLineAllocator&) { return true; }
};

struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float, CacheLineAllocator<float>> data;

  Matrix() = default;
  Matrix(int64_t rows_, int64_t cols_) : rows(rows_), cols(cols_), data(rows_ * cols_, 0.0f) {}

  float* row(int64_t i) { return data.data() + i * cols; }
  const float* row(int64_t i) const { return data.data() + i * cols; }
  std::span<float> row_span(int64_t i) { return {row(i), static_cast<size_t>(cols)}; }
  std::span<const float> row_span(int64_t i) const { return {row(i), static_cast<size_t>(cols)}; }
  float& at(int64_t i, int64_t j) { return data[i * cols + j]; }
  float at(int64_t i, int64_t j) const { return data[i * cols + j]; }

  // Makes this rows_ x cols_ and keeps the allocation where it is large enough, for buffers that
  // are written whole step after step (a fresh one costs a page fault and zeroing per 4 KB on every
  // step); the values are then unspecified.
  void Reshape(int64_t rows_, int64_t cols_) {
    rows = rows_;
    cols = cols_;
    data.resize(rows_ * cols_);
  }
};

// A copy of rows [first, first + count) of m.
Matrix RowSlice(const Matrix& m, int64_t first, int64_t count);

// Index of the first non-finite value (NaN or Inf), or -1 when all are finite.
int64_t FirstNonFinite(std::span<const float> values);

// Order-independent-of-threads checksum of a matrix: the sum of all values in double, for reports.
double Checksum(const Matrix& m);

// max |a - b| / max(max |b|, tiny): the normalized error the tests bound per weight format.
double NormalizedMaxError(const Matrix& actual, const Matrix& expected);

}  // namespace epmoe
