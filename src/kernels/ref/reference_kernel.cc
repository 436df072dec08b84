// The reference matrix kernel: fp32 activations, each weight row dequantized to fp32 once and
// dotted with every activation row in plain loops (float accumulation in input order). Any shape.
#include <vector>

#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

class ReferenceKernel final : public Fp32ActivationKernel {
 public:
  explicit ReferenceKernel(WeightFormat format) : Fp32ActivationKernel(format) {}
  Isa isa() const override { return Isa::kReference; }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride) const override {
    std::vector<float> weights(w.cols);
    for (int64_t n = n_begin; n < n_end; ++n) {
      DequantizePackedRow(w, n, weights.data());
      for (int64_t r = 0; r < rows; ++r) {
        const float* x = reinterpret_cast<const float*>(acts + r * ActivationBytes(w.cols));
        float acc = 0;
        for (int64_t c = 0; c < w.cols; ++c) acc += weights[c] * x[c];
        out[r * out_stride + (n - n_begin)] = acc;
      }
    }
  }
};

}  // namespace

std::unique_ptr<MatrixKernel> MakeReferenceKernel(WeightFormat format) {
  return std::make_unique<ReferenceKernel>(format);
}

}  // namespace epmoe::kernels
