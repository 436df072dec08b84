// Weight formats: the scalar encodings, block round trips, exact byte counts, and the kernels'
// packed layouts holding the same values.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include "epmoe/quantize.h"
#include "kernels/kernel.h"

namespace epmoe {
namespace {

TEST(Encodings, E2m1RoundTripsEveryCode) {
  for (int code = 0; code < 16; ++code) {
    if (code == 8) continue;  // negative zero encodes as +0
    EXPECT_EQ(EncodeE2m1(DecodeE2m1(static_cast<uint8_t>(code))), code);
  }
  EXPECT_EQ(DecodeE2m1(7), 6.0f);
  EXPECT_EQ(DecodeE2m1(0xD), -3.0f);
  EXPECT_EQ(EncodeE2m1(100.0f), 7);     // clamps to 6
  EXPECT_EQ(EncodeE2m1(2.4f), 4);       // nearest is 2
  EXPECT_EQ(EncodeE2m1(-2.6f), 8 | 5);  // nearest is -3
}

TEST(Encodings, E4m3MatchesTheFnVariant) {
  EXPECT_EQ(DecodeE4m3(0x7E), 448.0f);
  EXPECT_EQ(DecodeE4m3(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(DecodeE4m3(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(DecodeE4m3(0x3F), 1.875f);
  EXPECT_TRUE(std::isnan(DecodeE4m3(0x7F)));
  for (int code = 0; code < 127; ++code) EXPECT_EQ(EncodeE4m3(DecodeE4m3(static_cast<uint8_t>(code))), code);
  EXPECT_EQ(EncodeE4m3(1e9f), 0x7E);
  EXPECT_EQ(EncodeE4m3(1.06f), 0x38);  // 1.0 is nearer than 1.125
}

TEST(Encodings, E8m0AndBf16) {
  EXPECT_EQ(DecodeE8m0(127), 1.0f);
  EXPECT_EQ(DecodeE8m0(130), 8.0f);
  EXPECT_EQ(FloatFromBf16(Bf16FromFloat(1.0f)), 1.0f);
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1).
  EXPECT_EQ(FloatFromBf16(Bf16FromFloat(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(FloatFromBf16(Bf16FromFloat(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
}

// Every float from 0.5 to 200 and its negative (the int8 and row codes round values up to 127),
// and a million below 0.5 (which round to zero): the value std::nearbyint gives.
TEST(Encodings, RoundHalfEvenIsNearbyint) {
  int64_t wrong = 0;
  for (uint32_t bits = std::bit_cast<uint32_t>(0.5f); bits <= std::bit_cast<uint32_t>(200.0f); ++bits) {
    const float x = std::bit_cast<float>(bits);
    wrong += RoundHalfEven(x) != std::nearbyint(x);
    wrong += RoundHalfEven(-x) != std::nearbyint(-x);
  }
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> below(0, std::bit_cast<uint32_t>(0.5f) - 1);
  for (int i = 0; i < 1000000; ++i) {
    const float x = std::bit_cast<float>(below(rng));
    wrong += RoundHalfEven(x) != std::nearbyint(x);
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(RoundHalfEven(2.5f), 2.0f);
  EXPECT_EQ(RoundHalfEven(3.5f), 4.0f);
  EXPECT_EQ(RoundHalfEven(-126.5f), -126.0f);
}

TEST(Blocks, Mxfp4ScaleNeverClips) {
  float values[32];
  for (int i = 0; i < 32; ++i) values[i] = (i - 16) * 0.37f;
  const BlockMxfp4 block = QuantizeMxfp4Block(values);
  float back[32];
  DequantizeMxfp4Block(block, back);
  const float scale = DecodeE8m0(block.scale_e8m0);
  EXPECT_EQ(scale, 1.0f);  // max |v| = 5.92 fits under 6 * 2^0
  // Every error is at most half the widest E2M1 gap (2, between 4 and 6) times the scale.
  for (int i = 0; i < 32; ++i) EXPECT_LE(std::fabs(back[i] - values[i]), scale * 1.0f + 1e-6f) << i;
}

Matrix RandomMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  Matrix m(rows, cols);
  for (float& v : m.data) v = dist(rng);
  return m;
}

class FormatTest : public ::testing::TestWithParam<WeightFormat> {};

TEST_P(FormatTest, ExactBytesAndBoundedError) {
  const WeightFormat format = GetParam();
  const Matrix m = RandomMatrix(32, 512, 1);
  auto q = Quantize(format, m);
  ASSERT_TRUE(q.ok()) << q.status().message();
  EXPECT_EQ(q->bytes(), ByteCount(format, 32, 512));
  const Matrix back = Dequantize(*q);
  // Relative RMS error of the weights, by format (4-bit E2M1 is coarse).
  double err = 0, ref = 0;
  for (size_t i = 0; i < m.data.size(); ++i) {
    err += (back.data[i] - m.data[i]) * (back.data[i] - m.data[i]);
    ref += m.data[i] * m.data[i];
  }
  const double bound = format == WeightFormat::kFp32   ? 0
                       : format == WeightFormat::kBf16 ? 4e-3
                       : format == WeightFormat::kInt8 ? 2e-2
                                                       : 0.15;
  EXPECT_LE(std::sqrt(err / ref), bound);
  for (auto layout : {kernels::PackLayout::kNatural, kernels::PackLayout::kChannelBlocked}) {
    const kernels::PackedMatrix packed = kernels::PackMatrix(*q, layout);
    EXPECT_EQ(packed.bytes(), ByteCount(format, 32, 512));
    std::vector<float> row(512);
    for (int64_t r = 0; r < 32; ++r) {
      kernels::DequantizePackedRow(packed, r, row.data());
      for (int64_t c = 0; c < 512; ++c) ASSERT_EQ(row[c], back.at(r, c)) << r << "," << c;
    }
  }
}

TEST_P(FormatTest, RefusesBadInput) {
  const WeightFormat format = GetParam();
  Matrix m = RandomMatrix(4, 64, 2);
  m.at(2, 9) = INFINITY;
  auto q = Quantize(format, m);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("row 2, column 9"), std::string::npos);
  if (BlockSize(format) > 1) {
    EXPECT_FALSE(Quantize(format, RandomMatrix(4, 40, 3)).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, FormatTest, ::testing::ValuesIn(AllWeightFormats()),
                         [](const ::testing::TestParamInfo<WeightFormat>& info) {
                           return std::string(WeightFormatName(info.param));
                         });

}  // namespace
}  // namespace epmoe
