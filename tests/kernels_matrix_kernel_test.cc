// The matrix kernels' MatMul contract, below the expert store: every kernel this CPU runs writes
// exactly the rows it is asked for, each the dot products of that row with the packed weights.
#include "kernels/kernel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/cpu.h"
#include "epmoe/quantize.h"
#include "kernel_testing.h"

namespace epmoe::kernels {
namespace {

// 288 input features: 72 input groups of int8, 144 of bf16, 288 of fp32, none a multiple of the
// 64 that the dense pair tiles take per chunk, so every format ends on a short chunk.
constexpr int64_t kChannels = 64, kCols = 288;

using epmoe::testing::AllKernelCases;
using epmoe::testing::KernelCase;
using epmoe::testing::KernelCaseName;

using epmoe::testing::RandomMatrix;

class MatMulContract : public ::testing::TestWithParam<KernelCase> {};

// Rows 0 .. rows-1 of `out` hold the dot products (against the dequantized weights, within the
// activation rounding) and the row after them is untouched: a 1-row 4-bit call runs the 2-row tile
// with its row repeated, which must write the row's place only (and a 0-row call nothing).
// 13 and 43 rows are split into row tiles of unequal height (13: 5 + 4 + 4 dense, 7 + 6 4-bit); 7,
// 9 and 12 rows run the dense pair tiles (4 + 3, 5 + 4, 6 + 6), 13 and 18 the dense triples (5 + 4
// + 4, 6 + 6 + 6), 19 the dense tiles over whole groups (5 + 5 + 5 + 4); from 17 rows on (mxfp4) or 33
// (nvfp4), the 4-bit kernels' first 8 rows expand the panel that the others then read (17: 8, then
// 5 + 4; 33: 8, then 5 x 5; 43: 8, then 5 x 6 + 5).
TEST_P(MatMulContract, WritesExactlyTheRowsAskedFor) {
  const auto [format, isa] = GetParam();
  const std::unique_ptr<MatrixKernel> kernel = ChooseKernel(format, isa, kCols, kChannels);
  std::mt19937 rng(1);
  const PackedMatrix w = PackMatrix(*Quantize(format, RandomMatrix(kChannels, kCols, 0.05f, rng)), kernel->layout());
  std::vector<float> dequantized(kChannels * kCols);
  for (int64_t n = 0; n < kChannels; ++n) DequantizePackedRow(w, n, dequantized.data() + n * kCols);
  const int64_t stride = kernel->ActivationBytes(kCols);
  for (int64_t rows : {0, 1, 2, 3, 5, 6, 7, 9, 12, 13, 17, 18, 19, 33, 43}) {
    SCOPED_TRACE(std::to_string(rows) + " rows, " + IsaName(kernel->isa()));
    const Matrix x = RandomMatrix(rows, kCols, 1.0f, rng);
    std::vector<uint8_t> acts(rows * stride);
    for (int64_t r = 0; r < rows; ++r) kernel->QuantizeActivations(x.row(r), kCols, acts.data() + r * stride);
    const float sentinel = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> out((rows + 1) * kChannels, sentinel);
    kernel->MatMul(w, 0, kChannels, acts.data(), rows, out.data(), kChannels, OutputWrites::kCached);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t n = 0; n < kChannels; ++n) {
        double exact = 0, scale = 0;
        for (int64_t c = 0; c < kCols; ++c) {
          exact += static_cast<double>(dequantized[n * kCols + c]) * x.at(r, c);
          scale += std::abs(static_cast<double>(dequantized[n * kCols + c]) * x.at(r, c));
        }
        ASSERT_NEAR(out[r * kChannels + n], exact, 0.02 * scale + 1e-6) << "row " << r << " channel " << n;
      }
    }
    for (int64_t n = 0; n < kChannels; ++n)
      ASSERT_TRUE(std::isnan(out[rows * kChannels + n])) << "wrote past row " << rows - 1;
  }
}

// A channel range without the first and last channel block (for the AVX-512 dense kernels channels
// 16 - 47 of an interleaved group of 64: tiles that do not cover a whole group, addressed block by
// block), and one without the last only (3 blocks: a 2-block tile and a 1-block one), give the same
// values, bit for bit, as those channels of the whole range, for every tile height and both paths.
TEST_P(MatMulContract, InnerChannelRangeMatchesTheWholeRange) {
  const auto [format, isa] = GetParam();
  const std::unique_ptr<MatrixKernel> kernel = ChooseKernel(format, isa, kCols, kChannels);
  const int64_t block = kernel->channel_block();
  ASSERT_LT(block, kChannels - block);
  std::mt19937 rng(2);
  const PackedMatrix w = PackMatrix(*Quantize(format, RandomMatrix(kChannels, kCols, 0.05f, rng)), kernel->layout());
  const int64_t stride = kernel->ActivationBytes(kCols);
  for (int64_t rows : {1, 3, 5, 6, 8, 11, 16, 43, 64}) {
    const Matrix x = RandomMatrix(rows, kCols, 1.0f, rng);
    std::vector<uint8_t> acts(rows * stride);
    for (int64_t r = 0; r < rows; ++r) kernel->QuantizeActivations(x.row(r), kCols, acts.data() + r * stride);
    std::vector<float> whole(rows * kChannels), part(rows * kChannels);
    kernel->MatMul(w, 0, kChannels, acts.data(), rows, whole.data(), kChannels, OutputWrites::kCached);
    for (const auto& [begin, end] : {std::pair{block, kChannels - block}, std::pair{int64_t{0}, kChannels - block}}) {
      SCOPED_TRACE(std::to_string(rows) + " rows, channels " + std::to_string(begin) + " - " + std::to_string(end) +
                   ", " + IsaName(kernel->isa()));
      kernel->MatMul(w, begin, end, acts.data(), rows, part.data(), kChannels, OutputWrites::kCached);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = begin; n < end; ++n)
          ASSERT_EQ(part[r * kChannels + n - begin], whole[r * kChannels + n]) << "row " << r << " channel " << n;
    }
  }
}

// Streamed outputs (OutputWrites::kStreamed) equal cached ones bit for bit, written where the
// output is aligned to a cache line (non-temporal stores) and where it is not (ordinary ones), and
// only the rows asked for are written.
TEST_P(MatMulContract, StreamedOutputsEqualCachedOnes) {
  const auto [format, isa] = GetParam();
  const std::unique_ptr<MatrixKernel> kernel = ChooseKernel(format, isa, kCols, kChannels);
  std::mt19937 rng(3);
  const PackedMatrix w = PackMatrix(*Quantize(format, RandomMatrix(kChannels, kCols, 0.05f, rng)), kernel->layout());
  const int64_t stride = kernel->ActivationBytes(kCols);
  for (int64_t rows : {1, 2, 5, 12, 17, 43}) {
    const Matrix x = RandomMatrix(rows, kCols, 1.0f, rng);
    std::vector<uint8_t> acts(rows * stride);
    for (int64_t r = 0; r < rows; ++r) kernel->QuantizeActivations(x.row(r), kCols, acts.data() + r * stride);
    std::vector<float> cached(rows * kChannels);
    kernel->MatMul(w, 0, kChannels, acts.data(), rows, cached.data(), kChannels, OutputWrites::kCached);
    const float sentinel = std::numeric_limits<float>::quiet_NaN();
    // Room for the rows, a row past them, and a shift of up to a cache line.
    std::vector<float> buffer((rows + 1) * kChannels + 16);
    const int64_t to_line = (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64 / sizeof(float);
    for (const int64_t shift : {to_line, to_line + 1}) {
      SCOPED_TRACE(std::to_string(rows) + " rows, output " + (shift == to_line ? "aligned" : "unaligned"));
      std::fill(buffer.begin(), buffer.end(), sentinel);
      float* out = buffer.data() + shift;
      kernel->MatMul(w, 0, kChannels, acts.data(), rows, out, kChannels, OutputWrites::kStreamed);
      for (int64_t i = 0; i < rows * kChannels; ++i) ASSERT_EQ(out[i], cached[i]) << "output " << i;
      for (int64_t n = 0; n < kChannels; ++n)
        ASSERT_TRUE(std::isnan(out[rows * kChannels + n])) << "wrote past the rows";
    }
  }
}

// The 4-bit vector kernels' activation row (kernels/kernel.h): the row's int8 values, then for each
// scale block -12 x the sum of its values, the correction the kernels start that block's sums from.
// The widths leave blocks past the last 64 (AVX-512) or 32 (AVX2) values the kernels sum at a time.
TEST_P(MatMulContract, FourBitRowsCarryTheirBlocksCorrections) {
  const auto [format, isa] = GetParam();
  if (format != WeightFormat::kNvfp4 && format != WeightFormat::kMxfp4) GTEST_SKIP() << "not a 4-bit format";
  const int block = BlockSize(format);
  std::mt19937 rng(4);
  for (int64_t cols : {16, 48, 80, 96, 288, 2048}) {
    if (cols % block != 0) continue;
    const std::unique_ptr<MatrixKernel> kernel = ChooseKernel(format, isa, cols, kChannels);
    if (kernel->isa() == Isa::kReference) continue;  // fp32 rows
    SCOPED_TRACE(std::to_string(cols) + " columns, " + IsaName(kernel->isa()));
    const Matrix x = RandomMatrix(1, cols, 1.0f, rng);
    std::vector<uint8_t> row(kernel->ActivationBytes(cols));
    kernel->QuantizeActivations(x.row(0), cols, row.data());
    for (int64_t b = 0; b < cols / block; ++b) {
      int32_t sum = 0;
      for (int64_t c = b * block; c < (b + 1) * block; ++c) sum += static_cast<int8_t>(row[c]);
      int32_t correction = 0;
      std::memcpy(&correction, row.data() + FourBitCorrectionOffset(cols) + 4 * b, 4);
      ASSERT_EQ(correction, -12 * sum) << "scale block " << b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormatsAndIsas, MatMulContract, ::testing::ValuesIn(AllKernelCases()), KernelCaseName);

}  // namespace
}  // namespace epmoe::kernels
