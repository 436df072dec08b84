// Reading load matrices: NumPy .npy, JSON and CSV (see epmoe/load_matrix.h).
#include <fmt/format.h>

#include <charconv>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "epmoe/load_matrix.h"

namespace epmoe {
namespace {

constexpr std::string_view kNpyMagic = "\x93NUMPY";

// A load matrix from values and 1 to 3 dimensions (see ReadLoadMatrix for their meaning).
Result<LoadMatrix> FromShape(const std::vector<int64_t>& shape, std::vector<double> values, const std::string& source) {
  if (shape.empty() || shape.size() > 3)
    return InvalidArgument(fmt::format("{}: a load matrix has 1 to 3 dimensions ([step][layer][expert]), this one {}",
                                       source, shape.size()));
  std::vector<int64_t> full(3 - shape.size(), 1);
  full.insert(full.end(), shape.begin(), shape.end());
  constexpr int64_t kMaxDimension = int64_t{1} << 30;
  for (int64_t d : full)
    if (d < 1 || d > kMaxDimension)
      return InvalidArgument(
          fmt::format("{}: dimension {} of the load matrix: need 1 to {}", source, d, kMaxDimension));
  if (full[1] > INT32_MAX || full[2] > INT32_MAX)
    return InvalidArgument(fmt::format("{}: {} layers x {} experts is too large", source, full[1], full[2]));
  LoadMatrix load;
  load.num_steps = full[0];
  load.num_layers = static_cast<int>(full[1]);
  load.num_experts = static_cast<int>(full[2]);
  load.values = std::move(values);
  EPMOE_RETURN_IF_ERROR(ValidateLoadMatrix(load, source));
  return load;
}

// Walks a nested JSON array, appending numbers; every row of one depth must have the same length.
Status FlattenJson(const nlohmann::json& value, size_t depth, std::vector<int64_t>* shape, std::vector<double>* out,
                   const std::string& where) {
  if (value.is_number()) {
    if (depth != shape->size()) return InvalidArgument(fmt::format("{}: a number where an array was expected", where));
    out->push_back(value.get<double>());
    return Status::Ok();
  }
  if (!value.is_array())
    return InvalidArgument(fmt::format("{}: {} is not a number or an array", where, value.type_name()));
  if (value.empty()) return InvalidArgument(fmt::format("{}: empty array", where));
  if (depth == shape->size()) {
    if (!out->empty()) return InvalidArgument(fmt::format("{}: an array where a number was expected", where));
    shape->push_back(static_cast<int64_t>(value.size()));
  } else if ((*shape)[depth] != static_cast<int64_t>(value.size())) {
    return InvalidArgument(fmt::format("{}: {} values, the first row at this depth has {} (rows must be equal)", where,
                                       value.size(), (*shape)[depth]));
  }
  for (size_t i = 0; i < value.size(); ++i)
    EPMOE_RETURN_IF_ERROR(FlattenJson(value[i], depth + 1, shape, out, fmt::format("{}[{}]", where, i)));
  return Status::Ok();
}

struct NpyHeader {
  char kind = 0;  // 'f', 'i' or 'u'
  int item_bytes = 0;
  std::vector<int64_t> shape;
  size_t data_offset = 0;
};

// The value of `key` in NumPy's header dictionary, e.g. "'<f8'" or "(2, 12)".
std::string_view NpyField(std::string_view header, std::string_view key) {
  const size_t at = header.find(fmt::format("'{}':", key));
  if (at == std::string_view::npos) return {};
  std::string_view rest = header.substr(at + key.size() + 3);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  const size_t end = rest.front() == '(' ? rest.find(')') + 1 : rest.find_first_of(",}");
  return rest.substr(0, end);
}

Result<NpyHeader> ParseNpyHeader(std::string_view bytes, const std::string& source) {
  if (bytes.size() < 10) return InvalidArgument(fmt::format("{}: truncated .npy header", source));
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_bytes = 0, header_start = 0;
  if (major == 1) {
    header_bytes = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return InvalidArgument(fmt::format("{}: truncated .npy header", source));
    for (int i = 3; i >= 0; --i) header_bytes = header_bytes << 8 | static_cast<unsigned char>(bytes[8 + i]);
    header_start = 12;
  } else {
    return InvalidArgument(fmt::format("{}: .npy version {} (1, 2 and 3 are read)", source, major));
  }
  if (bytes.size() < header_start + header_bytes)
    return InvalidArgument(fmt::format("{}: truncated .npy header", source));
  const std::string_view header = bytes.substr(header_start, header_bytes);
  NpyHeader out;
  out.data_offset = header_start + header_bytes;
  std::string_view descr = NpyField(header, "descr");
  if (descr.size() != 5 || descr.front() != '\'' || descr.back() != '\'')
    return InvalidArgument(fmt::format("{}: .npy dtype {} (need a plain number type)", source, descr));
  const char order = descr[1];
  out.kind = descr[2];
  out.item_bytes = descr[3] - '0';
  const bool known = (out.kind == 'f' && (out.item_bytes == 2 || out.item_bytes == 4 || out.item_bytes == 8)) ||
                     ((out.kind == 'i' || out.kind == 'u') &&
                      (out.item_bytes == 1 || out.item_bytes == 2 || out.item_bytes == 4 || out.item_bytes == 8));
  if (!known || order == '>' || (order != '<' && !(order == '|' && out.item_bytes == 1)))
    return InvalidArgument(
        fmt::format("{}: .npy dtype {}: need little-endian float16/32/64 or (unsigned) integers", source, descr));
  if (NpyField(header, "fortran_order") != "False")
    return InvalidArgument(fmt::format("{}: .npy array in Fortran order: save it in C order", source));
  std::string_view shape = NpyField(header, "shape");
  if (shape.size() < 2) return InvalidArgument(fmt::format("{}: .npy header without a shape", source));
  shape = shape.substr(1, shape.size() - 2);
  while (!shape.empty()) {
    while (!shape.empty() && (shape.front() == ' ' || shape.front() == ',')) shape.remove_prefix(1);
    if (shape.empty()) break;
    int64_t d = 0;
    auto [end, error] = std::from_chars(shape.data(), shape.data() + shape.size(), d);
    if (error != std::errc()) return InvalidArgument(fmt::format("{}: bad .npy shape", source));
    out.shape.push_back(d);
    shape.remove_prefix(end - shape.data());
  }
  return out;
}

double HalfToDouble(uint16_t bits) {
  const int exponent = bits >> 10 & 0x1f;
  const int mantissa = bits & 0x3ff;
  const double sign = bits & 0x8000 ? -1.0 : 1.0;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  if (exponent == 31) return mantissa ? std::nan("") : sign * INFINITY;
  return sign * std::ldexp(mantissa + 1024, exponent - 25);
}

template <typename T>
double ReadAs(const char* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return static_cast<double>(value);
}

double NpyValue(const NpyHeader& h, const char* at) {
  if (h.kind == 'f') {
    if (h.item_bytes == 2) return HalfToDouble(static_cast<uint16_t>(ReadAs<uint16_t>(at)));
    return h.item_bytes == 4 ? ReadAs<float>(at) : ReadAs<double>(at);
  }
  if (h.kind == 'i') {
    switch (h.item_bytes) {
      case 1: return ReadAs<int8_t>(at);
      case 2: return ReadAs<int16_t>(at);
      case 4: return ReadAs<int32_t>(at);
      default: return ReadAs<int64_t>(at);
    }
  }
  switch (h.item_bytes) {
    case 1: return ReadAs<uint8_t>(at);
    case 2: return ReadAs<uint16_t>(at);
    case 4: return ReadAs<uint32_t>(at);
    default: return ReadAs<uint64_t>(at);
  }
}

Result<LoadMatrix> LoadMatrixFromNpy(std::string_view bytes, const std::string& source) {
  EPMOE_ASSIGN_OR_RETURN(NpyHeader header, ParseNpyHeader(bytes, source));
  int64_t count = 1;
  for (int64_t d : header.shape) {
    if (d < 1 || d > (int64_t{1} << 40) / count)
      return InvalidArgument(fmt::format("{}: .npy shape dimension {}: need 1 or more (and a sane total)", source, d));
    count *= d;
  }
  const size_t data_bytes = bytes.size() - header.data_offset;
  if (data_bytes != static_cast<size_t>(count) * header.item_bytes)
    return InvalidArgument(
        fmt::format("{}: .npy data holds {} bytes, its shape needs {}", source, data_bytes, count * header.item_bytes));
  std::vector<double> values(count);
  for (int64_t i = 0; i < count; ++i)
    values[i] = NpyValue(header, bytes.data() + header.data_offset + i * header.item_bytes);
  return FromShape(header.shape, std::move(values), source);
}

// One CSV line as numbers; false when a field is not a number.
bool ParseCsvNumbers(std::string_view line, std::vector<double>* out) {
  out->clear();
  while (true) {
    const size_t comma = line.find(',');
    std::string_view field = line.substr(0, comma);
    while (!field.empty() && (field.front() == ' ' || field.front() == '\t')) field.remove_prefix(1);
    while (!field.empty() && (field.back() == ' ' || field.back() == '\t')) field.remove_suffix(1);
    double value = 0;
    auto [end, error] = std::from_chars(field.data(), field.data() + field.size(), value);
    if (field.empty() || error != std::errc() || end != field.data() + field.size()) return false;
    out->push_back(value);
    if (comma == std::string_view::npos) return true;
    line.remove_prefix(comma + 1);
  }
}

Result<LoadMatrix> LoadMatrixFromCsv(const std::string& text, const std::string& source) {
  std::istringstream in(text);
  std::string line;
  std::vector<double> values, row;
  int64_t steps = 0, layers_in_step = 0, layers = 0, experts = 0, line_number = 0;
  bool header_allowed = true;
  while (std::getline(in, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) {
      if (layers_in_step > 0) {
        if (layers != 0 && layers_in_step != layers)
          return InvalidArgument(fmt::format("{}:{}: step {} has {} layers, the first step {}", source, line_number,
                                             steps, layers_in_step, layers));
        layers = layers_in_step, layers_in_step = 0, ++steps;
      }
      continue;
    }
    if (!ParseCsvNumbers(line, &row)) {
      if (header_allowed) {
        header_allowed = false;
        continue;
      }
      return InvalidArgument(fmt::format("{}:{}: not a comma-separated line of numbers", source, line_number));
    }
    header_allowed = false;
    if (experts != 0 && static_cast<int64_t>(row.size()) != experts)
      return InvalidArgument(fmt::format("{}:{}: {} values, the first line {} (one per expert)", source, line_number,
                                         row.size(), experts));
    experts = static_cast<int64_t>(row.size());
    values.insert(values.end(), row.begin(), row.end());
    ++layers_in_step;
  }
  if (layers_in_step > 0) {
    if (layers != 0 && layers_in_step != layers)
      return InvalidArgument(
          fmt::format("{}: the last step has {} layers, the first step {}", source, layers_in_step, layers));
    layers = layers_in_step, ++steps;
  }
  if (steps == 0) return InvalidArgument(fmt::format("{}: no numbers", source));
  return FromShape({steps, layers, experts}, std::move(values), source);
}

}  // namespace

Result<LoadMatrix> LoadMatrixFromJson(const std::string& json_text, const std::string& source) {
  nlohmann::json doc = nlohmann::json::parse(json_text, nullptr, false);
  if (doc.is_discarded()) return InvalidArgument(fmt::format("{}: not valid JSON", source));
  std::string where = source;
  if (doc.is_object()) {
    // DeepSeek's argument name, or SGLang's recorder field.
    const char* key = doc.contains("weight") ? "weight" : "logical_count";
    if (!doc.contains(key))
      return InvalidArgument(
          fmt::format("{}: a JSON object needs a \"weight\" or \"logical_count\" field (the load matrix)", source));
    doc = nlohmann::json(std::move(doc[key]));
    where += fmt::format(": {}", key);
  }
  std::vector<int64_t> shape;
  std::vector<double> values;
  EPMOE_RETURN_IF_ERROR(FlattenJson(doc, 0, &shape, &values, where));
  return FromShape(shape, std::move(values), source);
}

Result<LoadMatrix> ReadLoadMatrix(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("{}: cannot open", path));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return IoError(fmt::format("{}: read failed", path));
  if (std::string_view(bytes).starts_with(kNpyMagic)) return LoadMatrixFromNpy(bytes, path);
  const size_t first = bytes.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && (bytes[first] == '[' || bytes[first] == '{'))
    return LoadMatrixFromJson(bytes, path);
  return LoadMatrixFromCsv(bytes, path);
}

}  // namespace epmoe
