#include <cstring>

#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

// Position (byte, high nibble?) of input c of a row in the kGrouped256 layout.
void Grouped256Position(int64_t c, int64_t* byte, bool* high) {
  const int64_t group = c / 256;
  const int64_t within = c % 256;
  const int64_t lane = within / 16;
  const int64_t vector = (within % 16) / 4;  // j
  const int64_t t = within % 4;
  *byte = group * 128 + (vector / 2) * 64 + lane * 4 + t;
  *high = (vector % 2) == 1;
}

uint8_t PackedCode(const PackedMatrix& w, int64_t n, int64_t c) {
  int64_t byte = c / 2;
  bool high = (c % 2) == 1;
  if (w.layout == PackLayout::kGrouped256) Grouped256Position(c, &byte, &high);
  const uint8_t v = w.row(n)[byte];
  return high ? v >> 4 : v & 0xF;
}

}  // namespace

int64_t PackedMatrix::bytes() const {
  return static_cast<int64_t>(values.size() + scales.size()) +
         (format == WeightFormat::kNvfp4 ? static_cast<int64_t>(sizeof(float)) : 0);
}

PackedMatrix PackMatrix(const QuantizedMatrix& q, PackLayout layout) {
  PackedMatrix w;
  w.format = q.format;
  w.layout = layout;
  w.rows = q.rows;
  w.cols = q.cols;
  const int64_t count = q.rows * q.cols;
  switch (q.format) {
    case WeightFormat::kFp32:
      w.row_bytes = q.cols * 4;
      w.values.resize(count * 4);
      std::memcpy(w.values.data(), q.fp32.data(), w.values.size());
      break;
    case WeightFormat::kBf16:
      w.row_bytes = q.cols * 2;
      w.values.resize(count * 2);
      std::memcpy(w.values.data(), q.bf16.data(), w.values.size());
      break;
    case WeightFormat::kInt8:
      w.row_bytes = q.cols;
      w.values.resize(count);
      for (int64_t i = 0; i < count; ++i) w.values[i] = static_cast<uint8_t>(static_cast<uint8_t>(q.int8[i]) ^ 0x80);
      w.scales.resize(q.rows * sizeof(float));
      std::memcpy(w.scales.data(), q.row_scales.data(), w.scales.size());
      break;
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: {
      const int block = BlockSize(q.format);
      const int64_t blocks_per_row = q.cols / block;
      w.row_bytes = q.cols / 2;
      w.values.assign(count / 2, 0);
      // The blocks' packed bytes, concatenated, are the natural layout already.
      std::vector<uint8_t> natural(w.row_bytes);
      std::vector<int64_t> byte_of(layout == PackLayout::kGrouped256 ? q.cols : 0);
      std::vector<uint8_t> high_of(byte_of.size());
      for (int64_t c = 0; c < static_cast<int64_t>(byte_of.size()); ++c) {
        bool high = false;
        Grouped256Position(c, &byte_of[c], &high);
        high_of[c] = high;
      }
      for (int64_t r = 0; r < q.rows; ++r) {
        for (int64_t b = 0; b < blocks_per_row; ++b) {
          const uint8_t* packed = q.format == WeightFormat::kNvfp4 ? q.nvfp4[r * blocks_per_row + b].packed
                                                                   : q.mxfp4[r * blocks_per_row + b].packed;
          std::memcpy(natural.data() + b * block / 2, packed, block / 2);
        }
        uint8_t* row = w.values.data() + r * w.row_bytes;
        if (layout == PackLayout::kNatural) {
          std::memcpy(row, natural.data(), w.row_bytes);
          continue;
        }
        for (int64_t c = 0; c < q.cols; ++c) {
          const uint8_t code = (c % 2) ? natural[c / 2] >> 4 : natural[c / 2] & 0xF;
          row[byte_of[c]] |= high_of[c] ? code << 4 : code;
        }
      }
      w.scales.resize(count / block);
      for (int64_t b = 0; b < count / block; ++b)
        w.scales[b] = q.format == WeightFormat::kNvfp4 ? q.nvfp4[b].scale_e4m3 : q.mxfp4[b].scale_e8m0;
      w.tensor_scale = q.tensor_scale;
      break;
    }
  }
  return w;
}

void DequantizePackedRow(const PackedMatrix& w, int64_t n, float* out) {
  switch (w.format) {
    case WeightFormat::kFp32: std::memcpy(out, w.row(n), w.cols * sizeof(float)); return;
    case WeightFormat::kBf16: {
      const uint8_t* row = w.row(n);
      for (int64_t c = 0; c < w.cols; ++c) {
        uint16_t bits;
        std::memcpy(&bits, row + 2 * c, 2);
        out[c] = FloatFromBf16(bits);
      }
      return;
    }
    case WeightFormat::kInt8: {
      float scale;
      std::memcpy(&scale, w.scales.data() + n * sizeof(float), sizeof(float));
      const uint8_t* row = w.row(n);
      for (int64_t c = 0; c < w.cols; ++c) out[c] = static_cast<float>(static_cast<int>(row[c]) - 128) * scale;
      return;
    }
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: {
      const int block = BlockSize(w.format);
      const uint8_t* scales = w.scales.data() + n * (w.cols / block);
      if (w.layout == PackLayout::kNatural) {
        float values[16];
        for (int code = 0; code < 16; ++code) values[code] = DecodeE2m1(static_cast<uint8_t>(code));
        const uint8_t* row = w.row(n);
        for (int64_t b = 0; b < w.cols / block; ++b) {
          const float scale =
              w.format == WeightFormat::kNvfp4 ? DecodeE4m3(scales[b]) * w.tensor_scale : DecodeE8m0(scales[b]);
          for (int i = 0; i < block / 2; ++i) {
            const uint8_t byte = row[b * block / 2 + i];
            out[b * block + 2 * i] = values[byte & 0xF] * scale;
            out[b * block + 2 * i + 1] = values[byte >> 4] * scale;
          }
        }
        return;
      }
      for (int64_t c = 0; c < w.cols; ++c) {
        const float scale = w.format == WeightFormat::kNvfp4 ? DecodeE4m3(scales[c / block]) * w.tensor_scale
                                                             : DecodeE8m0(scales[c / block]);
        out[c] = DecodeE2m1(PackedCode(w, n, c)) * scale;
      }
      return;
    }
  }
}

std::unique_ptr<MatrixKernel> ChooseKernel(WeightFormat format, Isa highest, int64_t hidden, int64_t intermediate) {
  for (Isa isa : AllIsas()) {
    if (isa > highest || !IsaSupported(isa)) continue;
    std::unique_ptr<MatrixKernel> kernel;
    switch (isa) {
      case Isa::kAvx512: kernel = MakeAvx512Kernel(format); break;
      case Isa::kAvx2: kernel = MakeAvx2Kernel(format); break;
      case Isa::kReference: kernel = MakeReferenceKernel(format); break;
    }
    if (kernel->SupportsCols(hidden) && kernel->SupportsCols(intermediate)) return kernel;
  }
  return MakeReferenceKernel(format);
}

}  // namespace epmoe::kernels
