// Writes a small seed corpus for the safetensors fuzz target into <dir>/<target>/: safetensors
// files made with WriteSafetensors (every dtype, 0-D to 3-D and empty tensors, metadata).
// Usage: safetensors_fuzz_seeds OUT_DIR
#include <cstdio>
#include <filesystem>
#include <vector>

#include "epmoe/safetensors.h"

namespace fs = std::filesystem;
using epmoe::TensorDtype;
using epmoe::TensorToWrite;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: safetensors_fuzz_seeds OUT_DIR\n");
    return 2;
  }
  const fs::path out = fs::path(argv[1]) / "safetensors_file_fuzz";
  fs::create_directories(out);
  const auto write = [&](const char* name, const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata) {
    const epmoe::Status status = epmoe::WriteSafetensors((out / name).string(), tensors, metadata);
    if (!status.ok()) std::fprintf(stderr, "safetensors_fuzz_seeds: %s\n", status.ToString().c_str());
    return status.ok();
  };

  std::vector<float> values(24);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.375f * static_cast<float>(i) - 4.0f;
  std::vector<std::byte> f32, bf16, f16;
  if (!epmoe::EncodeFloats(values, TensorDtype::kF32, &f32).ok() ||
      !epmoe::EncodeFloats(values, TensorDtype::kBf16, &bf16).ok() ||
      !epmoe::EncodeFloats(values, TensorDtype::kF16, &f16).ok())
    return 1;
  const std::span<const std::byte> f32_bytes(f32), bf16_bytes(bf16), f16_bytes(f16);
  if (!write("floats.safetensors",
             {{"model.layers.0.mlp.experts.0.w1", TensorDtype::kBf16, {4, 6}, bf16_bytes},
              {"model.layers.0.mlp.gate", TensorDtype::kF32, {2, 3, 4}, f32_bytes},
              {"scalar", TensorDtype::kF16, {}, f16_bytes.first(2)},
              {"empty", TensorDtype::kF32, {0, 8}, {}},
              {"row", TensorDtype::kF16, {24}, f16_bytes}},
             {{"format", "pt"}}))
    return 1;

  // Every dtype, two elements each, so that the data offsets land unaligned for the wider ones.
  const std::vector<std::byte> raw(32, std::byte{0x3c});
  std::vector<TensorToWrite> every_dtype;
  for (int dtype = 0; dtype < static_cast<int>(TensorDtype::kUnknown); ++dtype) {
    const auto tensor_dtype = static_cast<TensorDtype>(dtype);
    every_dtype.push_back({epmoe::TensorDtypeName(tensor_dtype),
                           tensor_dtype,
                           {2},
                           std::span(raw).first(2 * static_cast<size_t>(epmoe::TensorDtypeBytes(tensor_dtype)))});
  }
  if (!write("every_dtype.safetensors", every_dtype, {})) return 1;
  if (!write("metadata_only.safetensors", {}, {{"step", "100"}, {"note", "no tensors"}})) return 1;
  return 0;
}
