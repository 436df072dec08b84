#include "epmoe/weight_format.h"

#include <fmt/format.h>

#include "epmoe/enum_names.h"

namespace epmoe {

namespace {
constexpr EnumNames<WeightFormat, 5> kWeightFormats("weight format", {{{WeightFormat::kFp32, "fp32"},
                                                                       {WeightFormat::kBf16, "bf16"},
                                                                       {WeightFormat::kInt8, "int8"},
                                                                       {WeightFormat::kNvfp4, "nvfp4"},
                                                                       {WeightFormat::kMxfp4, "mxfp4"}}});
}  // namespace

const char* WeightFormatName(WeightFormat format) {
  return kWeightFormats.Name(format);
}
std::vector<WeightFormat> AllWeightFormats() {
  return kWeightFormats.All();
}
Result<WeightFormat> ParseWeightFormat(std::string_view name) {
  return kWeightFormats.Parse(name);
}

int BlockSize(WeightFormat format) {
  switch (format) {
    case WeightFormat::kNvfp4: return 16;
    case WeightFormat::kMxfp4: return 32;
    default: return 1;
  }
}

Status CheckShape(WeightFormat format, int64_t out_features, int64_t in_features) {
  if (out_features <= 0 || in_features <= 0)
    return InvalidArgument(fmt::format("matrix shape {}x{} must be positive", out_features, in_features));
  const int block = BlockSize(format);
  if (in_features % block != 0)
    return InvalidArgument(fmt::format("{} stores blocks of {} weights along the input dimension; {} is not a multiple",
                                       WeightFormatName(format), block, in_features));
  return Status::Ok();
}

int64_t ByteCount(WeightFormat format, int64_t out_features, int64_t in_features) {
  const int64_t weights = out_features * in_features;
  switch (format) {
    case WeightFormat::kFp32: return weights * 4;
    case WeightFormat::kBf16: return weights * 2;
    case WeightFormat::kInt8: return weights + out_features * static_cast<int64_t>(sizeof(float));
    case WeightFormat::kNvfp4:
      return weights / 16 * static_cast<int64_t>(sizeof(BlockNvfp4)) + static_cast<int64_t>(sizeof(float));
    case WeightFormat::kMxfp4: return weights / 32 * static_cast<int64_t>(sizeof(BlockMxfp4));
  }
  return 0;
}

int64_t ExpertByteCount(WeightFormat format, int64_t hidden, int64_t intermediate) {
  return 2 * ByteCount(format, intermediate, hidden) + ByteCount(format, hidden, intermediate);
}

}  // namespace epmoe
