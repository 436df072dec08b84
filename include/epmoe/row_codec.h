// Row codecs: how rows travel between ranks. fp32 (exact), bf16 (round to nearest even), and two
// block formats in the style of the int8 / 4-bit activation formats of the expert kernels:
//   q8: blocks of 32 values, one fp32 scale (max |x| / 127) and 32 int8 values: 36 bytes a block;
//   q4: blocks of 32 values, one fp32 scale (max |x| / 7) and 32 4-bit values (two a byte, low
//       nibble first, stored as q + 8 for q in [-8, 7]): 20 bytes a block.
// Encoding then decoding is deterministic, so a reference that decodes the same encoded rows sees
// the same values as the rank that received them. Free functions; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "epmoe/status.h"

namespace epmoe {

enum class RowFormat { kFp32, kBf16, kQ8, kQ4 };

const char* RowFormatName(RowFormat format);
Result<RowFormat> ParseRowFormat(std::string_view name);

// Values per block (1 for fp32 and bf16, 32 for q8 and q4).
int RowBlockSize(RowFormat format);
// Refuses a row width the format cannot carry (q8 and q4 need a multiple of 32).
Status CheckRowWidth(RowFormat format, int64_t cols);
// Bytes of one encoded row of `cols` values (cols must pass CheckRowWidth).
int64_t RowBytes(RowFormat format, int64_t cols);

// Values must be finite (the executors check rows before they travel): a NaN or infinity encodes
// to no particular value.
void EncodeRow(RowFormat format, const float* values, int64_t cols, uint8_t* out);
void DecodeRow(RowFormat format, const uint8_t* in, int64_t cols, float* values);

// Fused forms for the a2a combine, bit-identical to the two-step forms they replace:
// EncodeScaledRow(f, s, v, n, out) == EncodeRow(f, {s * v[i]}, n, out), and
// AddDecodedRow(f, in, n, acc) == DecodeRow(f, in, n, tmp) then acc[i] += tmp[i].
void EncodeScaledRow(RowFormat format, float scale, const float* values, int64_t cols, uint8_t* out);
void AddDecodedRow(RowFormat format, const uint8_t* in, int64_t cols, float* accumulate);

}  // namespace epmoe
