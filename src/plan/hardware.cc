#include "epmoe/hardware.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "epmoe/config_file.h"

namespace epmoe::embedded {
extern const std::vector<std::pair<std::string_view, std::string_view>> kHardwareProfiles;
}

namespace epmoe {
namespace {

using nlohmann::json;

// Reads a number at the dotted `path` (e.g. "memory.bandwidth_gbs"); errors name source and field.
Status ReadNumber(const json& root, std::string_view source, const std::string& path, double* out) {
  const json* node = &root;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!node->is_object())
      return InvalidArgument(fmt::format("{}: field '{}' must be an object", source, path.substr(0, start - 1)));
    auto it = node->find(key);
    if (it == node->end()) return InvalidArgument(fmt::format("{}: missing field '{}'", source, path));
    node = &*it;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  if (!node->is_number())
    return InvalidArgument(fmt::format("{}: field '{}' must be a number, got {}", source, path, node->dump()));
  *out = node->get<double>();
  if (!std::isfinite(*out)) return InvalidArgument(fmt::format("{}: field '{}' is not finite", source, path));
  return Status::Ok();
}

Status ReadString(const json& root, std::string_view source, const char* key, std::string* out) {
  auto it = root.find(key);
  if (it == root.end()) return InvalidArgument(fmt::format("{}: missing field '{}'", source, key));
  if (!it->is_string())
    return InvalidArgument(fmt::format("{}: field '{}' must be a string, got {}", source, key, it->dump()));
  *out = it->get<std::string>();
  return Status::Ok();
}

Status Positive(std::string_view source, const char* field, double value) {
  if (value > 0) return Status::Ok();
  return InvalidArgument(fmt::format("{}: field '{}' must be positive, got {}", source, field, value));
}
Status NonNegative(std::string_view source, const char* field, double value) {
  if (value >= 0) return Status::Ok();
  return InvalidArgument(fmt::format("{}: field '{}' must not be negative, got {}", source, field, value));
}
Status Fraction(std::string_view source, const char* field, double value) {
  if (value > 0 && value <= 1) return Status::Ok();
  return InvalidArgument(fmt::format("{}: field '{}' must be in (0, 1], got {}", source, field, value));
}

Status ValidateLink(std::string_view source, const std::string& prefix, const LinkSpec& link) {
  EPMOE_RETURN_IF_ERROR(Positive(source, (prefix + ".bandwidth_gbs").c_str(), link.bandwidth_gbs));
  EPMOE_RETURN_IF_ERROR(Fraction(source, (prefix + ".efficiency").c_str(), link.efficiency));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, (prefix + ".latency_us").c_str(), link.latency_us));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, (prefix + ".exchange_latency_us").c_str(), link.exchange_latency_us));
  return NonNegative(source, (prefix + ".one_sided_efficiency").c_str(), link.one_sided_efficiency);
}

Status ReadLink(const json& j, std::string_view source, const std::string& prefix, LinkSpec* link) {
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, prefix + ".bandwidth_gbs", &link->bandwidth_gbs));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, prefix + ".efficiency", &link->efficiency));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, prefix + ".latency_us", &link->latency_us));
  if (const auto it = j.find(prefix); it != j.end() && it->is_object() && it->contains("one_sided_efficiency"))
    EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, prefix + ".one_sided_efficiency", &link->one_sided_efficiency));
  if (const auto it = j.find(prefix); it != j.end() && it->is_object() && it->contains("exchange_latency_us"))
    EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, prefix + ".exchange_latency_us", &link->exchange_latency_us));
  return Status::Ok();
}

Status CheckKnownKeys(const json& j, std::string_view source, const std::string& prefix,
                      std::initializer_list<const char*> known) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; }))
      return InvalidArgument(fmt::format("{}: unknown field '{}{}'", source, prefix, it.key()));
  }
  return Status::Ok();
}

}  // namespace

std::optional<KernelLine> HardwareProfile::LineFor(WeightFormat format) const {
  for (const auto& line : kernel_lines)
    if (line.format == format) return line;
  return std::nullopt;
}

double HardwareProfile::CopyBytesPerSecond() const {
  if (memory_copy_gbs > 0) return memory_copy_gbs * 1e9;
  return memory_bandwidth_gbs * 1e9 * memory_read_efficiency / 2;  // each byte read once and written once
}

int HardwareProfile::RanksPerDevice(int gpus) const {
  if (!ranks_share_device) return 1;
  return nodes_share_device ? gpus : std::min(gpus, gpus_per_node);
}

bool HardwareProfile::LanesOutnumberCores(int gpus, int lanes) const {
  return cores > 0 && static_cast<int64_t>(RanksPerDevice(gpus)) * lanes > cores;
}

double HardwareProfile::PeakTflopsFor(WeightFormat format) const {
  switch (format) {
    case WeightFormat::kFp32: return peak_tflops.fp32;
    case WeightFormat::kBf16: return peak_tflops.bf16;
    // The planner's 1-byte format stands for any 8-bit weights: GPU checkpoints use FP8, CPUs int8.
    case WeightFormat::kInt8: return std::max(peak_tflops.int8, peak_tflops.fp8);
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: return peak_tflops.fp4;
  }
  return peak_tflops.fp32;
}

Status ValidateHardware(const HardwareProfile& p, std::string_view source) {
  if (p.name.empty()) return InvalidArgument(fmt::format("{}: field 'name' must not be empty", source));
  if (p.sources.empty())
    return InvalidArgument(fmt::format("{}: field 'sources' must list where the numbers come from", source));
  EPMOE_RETURN_IF_ERROR(Positive(source, "gpus_per_node", p.gpus_per_node));
  EPMOE_RETURN_IF_ERROR(Positive(source, "memory.capacity_gb", p.memory_capacity_gb));
  EPMOE_RETURN_IF_ERROR(Positive(source, "memory.bandwidth_gbs", p.memory_bandwidth_gbs));
  EPMOE_RETURN_IF_ERROR(Fraction(source, "memory.read_efficiency", p.memory_read_efficiency));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, "memory.copy_gbs", p.memory_copy_gbs));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, "row_codec_ns", p.row_codec_ns));
  EPMOE_RETURN_IF_ERROR(Positive(source, "peak_tflops.fp32", p.peak_tflops.fp32));
  EPMOE_RETURN_IF_ERROR(Positive(source, "peak_tflops.bf16", p.peak_tflops.bf16));
  EPMOE_RETURN_IF_ERROR(Positive(source, "peak_tflops.int8", p.peak_tflops.int8));
  EPMOE_RETURN_IF_ERROR(Positive(source, "peak_tflops.fp8", p.peak_tflops.fp8));
  EPMOE_RETURN_IF_ERROR(Positive(source, "peak_tflops.fp4", p.peak_tflops.fp4));
  EPMOE_RETURN_IF_ERROR(Fraction(source, "arithmetic_efficiency", p.arithmetic_efficiency));
  EPMOE_RETURN_IF_ERROR(Fraction(source, "gemm_efficiency", p.gemm_efficiency));
  EPMOE_RETURN_IF_ERROR(NonNegative(source, "kernel_fixed_us", p.kernel_fixed_us));
  if (p.partial_sum_bytes != 2 && p.partial_sum_bytes != 4)
    return InvalidArgument(fmt::format("{}: field 'partial_sums' must be bf16 or fp32 (2 or 4 bytes), got {} bytes",
                                       source, p.partial_sum_bytes));
  EPMOE_RETURN_IF_ERROR(ValidateLink(source, "intra_node", p.intra_node));
  EPMOE_RETURN_IF_ERROR(ValidateLink(source, "inter_node", p.inter_node));
  for (size_t i = 0; i < p.kernel_lines.size(); ++i) {
    const std::string prefix = fmt::format("kernel_lines[{}]", i);
    EPMOE_RETURN_IF_ERROR(NonNegative(source, (prefix + ".fixed_us").c_str(), p.kernel_lines[i].fixed_us));
    EPMOE_RETURN_IF_ERROR(Positive(source, (prefix + ".us_per_gb").c_str(), p.kernel_lines[i].us_per_gb));
    EPMOE_RETURN_IF_ERROR(
        NonNegative(source, (prefix + ".sliced_extra_us").c_str(), p.kernel_lines[i].sliced_extra_us));
    for (size_t j = 0; j < i; ++j)
      if (p.kernel_lines[j].format == p.kernel_lines[i].format)
        return InvalidArgument(fmt::format("{}: field '{}.format': a second line for {}", source, prefix,
                                           WeightFormatName(p.kernel_lines[i].format)));
  }
  return Status::Ok();
}

Result<HardwareProfile> ParseHardware(std::string_view text, std::string_view source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    return InvalidArgument(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: expected a JSON object", source));
  EPMOE_RETURN_IF_ERROR(
      CheckKnownKeys(j, source, "",
                     {"name", "description", "sources", "gpus_per_node", "ranks_share_device", "nodes_share_device",
                      "cores", "row_codec_ns", "memory", "peak_tflops", "arithmetic_efficiency", "gemm_efficiency",
                      "kernel_fixed_us", "intra_node", "inter_node", "kernel_lines", "partial_sums"}));
  HardwareProfile p;
  EPMOE_RETURN_IF_ERROR(ReadString(j, source, "name", &p.name));
  EPMOE_RETURN_IF_ERROR(ReadString(j, source, "description", &p.description));
  auto sources = j.find("sources");
  if (sources == j.end()) return InvalidArgument(fmt::format("{}: missing field 'sources'", source));
  if (!sources->is_array())
    return InvalidArgument(fmt::format("{}: field 'sources' must be an array of strings", source));
  for (const auto& s : *sources) {
    if (!s.is_string()) return InvalidArgument(fmt::format("{}: field 'sources' must be an array of strings", source));
    p.sources.push_back(s.get<std::string>());
  }
  double gpus_per_node = 0;
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "gpus_per_node", &gpus_per_node));
  if (gpus_per_node != std::floor(gpus_per_node) || gpus_per_node > 1e6)
    return InvalidArgument(
        fmt::format("{}: field 'gpus_per_node' must be a whole number, got {}", source, gpus_per_node));
  p.gpus_per_node = static_cast<int>(gpus_per_node);
  auto share = j.find("ranks_share_device");
  if (share == j.end()) return InvalidArgument(fmt::format("{}: missing field 'ranks_share_device'", source));
  if (!share->is_boolean())
    return InvalidArgument(fmt::format("{}: field 'ranks_share_device' must be true or false", source));
  p.ranks_share_device = share->get<bool>();
  if (auto nodes = j.find("nodes_share_device"); nodes != j.end()) {
    if (!nodes->is_boolean())
      return InvalidArgument(fmt::format("{}: field 'nodes_share_device' must be true or false", source));
    p.nodes_share_device = nodes->get<bool>();
  }
  if (j.contains("cores")) {
    double cores = 0;
    EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "cores", &cores));
    if (cores != std::floor(cores) || cores < 1 || cores > 1 << 20)
      return InvalidArgument(
          fmt::format("{}: field 'cores' must be a whole number in 1..{}, got {}", source, 1 << 20, cores));
    p.cores = static_cast<int>(cores);
  }
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "memory.capacity_gb", &p.memory_capacity_gb));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "memory.bandwidth_gbs", &p.memory_bandwidth_gbs));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "memory.read_efficiency", &p.memory_read_efficiency));
  if (j["memory"].contains("copy_gbs"))
    EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "memory.copy_gbs", &p.memory_copy_gbs));
  if (j.contains("row_codec_ns")) EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "row_codec_ns", &p.row_codec_ns));
  EPMOE_RETURN_IF_ERROR(
      CheckKnownKeys(j["memory"], source, "memory.", {"capacity_gb", "bandwidth_gbs", "read_efficiency", "copy_gbs"}));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "peak_tflops.fp32", &p.peak_tflops.fp32));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "peak_tflops.bf16", &p.peak_tflops.bf16));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "peak_tflops.int8", &p.peak_tflops.int8));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "peak_tflops.fp8", &p.peak_tflops.fp8));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "peak_tflops.fp4", &p.peak_tflops.fp4));
  EPMOE_RETURN_IF_ERROR(
      CheckKnownKeys(j["peak_tflops"], source, "peak_tflops.", {"fp32", "bf16", "int8", "fp8", "fp4"}));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "arithmetic_efficiency", &p.arithmetic_efficiency));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "gemm_efficiency", &p.gemm_efficiency));
  EPMOE_RETURN_IF_ERROR(ReadNumber(j, source, "kernel_fixed_us", &p.kernel_fixed_us));
  if (auto partial = j.find("partial_sums"); partial != j.end()) {
    if (!partial->is_string() || (*partial != "bf16" && *partial != "fp32"))
      return InvalidArgument(
          fmt::format("{}: field 'partial_sums' must be \"bf16\" or \"fp32\", got {}", source, partial->dump()));
    p.partial_sum_bytes = *partial == "fp32" ? 4 : 2;
  }
  EPMOE_RETURN_IF_ERROR(ReadLink(j, source, "intra_node", &p.intra_node));
  EPMOE_RETURN_IF_ERROR(
      CheckKnownKeys(j["intra_node"], source, "intra_node.",
                     {"bandwidth_gbs", "efficiency", "latency_us", "one_sided_efficiency", "exchange_latency_us"}));
  EPMOE_RETURN_IF_ERROR(ReadLink(j, source, "inter_node", &p.inter_node));
  EPMOE_RETURN_IF_ERROR(
      CheckKnownKeys(j["inter_node"], source, "inter_node.",
                     {"bandwidth_gbs", "efficiency", "latency_us", "one_sided_efficiency", "exchange_latency_us"}));
  if (auto lines = j.find("kernel_lines"); lines != j.end()) {
    if (!lines->is_array()) return InvalidArgument(fmt::format("{}: field 'kernel_lines' must be an array", source));
    for (size_t i = 0; i < lines->size(); ++i) {
      const json& entry = (*lines)[i];
      const std::string prefix = fmt::format("kernel_lines[{}]", i);
      if (!entry.is_object()) return InvalidArgument(fmt::format("{}: field '{}' must be an object", source, prefix));
      EPMOE_RETURN_IF_ERROR(CheckKnownKeys(entry, source, prefix + ".",
                                           {"format", "fixed_us", "us_per_gb", "source", "sliced_extra_us"}));
      KernelLine line;
      std::string format_name;
      EPMOE_RETURN_IF_ERROR(ReadString(entry, fmt::format("{}: {}", source, prefix), "format", &format_name));
      auto format = ParseWeightFormat(format_name);
      if (!format.ok()) return format.status().WithContext(fmt::format("{}: field '{}.format'", source, prefix));
      line.format = *format;
      EPMOE_RETURN_IF_ERROR(ReadNumber(entry, fmt::format("{}: {}", source, prefix), "fixed_us", &line.fixed_us));
      EPMOE_RETURN_IF_ERROR(ReadNumber(entry, fmt::format("{}: {}", source, prefix), "us_per_gb", &line.us_per_gb));
      EPMOE_RETURN_IF_ERROR(ReadString(entry, fmt::format("{}: {}", source, prefix), "source", &line.source));
      if (entry.contains("sliced_extra_us"))
        EPMOE_RETURN_IF_ERROR(
            ReadNumber(entry, fmt::format("{}: {}", source, prefix), "sliced_extra_us", &line.sliced_extra_us));
      p.kernel_lines.push_back(line);
    }
  }
  EPMOE_RETURN_IF_ERROR(ValidateHardware(p, source));
  return p;
}

std::string HardwareToJson(const HardwareProfile& p) {
  auto link = [](const LinkSpec& l) {
    json out{{"bandwidth_gbs", l.bandwidth_gbs}, {"efficiency", l.efficiency}, {"latency_us", l.latency_us}};
    if (l.one_sided_efficiency > 0) out["one_sided_efficiency"] = l.one_sided_efficiency;
    if (l.exchange_latency_us > 0) out["exchange_latency_us"] = l.exchange_latency_us;
    return out;
  };
  json memory = {{"capacity_gb", p.memory_capacity_gb},
                 {"bandwidth_gbs", p.memory_bandwidth_gbs},
                 {"read_efficiency", p.memory_read_efficiency}};
  if (p.memory_copy_gbs > 0) memory["copy_gbs"] = p.memory_copy_gbs;
  json lines = json::array();
  for (const auto& l : p.kernel_lines)
    lines.push_back({{"format", WeightFormatName(l.format)},
                     {"fixed_us", l.fixed_us},
                     {"us_per_gb", l.us_per_gb},
                     {"sliced_extra_us", l.sliced_extra_us},
                     {"source", l.source}});
  json j = {{"name", p.name},
            {"description", p.description},
            {"sources", p.sources},
            {"gpus_per_node", p.gpus_per_node},
            {"ranks_share_device", p.ranks_share_device},
            {"memory", memory},
            {"peak_tflops",
             {{"fp32", p.peak_tflops.fp32},
              {"bf16", p.peak_tflops.bf16},
              {"int8", p.peak_tflops.int8},
              {"fp8", p.peak_tflops.fp8},
              {"fp4", p.peak_tflops.fp4}}},
            {"arithmetic_efficiency", p.arithmetic_efficiency},
            {"gemm_efficiency", p.gemm_efficiency},
            {"kernel_fixed_us", p.kernel_fixed_us},
            {"intra_node", link(p.intra_node)},
            {"inter_node", link(p.inter_node)}};
  if (!p.kernel_lines.empty()) j["kernel_lines"] = lines;
  if (p.partial_sum_bytes != 2) j["partial_sums"] = "fp32";
  if (p.nodes_share_device) j["nodes_share_device"] = true;
  if (p.cores > 0) j["cores"] = p.cores;
  if (p.row_codec_ns > 0) j["row_codec_ns"] = p.row_codec_ns;
  return j.dump(2);
}

std::vector<std::string> ListHardwareProfiles() {
  return BuiltinConfigNames(embedded::kHardwareProfiles);
}

Result<HardwareProfile> LoadHardware(std::string_view name_or_path) {
  EPMOE_ASSIGN_OR_RETURN(ConfigText config,
                         ReadConfig(name_or_path, embedded::kHardwareProfiles, "hardware profile", "hardware"));
  return ParseHardware(config.text, config.source);
}

}  // namespace epmoe
