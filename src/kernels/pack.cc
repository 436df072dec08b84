#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/huge_pages.h"
#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

constexpr int64_t kBlockChannels = 16;  // channels per block in kChannelBlocked
constexpr int64_t kGroupBytes = 4;      // bytes of one input group per lane

int ValueBytes(WeightFormat format) {
  switch (format) {
    case WeightFormat::kFp32: return 4;
    case WeightFormat::kBf16: return 2;
    default: return 1;
  }
}

bool IsFourBit(WeightFormat format) {
  return format == WeightFormat::kNvfp4 || format == WeightFormat::kMxfp4;
}

int64_t ValueStorageBytes(WeightFormat format, int64_t rows, int64_t cols) {
  return IsFourBit(format) ? rows * cols / 2 : rows * cols * ValueBytes(format);
}

// int8: one fp32 per row; 4-bit: one code per scale block.
int64_t ScaleStorageBytes(WeightFormat format, int64_t rows, int64_t cols) {
  if (format == WeightFormat::kInt8) return rows * static_cast<int64_t>(sizeof(float));
  return IsFourBit(format) ? rows * cols / BlockSize(format) : 0;
}

int64_t RoundUpTo64(int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}

// Byte offset of value (n, c) of an fp32, bf16 or int8 [rows x cols] matrix in the kChannelBlocked
// layout: its interleaved group of blocks, then input group by input group the group's blocks.
int64_t BlockedOffset(int64_t rows, int64_t cols, int value_bytes, int64_t n, int64_t c) {
  const int64_t groups = cols * value_bytes / kGroupBytes;
  const int64_t byte = c * value_bytes;
  const int64_t block = n / kBlockChannels;
  const InterleavedGroup group = InterleavedGroupOf(block, rows / kBlockChannels);
  const int64_t vector = group.first * groups + (byte / kGroupBytes) * group.count + (block - group.first);
  return vector * 64 + (n % kBlockChannels) * kGroupBytes + byte % kGroupBytes;
}

// Position (byte, high nibble?) of 4-bit value (n, c) in the kChannelBlocked layout.
void BlockedCodePosition(int64_t cols, int64_t n, int64_t c, int64_t* byte, bool* high) {
  const int64_t chunk = c / 16, within = c % 16;
  const int64_t vector = within / 4;
  *byte =
      ((n / kBlockChannels) * (cols / 16) + chunk) * 128 + (vector / 2) * 64 + (n % kBlockChannels) * 4 + within % 4;
  *high = (vector % 2) == 1;
}

// Index of the scale of (row n, scale block sb) among a 4-bit matrix's scales in `layout`.
int64_t ScaleIndex(const PackedMatrix& w, int64_t n, int64_t sb) {
  const int64_t per_row = w.cols / BlockSize(w.format);
  if (w.layout == PackLayout::kNatural) return n * per_row + sb;
  return ((n / kBlockChannels) * per_row + sb) * kBlockChannels + n % kBlockChannels;
}

uint8_t PackedCode(const PackedMatrix& w, int64_t n, int64_t c) {
  int64_t byte = n * w.row_bytes + c / 2;
  bool high = (c % 2) == 1;
  if (w.layout == PackLayout::kChannelBlocked) BlockedCodePosition(w.cols, n, c, &byte, &high);
  const uint8_t v = w.values[byte];
  return high ? v >> 4 : v & 0xF;
}

}  // namespace

int64_t PackedMatrix::bytes() const {
  return static_cast<int64_t>(values.size() + scales.size()) +
         (format == WeightFormat::kNvfp4 ? static_cast<int64_t>(sizeof(float)) : 0);
}

int64_t PackedStorageBytes(WeightFormat format, int64_t rows, int64_t cols) {
  return RoundUpTo64(ValueStorageBytes(format, rows, cols)) + RoundUpTo64(ScaleStorageBytes(format, rows, cols));
}

PackedMatrix PackMatrix(const QuantizedMatrix& q, PackLayout layout) {
  std::shared_ptr<uint8_t> storage(AllocateHugePageMemory(PackedStorageBytes(q.format, q.rows, q.cols)));
  EPMOE_CHECK_MSG(storage != nullptr, "cannot allocate a packed matrix");
  PackedMatrix w = PackMatrixAt(q, layout, storage.get());
  w.storage = std::move(storage);
  return w;
}

PackedMatrix PackMatrixAt(const QuantizedMatrix& q, PackLayout layout, uint8_t* memory) {
  EPMOE_CHECK(layout == PackLayout::kNatural || q.rows % kBlockChannels == 0);
  PackedMatrix w;
  w.format = q.format;
  w.layout = layout;
  w.rows = q.rows;
  w.cols = q.cols;
  const int64_t value_bytes_total = ValueStorageBytes(q.format, q.rows, q.cols);
  w.values = {memory, static_cast<size_t>(value_bytes_total)};
  w.scales = {memory + RoundUpTo64(value_bytes_total),
              static_cast<size_t>(ScaleStorageBytes(q.format, q.rows, q.cols))};
  const int64_t count = q.rows * q.cols;
  const bool blocked = layout == PackLayout::kChannelBlocked;
  switch (q.format) {
    case WeightFormat::kFp32:
    case WeightFormat::kBf16:
    case WeightFormat::kInt8: {
      const int value_bytes = ValueBytes(q.format);
      w.row_bytes = q.cols * value_bytes;
      const uint8_t* source = q.format == WeightFormat::kFp32   ? reinterpret_cast<const uint8_t*>(q.fp32.data())
                              : q.format == WeightFormat::kBf16 ? reinterpret_cast<const uint8_t*>(q.bf16.data())
                                                                : reinterpret_cast<const uint8_t*>(q.int8.data());
      if (q.format == WeightFormat::kInt8) std::memcpy(w.scales.data(), q.row_scales.data(), w.scales.size());
      // Copies `bytes` of values, int8 as offset binary (q + 128).
      auto copy = [int8 = q.format == WeightFormat::kInt8](uint8_t* to, const uint8_t* from, int64_t bytes) {
        if (int8) {
          for (int64_t i = 0; i < bytes; ++i) to[i] = static_cast<uint8_t>(from[i] ^ 0x80);
        } else {
          std::memcpy(to, from, bytes);
        }
      };
      if (!blocked) {
        copy(w.values.data(), source, count * value_bytes);
        break;
      }
      // Row n's input groups (4 bytes each) go to one lane of its block's vectors, which follow each
      // other group by group within its interleaved group of blocks: BlockedOffset of the row's first
      // value, then group.count vectors per input group.
      const int64_t groups = (w.row_bytes + kGroupBytes - 1) / kGroupBytes;
      for (int64_t n = 0; n < q.rows; ++n) {
        const InterleavedGroup group = InterleavedGroupOf(n / kBlockChannels, q.rows / kBlockChannels);
        uint8_t* lane = w.values.data() + BlockedOffset(q.rows, q.cols, value_bytes, n, 0);
        const uint8_t* from = source + n * w.row_bytes;
        for (int64_t g = 0; g < groups; ++g)
          copy(lane + g * group.count * 64, from + g * kGroupBytes,
               std::min<int64_t>(kGroupBytes, w.row_bytes - g * kGroupBytes));
      }
      break;
    }
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: {
      const int block = BlockSize(q.format);
      const int64_t blocks_per_row = q.cols / block;
      const bool nv = q.format == WeightFormat::kNvfp4;
      w.row_bytes = q.cols / 2;
      w.tensor_scale = q.tensor_scale;
      for (int64_t n = 0; n < q.rows; ++n) {
        for (int64_t b = 0; b < blocks_per_row; ++b) {
          const int64_t index = n * blocks_per_row + b;
          w.scales[ScaleIndex(w, n, b)] = nv ? q.nvfp4[index].scale_e4m3 : q.mxfp4[index].scale_e8m0;
          const uint8_t* packed = nv ? q.nvfp4[index].packed : q.mxfp4[index].packed;
          if (!blocked) {
            std::memcpy(w.values.data() + n * w.row_bytes + b * block / 2, packed, block / 2);
            continue;
          }
          // Each 16 inputs (8 packed bytes: input 2i low, 2i + 1 high) become 8 bytes of row n's
          // lane in its block's 128-byte chunk, from where BlockedCodePosition puts the first: byte k
          // of the first 64 holds inputs k (low) and 4 + k (high), byte k of the second 64 inputs
          // 8 + k and 12 + k.
          for (int64_t within = 0; within < block; within += 16) {
            const uint8_t* codes = packed + within / 2;
            auto code = [codes](int i) { return (i % 2) ? codes[i / 2] >> 4 : codes[i / 2] & 0xF; };
            int64_t first = 0;
            bool high = false;
            BlockedCodePosition(q.cols, n, b * block + within, &first, &high);
            uint8_t* lane = w.values.data() + first;
            for (int k = 0; k < 4; ++k) {
              lane[k] = static_cast<uint8_t>(code(k) | code(4 + k) << 4);
              lane[64 + k] = static_cast<uint8_t>(code(8 + k) | code(12 + k) << 4);
            }
          }
        }
      }
      break;
    }
  }
  return w;
}

void DequantizePackedRow(const PackedMatrix& w, int64_t n, float* out) {
  const bool blocked = w.layout == PackLayout::kChannelBlocked;
  switch (w.format) {
    case WeightFormat::kFp32:
    case WeightFormat::kBf16:
    case WeightFormat::kInt8: {
      const int value_bytes = ValueBytes(w.format);
      float scale = 1;
      if (w.format == WeightFormat::kInt8) std::memcpy(&scale, w.scales.data() + n * sizeof(float), sizeof(float));
      for (int64_t c = 0; c < w.cols; ++c) {
        const uint8_t* at = w.values.data() + (blocked ? BlockedOffset(w.rows, w.cols, value_bytes, n, c)
                                                       : (n * w.cols + c) * value_bytes);
        if (w.format == WeightFormat::kFp32) {
          std::memcpy(&out[c], at, sizeof(float));
        } else if (w.format == WeightFormat::kBf16) {
          uint16_t bits;
          std::memcpy(&bits, at, 2);
          out[c] = FloatFromBf16(bits);
        } else {
          out[c] = static_cast<float>(static_cast<int>(*at) - 128) * scale;
        }
      }
      return;
    }
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: {
      const int block = BlockSize(w.format);
      for (int64_t c = 0; c < w.cols; ++c) {
        const uint8_t code = w.scales[ScaleIndex(w, n, c / block)];
        const float scale = w.format == WeightFormat::kNvfp4 ? DecodeE4m3(code) * w.tensor_scale : DecodeE8m0(code);
        out[c] = DecodeE2m1(PackedCode(w, n, c)) * scale;
      }
      return;
    }
  }
}

void MatrixKernel::Activate(const float* gate, const float* up, const float* gate_bias, const float* up_bias,
                            int64_t count, const GatedActivation& activation, float* out) const {
  const float limit = activation.limit;
  for (int64_t i = 0; i < count; ++i) {
    float g = gate[i] + (gate_bias != nullptr ? gate_bias[i] : 0.0f);
    float u = up[i] + (up_bias != nullptr ? up_bias[i] : 0.0f);
    // Written so that a NaN passes through (std::min and std::max return their first argument).
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    out[i] = g / (1.0f + std::exp(-activation.alpha * g)) * (u + activation.up_offset);
  }
}

std::unique_ptr<MatrixKernel> ChooseKernel(WeightFormat format, Isa highest, int64_t hidden, int64_t intermediate) {
  for (Isa isa : AllIsas()) {
    if (isa > highest || !FormatSupportedBy(isa, format, DetectCpuFeatures())) continue;
    std::unique_ptr<MatrixKernel> kernel;
    switch (isa) {
      case Isa::kAvx512: kernel = MakeAvx512Kernel(format); break;
      case Isa::kAvx2: kernel = MakeAvx2Kernel(format); break;
      case Isa::kReference: kernel = MakeReferenceKernel(format); break;
    }
    if (kernel->SupportsSize(hidden) && kernel->SupportsSize(intermediate)) return kernel;
  }
  return MakeReferenceKernel(format);
}

}  // namespace epmoe::kernels
