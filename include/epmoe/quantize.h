// Quantization of fp32 weights into each WeightFormat, and back.
//
// These are the canonical encodings (natural element order, block structs from weight_format.h);
// the kernels repack them once at load into their own layouts, with the same values and the same
// byte count. All functions are pure and thread-safe.
//   bf16   round to nearest even.
//   int8   per output channel: scale = max|w| / 127, q = round(w / scale).
//   nvfp4  tensor scale = max|w| / (6 * 448); per 16 weights an E4M3 scale (nearest to
//          block max|w| / (6 * tensor scale)); values are the nearest E2M1 of w / (scale * tensor).
//   mxfp4  per 32 weights an E8M0 scale 2^ceil(log2(block max|w| / 6)), so no value clips;
//          values are the nearest E2M1 of w / scale.
// E2M1 holds +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (bit 3 is the sign); E4M3 is the "fn" variant (no
// infinities, max 448); E8M0 is a biased power of two (127 = 1.0).
#pragma once

#include <bit>
#include <cstdint>
#include <vector>

#include "epmoe/matrix.h"
#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

// x rounded to the nearest integer, ties to even: std::nearbyint's value in the default rounding
// mode for |x| < 2^22 (only the sign of a zero may differ; kernels_quantize_test checks every float
// from 0.5 to 200), without a library call. Adding 1.5 x 2^23 leaves no bits below the units, and
// the addition rounds to nearest even.
inline float RoundHalfEven(float x) {
  constexpr float kShift = 0x1.8p23f;
  return (x + kShift) - kShift;
}
float DecodeE2m1(uint8_t code);   // low 4 bits used
uint8_t EncodeE2m1(float value);  // nearest, clamped to +-6
float DecodeE4m3(uint8_t code);   // 0x7F / 0xFF (NaN) decode to NaN
uint8_t EncodeE4m3(float value);  // nearest non-negative code, clamped to 448; value >= 0
float DecodeE8m0(uint8_t code);   // 2^(code - 127); 255 decodes to NaN

// One [rows x cols] matrix in a weight format, natural order. Only the fields of `format` are used.
struct QuantizedMatrix {
  WeightFormat format = WeightFormat::kFp32;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> fp32;        // rows * cols
  std::vector<uint16_t> bf16;     // rows * cols
  std::vector<int8_t> int8;       // rows * cols
  std::vector<float> row_scales;  // int8: one per row
  std::vector<BlockNvfp4> nvfp4;  // rows * cols / 16, row-major
  float tensor_scale = 1.0f;      // nvfp4
  std::vector<BlockMxfp4> mxfp4;  // rows * cols / 32, row-major

  // Bytes of the encoded data: equals ByteCount(format, rows, cols).
  int64_t bytes() const;
};

// Fails on shapes the format refuses (CheckShape) and on NaN or Inf weights (naming the element).
Result<QuantizedMatrix> Quantize(WeightFormat format, const Matrix& weights);
// The same into *out, reusing its vectors' memory (packing quantizes expert after expert).
Status Quantize(WeightFormat format, const Matrix& weights, QuantizedMatrix* out);

// Row `row` of the matrix as fp32 (cols values).
void DequantizeRow(const QuantizedMatrix& q, int64_t row, float* out);
Matrix Dequantize(const QuantizedMatrix& q);

// One block each way (used by Quantize and the kernels' tests).
BlockNvfp4 QuantizeNvfp4Block(const float* values16, float tensor_scale);
void DequantizeNvfp4Block(const BlockNvfp4& block, float tensor_scale, float* out16);
BlockMxfp4 QuantizeMxfp4Block(const float* values32);
void DequantizeMxfp4Block(const BlockMxfp4& block, float* out32);

}  // namespace epmoe
