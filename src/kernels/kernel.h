// Internal interface of the expert kernels: a weight matrix packed in a kernel's layout, and the
// matrix kernel (one per weight format x instruction set) that quantizes activation rows the way
// its dot product wants them and multiplies them with rows of packed weights.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "epmoe/cpu.h"
#include "epmoe/quantize.h"
#include "epmoe/weight_format.h"

namespace epmoe::kernels {

// How the values of a packed matrix are ordered inside each row.
enum class PackLayout {
  // Input features in order; 4-bit values two per byte, low nibble first (as in the block structs).
  kNatural,
  // 4-bit formats for the AVX-512 VNNI kernel: each group of 256 inputs is 128 bytes; byte p of the
  // first 64 holds v0[p] (low nibble) and v1[p] (high), byte p of the next 64 holds v2[p] and v3[p],
  // where vj[4i + t] = input 16i + 4j + t of the group. So 32-bit lane i of every vector covers the
  // 16 inputs 16i .. 16i+15, one NVFP4 block (half an MXFP4 block), and a lane's integer sum can run
  // over a whole block before it is scaled.
  kGrouped256,
};

// One [rows x cols] weight matrix in a kernel's layout. The byte count equals ByteCount(format,
// rows, cols): the same encoded values as QuantizedMatrix, reordered. Immutable after packing.
struct PackedMatrix {
  WeightFormat format = WeightFormat::kFp32;
  PackLayout layout = PackLayout::kNatural;
  int64_t rows = 0;
  int64_t cols = 0;
  // fp32: floats; bf16: uint16; int8: offset binary (q + 128 as uint8, what VNNI's unsigned operand
  // takes); 4-bit: E2M1 codes, two per byte, in `layout` order. Row r starts at r * row_bytes.
  std::vector<uint8_t> values;
  int64_t row_bytes = 0;
  // int8: one fp32 per row; nvfp4: cols/16 E4M3 codes per row; mxfp4: cols/32 E8M0 codes per row.
  std::vector<uint8_t> scales;
  float tensor_scale = 1.0f;  // nvfp4: stored (4 bytes); others: unused and not stored

  const uint8_t* row(int64_t r) const { return values.data() + r * row_bytes; }
  int64_t bytes() const;
};

PackedMatrix PackMatrix(const QuantizedMatrix& q, PackLayout layout);

// Row n of a packed matrix as fp32 (cols values); any layout.
void DequantizePackedRow(const PackedMatrix& w, int64_t n, float* out);

// A matrix kernel: stateless and thread-safe.
class MatrixKernel {
 public:
  virtual ~MatrixKernel() = default;
  virtual Isa isa() const = 0;
  virtual WeightFormat format() const = 0;
  virtual PackLayout layout() const { return PackLayout::kNatural; }
  // Whether this kernel runs matrices with `cols` input features (vector kernels need whole
  // vectors or groups; the caller falls back to a lower instruction set otherwise).
  virtual bool SupportsCols(int64_t cols) const = 0;
  // Bytes of one activation row of `cols` features as QuantizeActivations writes it.
  virtual int64_t ActivationBytes(int64_t cols) const = 0;
  virtual void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const = 0;
  // out[r * out_stride + (n - n_begin)] = dot(weights row n, activation row r) for r in [0, rows)
  // and n in [n_begin, n_end); activation row r starts at acts + r * ActivationBytes(w.cols).
  // Reads each weight row once for all `rows` (rows are tiled in registers, weights stay in L1).
  virtual void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows,
                      float* out, int64_t out_stride) const = 0;
};

// Base of the kernels that take fp32 activations as they are and run any input size (the AVX2 and
// reference kernels): they differ only in MatMul.
class Fp32ActivationKernel : public MatrixKernel {
 public:
  explicit Fp32ActivationKernel(WeightFormat format) : format_(format) {}
  WeightFormat format() const override { return format_; }
  bool SupportsCols(int64_t) const override { return true; }
  int64_t ActivationBytes(int64_t cols) const override { return cols * static_cast<int64_t>(sizeof(float)); }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    std::memcpy(out, x, cols * sizeof(float));
  }

 protected:
  WeightFormat format_;
};

// Factories; the avx2 and avx512 ones may be called only when IsaSupported says so.
std::unique_ptr<MatrixKernel> MakeReferenceKernel(WeightFormat format);
std::unique_ptr<MatrixKernel> MakeAvx2Kernel(WeightFormat format);
std::unique_ptr<MatrixKernel> MakeAvx512Kernel(WeightFormat format);

// The kernel of the highest instruction set <= `highest` that supports both matrices' input sizes.
std::unique_ptr<MatrixKernel> ChooseKernel(WeightFormat format, Isa highest, int64_t hidden, int64_t intermediate);

}  // namespace epmoe::kernels
