// The reference matrix kernel: fp32 activations, each weight row dequantized to fp32 once and
// dotted with every activation row in plain loops (float accumulation in input order). Any shape.
#include <cstring>
#include <vector>

#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

class ReferenceKernel final : public MatrixKernel {
 public:
  explicit ReferenceKernel(WeightFormat format) : format_(format) {}
  Isa isa() const override { return Isa::kReference; }
  WeightFormat format() const override { return format_; }
  bool SupportsSize(int64_t) const override { return true; }
  int64_t ActivationBytes(int64_t cols) const override { return cols * static_cast<int64_t>(sizeof(float)); }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    std::memcpy(out, x, cols * sizeof(float));
  }
  // Writes ordinarily whatever `writes` asks.
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride, OutputWrites /*writes*/) const override {
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

 private:
  WeightFormat format_;
};

}  // namespace

std::unique_ptr<MatrixKernel> MakeReferenceKernel(WeightFormat format) {
  return std::make_unique<ReferenceKernel>(format);
}

}  // namespace epmoe::kernels
