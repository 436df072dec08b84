// Row codecs (bf16, q8, q4) against hand-computed values and error bounds, and the small helpers
// of the executors (row split, expected copies per row, option names).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "epmoe/executor.h"
#include "epmoe/row_codec.h"

namespace epmoe {
namespace {

std::vector<float> RoundTrip(RowFormat format, const std::vector<float>& values) {
  std::vector<uint8_t> bytes(RowBytes(format, static_cast<int64_t>(values.size())));
  std::vector<float> out(values.size());
  EncodeRow(format, values.data(), static_cast<int64_t>(values.size()), bytes.data());
  DecodeRow(format, bytes.data(), static_cast<int64_t>(values.size()), out.data());
  return out;
}

TEST(RowCodec, SizesAndNames) {
  EXPECT_EQ(RowBytes(RowFormat::kFp32, 64), 256);
  EXPECT_EQ(RowBytes(RowFormat::kBf16, 64), 128);
  EXPECT_EQ(RowBytes(RowFormat::kQ8, 64), 72);
  EXPECT_EQ(RowBytes(RowFormat::kQ4, 64), 40);
  for (RowFormat f : {RowFormat::kFp32, RowFormat::kBf16, RowFormat::kQ8, RowFormat::kQ4}) {
    auto parsed = ParseRowFormat(RowFormatName(f));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_FALSE(ParseRowFormat("fp8").ok());
  EXPECT_TRUE(CheckRowWidth(RowFormat::kQ8, 64).ok());
  EXPECT_EQ(CheckRowWidth(RowFormat::kQ4, 48).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckRowWidth(RowFormat::kBf16, 48).ok());
  EXPECT_FALSE(CheckRowWidth(RowFormat::kFp32, 0).ok());
}

TEST(RowCodec, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to the even one, 1.
  // 1 + 3 * 2^-8 lies between 1 + 2^-7 and 1 + 2^-6: ties to even, 1 + 2^-6.
  const std::vector<float> in = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, 0.0f, 1.0f + 1.0f / 128 + 1.0f / 1024};
  const auto out = RoundTrip(RowFormat::kBf16, in);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 1.0f + 1.0f / 64);
  EXPECT_EQ(out[2], -2.5f);
  EXPECT_EQ(out[3], 0.0f);
  EXPECT_EQ(out[4], 1.0f + 1.0f / 128);
  EXPECT_EQ(RoundTrip(RowFormat::kFp32, in), in);
}

TEST(RowCodec, BlockFormatsStayWithinHalfAStep) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> in(128);
  for (float& v : in) v = dist(rng);
  in[40] = 0;  // zeros survive
  for (auto [format, levels] : {std::pair{RowFormat::kQ8, 127.0f}, std::pair{RowFormat::kQ4, 7.0f}}) {
    const auto out = RoundTrip(format, in);
    for (size_t b = 0; b < in.size(); b += 32) {
      float max_abs = 0;
      for (size_t i = b; i < b + 32; ++i) max_abs = std::max(max_abs, std::fabs(in[i]));
      const float step = max_abs / levels;
      for (size_t i = b; i < b + 32; ++i) EXPECT_LE(std::fabs(out[i] - in[i]), step * 0.5f + 1e-6f) << i;
    }
    EXPECT_EQ(out[40], 0.0f);
  }
  // An all-zero block has scale 0 and decodes to zeros.
  const auto zeros = RoundTrip(RowFormat::kQ4, std::vector<float>(32, 0.0f));
  for (float v : zeros) EXPECT_EQ(v, 0.0f);
}

TEST(RowCodec, FusedFormsEqualTheTwoStepForms) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> values(96), accumulate(96);
  for (float& v : values) v = dist(rng);
  for (float& v : accumulate) v = dist(rng);
  for (RowFormat f : {RowFormat::kFp32, RowFormat::kBf16, RowFormat::kQ8, RowFormat::kQ4}) {
    SCOPED_TRACE(RowFormatName(f));
    const float scale = 0.3712f;
    std::vector<float> scaled(values.size());
    for (size_t i = 0; i < values.size(); ++i) scaled[i] = scale * values[i];
    std::vector<uint8_t> two_step(RowBytes(f, 96)), fused(RowBytes(f, 96));
    EncodeRow(f, scaled.data(), 96, two_step.data());
    EncodeScaledRow(f, scale, values.data(), 96, fused.data());
    EXPECT_EQ(fused, two_step);
    std::vector<float> decoded(96), want = accumulate, got = accumulate;
    DecodeRow(f, fused.data(), 96, decoded.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] += decoded[i];
    AddDecodedRow(f, fused.data(), 96, got.data());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  }
}

TEST(RowCodec, Q8LayoutIsScaleThenValues) {
  std::vector<float> in(32, 0.0f);
  in[0] = 1.27f;
  in[1] = -0.635f;
  std::vector<uint8_t> bytes(36);
  EncodeRow(RowFormat::kQ8, in.data(), 32, bytes.data());
  float scale;
  std::memcpy(&scale, bytes.data(), 4);
  EXPECT_FLOAT_EQ(scale, 0.01f);
  EXPECT_EQ(static_cast<int8_t>(bytes[4]), 127);
  EXPECT_EQ(static_cast<int8_t>(bytes[5]), -64);  // -63.5 rounds to even
}

TEST(ExecutorHelpers, RowSplit) {
  EXPECT_EQ(RowBegin(10, 4, 0), 0);
  EXPECT_EQ(RowBegin(10, 4, 1), 3);
  EXPECT_EQ(RowBegin(10, 4, 2), 6);
  EXPECT_EQ(RowBegin(10, 4, 3), 8);
  EXPECT_EQ(RowBegin(10, 4, 4), 10);
  EXPECT_EQ(RowBegin(2, 4, 3), 2);
}

}  // namespace
}  // namespace epmoe
