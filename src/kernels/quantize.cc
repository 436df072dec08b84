#include "epmoe/quantize.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>

namespace epmoe {
namespace {

constexpr std::array<float, 8> kE2m1Magnitudes = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr float kE2m1Max = 6.0f;
constexpr float kE4m3Max = 448.0f;

// The 127 non-negative finite E4M3 values, increasing with the code (0x00 .. 0x7E).
const std::array<float, 127>& E4m3Table() {
  static const std::array<float, 127> table = [] {
    std::array<float, 127> t{};
    for (int code = 0; code < 127; ++code) t[code] = DecodeE4m3(static_cast<uint8_t>(code));
    return t;
  }();
  return table;
}

float MaxAbs(const float* values, int64_t count) {
  // Eight running maxima, combined at the end (the maximum does not depend on the order; values
  // are finite, checked first): one running maximum was a chain of dependent instructions, one
  // value at a time, and a tenth of the time of packing.
  constexpr int kLanes = 8;
  float lanes[kLanes] = {};
  const int64_t whole = count - count % kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float a = std::fabs(values[i + j]);
      lanes[j] = a > lanes[j] ? a : lanes[j];
    }
  }
  for (int64_t i = whole; i < count; ++i) lanes[0] = std::max(lanes[0], std::fabs(values[i]));
  return *std::max_element(lanes, lanes + kLanes);
}

// The E2M1 code of q: the count of midpoints between neighbouring magnitudes at or below |q| (ties
// go to the larger magnitude), with the sign bit for a negative non-zero code. No data-dependent
// branches, which mispredicted on nearly every weight and made packing 4-bit experts slow.
int32_t E2m1Code(float q) {
  static constexpr float kMidpoints[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float magnitude = std::fabs(q);
  int32_t code = 0;
  for (float midpoint : kMidpoints) code += magnitude >= midpoint;
  return code | (code != 0 && std::signbit(q) ? 8 : 0);
}

// The E2M1 codes of values[i] / scale for a block of kCount values, packed two a byte, low nibble
// first. Whole-block loops in 32-bit lanes, which the compiler vectorizes: code by code, the
// division and the seven comparisons were most of the time of packing 4-bit experts.
template <int kCount>
void EncodeE2m1Block(const float* values, float scale, uint8_t* packed) {
  int32_t codes[kCount];
  for (int i = 0; i < kCount; ++i) codes[i] = E2m1Code(values[i] / scale);
  for (int i = 0; i < kCount / 2; ++i) packed[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
}

}  // namespace

float DecodeE2m1(uint8_t code) {
  const float magnitude = kE2m1Magnitudes[code & 7];
  return (code & 8) ? -magnitude : magnitude;
}

uint8_t EncodeE2m1(float value) {
  return static_cast<uint8_t>(E2m1Code(value));
}

float DecodeE4m3(uint8_t code) {
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 7;
  if (exponent == 0xF && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude =
      exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

uint8_t EncodeE4m3(float value) {
  const auto& table = E4m3Table();
  if (!(value > 0)) return 0;
  if (value >= kE4m3Max) return 126;
  // std::lower_bound's index without its branches (one per halving, which the scales of
  // successive blocks leave unpredictable): the first code whose value is at or above `value`,
  // which exists as value < 448.
  const float* base = table.data();
  for (size_t n = table.size(); n > 1;) {
    const size_t half = n / 2;
    base = base[half] < value ? base + half : base;
    n -= half;
  }
  const int upper = static_cast<int>(base - table.data()) + (*base < value);
  if (upper == 0) return 0;
  const int lower = upper - 1;
  return static_cast<uint8_t>(value - table[lower] < table[upper] - value ? lower : upper);
}

float DecodeE8m0(uint8_t code) {
  if (code == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

BlockNvfp4 QuantizeNvfp4Block(const float* values16, float tensor_scale) {
  BlockNvfp4 block{};
  block.scale_e4m3 = EncodeE4m3(MaxAbs(values16, 16) / (kE2m1Max * tensor_scale));
  const float scale = E4m3Table()[block.scale_e4m3] * tensor_scale;  // DecodeE4m3 of codes 0 - 126
  if (scale > 0) EncodeE2m1Block<16>(values16, scale, block.packed);  // else all codes 0
  return block;
}

void DequantizeNvfp4Block(const BlockNvfp4& block, float tensor_scale, float* out16) {
  const float scale = DecodeE4m3(block.scale_e4m3) * tensor_scale;
  for (int i = 0; i < 8; ++i) {
    out16[2 * i] = DecodeE2m1(block.packed[i] & 0xF) * scale;
    out16[2 * i + 1] = DecodeE2m1(block.packed[i] >> 4) * scale;
  }
}

BlockMxfp4 QuantizeMxfp4Block(const float* values32) {
  BlockMxfp4 block{};
  const float amax = MaxAbs(values32, 32);
  // Smallest power of two with amax / scale <= 6; exponents kept inside E8M0's finite range
  // (code 1 .. 254), so an all-zero block gets the smallest scale and zero values.
  int exponent = -126;
  if (amax > 0) {
    int e = 0;
    const float m = std::frexp(amax / kE2m1Max, &e);  // amax/6 = m * 2^e, m in [0.5, 1)
    exponent = (m == 0.5f) ? e - 1 : e;
  }
  exponent = std::clamp(exponent, -126, 127);
  block.scale_e8m0 = static_cast<uint8_t>(exponent + 127);
  const float scale = DecodeE8m0(block.scale_e8m0);
  EncodeE2m1Block<32>(values32, scale, block.packed);
  return block;
}

void DequantizeMxfp4Block(const BlockMxfp4& block, float* out32) {
  const float scale = DecodeE8m0(block.scale_e8m0);
  for (int i = 0; i < 16; ++i) {
    out32[2 * i] = DecodeE2m1(block.packed[i] & 0xF) * scale;
    out32[2 * i + 1] = DecodeE2m1(block.packed[i] >> 4) * scale;
  }
}

int64_t QuantizedMatrix::bytes() const {
  switch (format) {
    case WeightFormat::kFp32: return static_cast<int64_t>(fp32.size() * sizeof(float));
    case WeightFormat::kBf16: return static_cast<int64_t>(bf16.size() * sizeof(uint16_t));
    case WeightFormat::kInt8: return static_cast<int64_t>(int8.size() + row_scales.size() * sizeof(float));
    case WeightFormat::kNvfp4: return static_cast<int64_t>(nvfp4.size() * sizeof(BlockNvfp4) + sizeof(float));
    case WeightFormat::kMxfp4: return static_cast<int64_t>(mxfp4.size() * sizeof(BlockMxfp4));
  }
  return 0;
}

Result<QuantizedMatrix> Quantize(WeightFormat format, const Matrix& weights) {
  QuantizedMatrix q;
  EPMOE_RETURN_IF_ERROR(Quantize(format, weights, &q));
  return q;
}

Status Quantize(WeightFormat format, const Matrix& weights, QuantizedMatrix* out) {
  EPMOE_RETURN_IF_ERROR(CheckShape(format, weights.rows, weights.cols));
  if (const int64_t bad = FirstNonFinite(weights.data); bad >= 0)
    return InvalidArgument(fmt::format("quantize to {}: weight at row {}, column {} is {}", WeightFormatName(format),
                                       bad / weights.cols, bad % weights.cols, weights.data[bad]));
  QuantizedMatrix& q = *out;
  q.format = format;
  q.rows = weights.rows;
  q.cols = weights.cols;
  const int64_t count = weights.rows * weights.cols;
  switch (format) {
    case WeightFormat::kFp32: q.fp32.assign(weights.data.begin(), weights.data.end()); break;
    case WeightFormat::kBf16:
      q.bf16.resize(count);
      for (int64_t i = 0; i < count; ++i) q.bf16[i] = Bf16FromFloat(weights.data[i]);
      break;
    case WeightFormat::kInt8:
      q.int8.resize(count);
      q.row_scales.resize(weights.rows);
      for (int64_t r = 0; r < weights.rows; ++r) {
        const float* w = weights.row(r);
        const float scale = MaxAbs(w, weights.cols) / 127.0f;
        q.row_scales[r] = scale;
        for (int64_t c = 0; c < weights.cols; ++c) {
          const float v = scale > 0 ? RoundHalfEven(w[c] / scale) : 0.0f;
          q.int8[r * weights.cols + c] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
        }
      }
      break;
    case WeightFormat::kNvfp4: {
      const float amax = MaxAbs(weights.data.data(), count);
      q.tensor_scale = amax > 0 ? amax / (kE2m1Max * kE4m3Max) : 1.0f;
      q.nvfp4.resize(count / 16);
      for (int64_t b = 0; b < count / 16; ++b)
        q.nvfp4[b] = QuantizeNvfp4Block(weights.data.data() + b * 16, q.tensor_scale);
      break;
    }
    case WeightFormat::kMxfp4:
      q.mxfp4.resize(count / 32);
      for (int64_t b = 0; b < count / 32; ++b) q.mxfp4[b] = QuantizeMxfp4Block(weights.data.data() + b * 32);
      break;
  }
  return Status::Ok();
}

void DequantizeRow(const QuantizedMatrix& q, int64_t row, float* out) {
  const int64_t first = row * q.cols;
  switch (q.format) {
    case WeightFormat::kFp32: std::copy_n(q.fp32.data() + first, q.cols, out); break;
    case WeightFormat::kBf16:
      for (int64_t c = 0; c < q.cols; ++c) out[c] = FloatFromBf16(q.bf16[first + c]);
      break;
    case WeightFormat::kInt8:
      for (int64_t c = 0; c < q.cols; ++c) out[c] = q.int8[first + c] * q.row_scales[row];
      break;
    case WeightFormat::kNvfp4:
      for (int64_t b = 0; b < q.cols / 16; ++b)
        DequantizeNvfp4Block(q.nvfp4[first / 16 + b], q.tensor_scale, out + b * 16);
      break;
    case WeightFormat::kMxfp4:
      for (int64_t b = 0; b < q.cols / 32; ++b) DequantizeMxfp4Block(q.mxfp4[first / 32 + b], out + b * 32);
      break;
  }
}

Matrix Dequantize(const QuantizedMatrix& q) {
  Matrix m(q.rows, q.cols);
  for (int64_t r = 0; r < q.rows; ++r) DequantizeRow(q, r, m.row(r));
  return m;
}

}  // namespace epmoe
