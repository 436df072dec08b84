// Weight formats and their exact sizes in bytes, scales included.
//
// The recorder, the balancer and the planner all reason in bytes read, so ByteCount must equal what
// the kernels store. A matrix is [out_features x in_features]; quantization blocks run along
// in_features (the dot-product direction).
//   fp32   4 bytes a weight.
//   bf16   2 bytes a weight.
//   int8   1 byte a weight + one fp32 scale per output channel.
//   nvfp4  E2M1 values (4 bits) + one FP8-E4M3 scale per 16 weights + one fp32 scale per matrix.
//   mxfp4  E2M1 values (4 bits) + one E8M0 (power of two) scale per 32 weights.
// Block formats need in_features to be a multiple of their block (16 or 32): every preset's sizes
// are; other shapes are refused by CheckShape, not padded.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

enum class WeightFormat { kFp32, kBf16, kInt8, kNvfp4, kMxfp4 };

const char* WeightFormatName(WeightFormat format);
Result<WeightFormat> ParseWeightFormat(std::string_view name);
std::vector<WeightFormat> AllWeightFormats();

// Weights per quantization block along in_features (1 for unblocked formats).
int BlockSize(WeightFormat format);

// NVFP4 block: 16 E2M1 values, two per byte (low nibble first), and their E4M3 scale.
struct BlockNvfp4 {
  uint8_t scale_e4m3;
  uint8_t packed[8];
};
static_assert(sizeof(BlockNvfp4) == 9);

// MXFP4 block: 32 E2M1 values, two per byte (low nibble first), and their E8M0 scale.
struct BlockMxfp4 {
  uint8_t scale_e8m0;
  uint8_t packed[16];
};
static_assert(sizeof(BlockMxfp4) == 17);

// Refuses shapes the format cannot store (in_features not a multiple of the block).
Status CheckShape(WeightFormat format, int64_t out_features, int64_t in_features);

// Exact bytes of one [out_features x in_features] matrix, scales included.
int64_t ByteCount(WeightFormat format, int64_t out_features, int64_t in_features);

// Exact bytes of one SwiGLU expert: gate and up [intermediate x hidden], down [hidden x intermediate].
int64_t ExpertByteCount(WeightFormat format, int64_t hidden, int64_t intermediate);

// bf16 from float, rounded to nearest, ties to even (a NaN stays a quiet NaN), and back. Inline:
// rows are encoded value by value on the exchange path (a call per value there tripled the time of
// a bf16 row). Bf16FromFiniteFloat leaves out the NaN check, for values known finite (rows are
// checked before they travel; the check cost a third).
inline uint16_t Bf16FromFiniteFloat(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
inline uint16_t Bf16FromFloat(float value) {
  const uint16_t quiet_nan = static_cast<uint16_t>((std::bit_cast<uint32_t>(value) >> 16) | 0x40);
  return value != value ? quiet_nan : Bf16FromFiniteFloat(value);
}
inline float FloatFromBf16(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

}  // namespace epmoe
