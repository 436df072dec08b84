// Internal interface of the expert kernels: a weight matrix packed in a kernel's layout, and the
// matrix kernel (one per weight format x instruction set) that quantizes activation rows the way
// its dot product wants them and multiplies them with rows of packed weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "epmoe/cpu.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/quantize.h"
#include "epmoe/weight_format.h"

namespace epmoe::kernels {

// How the values of a packed matrix are ordered.
enum class PackLayout {
  // Row by row, input features in order; 4-bit values two per byte, low nibble first (as in the
  // block structs).
  kNatural,
  // For the AVX-512 and AVX2 kernels (AVX2 takes a block as two 8-lane halves): output channels
  // (rows) in blocks of 16, one per 32-bit lane of a vector. A vector holds one input group (4
  // bytes: 1 fp32, 2 bf16 or 4 int8 values) of each of a block's 16 channels, lane c at bytes
  // 4c..4c+3. fp32, bf16, int8: the blocks are interleaved in groups of kInterleavedBlocks (the
  // last group of a matrix may have fewer): a group is one contiguous run of vectors, input group
  // by input group, each with the vectors of the group's blocks in order, so that a decode tile
  // over a group reads one sequential stream (one thread reads 31 - 32 GB/s as one stream, 26 as
  // 4 streams 32 KB apart). 4-bit formats: for each block and chunk of 16 inputs, 128 bytes
  // holding the chunk's 4 vectors of the int8 arrangement as nibbles (vector 2i in the low nibbles
  // of bytes 64i..64i+63, vector 2i+1 in the high nibbles); the block scales are stored per block
  // and scale block, 16 codes in lane order. rows must be a multiple of 16.
  kChannelBlocked,
};

// Channel blocks per interleaved group of the kChannelBlocked fp32, bf16 and int8 layout.
constexpr int64_t kInterleavedBlocks = 4;

// The interleaved group that holds channel block `block` of a matrix of `blocks` blocks: its first
// block and its number of blocks (kInterleavedBlocks, fewer for a matrix's short last group).
struct InterleavedGroup {
  int64_t first;
  int64_t count;
};
inline InterleavedGroup InterleavedGroupOf(int64_t block, int64_t blocks) {
  const int64_t first = block / kInterleavedBlocks * kInterleavedBlocks;
  return {first, std::min(kInterleavedBlocks, blocks - first)};
}

// ---- shared by the vector kernels ----

inline int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Unaligned loads of a 4-byte value from an activation row.
inline int32_t LoadInt32(const uint8_t* at) {
  int32_t v;
  std::memcpy(&v, at, 4);
  return v;
}
inline float LoadFloat(const uint8_t* at) {
  float v;
  std::memcpy(&v, at, 4);
  return v;
}

// 2 * E2M1 value + 12 for codes 0..15 (8..15 negative): the 4-bit kernels' weights as unsigned
// bytes (0..24), the operand VPDPBUSD and VPMADDUBSW take unsigned.
constexpr uint8_t kE2m1TwicePlus12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The 4-bit vector kernels' activation row: cols int8 values (padded to 64 bytes), then one int32
// per scale block (-12 * the block's sum, which removes the weights' offset of 12), then the fp32
// scale.
inline int64_t FourBitCorrectionOffset(int64_t cols) {
  return RoundUp(cols, 64);
}
inline int64_t FourBitScaleOffset(int64_t cols, int scale_block) {
  return FourBitCorrectionOffset(cols) + cols / scale_block * 4;
}

// One [rows x cols] weight matrix in a kernel's layout. The byte count equals ByteCount(format,
// rows, cols): the same encoded values as QuantizedMatrix, reordered. Immutable after packing
// (except that an expert store may overwrite its values and scales in place with another expert's).
struct PackedMatrix {
  WeightFormat format = WeightFormat::kFp32;
  PackLayout layout = PackLayout::kNatural;
  int64_t rows = 0;
  int64_t cols = 0;
  // fp32: floats; bf16: uint16; int8: offset binary (q + 128 as uint8, what VNNI's unsigned operand
  // takes); 4-bit: E2M1 codes, two per byte; in `layout` order.
  std::span<uint8_t> values;
  int64_t row_bytes = 0;  // bytes of values per row (output channel)
  // int8: one fp32 per row, in row order; nvfp4: cols/16 E4M3 codes per row; mxfp4: cols/32 E8M0
  // codes per row; 4-bit codes in `layout` order.
  std::span<uint8_t> scales;
  float tensor_scale = 1.0f;  // nvfp4: stored (4 bytes); others: unused and not stored
  // The memory of values and scales when PackMatrix allocated it; empty when the matrix was packed
  // into memory its owner keeps (PackMatrixAt).
  std::shared_ptr<uint8_t> storage;

  // Row r's values in the natural layout.
  const uint8_t* row(int64_t r) const { return values.data() + r * row_bytes; }
  int64_t bytes() const;
};

// Bytes PackMatrixAt writes for a [rows x cols] matrix of `format`: its values, then its scales,
// each starting at a multiple of 64 bytes.
int64_t PackedStorageBytes(WeightFormat format, int64_t rows, int64_t cols);
// Packs q into `memory` (PackedStorageBytes bytes, 64-byte aligned), which the caller keeps for as
// long as the matrix is used.
PackedMatrix PackMatrixAt(const QuantizedMatrix& q, PackLayout layout, uint8_t* memory);
// Packs q into memory of its own (on 2 MiB pages when large, core/huge_pages.h).
PackedMatrix PackMatrix(const QuantizedMatrix& q, PackLayout layout);

// Row n of a packed matrix as fp32 (cols values); any layout.
void DequantizePackedRow(const PackedMatrix& w, int64_t n, float* out);

// How MatMul writes its outputs. kCached: ordinary stores, for outputs that are read again soon.
// kStreamed: for outputs that will not be (larger than the caches): every output vector that is a
// whole aligned cache line is written with a non-temporal store, which neither reads the line from
// memory first nor evicts the weights and activations the kernel reads (KernelExpertStore's down
// projection). A kernel may write ordinarily either way (the reference kernel does).
enum class OutputWrites { kCached, kStreamed };

// A matrix kernel: stateless and thread-safe.
class MatrixKernel {
 public:
  virtual ~MatrixKernel() = default;
  virtual Isa isa() const = 0;
  virtual WeightFormat format() const = 0;
  virtual PackLayout layout() const { return PackLayout::kNatural; }
  // Whether this kernel runs matrices with `size` rows or columns (vector kernels need whole
  // channel blocks and input groups; the caller falls back to a lower instruction set otherwise).
  virtual bool SupportsSize(int64_t size) const = 0;
  // MatMul's channel ranges must start at a multiple of channel_block(); ranges that are multiples
  // of channel_tile() run only full register tiles when there are many rows.
  virtual int64_t channel_block() const { return 1; }
  virtual int64_t channel_tile() const { return 1; }
  // Bytes of one activation row of `cols` features as QuantizeActivations writes it.
  virtual int64_t ActivationBytes(int64_t cols) const = 0;
  virtual void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const = 0;
  // out[r * out_stride + (n - n_begin)] = dot(weights row n, activation row r) for r in [0, rows)
  // and n in [n_begin, n_end); activation row r starts at acts + r * ActivationBytes(w.cols).
  // Reads each weight once from memory for all `rows` (rows are tiled in registers, weights are
  // re-read from cache for further row tiles). The outputs are visible to other threads once it
  // returns, however written.
  virtual void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows,
                      float* out, int64_t out_stride, OutputWrites writes) const = 0;
  // out[i] = activation(gate[i] + gate_bias[i], up[i] + up_bias[i]) for i in [0, count)
  // (GatedActivation, expert_ffn.h); a null bias adds nothing.
  virtual void Activate(const float* gate, const float* up, const float* gate_bias, const float* up_bias, int64_t count,
                        const GatedActivation& activation, float* out) const;
};

// Factories; the avx2 and avx512 ones may be called only when FormatSupportedBy says so for this CPU.
std::unique_ptr<MatrixKernel> MakeReferenceKernel(WeightFormat format);
std::unique_ptr<MatrixKernel> MakeAvx2Kernel(WeightFormat format);
std::unique_ptr<MatrixKernel> MakeAvx512Kernel(WeightFormat format);

// The kernel of the highest instruction set <= `highest` that supports both matrices' input sizes.
std::unique_ptr<MatrixKernel> ChooseKernel(WeightFormat format, Isa highest, int64_t hidden, int64_t intermediate);

}  // namespace epmoe::kernels
