// Safetensors reader and writer: round trips, block reads, exact number conversions (every code of
// the 8- and 16-bit formats against formulas written here independently) and one test per header
// error, each checking that the message names the offending tensor or field.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "epmoe/safetensors.h"

namespace epmoe {
namespace {

namespace fs = std::filesystem;

template <typename T>
std::vector<std::byte> RawBytes(const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::vector<std::byte> Encoded(const std::vector<float>& values, TensorDtype dtype) {
  std::vector<std::byte> bytes;
  EXPECT_TRUE(EncodeFloats(values, dtype, &bytes).ok());
  return bytes;
}

// A file whose first 8 bytes declare `declared_length` header bytes, followed by `rest`.
std::vector<std::byte> FileWithLength(uint64_t declared_length, const std::string& rest) {
  std::vector<std::byte> file(8 + rest.size());
  std::memcpy(file.data(), &declared_length, 8);
  std::memcpy(file.data() + 8, rest.data(), rest.size());
  return file;
}

// A well-framed file: the header text, then `data_bytes` zero bytes of data.
std::vector<std::byte> FileOf(const std::string& header, size_t data_bytes) {
  return FileWithLength(header.size(), header + std::string(data_bytes, '\0'));
}

// The message of the error that parsing `file` gives (fails the test if the file is accepted).
std::string ParseError(const std::vector<std::byte>& file, const std::string& source = "bad.safetensors") {
  auto parsed = SafetensorsFile::Parse(file, source);
  if (parsed.ok()) {
    ADD_FAILURE() << "accepted a bad file";
    return "";
  }
  EXPECT_EQ(parsed.status().code(), StatusCode::kIoError);
  return parsed.status().message();
}

void ExpectMentions(const std::string& message, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;
}

std::string OneTensor(const std::string& fields) {
  return "{\"x\": {" + fields + "}}";
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "/safetensors_test_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  std::unique_ptr<SafetensorsFile> WriteAndOpen(const std::vector<TensorToWrite>& tensors,
                                                const std::map<std::string, std::string>& metadata = {}) {
    const std::string path = Path("model.safetensors");
    const Status written = WriteSafetensors(path, tensors, metadata);
    EXPECT_TRUE(written.ok()) << written.ToString();
    auto file = SafetensorsFile::Open(path);
    EXPECT_TRUE(file.ok()) << file.status().ToString();
    return file.ok() ? std::move(file).value() : nullptr;
  }

  fs::path dir_;
};

std::vector<float> ReadAll(const SafetensorsFile& file, const TensorInfo& tensor) {
  const int64_t cols = tensor.shape.empty() ? 1 : tensor.shape.back();
  const int64_t rows = cols == 0 ? 0 : tensor.elements() / cols;
  std::vector<float> values(static_cast<size_t>(rows * cols));
  const Status status = file.ReadFloat(tensor, 0, rows, 0, cols, values.data());
  EXPECT_TRUE(status.ok()) << status.ToString();
  return values;
}

TEST_F(SafetensorsTest, RoundTripOfShapesAndDtypes) {
  const std::vector<float> scalar = {3.5f};
  const std::vector<int32_t> ints = {-7, 0, 1, std::numeric_limits<int32_t>::max(),
                                     std::numeric_limits<int32_t>::min()};
  std::vector<float> matrix(12), cube(24);
  for (size_t i = 0; i < matrix.size(); ++i) matrix[i] = 0.25f * static_cast<float>(i) - 1.0f;
  for (size_t i = 0; i < cube.size(); ++i) cube[i] = static_cast<float>(i) / 16.0f;
  const std::vector<uint8_t> bytes = {0, 1, 255};
  const std::vector<int64_t> longs = {-5, 1LL << 40};
  const std::vector<double> doubles = {0.1, -1e300};
  const auto scalar_bytes = RawBytes(scalar), int_bytes = RawBytes(ints), u8_bytes = RawBytes(bytes),
             i64_bytes = RawBytes(longs), f64_bytes = RawBytes(doubles);
  const auto matrix_bytes = Encoded(matrix, TensorDtype::kBf16), cube_bytes = Encoded(cube, TensorDtype::kF16);
  const std::vector<TensorToWrite> tensors = {
      {"scalar", TensorDtype::kF32, {}, scalar_bytes},
      {"ints", TensorDtype::kI32, {5}, int_bytes},
      {"empty_rows", TensorDtype::kF32, {0, 4}, {}},
      {"layers.0.matrix", TensorDtype::kBf16, {3, 4}, matrix_bytes},
      {"cube", TensorDtype::kF16, {2, 3, 4}, cube_bytes},
      {"empty", TensorDtype::kBf16, {0}, {}},
      {"u8", TensorDtype::kU8, {3}, u8_bytes},
      {"i64", TensorDtype::kI64, {2, 1}, i64_bytes},
      {"f64", TensorDtype::kF64, {2}, f64_bytes},
  };
  auto file = WriteAndOpen(tensors);
  ASSERT_NE(file, nullptr);

  ASSERT_EQ(file->tensors().size(), tensors.size());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& info = file->tensors()[i];  // data-offset order is the order written
    EXPECT_EQ(info.name, tensors[i].name);
    EXPECT_EQ(info.dtype, tensors[i].dtype);
    EXPECT_EQ(info.dtype_name, TensorDtypeName(tensors[i].dtype));
    EXPECT_EQ(info.shape, tensors[i].shape);
    EXPECT_EQ(info.offset, offset);
    EXPECT_EQ(info.bytes, static_cast<int64_t>(tensors[i].bytes.size()));
    offset += info.bytes;
    EXPECT_EQ(file->Find(info.name), &info);
    const std::span<const std::byte> data = file->Data(info);
    ASSERT_EQ(data.size(), tensors[i].bytes.size());
    EXPECT_TRUE(std::equal(data.begin(), data.end(), tensors[i].bytes.begin())) << info.name;
  }
  EXPECT_EQ(file->Find("missing"), nullptr);
  EXPECT_EQ(file->Find("layers.0"), nullptr);
  EXPECT_TRUE(file->metadata().empty());

  EXPECT_EQ(file->Find("scalar")->elements(), 1);
  EXPECT_EQ(file->Find("empty_rows")->elements(), 0);
  EXPECT_EQ(ReadAll(*file, *file->Find("scalar")), scalar);
  EXPECT_EQ(ReadAll(*file, *file->Find("ints")),
            std::vector<float>({-7.0f, 0.0f, 1.0f, 2147483648.0f, -2147483648.0f}));
  EXPECT_TRUE(ReadAll(*file, *file->Find("empty_rows")).empty());
  EXPECT_TRUE(ReadAll(*file, *file->Find("empty")).empty());
  EXPECT_EQ(ReadAll(*file, *file->Find("layers.0.matrix")), matrix);  // quarters are exact in bf16
  EXPECT_EQ(ReadAll(*file, *file->Find("cube")), cube);
  EXPECT_EQ(ReadAll(*file, *file->Find("u8")), std::vector<float>({0.0f, 1.0f, 255.0f}));
  EXPECT_EQ(ReadAll(*file, *file->Find("i64")), std::vector<float>({-5.0f, 1099511627776.0f}));
  EXPECT_EQ(ReadAll(*file, *file->Find("f64")), std::vector<float>({0.1f, -std::numeric_limits<float>::infinity()}));
}

TEST_F(SafetensorsTest, NoTensorsAtAll) {
  auto file = WriteAndOpen({});
  ASSERT_NE(file, nullptr);
  EXPECT_TRUE(file->tensors().empty());
  EXPECT_EQ(file->Find(""), nullptr);
}

TEST_F(SafetensorsTest, MetadataRoundTrip) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"empty", ""}, {"quote \" and \\ and \n", "ünïcødé ✓"}};
  const std::vector<float> values = {1, 2};
  const auto bytes = RawBytes(values);
  auto file = WriteAndOpen({{"w", TensorDtype::kF32, {2}, bytes}}, metadata);
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->metadata(), metadata);
  EXPECT_EQ(file->Find("__metadata__"), nullptr);
  EXPECT_EQ(file->tensors().size(), 1u);
}

TEST_F(SafetensorsTest, HeaderIsPaddedWithSpacesToEightBytes) {
  for (const std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    const std::vector<float> values = {1.5f};
    const auto bytes = RawBytes(values);
    const std::string path = Path("padded.safetensors");
    ASSERT_TRUE(WriteSafetensors(path, std::vector<TensorToWrite>{{name, TensorDtype::kF32, {1}, bytes}}).ok());
    std::ifstream in(path, std::ios::binary);
    const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t header_bytes;
    std::memcpy(&header_bytes, file.data(), 8);
    EXPECT_EQ(header_bytes % 8, 0u) << name;
    ASSERT_EQ(file.size(), 8 + header_bytes + 4) << name;
    const std::string header = file.substr(8, header_bytes);
    const size_t json_end = header.rfind('}') + 1;
    EXPECT_EQ(header.substr(json_end), std::string(header.size() - json_end, ' ')) << name;
    EXPECT_LT(header.size() - json_end, 8u);
    EXPECT_FALSE(fs::exists(path + ".tmp"));
  }
}

TEST_F(SafetensorsTest, BlockReadsAtOffsets) {
  std::vector<float> values(2 * 3 * 5);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  const auto f32 = RawBytes(values), bf16 = Encoded(values, TensorDtype::kBf16);
  std::vector<int16_t> shorts(values.begin(), values.end());
  const auto i16 = RawBytes(shorts);
  const std::vector<float> row = {10, 11, 12, 13};
  const auto row_bytes = RawBytes(row);
  auto file = WriteAndOpen({{"f32", TensorDtype::kF32, {2, 3, 5}, f32},
                            {"bf16", TensorDtype::kBf16, {2, 3, 5}, bf16},
                            {"i16", TensorDtype::kI16, {6, 5}, i16},
                            {"row", TensorDtype::kF32, {4}, row_bytes}});
  ASSERT_NE(file, nullptr);
  // Seen as a 6 x 5 matrix: rows [1, 4) x columns [2, 5).
  const std::vector<float> expected = {7, 8, 9, 12, 13, 14, 17, 18, 19};
  for (const char* name : {"f32", "bf16", "i16"}) {
    std::vector<float> block(9, -1.0f);
    ASSERT_TRUE(file->ReadFloat(*file->Find(name), 1, 3, 2, 3, block.data()).ok()) << name;
    EXPECT_EQ(block, expected) << name;
  }
  std::vector<float> one(1);
  ASSERT_TRUE(file->ReadFloat(*file->Find("f32"), 5, 1, 4, 1, one.data()).ok());  // the last one
  EXPECT_EQ(one[0], 29.0f);
  std::vector<float> middle(2);
  ASSERT_TRUE(file->ReadFloat(*file->Find("row"), 0, 1, 1, 2, middle.data()).ok());  // 1-D: one row
  EXPECT_EQ(middle, std::vector<float>({11, 12}));
  EXPECT_TRUE(file->ReadFloat(*file->Find("row"), 1, 0, 0, 4, nullptr).ok());  // empty, at the end
}

TEST_F(SafetensorsTest, UnalignedTensorsReadCorrectly) {
  const std::vector<uint8_t> odd = {9};
  const std::vector<float> floats = {1.25f, -2.5f, 1e-30f};
  const std::vector<double> doubles = {6.5, -0.125};
  const auto odd_bytes = RawBytes(odd), float_bytes = RawBytes(floats), double_bytes = RawBytes(doubles),
             half_bytes = Encoded(floats, TensorDtype::kF16);
  auto file = WriteAndOpen({{"odd", TensorDtype::kU8, {1}, odd_bytes},
                            {"floats", TensorDtype::kF32, {3}, float_bytes},
                            {"halves", TensorDtype::kF16, {3}, half_bytes},
                            {"doubles", TensorDtype::kF64, {2}, double_bytes}});
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->Find("floats")->offset, 1);
  EXPECT_EQ(ReadAll(*file, *file->Find("floats")), floats);
  EXPECT_EQ(ReadAll(*file, *file->Find("halves")), std::vector<float>({1.25f, -2.5f, 0.0f}));
  EXPECT_EQ(ReadAll(*file, *file->Find("doubles")), std::vector<float>({6.5f, -0.125f}));
}

TEST_F(SafetensorsTest, BlockOutOfRangeIsRefused) {
  const std::vector<float> values(12);
  const auto bytes = RawBytes(values);
  auto file = WriteAndOpen({{"w.weight", TensorDtype::kF32, {3, 4}, bytes}});
  ASSERT_NE(file, nullptr);
  const TensorInfo& tensor = *file->Find("w.weight");
  std::vector<float> out(64);
  const struct {
    int64_t row_begin, row_count, col_begin, col_count;
  } blocks[] = {{2, 2, 0, 4},
                {0, 1, 1, 4},
                {-1, 1, 0, 1},
                {0, -1, 0, 1},
                {0, 1, -1, 1},
                {3, 0, 5, 0},
                {0, 1, 0, std::numeric_limits<int64_t>::max()},
                {std::numeric_limits<int64_t>::max(), 1, 0, 1}};
  for (const auto& block : blocks) {
    const Status status =
        file->ReadFloat(tensor, block.row_begin, block.row_count, block.col_begin, block.col_count, out.data());
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    ExpectMentions(status.message(),
                   {"model.safetensors", "tensor \"w.weight\" (F32 [3, 4])", "3 x 4 matrix",
                    fmt::format("rows [{}, {} + {})", block.row_begin, block.row_begin, block.row_count)});
  }
}

TEST_F(SafetensorsTest, BoolAndUnknownDtypesAreNotReadAsFloats) {
  const std::vector<uint8_t> flags = {1, 0};
  const auto bytes = RawBytes(flags);
  auto file = WriteAndOpen({{"mask", TensorDtype::kBool, {2}, bytes}});
  ASSERT_NE(file, nullptr);
  float out[2];
  const Status status = file->ReadFloat(*file->Find("mask"), 0, 1, 0, 2, out);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  ExpectMentions(status.message(), {"tensor \"mask\" (BOOL [2])", "cannot be read as floats"});

  // A dtype this reader does not know: kept with its name, only its byte range checked.
  const auto unknown = FileOf(R"({"packed": {"dtype": "F4", "shape": [5], "data_offsets": [0, 3]},)"
                              R"( "next": {"dtype": "U8", "shape": [1], "data_offsets": [3, 4]}})",
                              4);
  auto parsed = SafetensorsFile::Parse(unknown, "f4.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const TensorInfo& packed = *(*parsed)->Find("packed");
  EXPECT_EQ(packed.dtype, TensorDtype::kUnknown);
  EXPECT_EQ(packed.dtype_name, "F4");
  EXPECT_EQ(packed.bytes, 3);
  const Status refused = (*parsed)->ReadFloat(packed, 0, 1, 0, 1, out);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  ExpectMentions(refused.message(), {"f4.safetensors", "tensor \"packed\" (F4 [5])"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "F4", "shape": [5], "data_offsets": [0, 9])"), 3)),
                 {"tensor \"x\"", "data_offsets [0, 9] end past the data section's 3 bytes"});
}

TEST(SafetensorsDtypes, NamesAndSizes) {
  const struct {
    TensorDtype dtype;
    const char* name;
    int bytes;
  } expected[] = {
      {TensorDtype::kBool, "BOOL", 1},      {TensorDtype::kU8, "U8", 1},          {TensorDtype::kI8, "I8", 1},
      {TensorDtype::kF8E5M2, "F8_E5M2", 1}, {TensorDtype::kF8E4M3, "F8_E4M3", 1}, {TensorDtype::kI16, "I16", 2},
      {TensorDtype::kU16, "U16", 2},        {TensorDtype::kF16, "F16", 2},        {TensorDtype::kBf16, "BF16", 2},
      {TensorDtype::kI32, "I32", 4},        {TensorDtype::kU32, "U32", 4},        {TensorDtype::kF32, "F32", 4},
      {TensorDtype::kF64, "F64", 8},        {TensorDtype::kI64, "I64", 8},        {TensorDtype::kU64, "U64", 8}};
  for (const auto& dtype : expected) {
    EXPECT_STREQ(TensorDtypeName(dtype.dtype), dtype.name);
    EXPECT_EQ(TensorDtypeFromName(dtype.name), dtype.dtype);
    EXPECT_EQ(TensorDtypeBytes(dtype.dtype), dtype.bytes);
  }
  EXPECT_EQ(TensorDtypeBytes(TensorDtype::kUnknown), 0);
  EXPECT_EQ(TensorDtypeFromName("bf16"), TensorDtype::kUnknown);  // names are case-sensitive
  EXPECT_EQ(TensorDtypeFromName("F4"), TensorDtype::kUnknown);
}

// ---- Exact conversions ----

// Reads every code of an 8- or 16-bit format through a one-tensor file.
template <typename Code>
std::vector<float> DecodeAllCodes(TensorDtype dtype) {
  std::vector<Code> codes(size_t{1} << (8 * sizeof(Code)));
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<Code>(i);
  const auto bytes = RawBytes(codes);
  const std::string header = fmt::format(R"({{"codes": {{"dtype": "{}", "shape": [{}], "data_offsets": [0, {}]}}}})",
                                         TensorDtypeName(dtype), codes.size(), bytes.size());
  std::vector<std::byte> file = FileOf(header, 0);
  file.insert(file.end(), bytes.begin(), bytes.end());
  auto parsed = SafetensorsFile::Parse(file, "codes");
  EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
  std::vector<float> values(codes.size());
  EXPECT_TRUE((*parsed)->ReadFloat((*parsed)->tensors()[0], 0, 1, 0, codes.size(), values.data()).ok());
  return values;
}

// Same value, or both NaN; +0 and -0 are told apart.
void ExpectSameFloat(float actual, float expected, int code) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(actual)) << "code " << code;
  } else {
    EXPECT_EQ(std::bit_cast<uint32_t>(actual), std::bit_cast<uint32_t>(expected))
        << "code " << code << ": " << actual << " != " << expected;
  }
}

TEST(SafetensorsConversion, EveryF8E4M3Code) {
  const std::vector<float> values = DecodeAllCodes<uint8_t>(TensorDtype::kF8E4M3);
  for (int code = 0; code < 256; ++code) {
    const uint32_t sign = static_cast<uint32_t>(code >> 7) << 31;
    const uint32_t exponent = (code >> 3) & 15, mantissa = code & 7;
    float expected;
    if (exponent == 15 && mantissa == 7) {
      expected = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      expected = std::bit_cast<float>(sign | std::bit_cast<uint32_t>(static_cast<float>(mantissa) / 512.0f));
    } else {  // the fp32 with the same mantissa bits and the exponent rebiased from 7 to 127
      expected = std::bit_cast<float>(sign | (exponent + 120) << 23 | mantissa << 20);
    }
    ExpectSameFloat(values[code], expected, code);
  }
  EXPECT_EQ(values[0x38], 1.0f);
  EXPECT_EQ(values[0x7e], 448.0f);
  EXPECT_EQ(values[0xfe], -448.0f);
  EXPECT_EQ(values[0x01], 0.001953125f);  // 2^-9, the smallest subnormal
  EXPECT_EQ(values[0x08], 0.015625f);     // 2^-6, the smallest normal
  EXPECT_TRUE(std::isnan(values[0x7f]) && std::isnan(values[0xff]));
  EXPECT_TRUE(std::signbit(values[0x80]) && values[0x80] == 0.0f);
  EXPECT_EQ(values[0x78], 256.0f);  // no infinities: exponent 15 holds ordinary numbers
}

// f16 by its definition: (-1)^s * 2^(e-15) * 1.m, subnormals 2^-14 * 0.m, e = 31 infinity / NaN.
float HalfByDefinition(int code) {
  const int exponent = (code >> 10) & 31, mantissa = code & 1023;
  const float sign = (code & 0x8000) ? -1.0f : 1.0f;
  if (exponent == 31)
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  return sign * std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
}

TEST(SafetensorsConversion, EveryF8E5M2Code) {
  const std::vector<float> values = DecodeAllCodes<uint8_t>(TensorDtype::kF8E5M2);
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 2) & 31, mantissa = code & 3;
    const float sign = (code & 0x80) ? -1.0f : 1.0f;
    float expected;
    if (exponent == 31) {
      expected =
          mantissa == 0 ? sign * std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      expected = sign * std::ldexp(static_cast<float>(mantissa), -16);
    } else {
      expected = sign * std::ldexp(static_cast<float>(4 + mantissa), exponent - 17);
    }
    ExpectSameFloat(values[code], expected, code);
  }
  EXPECT_EQ(values[0x3c], 1.0f);
  EXPECT_EQ(values[0x7b], 57344.0f);
  EXPECT_EQ(values[0x7c], std::numeric_limits<float>::infinity());
  EXPECT_EQ(values[0x01], std::ldexp(1.0f, -16));
}

TEST(SafetensorsConversion, EveryF16Code) {
  const std::vector<float> values = DecodeAllCodes<uint16_t>(TensorDtype::kF16);
  for (int code = 0; code < 65536; ++code) ExpectSameFloat(values[code], HalfByDefinition(code), code);
  EXPECT_EQ(values[0x3c00], 1.0f);
  EXPECT_EQ(values[0x0001], 5.9604644775390625e-8f);  // 2^-24
  EXPECT_EQ(values[0x03ff], 6.0975551605224609e-5f);  // the largest subnormal
  EXPECT_EQ(values[0x0400], 6.103515625e-5f);         // 2^-14
  EXPECT_EQ(values[0x7bff], 65504.0f);
  EXPECT_EQ(values[0xfc00], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(values[0x7e00]) && std::isnan(values[0xfc01]));
  EXPECT_TRUE(std::signbit(values[0x8000]) && values[0x8000] == 0.0f);
}

TEST(SafetensorsConversion, EveryBf16Code) {
  const std::vector<float> values = DecodeAllCodes<uint16_t>(TensorDtype::kBf16);
  for (uint32_t code = 0; code < 65536; ++code)
    ASSERT_EQ(std::bit_cast<uint32_t>(values[code]), code << 16) << "code " << code;  // NaNs too
  EXPECT_EQ(values[0x3f80], 1.0f);
  EXPECT_EQ(values[0xc040], -3.0f);
}

uint16_t EncodeOne(float value, TensorDtype dtype) {
  std::vector<std::byte> bytes;
  EXPECT_TRUE(EncodeFloats(std::span(&value, 1), dtype, &bytes).ok());
  uint16_t code;
  std::memcpy(&code, bytes.data(), 2);
  return code;
}

// For every finite positive code c of a 16-bit format (decoded by `decode`, which gives code
// `infinity` the value where the exponent would continue past the largest finite one): c encodes to
// itself, the midpoint between c and c + 1 to whichever is even, anything nearer to its nearer
// one, and every case mirrored for negative values.
template <typename Decode>
void ExpectRoundToNearestEven(TensorDtype dtype, uint16_t infinity, Decode decode) {
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  for (uint32_t code = 0; code < infinity; ++code) {
    const double value = decode(code), next = decode(code + 1);
    const float midpoint = static_cast<float>((value + next) / 2);  // exact: fp32 has the bits
    const uint32_t even = (code & 1) ? code + 1 : code;
    const struct {
      float value;
      uint32_t expected;
    } cases[] = {{static_cast<float>(value), code},
                 {midpoint, even},
                 {std::nextafter(midpoint, 0.0f), code},
                 {std::nextafter(midpoint, kInfinity), code + 1}};
    for (const auto& c : cases) {
      ASSERT_EQ(EncodeOne(c.value, dtype), c.expected) << TensorDtypeName(dtype) << " " << c.value;
      ASSERT_EQ(EncodeOne(-c.value, dtype), c.expected | 0x8000u) << TensorDtypeName(dtype) << " " << -c.value;
    }
  }
  EXPECT_EQ(EncodeOne(kInfinity, dtype), infinity);
  EXPECT_EQ(EncodeOne(-kInfinity, dtype), infinity | 0x8000u);
  const uint16_t nan = EncodeOne(std::numeric_limits<float>::quiet_NaN(), dtype);
  EXPECT_EQ(nan & infinity, infinity);
  EXPECT_NE(nan & 0x7fffu & ~infinity, 0u) << "NaN must not become infinity";
  // A NaN whose payload lies only in the bits that the encoding drops.
  const uint16_t signaling = EncodeOne(std::bit_cast<float>(0x7f800001u), dtype);
  EXPECT_NE(signaling & 0x7fffu & ~infinity, 0u) << "NaN must not become infinity";
}

TEST(SafetensorsConversion, F16EncodingRoundsToNearestEven) {
  ExpectRoundToNearestEven(TensorDtype::kF16, 0x7c00, [](uint32_t code) {
    return code == 0x7c00 ? 65536.0 : HalfByDefinition(static_cast<int>(code));
  });
  EXPECT_EQ(EncodeOne(65519.0f, TensorDtype::kF16), 0x7bff);
  EXPECT_EQ(EncodeOne(65520.0f, TensorDtype::kF16), 0x7c00);
  EXPECT_EQ(EncodeOne(1e10f, TensorDtype::kF16), 0x7c00);
  EXPECT_EQ(EncodeOne(1e-10f, TensorDtype::kF16), 0x0000);
  EXPECT_EQ(EncodeOne(-1e-10f, TensorDtype::kF16), 0x8000);
}

TEST(SafetensorsConversion, Bf16EncodingRoundsToNearestEven) {
  ExpectRoundToNearestEven(TensorDtype::kBf16, 0x7f80, [](uint32_t code) {
    return code == 0x7f80 ? std::ldexp(1.0, 128) : static_cast<double>(std::bit_cast<float>(code << 16));
  });
  // The largest fp32 lies past the midpoint between the largest bf16 and 2^128.
  EXPECT_EQ(EncodeOne(std::numeric_limits<float>::max(), TensorDtype::kBf16), 0x7f80);
  EXPECT_EQ(EncodeOne(std::numeric_limits<float>::denorm_min(), TensorDtype::kBf16), 0x0000);
}

TEST(SafetensorsConversion, EncodeFloatsAppendsAndRefusesOtherDtypes) {
  std::vector<std::byte> out(3, std::byte{7});
  ASSERT_TRUE(EncodeFloats(std::vector<float>{1.0f, -2.0f}, TensorDtype::kF32, &out).ok());
  ASSERT_EQ(out.size(), 3u + 8u);
  EXPECT_EQ(out[0], std::byte{7});
  float second;
  std::memcpy(&second, out.data() + 7, 4);
  EXPECT_EQ(second, -2.0f);
  for (TensorDtype dtype : {TensorDtype::kF64, TensorDtype::kF8E4M3, TensorDtype::kI32, TensorDtype::kUnknown}) {
    const Status status = EncodeFloats(std::vector<float>{1.0f}, dtype, &out);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << TensorDtypeName(dtype);
    ExpectMentions(status.message(), {TensorDtypeName(dtype)});
  }
  EXPECT_EQ(out.size(), 11u);
}

// ---- Header errors ----

TEST(SafetensorsHeader, FileShorterThanTheLength) {
  const std::vector<std::byte> file(5);
  ExpectMentions(ParseError(file, "short.safetensors"), {"short.safetensors: 5 bytes, too short"});
  ExpectMentions(ParseError({}), {"0 bytes"});
}

TEST(SafetensorsHeader, LengthPastTheEnd) {
  ExpectMentions(ParseError(FileWithLength(100, "{}")), {"bad.safetensors", "header length 100 runs past the end"});
  ExpectMentions(ParseError(FileWithLength(~uint64_t{0}, "{}")), {"over the limit of 100000000 bytes"});
  ExpectMentions(ParseError(FileWithLength(100'000'001, "{}")), {"header length 100000001 is over the limit"});
}

TEST(SafetensorsHeader, NotJson) {
  ExpectMentions(ParseError(FileOf(R"({"x": {"dtype": )", 0)), {"bad.safetensors: header: not valid JSON"});
  ExpectMentions(ParseError(FileOf("{} trailing", 0)), {"not valid JSON"});
  ExpectMentions(ParseError(FileOf("{\"\xff\": 1}", 0)), {"not valid JSON"});  // not UTF-8
  ExpectMentions(ParseError(FileOf("", 0)), {"not valid JSON"});
}

TEST(SafetensorsHeader, NotAnObject) {
  ExpectMentions(ParseError(FileOf("[1, 2]", 0)), {"header is a JSON array, expected an object"});
  ExpectMentions(ParseError(FileOf("7", 0)), {"header is a JSON number"});
}

TEST(SafetensorsHeader, DuplicateKeys) {
  const std::string tensor = R"({"dtype": "U8", "shape": [4], "data_offsets": [0, 4]})";
  ExpectMentions(ParseError(FileOf("{\"a\": " + tensor + ", \"a\": " + tensor + "}", 4)), {"key \"a\" appears twice"});
  ExpectMentions(
      ParseError(FileOf(OneTensor(R"("dtype": "U8", "dtype": "I8", "shape": [4], "data_offsets": [0, 4])"), 4)),
      {"key \"dtype\" appears twice"});
}

TEST(SafetensorsHeader, TensorNotAnObjectOrFieldMissing) {
  ExpectMentions(ParseError(FileOf(R"({"x": [1]})", 0)), {"tensor \"x\": is an array, expected an object"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "F32", "shape": [1])"), 4)),
                 {"tensor \"x\": no \"data_offsets\""});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("shape": [1], "data_offsets": [0, 4])"), 4)),
                 {"tensor \"x\": no \"dtype\""});
}

TEST(SafetensorsHeader, DtypeNotAString) {
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": 5, "shape": [1], "data_offsets": [0, 4])"), 4)),
                 {"tensor \"x\": \"dtype\" is a number, expected a string"});
}

TEST(SafetensorsHeader, ShapeNotNonNegativeIntegers) {
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [2, -1], "data_offsets": [0, 2])"), 2)),
                 {"tensor \"x\": shape[1] is -1, expected a non-negative integer"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [2.5], "data_offsets": [0, 2])"), 2)),
                 {"tensor \"x\": shape[0] is 2.5"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": ["2"], "data_offsets": [0, 2])"), 2)),
                 {"tensor \"x\": shape[0] is a string"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": 2, "data_offsets": [0, 2])"), 2)),
                 {"tensor \"x\": \"shape\" is a number, expected an array"});
  auto negative_zero = SafetensorsFile::Parse(
      FileOf(OneTensor(R"("dtype": "U8", "shape": [-0, 2], "data_offsets": [-0, 0])"), 0), "negative zero");
  EXPECT_TRUE(negative_zero.ok()) << negative_zero.status().ToString();
  ExpectMentions(
      ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 2])"), 2)),
      {"shape[0] is 9223372036854775808, expected a non-negative integer below 2^63"});
}

TEST(SafetensorsHeader, ShapeOverflow) {
  ExpectMentions(ParseError(FileOf(
                     OneTensor(R"("dtype": "U8", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0])"), 0)),
                 {"tensor \"x\": shape [4294967296, 4294967296, 0] has more than 2^63 elements"});
  // The elements fit, their bytes do not.
  ExpectMentions(
      ParseError(FileOf(OneTensor(R"("dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 4])"), 4)),
      {"tensor \"x\": data_offsets [0, 4] hold 4 bytes but shape [4611686018427387904] of F32 needs more than 2^63"});
}

TEST(SafetensorsHeader, OffsetsNotTwoNumbers) {
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [2], "data_offsets": [0])"), 2)),
                 {"tensor \"x\": data_offsets must hold two numbers [begin, end], not 1"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [2], "data_offsets": [0, 2, 4])"), 2)),
                 {"not 3"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [2], "data_offsets": [-1, 2])"), 2)),
                 {"tensor \"x\": data_offsets[0] is -1"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [2], "data_offsets": {"a": 1})"), 2)),
                 {"tensor \"x\": \"data_offsets\" is an object, expected an array"});
}

TEST(SafetensorsHeader, BeginAfterEnd) {
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [0], "data_offsets": [4, 2])"), 4)),
                 {"tensor \"x\": data_offsets [4, 2] begin after their end"});
}

TEST(SafetensorsHeader, EndPastTheData) {
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "U8", "shape": [8], "data_offsets": [0, 8])"), 6)),
                 {"tensor \"x\": data_offsets [0, 8] end past the data section's 6 bytes"});
}

TEST(SafetensorsHeader, ByteCountDoesNotMatchTheShape) {
  const std::string header = R"({"x.weight": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 12]}})";
  EXPECT_EQ(ParseError(FileOf(header, 12), "model-00001.safetensors"),
            "model-00001.safetensors: tensor \"x.weight\": data_offsets [0, 12] hold 12 bytes but shape [2, 4] of "
            "BF16 needs 16");
}

TEST(SafetensorsHeader, OverlappingTensors) {
  ExpectMentions(ParseError(FileOf(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                   R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                   12)),
                 {"tensor \"b\": data_offsets [4, 12] overlap tensor \"a\" [0, 8]"});
  // Two names for the same bytes (tied weights) are refused, as the reference implementation does.
  ExpectMentions(ParseError(FileOf(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                   R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                                   8)),
                 {"tensor \"b\": data_offsets [0, 8] overlap tensor \"a\" [0, 8]"});
  // An empty tensor inside another one's bytes.
  ExpectMentions(ParseError(FileOf(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                   R"( "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
                                   8)),
                 {"tensor \"e\": data_offsets [4, 4] overlap tensor \"a\""});
}

TEST(SafetensorsHeader, HoleBetweenOrAfterTensors) {
  ExpectMentions(ParseError(FileOf(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                                   R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                                   12)),
                 {"tensor \"b\": data_offsets [8, 12] leave bytes [4, 8) of the data section to no tensor"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "F32", "shape": [1], "data_offsets": [4, 8])"), 8)),
                 {"tensor \"x\"", "bytes [0, 4)"});
  ExpectMentions(ParseError(FileOf(OneTensor(R"("dtype": "F32", "shape": [1], "data_offsets": [0, 4])"), 6)),
                 {"bytes [4, 6) at the end of the data section belong to no tensor"});
  ExpectMentions(ParseError(FileOf("{}", 1)), {"bytes [0, 1) at the end"});
}

TEST(SafetensorsHeader, EmptyTensorsAnywhereBetweenOthers) {
  auto parsed = SafetensorsFile::Parse(FileOf(R"({"e0": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},)"
                                              R"( "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                                              R"( "e4": {"dtype": "I64", "shape": [3, 0], "data_offsets": [4, 4]},)"
                                              R"( "f4": {"dtype": "BOOL", "shape": [0, 0], "data_offsets": [4, 4]}})",
                                              4),
                                       "empty");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  std::vector<std::string> order;
  for (const TensorInfo& tensor : (*parsed)->tensors()) order.push_back(tensor.name);
  EXPECT_EQ(order, std::vector<std::string>({"e0", "a", "e4", "f4"}));
  EXPECT_TRUE((*parsed)->ReadFloat(*(*parsed)->Find("e4"), 0, 3, 0, 0, nullptr).ok());
}

TEST(SafetensorsHeader, MetadataNotStrings) {
  ExpectMentions(ParseError(FileOf(R"({"__metadata__": {"format": "pt", "step": 5}})", 0)),
                 {"\"__metadata__\" entry \"step\" is a number, expected a string"});
  ExpectMentions(ParseError(FileOf(R"({"__metadata__": ["pt"]})", 0)),
                 {"\"__metadata__\" is an array, expected an object of strings"});
  auto parsed = SafetensorsFile::Parse(FileOf(R"({"__metadata__": {"format": "pt"}}        )", 0), "padded");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ((*parsed)->metadata().at("format"), "pt");
}

// ---- Writer and Open errors ----

TEST_F(SafetensorsTest, WriterRefusesBadTensorsAndLeavesNoFile) {
  const std::vector<float> two = {1, 2};
  const auto bytes = RawBytes(two);
  const struct {
    std::vector<TensorToWrite> tensors;
    std::string expected;
  } cases[] = {
      {{{"w", TensorDtype::kF32, {2}, bytes}, {"w", TensorDtype::kF32, {2}, bytes}},
       "tensor \"w\": the name appears twice"},
      {{{"__metadata__", TensorDtype::kF32, {2}, bytes}}, "tensor \"__metadata__\": the name is reserved"},
      {{{"w", TensorDtype::kF32, {3}, bytes}}, "tensor \"w\": 8 bytes given, but shape [3] of F32 needs 12"},
      {{{"w", TensorDtype::kUnknown, {2}, bytes}}, "tensor \"w\": unknown dtype"},
      {{{"w", TensorDtype::kF32, {-2, -1}, bytes}}, "tensor \"w\": shape [-2, -1] has a negative dimension"},
      {{{"w\xc3", TensorDtype::kF32, {2}, bytes}}, "the name is not valid UTF-8"},
  };
  const std::string path = Path("refused.safetensors");
  for (const auto& c : cases) {
    const Status status = WriteSafetensors(path, c.tensors);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.expected;
    ExpectMentions(status.message(), {path, c.expected});
    EXPECT_FALSE(fs::exists(path));
    EXPECT_FALSE(fs::exists(path + ".tmp"));
  }
  const Status metadata = WriteSafetensors(path, {}, {{"k", "\xff"}});
  ExpectMentions(metadata.message(), {"metadata entry \"k\" is not valid UTF-8"});
  const Status unwritable = WriteSafetensors(Path("no/such/folder/x.safetensors"), {});
  EXPECT_EQ(unwritable.code(), StatusCode::kIoError);
  ExpectMentions(unwritable.message(), {"x.safetensors: cannot create"});
}

TEST_F(SafetensorsTest, WriterReplacesAnExistingFile) {
  const std::vector<float> first = {1}, second = {2, 3};
  const auto first_bytes = RawBytes(first), second_bytes = RawBytes(second);
  const std::string path = Path("model.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, std::vector<TensorToWrite>{{"a", TensorDtype::kF32, {1}, first_bytes}}).ok());
  ASSERT_TRUE(WriteSafetensors(path, std::vector<TensorToWrite>{{"b", TensorDtype::kF32, {2}, second_bytes}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->Find("a"), nullptr);
  EXPECT_EQ(ReadAll(**file, *(*file)->Find("b")), second);
}

TEST_F(SafetensorsTest, OpenErrorsNameThePath) {
  const auto missing = SafetensorsFile::Open(Path("missing.safetensors"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  ExpectMentions(missing.status().message(), {"missing.safetensors: cannot open"});

  const auto folder = SafetensorsFile::Open(dir_.string());
  EXPECT_EQ(folder.status().code(), StatusCode::kIoError);
  ExpectMentions(folder.status().message(), {dir_.string() + ": not a regular file"});

  const std::string empty = Path("empty.safetensors");
  std::ofstream(empty).close();
  ExpectMentions(SafetensorsFile::Open(empty).status().message(), {empty + ": 0 bytes, too short"});

  const std::string truncated = Path("truncated.safetensors");
  const std::vector<float> values(16);
  const auto bytes = RawBytes(values);
  ASSERT_TRUE(WriteSafetensors(truncated, std::vector<TensorToWrite>{{"w", TensorDtype::kF32, {16}, bytes}}).ok());
  fs::resize_file(truncated, fs::file_size(truncated) - 4);
  ExpectMentions(SafetensorsFile::Open(truncated).status().message(),
                 {truncated + ": tensor \"w\": data_offsets [0, 64] end past the data section's 60 bytes"});
}

}  // namespace
}  // namespace epmoe
