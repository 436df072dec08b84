// Safetensors reader and writer. See safetensors.h for the format and what is refused.
#include "epmoe/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <unordered_set>

#include "epmoe/atomic_file.h"
#include "epmoe/weight_format.h"

namespace epmoe {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors is little-endian; add byte swapping");

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit
constexpr std::string_view kMetadataKey = "__metadata__";

struct DtypeSpec {
  TensorDtype dtype;
  const char* name;
  int bytes;
};
constexpr DtypeSpec kDtypes[] = {
    {TensorDtype::kBool, "BOOL", 1},      {TensorDtype::kU8, "U8", 1},          {TensorDtype::kI8, "I8", 1},
    {TensorDtype::kF8E5M2, "F8_E5M2", 1}, {TensorDtype::kF8E4M3, "F8_E4M3", 1}, {TensorDtype::kI16, "I16", 2},
    {TensorDtype::kU16, "U16", 2},        {TensorDtype::kF16, "F16", 2},        {TensorDtype::kBf16, "BF16", 2},
    {TensorDtype::kI32, "I32", 4},        {TensorDtype::kU32, "U32", 4},        {TensorDtype::kF32, "F32", 4},
    {TensorDtype::kF64, "F64", 8},        {TensorDtype::kI64, "I64", 8},        {TensorDtype::kU64, "U64", 8},
};

const DtypeSpec* FindDtype(TensorDtype dtype) {
  for (const DtypeSpec& spec : kDtypes)
    if (spec.dtype == dtype) return &spec;
  return nullptr;
}

// The product of `dims`, or nullopt if one is negative or the product overflows int64 on the way
// (as the reference implementation counts: a later zero does not excuse an overflow).
std::optional<int64_t> ProductOf(std::span<const int64_t> dims) {
  int64_t product = 1;
  for (int64_t dim : dims)
    if (dim < 0 || __builtin_mul_overflow(product, dim, &product)) return std::nullopt;
  return product;
}

// elements * bytes per element of `shape` in `dtype` (known), or nullopt on overflow.
std::optional<int64_t> BytesOf(std::span<const int64_t> shape, TensorDtype dtype) {
  const std::optional<int64_t> elements = ProductOf(shape);
  int64_t bytes;
  if (!elements || __builtin_mul_overflow(*elements, int64_t{TensorDtypeBytes(dtype)}, &bytes)) return std::nullopt;
  return bytes;
}

// "[2, 4]"; a shape with many dimensions is cut short so that a hostile header cannot make the
// message huge.
std::string FormatShape(std::span<const int64_t> shape) {
  constexpr size_t kMaxShown = 16;
  if (shape.size() <= kMaxShown) return fmt::format("[{}]", fmt::join(shape, ", "));
  return fmt::format("[{}, ... ({} dimensions)]", fmt::join(shape.first(kMaxShown), ", "), shape.size());
}

// "an array", "a string": a JSON type name for a message.
std::string WithArticle(const char* type_name) {
  return fmt::format("{} {}", std::strchr("aeiou", type_name[0]) != nullptr ? "an" : "a", type_name);
}

// ---- Number formats ----

// Exact for every code: normals rebias the exponent, infinities and NaNs keep theirs at the top,
// subnormals are renormalized by one float subtraction (exact, and on normal fp32 numbers only, so
// it holds when a process flushes denormals). The cases are chosen with masks, not branches or
// ternaries, so that GCC vectorizes the loop over a block (over twice as fast).
float HalfToFloat(uint16_t half) {
  constexpr uint32_t kExponentMask = 0x7c00u << 13;
  const uint32_t shifted = (half & 0x7fffu) << 13;
  const uint32_t exponent = shifted & kExponentMask;
  const uint32_t if_infinity_or_nan = 0u - static_cast<uint32_t>(exponent == kExponentMask);
  const uint32_t if_subnormal = 0u - static_cast<uint32_t>(exponent == 0);
  const uint32_t rebiased = shifted + ((127 - 15) << 23) + (if_infinity_or_nan & ((128 - 16) << 23));
  // 2^-14 + mantissa * 2^-24, minus 2^-14.
  const uint32_t renormalized =
      std::bit_cast<uint32_t>(std::bit_cast<float>(rebiased + (1u << 23)) - std::bit_cast<float>(113u << 23));
  const uint32_t bits = (rebiased & ~if_subnormal) | (renormalized & if_subnormal);
  return std::bit_cast<float>(bits | (half & 0x8000u) << 16);
}

uint16_t FloatToHalf(float value) {
  const uint32_t all_bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (all_bits >> 16) & 0x8000u;
  uint32_t bits = all_bits & 0x7fffffffu;
  // From 2^16 on (past the largest f16, 65504, and every value that rounds down to it): infinity,
  // or a NaN for a NaN.
  if (bits >= 0x47800000u) return static_cast<uint16_t>(sign | (bits > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (bits < 0x38800000u) {
    // Below 2^-14: subnormal or zero. Adding 0.5 puts the value's f16 subnormal units (2^-24) in
    // the low mantissa bits of the sum, and the float addition rounds them to nearest even.
    const float sum = std::bit_cast<float>(bits) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(sum) - 0x3f000000u));
  }
  const uint32_t odd = (bits >> 13) & 1u;
  bits -= (127 - 15) << 23;
  // Round to nearest even; a carry into the exponent is correct, up to infinity.
  bits += 0xfffu + odd;
  return static_cast<uint16_t>(sign | (bits >> 13));
}

// OCP F8 E4M3FN: bias 7, no infinities, S.1111.111 is NaN, largest finite 448.
const std::array<float, 256>& E4M3Values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table;
    for (int code = 0; code < 256; ++code) {
      const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
      float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                      : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
      if ((code & 0x7f) == 0x7f) magnitude = std::numeric_limits<float>::quiet_NaN();
      table[code] = (code & 0x80) ? -magnitude : magnitude;
    }
    return table;
  }();
  return values;
}

// F8 E5M2 is the top byte of an f16.
const std::array<float, 256>& E5M2Values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table;
    for (int code = 0; code < 256; ++code) table[code] = HalfToFloat(static_cast<uint16_t>(code << 8));
    return table;
  }();
  return values;
}

// Where ReadFloat writes a block: `rows` x `cols` values from `first`, rows `stride` bytes apart,
// converted into `out` (row-major).
struct Block {
  const std::byte* first;
  int64_t stride, rows, cols;
  float* out;
};

// Safetensors offsets need not be aligned for the dtype, so every value is loaded with memcpy.
template <typename Source, typename Convert>
void ConvertBlock(const Block& block, Convert convert) {
  for (int64_t r = 0; r < block.rows; ++r) {
    const std::byte* row = block.first + r * block.stride;
    float* out_row = block.out + r * block.cols;
    for (int64_t c = 0; c < block.cols; ++c) {
      Source value;
      std::memcpy(&value, row + c * static_cast<int64_t>(sizeof(Source)), sizeof(Source));
      out_row[c] = convert(value);
    }
  }
}

template <typename Encoded, typename Encode>
void AppendEncoded(std::span<const float> values, Encode encode, std::vector<std::byte>* out) {
  const size_t start = out->size();
  out->resize(start + values.size() * sizeof(Encoded));
  for (size_t i = 0; i < values.size(); ++i) {
    const Encoded encoded = encode(values[i]);
    std::memcpy(out->data() + start + i * sizeof(Encoded), &encoded, sizeof(Encoded));
  }
}

// ---- Header ----

// A SAX pass over the header before it is built as a DOM: it explains syntax errors (the DOM parse
// without exceptions only says that it failed) and refuses duplicate keys, which nlohmann::json
// would silently resolve to the last one; a name that appears twice would make the file ambiguous.
class HeaderScan final : public nlohmann::json_sax<json> {
 public:
  const std::string& error() const { return error_; }

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_per_open_object_.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    if (keys_per_open_object_.back().insert(key).second) return true;
    error_ = fmt::format("key \"{}\" appears twice in the same object", key);
    return false;
  }
  bool end_object() override {
    keys_per_open_object_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& error) override {
    // what() is "[json.exception.parse_error.101] parse error at ...": the id is noise here.
    std::string_view message = error.what();
    if (const size_t id_end = message.find("] "); id_end != std::string_view::npos) message.remove_prefix(id_end + 2);
    constexpr size_t kMaxShown = 300;  // the message quotes the last token, which may be long
    error_ = fmt::format("not valid JSON: {}", message.substr(0, kMaxShown));
    return false;
  }

 private:
  std::vector<std::unordered_set<std::string>> keys_per_open_object_;
  std::string error_;
};

// Checks the header's fields; errors are IoError("<source>: ..."), since the file is corrupt.
class HeaderChecker {
 public:
  HeaderChecker(const std::string& source, int64_t data_bytes) : source_(source), data_bytes_(data_bytes) {}

  Status Corrupt(const std::string& message) const { return IoError(fmt::format("{}: {}", source_, message)); }
  Status CorruptTensor(const std::string& name, const std::string& message) const {
    return Corrupt(fmt::format("tensor \"{}\": {}", name, message));
  }

  Result<std::map<std::string, std::string>> Metadata(const json& value) const {
    if (!value.is_object())
      return Corrupt(
          fmt::format("\"{}\" is {}, expected an object of strings", kMetadataKey, WithArticle(value.type_name())));
    std::map<std::string, std::string> metadata;
    for (const auto& [key, entry] : value.items()) {
      if (!entry.is_string())
        return Corrupt(fmt::format("\"{}\" entry \"{}\" is {}, expected a string", kMetadataKey, key,
                                   WithArticle(entry.type_name())));
      metadata.emplace(key, entry.get<std::string>());
    }
    return metadata;
  }

  Result<TensorInfo> Tensor(const std::string& name, const json& value) const {
    if (!value.is_object())
      return CorruptTensor(name, fmt::format("is {}, expected an object with dtype, shape and data_offsets",
                                             WithArticle(value.type_name())));
    TensorInfo tensor;
    tensor.name = name;
    EPMOE_ASSIGN_OR_RETURN(const json* dtype, Field(name, value, "dtype", json::value_t::string));
    tensor.dtype_name = dtype->get<std::string>();
    tensor.dtype = TensorDtypeFromName(tensor.dtype_name);

    EPMOE_ASSIGN_OR_RETURN(const json* shape, Field(name, value, "shape", json::value_t::array));
    for (size_t i = 0; i < shape->size(); ++i) {
      EPMOE_ASSIGN_OR_RETURN(int64_t dim, NonNegative(name, (*shape)[i], fmt::format("shape[{}]", i)));
      tensor.shape.push_back(dim);
    }
    if (!ProductOf(tensor.shape))
      return CorruptTensor(name, fmt::format("shape {} has more than 2^63 elements", FormatShape(tensor.shape)));

    EPMOE_ASSIGN_OR_RETURN(const json* offsets, Field(name, value, "data_offsets", json::value_t::array));
    if (offsets->size() != 2)
      return CorruptTensor(name,
                           fmt::format("data_offsets must hold two numbers [begin, end], not {}", offsets->size()));
    EPMOE_ASSIGN_OR_RETURN(const int64_t begin, NonNegative(name, (*offsets)[0], "data_offsets[0]"));
    EPMOE_ASSIGN_OR_RETURN(const int64_t end, NonNegative(name, (*offsets)[1], "data_offsets[1]"));
    if (begin > end) return CorruptTensor(name, fmt::format("data_offsets [{}, {}] begin after their end", begin, end));
    if (end > data_bytes_)
      return CorruptTensor(
          name, fmt::format("data_offsets [{}, {}] end past the data section's {} bytes", begin, end, data_bytes_));
    tensor.offset = begin;
    tensor.bytes = end - begin;

    if (tensor.dtype != TensorDtype::kUnknown) {
      const std::optional<int64_t> needed = BytesOf(tensor.shape, tensor.dtype);
      if (needed != tensor.bytes)
        return CorruptTensor(name, fmt::format("data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}", begin,
                                               end, tensor.bytes, FormatShape(tensor.shape), tensor.dtype_name,
                                               needed ? fmt::format("{}", *needed) : "more than 2^63"));
    }
    return tensor;
  }

  // Every byte of the data section belongs to exactly one tensor (empty tensors own none).
  // `tensors` is sorted by offset and size.
  Status Coverage(const std::vector<TensorInfo>& tensors) const {
    int64_t covered = 0;
    const TensorInfo* previous = nullptr;
    for (const TensorInfo& tensor : tensors) {
      if (tensor.offset < covered)
        return CorruptTensor(tensor.name, fmt::format("data_offsets [{}, {}] overlap tensor \"{}\" [{}, {}]",
                                                      tensor.offset, tensor.offset + tensor.bytes, previous->name,
                                                      previous->offset, previous->offset + previous->bytes));
      if (tensor.offset > covered)
        return CorruptTensor(tensor.name,
                             fmt::format("data_offsets [{}, {}] leave bytes [{}, {}) of the data section to no tensor",
                                         tensor.offset, tensor.offset + tensor.bytes, covered, tensor.offset));
      covered = tensor.offset + tensor.bytes;
      previous = &tensor;
    }
    if (covered != data_bytes_)
      return Corrupt(
          fmt::format("bytes [{}, {}) at the end of the data section belong to no tensor", covered, data_bytes_));
    return Status::Ok();
  }

 private:
  Result<const json*> Field(const std::string& name, const json& tensor, const char* field, json::value_t type) const {
    const auto it = tensor.find(field);
    if (it == tensor.end()) return CorruptTensor(name, fmt::format("no \"{}\"", field));
    if (it->type() != type)
      return CorruptTensor(name, fmt::format("\"{}\" is {}, expected {}", field, WithArticle(it->type_name()),
                                             WithArticle(json(type).type_name())));
    return &*it;
  }

  Result<int64_t> NonNegative(const std::string& name, const json& value, const std::string& field) const {
    // nlohmann::json keeps non-negative integers unsigned, except "-0", which is signed.
    if (value.is_number_integer() &&
        (value.is_number_unsigned() ? value.get<uint64_t>() <= INT64_MAX : value.get<int64_t>() >= 0))
      return value.get<int64_t>();
    return CorruptTensor(name, fmt::format("{} is {}, expected a non-negative integer below 2^63", field,
                                           value.is_number() ? value.dump() : WithArticle(value.type_name())));
  }

  const std::string& source_;
  const int64_t data_bytes_;
};

// Whether `text` is valid UTF-8, as JSON strings must be (nlohmann::json's dump validates it).
bool IsUtf8(const std::string& text) {
  try {
    (void)json(text).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

}  // namespace

const char* TensorDtypeName(TensorDtype dtype) {
  const DtypeSpec* spec = FindDtype(dtype);
  return spec ? spec->name : "unknown";
}

TensorDtype TensorDtypeFromName(std::string_view name) {
  for (const DtypeSpec& spec : kDtypes)
    if (name == spec.name) return spec.dtype;
  return TensorDtype::kUnknown;
}

int TensorDtypeBytes(TensorDtype dtype) {
  const DtypeSpec* spec = FindDtype(dtype);
  return spec ? spec->bytes : 0;
}

int64_t TensorInfo::elements() const {
  int64_t product = 1;
  for (int64_t dim : shape) product *= dim;
  return product;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Parse(std::span<const std::byte> file, std::string source) {
  if (file.size() < 8)
    return IoError(fmt::format("{}: {} bytes, too short for the 8-byte header length", source, file.size()));
  uint64_t header_bytes;
  std::memcpy(&header_bytes, file.data(), 8);
  if (header_bytes > kMaxHeaderBytes)
    return IoError(
        fmt::format("{}: header length {} is over the limit of {} bytes", source, header_bytes, kMaxHeaderBytes));
  if (header_bytes > file.size() - 8)
    return IoError(fmt::format("{}: header length {} runs past the end of the file ({} bytes after the length)", source,
                               header_bytes, file.size() - 8));
  const char* header_begin = reinterpret_cast<const char*>(file.data() + 8);
  const char* header_end = header_begin + header_bytes;

  HeaderScan scan;
  if (!json::sax_parse(header_begin, header_end, &scan))
    return IoError(fmt::format("{}: header: {}", source, scan.error()));
  const json header = json::parse(header_begin, header_end, nullptr, /*allow_exceptions=*/false);
  EPMOE_CHECK(!header.is_discarded());  // the scan accepted the same text
  if (!header.is_object())
    return IoError(fmt::format("{}: header is a JSON {}, expected an object", source, header.type_name()));

  auto parsed = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  parsed->data_ = file.data() + 8 + header_bytes;
  parsed->data_bytes_ = static_cast<int64_t>(file.size() - 8 - header_bytes);
  const HeaderChecker checker(source, parsed->data_bytes_);
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      EPMOE_ASSIGN_OR_RETURN(parsed->metadata_, checker.Metadata(value));
    } else {
      EPMOE_ASSIGN_OR_RETURN(TensorInfo tensor, checker.Tensor(key, value));
      parsed->tensors_.push_back(std::move(tensor));
    }
  }
  std::vector<TensorInfo>& tensors = parsed->tensors_;
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.offset, a.bytes, a.name) < std::tie(b.offset, b.bytes, b.name);
  });
  EPMOE_RETURN_IF_ERROR(checker.Coverage(tensors));

  parsed->by_name_.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) parsed->by_name_[i] = static_cast<int32_t>(i);
  std::sort(parsed->by_name_.begin(), parsed->by_name_.end(),
            [&](int32_t a, int32_t b) { return tensors[a].name < tensors[b].name; });
  parsed->source_ = std::move(source);
  return parsed;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    std::string message = fmt::format("{}: cannot open: {}", path, std::strerror(error));
    return error == ENOENT ? NotFound(std::move(message)) : IoError(std::move(message));
  }
  struct stat info;
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    return IoError(fmt::format("{}: not a regular file", path));
  }
  const size_t size = static_cast<size_t>(info.st_size);
  // mmap refuses a length of 0; an empty file is refused by Parse as too short.
  void* mapping = size > 0 ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  const int map_error = errno;
  ::close(fd);
  if (mapping == MAP_FAILED)
    return IoError(fmt::format("{}: cannot map {} bytes: {}", path, size, std::strerror(map_error)));
  auto file = Parse(std::span(static_cast<const std::byte*>(mapping), size), path);
  if (!file.ok()) {
    if (mapping != nullptr) ::munmap(mapping, size);
    return file.status();
  }
  (*file)->mapping_ = mapping;
  (*file)->mapping_bytes_ = size;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                   [&](int32_t index, std::string_view key) { return tensors_[index].name < key; });
  if (it == by_name_.end() || tensors_[*it].name != name) return nullptr;
  return &tensors_[*it];
}

std::span<const std::byte> SafetensorsFile::Data(const TensorInfo& tensor) const {
  EPMOE_CHECK_MSG(tensor.offset >= 0 && tensor.bytes >= 0 && tensor.offset <= data_bytes_ - tensor.bytes,
                  fmt::format("tensor \"{}\" is not within {}'s data section", tensor.name, source_));
  return {data_ + tensor.offset, static_cast<size_t>(tensor.bytes)};
}

Status SafetensorsFile::ReadFloat(const TensorInfo& tensor, int64_t row_begin, int64_t row_count, int64_t col_begin,
                                  int64_t col_count, float* out) const {
  const std::span<const std::byte> data = Data(tensor);
  const auto described = [&] {
    return fmt::format("{}: tensor \"{}\" ({} {})", source_, tensor.name, tensor.dtype_name, FormatShape(tensor.shape));
  };
  if (tensor.dtype == TensorDtype::kBool || TensorDtypeBytes(tensor.dtype) == 0)
    return InvalidArgument(fmt::format("{}: cannot be read as floats", described()));
  const std::span<const int64_t> shape = tensor.shape;
  const std::optional<int64_t> rows = ProductOf(shape.empty() ? shape : shape.first(shape.size() - 1));
  const int64_t cols = shape.empty() ? 1 : shape.back();
  EPMOE_CHECK_MSG(rows && BytesOf(shape, tensor.dtype) == tensor.bytes,
                  fmt::format("{}: shape and dtype do not match its {} bytes", described(), tensor.bytes));
  if (row_begin < 0 || row_count < 0 || row_begin > *rows - row_count || col_begin < 0 || col_count < 0 ||
      col_begin > cols - col_count)
    return InvalidArgument(
        fmt::format("{}: block rows [{}, {} + {}) x columns [{}, {} + {}) is outside its {} x {} matrix", described(),
                    row_begin, row_begin, row_count, col_begin, col_begin, col_count, *rows, cols));

  const int64_t element_bytes = TensorDtypeBytes(tensor.dtype);
  const Block block{data.data() + (row_begin * cols + col_begin) * element_bytes, cols * element_bytes, row_count,
                    col_count, out};
  const auto cast = [](auto value) { return static_cast<float>(value); };
  switch (tensor.dtype) {
    case TensorDtype::kU8: ConvertBlock<uint8_t>(block, cast); break;
    case TensorDtype::kI8: ConvertBlock<int8_t>(block, cast); break;
    case TensorDtype::kU16: ConvertBlock<uint16_t>(block, cast); break;
    case TensorDtype::kI16: ConvertBlock<int16_t>(block, cast); break;
    case TensorDtype::kU32: ConvertBlock<uint32_t>(block, cast); break;
    case TensorDtype::kI32: ConvertBlock<int32_t>(block, cast); break;
    case TensorDtype::kU64: ConvertBlock<uint64_t>(block, cast); break;
    case TensorDtype::kI64: ConvertBlock<int64_t>(block, cast); break;
    case TensorDtype::kF32: ConvertBlock<float>(block, cast); break;
    case TensorDtype::kF64: ConvertBlock<double>(block, cast); break;
    // Lambdas, not function pointers, so that the conversion inlines into the loop and vectorizes.
    case TensorDtype::kF16: ConvertBlock<uint16_t>(block, [](uint16_t half) { return HalfToFloat(half); }); break;
    case TensorDtype::kBf16: ConvertBlock<uint16_t>(block, [](uint16_t bits) { return FloatFromBf16(bits); }); break;
    case TensorDtype::kF8E4M3: {
      const std::array<float, 256>& values = E4M3Values();
      ConvertBlock<uint8_t>(block, [&](uint8_t code) { return values[code]; });
      break;
    }
    case TensorDtype::kF8E5M2: {
      const std::array<float, 256>& values = E5M2Values();
      ConvertBlock<uint8_t>(block, [&](uint8_t code) { return values[code]; });
      break;
    }
    case TensorDtype::kBool:
    case TensorDtype::kUnknown: EPMOE_CHECK(false);  // refused above
  }
  return Status::Ok();
}

Status WriteSafetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                        const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps the metadata first and the tensors in the order they are written.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json& entries = header[std::string(kMetadataKey)];
    for (const auto& [key, value] : metadata) {
      if (!IsUtf8(key) || !IsUtf8(value))
        return InvalidArgument(fmt::format("{}: metadata entry \"{}\" is not valid UTF-8", path, key));
      entries[key] = value;
    }
  }
  std::unordered_set<std::string_view> names;
  int64_t offset = 0;
  for (const TensorToWrite& tensor : tensors) {
    const auto refuse = [&](const std::string& why) {
      return InvalidArgument(fmt::format("{}: tensor \"{}\": {}", path, tensor.name, why));
    };
    if (tensor.name == kMetadataKey) return refuse("the name is reserved for the header's metadata");
    if (!IsUtf8(tensor.name)) return refuse("the name is not valid UTF-8");
    if (!names.insert(tensor.name).second) return refuse("the name appears twice");
    if (TensorDtypeBytes(tensor.dtype) == 0) return refuse("unknown dtype");
    const std::optional<int64_t> bytes = BytesOf(tensor.shape, tensor.dtype);
    if (!bytes)
      return refuse(fmt::format("shape {} has a negative dimension or too many elements", FormatShape(tensor.shape)));
    if (static_cast<uint64_t>(*bytes) != tensor.bytes.size())
      return refuse(fmt::format("{} bytes given, but shape {} of {} needs {}", tensor.bytes.size(),
                                FormatShape(tensor.shape), TensorDtypeName(tensor.dtype), *bytes));
    header[tensor.name] = {
        {"dtype", TensorDtypeName(tensor.dtype)}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + *bytes}}};
    offset += *bytes;
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  if (text.size() > kMaxHeaderBytes)
    return InvalidArgument(fmt::format("{}: the header would take {} bytes, over the limit of {} bytes", path,
                                       text.size(), kMaxHeaderBytes));

  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(path));
  const uint64_t header_bytes = text.size();
  EPMOE_RETURN_IF_ERROR(file->Append(&header_bytes, 8));
  EPMOE_RETURN_IF_ERROR(file->Append(text));
  for (const TensorToWrite& tensor : tensors)
    EPMOE_RETURN_IF_ERROR(file->Append(tensor.bytes.data(), tensor.bytes.size()));
  return file->Commit();
}

Status EncodeFloats(std::span<const float> values, TensorDtype dtype, std::vector<std::byte>* out) {
  switch (dtype) {
    case TensorDtype::kF32:
      AppendEncoded<float>(
          values, [](float value) { return value; }, out);
      break;
    case TensorDtype::kBf16: AppendEncoded<uint16_t>(values, Bf16FromFloat, out); break;
    case TensorDtype::kF16: AppendEncoded<uint16_t>(values, FloatToHalf, out); break;
    default:
      return InvalidArgument(
          fmt::format("EncodeFloats: cannot encode as {} (only F32, BF16 and F16)", TensorDtypeName(dtype)));
  }
  return Status::Ok();
}

}  // namespace epmoe
