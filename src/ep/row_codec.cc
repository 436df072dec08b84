#include "epmoe/row_codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "epmoe/enum_names.h"
#include "epmoe/quantize.h"

namespace epmoe {
namespace {

constexpr int kBlock = 32;

float BlockScale(const float* values, float max_level) {
  float max_abs = 0;
  for (int i = 0; i < kBlock; ++i) max_abs = std::max(max_abs, std::fabs(values[i]));
  return max_abs / max_level;
}

int Quantize(float value, float scale, int lo, int hi) {
  if (scale == 0) return 0;
  return std::clamp(static_cast<int>(RoundHalfEven(value / scale)), lo, hi);
}

}  // namespace

namespace {
constexpr EnumNames<RowFormat, 4> kRowFormats(
    "row format",
    {{{RowFormat::kFp32, "fp32"}, {RowFormat::kBf16, "bf16"}, {RowFormat::kQ8, "q8"}, {RowFormat::kQ4, "q4"}}});
}  // namespace

const char* RowFormatName(RowFormat format) {
  return kRowFormats.Name(format);
}
Result<RowFormat> ParseRowFormat(std::string_view name) {
  return kRowFormats.Parse(name);
}

int RowBlockSize(RowFormat format) { return format == RowFormat::kQ8 || format == RowFormat::kQ4 ? kBlock : 1; }

Status CheckRowWidth(RowFormat format, int64_t cols) {
  if (cols < 1) return InvalidArgument(fmt::format("rows of {} values cannot travel", cols));
  if (cols % RowBlockSize(format) != 0)
    return InvalidArgument(fmt::format("rows of {} values cannot travel as {}: it needs a multiple of {}", cols,
                                       RowFormatName(format), RowBlockSize(format)));
  return Status::Ok();
}

int64_t RowBytes(RowFormat format, int64_t cols) {
  switch (format) {
    case RowFormat::kFp32: return cols * 4;
    case RowFormat::kBf16: return cols * 2;
    case RowFormat::kQ8: return cols / kBlock * (4 + kBlock);
    case RowFormat::kQ4: return cols / kBlock * (4 + kBlock / 2);
  }
  return 0;
}

void EncodeRow(RowFormat format, const float* values, int64_t cols, uint8_t* out) {
  switch (format) {
    case RowFormat::kFp32: std::memcpy(out, values, cols * sizeof(float)); return;
    case RowFormat::kBf16:
      for (int64_t i = 0; i < cols; ++i) {
        const uint16_t v = Bf16FromFiniteFloat(values[i]);
        std::memcpy(out + 2 * i, &v, 2);
      }
      return;
    case RowFormat::kQ8:
      for (int64_t b = 0; b < cols / kBlock; ++b, values += kBlock, out += 4 + kBlock) {
        const float scale = BlockScale(values, 127.0f);
        std::memcpy(out, &scale, 4);
        for (int i = 0; i < kBlock; ++i) out[4 + i] = static_cast<uint8_t>(static_cast<int8_t>(Quantize(values[i], scale, -127, 127)));
      }
      return;
    case RowFormat::kQ4:
      for (int64_t b = 0; b < cols / kBlock; ++b, values += kBlock, out += 4 + kBlock / 2) {
        const float scale = BlockScale(values, 7.0f);
        std::memcpy(out, &scale, 4);
        for (int i = 0; i < kBlock; i += 2) {
          const int lo = Quantize(values[i], scale, -8, 7) + 8;
          const int hi = Quantize(values[i + 1], scale, -8, 7) + 8;
          out[4 + i / 2] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
      return;
  }
}

void DecodeRow(RowFormat format, const uint8_t* in, int64_t cols, float* values) {
  switch (format) {
    case RowFormat::kFp32: std::memcpy(values, in, cols * sizeof(float)); return;
    case RowFormat::kBf16:
      for (int64_t i = 0; i < cols; ++i) {
        uint16_t v;
        std::memcpy(&v, in + 2 * i, 2);
        values[i] = FloatFromBf16(v);
      }
      return;
    case RowFormat::kQ8:
      for (int64_t b = 0; b < cols / kBlock; ++b, values += kBlock, in += 4 + kBlock) {
        float scale;
        std::memcpy(&scale, in, 4);
        for (int i = 0; i < kBlock; ++i) values[i] = static_cast<float>(static_cast<int8_t>(in[4 + i])) * scale;
      }
      return;
    case RowFormat::kQ4:
      for (int64_t b = 0; b < cols / kBlock; ++b, values += kBlock, in += 4 + kBlock / 2) {
        float scale;
        std::memcpy(&scale, in, 4);
        for (int i = 0; i < kBlock; i += 2) {
          const uint8_t byte = in[4 + i / 2];
          values[i] = static_cast<float>((byte & 0x0F) - 8) * scale;
          values[i + 1] = static_cast<float>((byte >> 4) - 8) * scale;
        }
      }
      return;
  }
}

void EncodeScaledRow(RowFormat format, float scale, const float* values, int64_t cols, uint8_t* out) {
  switch (format) {
    case RowFormat::kFp32:
      for (int64_t i = 0; i < cols; ++i) {
        const float v = scale * values[i];
        std::memcpy(out + 4 * i, &v, 4);
      }
      return;
    case RowFormat::kBf16:
      for (int64_t i = 0; i < cols; ++i) {
        const uint16_t v = Bf16FromFiniteFloat(scale * values[i]);
        std::memcpy(out + 2 * i, &v, 2);
      }
      return;
    case RowFormat::kQ8:
    case RowFormat::kQ4: {
      // Block formats: scale one block at a time (their blocks are self-contained).
      const int64_t block_bytes = RowBytes(format, kBlock);
      float scaled[kBlock];
      for (int64_t b = 0; b < cols / kBlock; ++b) {
        for (int i = 0; i < kBlock; ++i) scaled[i] = scale * values[b * kBlock + i];
        EncodeRow(format, scaled, kBlock, out + b * block_bytes);
      }
      return;
    }
  }
}

void AddDecodedRow(RowFormat format, const uint8_t* in, int64_t cols, float* accumulate) {
  switch (format) {
    case RowFormat::kFp32:
      for (int64_t i = 0; i < cols; ++i) {
        float v;
        std::memcpy(&v, in + 4 * i, 4);
        accumulate[i] += v;
      }
      return;
    case RowFormat::kBf16:
      for (int64_t i = 0; i < cols; ++i) {
        uint16_t v;
        std::memcpy(&v, in + 2 * i, 2);
        accumulate[i] += FloatFromBf16(v);
      }
      return;
    case RowFormat::kQ8:
    case RowFormat::kQ4: {
      const int64_t block_bytes = RowBytes(format, kBlock);
      float decoded[kBlock];
      for (int64_t b = 0; b < cols / kBlock; ++b) {
        DecodeRow(format, in + b * block_bytes, kBlock, decoded);
        for (int i = 0; i < kBlock; ++i) accumulate[b * kBlock + i] += decoded[i];
      }
      return;
    }
  }
}

}  // namespace epmoe
