// The AVX2 matrix kernel: fp32 activations; each weight row is dequantized to fp32 once (into L1)
// and applied to four activation rows at a time with 8-wide FMAs. Any shape (scalar tail).
// Not tuned for the quantized formats (dequantizing costs more than the AVX-512 VNNI path); it is
// the fallback for CPUs without AVX-512.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int kRows>
void DotRows(const float* w, int64_t cols, const float* const* x, float* results) {
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    const __m256 wv = _mm256_loadu_ps(w + c);
    for (int r = 0; r < kRows; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[r] + c), acc[r]);
  }
  for (int r = 0; r < kRows; ++r) {
    float sum = HorizontalSum(acc[r]);
    for (int64_t t = c; t < cols; ++t) sum += w[t] * x[r][t];
    results[r] = sum;
  }
}

class Avx2Kernel final : public Fp32ActivationKernel {
 public:
  explicit Avx2Kernel(WeightFormat format) : Fp32ActivationKernel(format) {}
  Isa isa() const override { return Isa::kAvx2; }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride) const override {
    std::vector<float> dequantized(format_ == WeightFormat::kFp32 ? 0 : w.cols);
    const int64_t stride = ActivationBytes(w.cols);
    for (int64_t n = n_begin; n < n_end; ++n) {
      const float* weights = reinterpret_cast<const float*>(w.row(n));
      if (format_ != WeightFormat::kFp32) {
        DequantizePackedRow(w, n, dequantized.data());
        weights = dequantized.data();
      }
      for (int64_t r = 0; r < rows; r += 4) {
        const float* x[4];
        const int count = static_cast<int>(std::min<int64_t>(4, rows - r));
        for (int i = 0; i < count; ++i) x[i] = reinterpret_cast<const float*>(acts + (r + i) * stride);
        float results[4];
        switch (count) {
          case 4: DotRows<4>(weights, w.cols, x, results); break;
          case 3: DotRows<3>(weights, w.cols, x, results); break;
          case 2: DotRows<2>(weights, w.cols, x, results); break;
          default: DotRows<1>(weights, w.cols, x, results); break;
        }
        for (int i = 0; i < count; ++i) out[(r + i) * out_stride + (n - n_begin)] = results[i];
      }
    }
  }
};

}  // namespace

std::unique_ptr<MatrixKernel> MakeAvx2Kernel(WeightFormat format) {
  return std::make_unique<Avx2Kernel>(format);
}

}  // namespace epmoe::kernels
