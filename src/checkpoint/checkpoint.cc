#include "epmoe/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "epmoe/atomic_file.h"
#include "epmoe/enum_names.h"
#include "epmoe/quantize.h"
#include "epmoe/thread_pool.h"

namespace epmoe {

namespace fs = std::filesystem;

namespace {
constexpr EnumNames<CheckpointNaming, 3> kNamings("checkpoint naming",
                                                  {{{CheckpointNaming::kMlpExperts, "mlp.experts"},
                                                    {CheckpointNaming::kBlockSparseMoe, "block_sparse_moe"},
                                                    {CheckpointNaming::kGptOss, "gpt_oss"}}});
}  // namespace

const char* CheckpointNamingName(CheckpointNaming naming) {
  return kNamings.Name(naming);
}
Result<CheckpointNaming> ParseCheckpointNaming(std::string_view name) {
  return kNamings.Parse(name);
}

namespace {

constexpr const char* kIndexFile = "model.safetensors.index.json";

// An expert's three matrices, in ExpertWeights' order.
enum Projection { kGate = 0, kUp = 1, kDown = 2 };

// Names of the tensors of MoE layer `layer` (transformer layer layer + dense layers).
struct LayerNames {
  CheckpointNaming naming;
  std::string prefix;  // "model.layers.N."
  // Qwen2-MoE's one gated shared expert: mlp.shared_expert (singular) and mlp.shared_expert_gate.
  bool gated_shared = false;

  LayerNames(CheckpointNaming naming_in, const ModelConfig& model, int layer)
      : LayerNames(naming_in, layer + model.num_dense_layers, model.shared_output_gate) {}
  LayerNames(CheckpointNaming naming_in, int transformer_layer, bool gated_shared_in = false)
      : naming(naming_in), prefix(fmt::format("model.layers.{}.", transformer_layer)), gated_shared(gated_shared_in) {}

  std::string Router() const {
    switch (naming) {
      case CheckpointNaming::kMlpExperts: return prefix + "mlp.gate.weight";
      case CheckpointNaming::kBlockSparseMoe: return prefix + "block_sparse_moe.gate.weight";
      case CheckpointNaming::kGptOss: return prefix + "mlp.router.weight";
    }
    return "";
  }
  std::string CorrectionBias() const { return prefix + "mlp.gate.e_score_correction_bias"; }
  std::string RouterBias() const { return prefix + "mlp.router.bias"; }
  // gpt-oss: every expert's gate and up projections in one tensor (rows interleaved: gate, up,
  // gate, ...), and their down projections in another; `suffix` is "_blocks", "_scales", "_bias" or
  // "".
  std::string GateUp(const char* suffix) const { return fmt::format("{}mlp.experts.gate_up_proj{}", prefix, suffix); }
  std::string Down(const char* suffix) const { return fmt::format("{}mlp.experts.down_proj{}", prefix, suffix); }
  std::string Expert(int expert, Projection projection) const {
    static const char* const kMlp[] = {"gate_proj", "up_proj", "down_proj"};
    static const char* const kMixtral[] = {"w1", "w3", "w2"};
    if (naming == CheckpointNaming::kMlpExperts)
      return fmt::format("{}mlp.experts.{}.{}.weight", prefix, expert, kMlp[projection]);
    return fmt::format("{}block_sparse_moe.experts.{}.{}.weight", prefix, expert, kMixtral[projection]);
  }
  // The shared experts, as one MLP (kMlpExperts only).
  std::string Shared(Projection projection) const {
    static const char* const kMlp[] = {"gate_proj", "up_proj", "down_proj"};
    return fmt::format("{}mlp.{}.{}.weight", prefix, gated_shared ? "shared_expert" : "shared_experts",
                       kMlp[projection]);
  }
  std::string SharedOutputGate() const { return prefix + "mlp.shared_expert_gate.weight"; }
};

std::string ShapeText(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Columns [col_begin, + count) of a row of E2M1 codes (two a byte, low nibble first) into out, each
// its code's value times its block's scale (scales[c / block], block columns to a scale). Block by
// block, through a table of the block's 16 values: decoding each value's code and scale on its own
// made loading gpt-oss-20b's MXFP4 layers 2.9 x as slow as making synthetic ones.
void DecodeE2m1Row(const std::byte* codes, const float* scales, int64_t block, int64_t col_begin, int64_t count,
                   float* out) {
  const int64_t col_end = col_begin + count;
  for (int64_t block_begin = col_begin / block * block; block_begin < col_end; block_begin += block) {
    float values[16];
    for (int code = 0; code < 16; ++code)
      values[code] = DecodeE2m1(static_cast<uint8_t>(code)) * scales[block_begin / block];
    const int64_t begin = std::max(block_begin, col_begin), end = std::min(block_begin + block, col_end);
    for (int64_t c = begin; c < end; ++c) {
      const uint8_t byte = std::to_integer<uint8_t>(codes[c / 2]);
      out[c - col_begin] = values[c % 2 == 0 ? byte & 0xF : byte >> 4];
    }
  }
}

}  // namespace

namespace checkpoint_internal {

// A tensor found in one of the files; an 8-bit float weight also has its scales, one per block of
// block_rows x block_cols weights (a grid of grid_rows x grid_cols).
struct Located {
  const SafetensorsFile* file = nullptr;
  const TensorInfo* info = nullptr;
  const SafetensorsFile* scale_file = nullptr;
  const TensorInfo* scale = nullptr;
  int64_t grid_rows = 0, grid_cols = 0, block_rows = 0, block_cols = 0;
  // NVFP4 as NVIDIA's ModelOpt stores it: U8 [rows x cols / 2], two E2M1 values a byte (low nibble
  // first); `scale` is F8_E4M3 [rows x cols / 16] and global_scale the tensor's weight_scale_2.
  bool nvfp4 = false;
  float global_scale = 1.0f;
  // gpt-oss's MXFP4 blocks (CheckMxfp4) keep their `scale` here too: U8 [experts, rows, cols / 32]
  // E8M0 codes beside U8 [experts, rows, cols / 32, 16] codes, two E2M1 values a byte (low nibble
  // first); ReadMxfp4Row reads them.
};

// The mapped files of a checkpoint and its tensors by name; Open checks the ones a model needs.
struct Index {
  ModelConfig model;
  int num_layers = 0;
  CheckpointNaming naming = CheckpointNaming::kMlpExperts;
  std::string path;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  int64_t file_bytes = 0;
  std::unordered_map<std::string, Located> tensors;

  // Maps the files of `path` and indexes their tensors by name.
  Status Load();

  const Located* Find(const std::string& name) const {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : &it->second;
  }

  // "x.weight" -> "x": the prefix of a weight's scale tensors.
  static std::string Stem(const std::string& name) {
    return name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
  }
  // Whether weight `name` is NVFP4 as ModelOpt writes it: U8 codes with a weight_scale_2 beside.
  bool IsModelOptNvfp4(const std::string& name, const TensorInfo& info) const {
    return info.dtype == TensorDtype::kU8 && Find(Stem(name) + ".weight_scale_2") != nullptr;
  }

  // Tensor `name`, which the model's MoE layers need: refused when the checkpoint lacks it.
  Result<Located*> FindNeeded(const std::string& name) {
    auto it = tensors.find(name);
    if (it == tensors.end())
      return NotFound(fmt::format("{}: no tensor \"{}\" (needed by MoE layer weights of {})", path, name, model.name));
    return &it->second;
  }

  // Finds `name`, checks its shape and dtype, and finds an 8-bit weight's scales.
  Status Check(const std::string& name, const std::vector<int64_t>& shape) {
    EPMOE_ASSIGN_OR_RETURN(Located * found, FindNeeded(name));
    Located& t = *found;
    const std::string where = fmt::format("{}: tensor \"{}\"", t.file->source(), name);
    const std::string stem = Stem(name);
    if (IsModelOptNvfp4(name, *t.info)) return CheckNvfp4(stem, where, shape, &t);
    if (t.info->shape != shape)
      return InvalidArgument(
          fmt::format("{} has shape {}, {} needs {}", where, ShapeText(t.info->shape), model.name, ShapeText(shape)));
    switch (t.info->dtype) {
      case TensorDtype::kF32:
      case TensorDtype::kBf16:
      case TensorDtype::kF16: return Status::Ok();
      case TensorDtype::kF8E4M3:
      case TensorDtype::kF8E5M2:
        if (shape.size() != 2)
          return InvalidArgument(
              fmt::format("{} is {}: 8-bit floats are read only in matrices", where, t.info->dtype_name));
        return FindScales(name, stem, where, &t);
      default:
        return InvalidArgument(
            fmt::format("{} is {}: weights are read in F32, BF16, F16, 8-bit floats with scales or NVFP4 (U8 with "
                        "weight_scale and weight_scale_2), not other packed or integer formats",
                        where, t.info->dtype_name));
    }
  }

  // A ModelOpt NVFP4 weight of logical shape `shape`: its codes, block scales and tensor scale.
  Status CheckNvfp4(const std::string& stem, const std::string& where, const std::vector<int64_t>& shape, Located* t) {
    const Located* block = Find(stem + ".weight_scale");
    const Located* global = Find(stem + ".weight_scale_2");
    const bool matrix = shape.size() == 2 && shape[1] % 16 == 0;
    if (!matrix || t->info->shape != std::vector<int64_t>{shape[0], shape[1] / 2})
      return InvalidArgument(fmt::format("{} has shape {} (NVFP4: two values a byte), {} needs {}", where,
                                         ShapeText(t->info->shape), model.name, ShapeText(shape)));
    if (block == nullptr || block->info->dtype != TensorDtype::kF8E4M3 ||
        block->info->shape != std::vector<int64_t>{shape[0], shape[1] / 16})
      return InvalidArgument(fmt::format("{} is NVFP4 but its \"{}.weight_scale\" is not F8_E4M3 {}", where, stem,
                                         ShapeText({shape[0], shape[1] / 16})));
    const TensorDtype global_dtype = global->info->dtype;
    if (global->info->elements() != 1 ||
        (global_dtype != TensorDtype::kF32 && global_dtype != TensorDtype::kBf16 && global_dtype != TensorDtype::kF16))
      return InvalidArgument(fmt::format("{} is NVFP4 but its \"{}.weight_scale_2\" is not one float", where, stem));
    EPMOE_RETURN_IF_ERROR(global->file->ReadFloat(*global->info, 0, 1, 0, 1, &t->global_scale));
    t->nvfp4 = true;
    t->scale_file = block->file;
    t->scale = block->info;
    return Status::Ok();
  }

  // Rows [row_begin, + row_count) x columns [col_begin, + col_count) of a ModelOpt NVFP4 weight:
  // each value its E2M1 code times (its block's E4M3 scale times the tensor scale), in the order
  // epmoe's nvfp4 dequantizes, so that packing into nvfp4 again finds the same codes.
  Status ReadNvfp4(const Located& t, int64_t row_begin, int64_t row_count, int64_t col_begin, int64_t col_count,
                   float* out) const {
    const int64_t blocks = t.scale->shape[1];
    std::vector<float> scales(row_count * blocks);
    EPMOE_RETURN_IF_ERROR(t.scale_file->ReadFloat(*t.scale, row_begin, row_count, 0, blocks, scales.data()));
    for (float& scale : scales) scale *= t.global_scale;
    const std::span<const std::byte> codes = t.file->Data(*t.info);
    const int64_t row_bytes = t.info->shape[1];
    for (int64_t r = 0; r < row_count; ++r)
      DecodeE2m1Row(codes.data() + (row_begin + r) * row_bytes, scales.data() + r * blocks, 16, col_begin, col_count,
                    out + r * col_count);
    return Status::Ok();
  }

  // gpt-oss's MXFP4 tensor `stem`_blocks (with `stem`_scales) of logical shape [experts, rows,
  // cols].
  Status CheckMxfp4(const std::string& stem, int64_t experts, int64_t rows, int64_t cols) {
    const std::string blocks_name = stem + "_blocks", scales_name = stem + "_scales";
    EPMOE_ASSIGN_OR_RETURN(Located * found, FindNeeded(blocks_name));
    Located& t = *found;
    const std::string where = fmt::format("{}: tensor \"{}\"", t.file->source(), blocks_name);
    const std::vector<int64_t> shape = {experts, rows, cols / 32, 16};
    if (cols % 32 != 0 || t.info->dtype != TensorDtype::kU8 || t.info->shape != shape)
      return InvalidArgument(fmt::format("{} is {} {}; {} needs U8 {} (MXFP4: 16 bytes of two values per block of 32)",
                                         where, t.info->dtype_name, ShapeText(t.info->shape), model.name,
                                         ShapeText(shape)));
    const Located* scales = Find(scales_name);
    const std::vector<int64_t> scale_shape = {experts, rows, cols / 32};
    if (scales == nullptr || scales->info->dtype != TensorDtype::kU8 || scales->info->shape != scale_shape)
      return InvalidArgument(
          fmt::format("{} is MXFP4 but its \"{}\" is not U8 {}", where, scales_name, ShapeText(scale_shape)));
    t.scale_file = scales->file;
    t.scale = scales->info;
    return Status::Ok();
  }

  // Row `row` (of rows_per_expert) of expert `expert` of an MXFP4 tensor, columns [col_begin, +
  // count) into out: each value its E2M1 code times its block's 2^(code - 127).
  void ReadMxfp4Row(const Located& t, int64_t expert, int64_t row, int64_t col_begin, int64_t count, float* out) const {
    const int64_t rows = t.info->shape[1], blocks = t.info->shape[2];
    const int64_t at = expert * rows + row;
    const std::byte* codes = t.scale_file->Data(*t.scale).data() + at * blocks;
    std::vector<float> scales(blocks);
    for (int64_t b = 0; b < blocks; ++b) scales[b] = DecodeE8m0(std::to_integer<uint8_t>(codes[b]));
    DecodeE2m1Row(t.file->Data(*t.info).data() + at * blocks * 16, scales.data(), 32, col_begin, count, out);
  }

  Status FindScales(const std::string& name, const std::string& stem, const std::string& where, Located* t) {
    const Located* scale = Find(name + "_scale_inv");
    if (scale == nullptr) scale = Find(stem + ".weight_scale");
    if (scale == nullptr)
      return InvalidArgument(fmt::format("{} is {} but has no scales (\"{}_scale_inv\" or \"{}.weight_scale\")", where,
                                         t->info->dtype_name, name, stem));
    const std::vector<int64_t>& s = scale->info->shape;
    const int64_t rows = t->info->shape[0], cols = t->info->shape[1];
    // One scale for the tensor ([] or [1]), one per row ([rows]) or one per block of a 2-D grid.
    int64_t grid_rows = 1, grid_cols = 1;
    if (s.size() == 1 && s[0] != 1) {
      grid_rows = s[0] == rows ? rows : 0;
    } else if (s.size() == 2) {
      grid_rows = s[0];
      grid_cols = s[1];
    } else if (s.size() > 2) {
      grid_rows = 0;
    }
    const bool readable = scale->info->dtype == TensorDtype::kF32 || scale->info->dtype == TensorDtype::kBf16 ||
                          scale->info->dtype == TensorDtype::kF16;
    const int64_t block_rows = grid_rows > 0 ? (rows + grid_rows - 1) / grid_rows : 0;
    const int64_t block_cols = grid_cols > 0 ? (cols + grid_cols - 1) / grid_cols : 0;
    if (!readable || block_rows <= 0 || block_cols <= 0 || (rows + block_rows - 1) / block_rows != grid_rows ||
        (cols + block_cols - 1) / block_cols != grid_cols)
      return InvalidArgument(fmt::format("{}: its scales \"{}\" ({} {}) do not tile its shape {} into blocks", where,
                                         scale->info->name, scale->info->dtype_name, ShapeText(s),
                                         ShapeText(t->info->shape)));
    t->scale_file = scale->file;
    t->scale = scale->info;
    t->grid_rows = grid_rows;
    t->grid_cols = grid_cols;
    t->block_rows = block_rows;
    t->block_cols = block_cols;
    return Status::Ok();
  }

  // The block [row_begin, + row_count) x [col_begin, + col_count) of a checked tensor in fp32,
  // scaled when it is stored in 8-bit floats.
  Status Read(const std::string& name, int64_t row_begin, int64_t row_count, int64_t col_begin, int64_t col_count,
              float* out) const {
    const Located* t = Find(name);
    EPMOE_CHECK_MSG(t != nullptr, name);  // Open checked every tensor a layer reads
    if (t->nvfp4) return ReadNvfp4(*t, row_begin, row_count, col_begin, col_count, out);
    EPMOE_RETURN_IF_ERROR(t->file->ReadFloat(*t->info, row_begin, row_count, col_begin, col_count, out));
    if (t->scale == nullptr) return Status::Ok();
    // The scales in grid order: the scale tensor as ReadFloat views it (rows of its last dim).
    const std::vector<int64_t>& shape = t->scale->shape;
    const int64_t view_cols = shape.empty() ? 1 : shape.back(), view_rows = t->scale->elements() / view_cols;
    std::vector<float> grid(t->grid_rows * t->grid_cols);
    EPMOE_RETURN_IF_ERROR(t->scale_file->ReadFloat(*t->scale, 0, view_rows, 0, view_cols, grid.data()));
    for (int64_t r = 0; r < row_count; ++r) {
      const float* scales = grid.data() + (row_begin + r) / t->block_rows * t->grid_cols;
      float* row = out + r * col_count;
      for (int64_t c = 0; c < col_count; ++c) row[c] *= scales[(col_begin + c) / t->block_cols];
    }
    return Status::Ok();
  }

  // The slice [begin, end) of an expert whose gate and up rows start at row `first` of the
  // tensors `name` gives and whose down columns start at column `first`, into *w (reshaped).
  Status ReadExpert(const std::function<std::string(Projection)>& name, int64_t first, int64_t begin, int64_t end,
                    ExpertWeights* w) const {
    const int64_t hidden = model.hidden, width = end - begin;
    w->gate.Reshape(width, hidden);
    w->up.Reshape(width, hidden);
    w->down.Reshape(hidden, width);
    w->gate_bias.clear();
    w->up_bias.clear();
    w->down_bias.clear();
    EPMOE_RETURN_IF_ERROR(Read(name(kGate), first + begin, width, 0, hidden, w->gate.data.data()));
    EPMOE_RETURN_IF_ERROR(Read(name(kUp), first + begin, width, 0, hidden, w->up.data.data()));
    return Read(name(kDown), 0, hidden, first + begin, width, w->down.data.data());
  }

  // The slice [begin, end) of gpt-oss expert `expert` of a layer (GateUp rows 2i and 2i + 1 are
  // the gate and up rows of intermediate index i), biases included (the down bias only when the
  // slice starts at 0), into *w. MXFP4 tensors are [experts, out, in] as blocks; plain ones (a
  // dequantized copy) [experts, in, out], as transformers holds them.
  Status ReadGptOssExpert(const LayerNames& names, int expert, int64_t begin, int64_t end, ExpertWeights* w) const {
    const int64_t hidden = model.hidden, inter = model.expert_intermediate, width = end - begin;
    w->gate.Reshape(width, hidden);
    w->up.Reshape(width, hidden);
    w->down.Reshape(hidden, width);
    if (const Located* blocks = Find(names.GateUp("_blocks")); blocks != nullptr) {
      const Located& down = *Find(names.Down("_blocks"));
      for (int64_t i = 0; i < width; ++i) {
        ReadMxfp4Row(*blocks, expert, 2 * (begin + i), 0, hidden, w->gate.row(i));
        ReadMxfp4Row(*blocks, expert, 2 * (begin + i) + 1, 0, hidden, w->up.row(i));
      }
      for (int64_t h = 0; h < hidden; ++h) ReadMxfp4Row(down, expert, h, begin, width, w->down.row(h));
    } else {
      // [hidden x 2 width] of gate_up (columns interleaved gate, up), [width x hidden] of down.
      std::vector<float> block(hidden * 2 * width);
      const Located& gate_up = *Find(names.GateUp(""));
      EPMOE_RETURN_IF_ERROR(
          gate_up.file->ReadFloat(*gate_up.info, expert * hidden, hidden, 2 * begin, 2 * width, block.data()));
      for (int64_t h = 0; h < hidden; ++h) {
        for (int64_t i = 0; i < width; ++i) {
          w->gate.at(i, h) = block[h * 2 * width + 2 * i];
          w->up.at(i, h) = block[h * 2 * width + 2 * i + 1];
        }
      }
      block.resize(width * hidden);
      const Located& down = *Find(names.Down(""));
      EPMOE_RETURN_IF_ERROR(down.file->ReadFloat(*down.info, expert * inter + begin, width, 0, hidden, block.data()));
      for (int64_t i = 0; i < width; ++i)
        for (int64_t h = 0; h < hidden; ++h) w->down.at(h, i) = block[i * hidden + h];
    }
    std::vector<float> biases(2 * width);
    const Located& gate_up_bias = *Find(names.GateUp("_bias"));
    EPMOE_RETURN_IF_ERROR(
        gate_up_bias.file->ReadFloat(*gate_up_bias.info, expert, 1, 2 * begin, 2 * width, biases.data()));
    w->gate_bias.resize(width);
    w->up_bias.resize(width);
    for (int64_t i = 0; i < width; ++i) {
      w->gate_bias[i] = biases[2 * i];
      w->up_bias[i] = biases[2 * i + 1];
    }
    w->down_bias.resize(begin == 0 ? hidden : 0);
    if (begin > 0) return Status::Ok();
    const Located& down_bias = *Find(names.Down("_bias"));
    return down_bias.file->ReadFloat(*down_bias.info, expert, 1, 0, hidden, w->down_bias.data());
  }
};

}  // namespace checkpoint_internal

struct Checkpoint::State : checkpoint_internal::Index {};

namespace {

// What Open and WriteCheckpoint both refuse: a layer count the model does not have, and a naming
// whose tensors do not match the model's (shared experts, correction bias, or gpt-oss's biases and
// activation). `where` begins the messages.
Status CheckLayers(const ModelConfig& model, int num_layers, std::string_view where) {
  if (num_layers < 1 || num_layers > model.num_moe_layers())
    return InvalidArgument(fmt::format("{}: {} layers asked, {} has {} MoE layers", where, num_layers, model.name,
                                       model.num_moe_layers()));
  return Status::Ok();
}
Status CheckNaming(const ModelConfig& model, CheckpointNaming naming, std::string_view where) {
  if (naming == CheckpointNaming::kBlockSparseMoe && (model.num_shared_experts > 0 || model.correction_bias))
    return InvalidArgument(fmt::format(
        "{}: the block_sparse_moe naming has no shared experts or correction bias, which {} has", where, model.name));
  const bool gpt_oss_layer = model.router_bias && model.expert_bias && model.activation == Activation::kSwiGluOai;
  if (naming == CheckpointNaming::kGptOss && !gpt_oss_layer)
    return InvalidArgument(
        fmt::format("{}: the gpt_oss naming holds gpt-oss's layers (router and expert biases, "
                    "activation swiglu_oai), which {} does not have",
                    where, model.name));
  if (naming != CheckpointNaming::kGptOss && (model.router_bias || model.expert_bias))
    return InvalidArgument(fmt::format("{}: the {} naming has no router or expert biases, which {} has", where,
                                       CheckpointNamingName(naming), model.name));
  return Status::Ok();
}

Result<std::vector<std::string>> CheckpointFiles(const std::string& path) {
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (!fs::exists(status)) return NotFound(fmt::format("{}: no such file or folder", path));
  if (!fs::is_directory(status)) return std::vector<std::string>{path};
  const fs::path index = fs::path(path) / kIndexFile;
  std::vector<std::string> files;
  if (fs::exists(index)) {
    std::ifstream in(index);
    const nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded() || !json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object())
      return IoError(fmt::format("{}: not JSON with a \"weight_map\" object", index.string()));
    std::set<std::string> names;
    for (const auto& [tensor, file] : json["weight_map"].items()) {
      if (!file.is_string())
        return IoError(fmt::format("{}: weight_map[\"{}\"] is not a file name", index.string(), tensor));
      const std::string name = file.get<std::string>();
      if (name.empty() || name.find('/') != std::string::npos)
        return IoError(
            fmt::format("{}: weight_map[\"{}\"] = \"{}\" is not a file in its folder", index.string(), tensor, name));
      names.insert(name);
    }
    for (const std::string& name : names) files.push_back((fs::path(path) / name).string());
  } else {
    for (const auto& entry : fs::directory_iterator(path, error)) {
      if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());
  }
  if (files.empty()) return NotFound(fmt::format("{}: no .safetensors files", path));
  return files;
}

}  // namespace

Status checkpoint_internal::Index::Load() {
  EPMOE_ASSIGN_OR_RETURN(const std::vector<std::string> paths, CheckpointFiles(path));
  for (const std::string& file : paths) {
    EPMOE_ASSIGN_OR_RETURN(auto opened, SafetensorsFile::Open(file));
    std::error_code error;
    file_bytes += static_cast<int64_t>(fs::file_size(file, error));
    for (const TensorInfo& info : opened->tensors()) {
      auto [it, added] = tensors.try_emplace(info.name, Located{opened.get(), &info});
      if (!added)
        return InvalidArgument(
            fmt::format("{}: tensor \"{}\" is in both {} and {}", path, info.name, it->second.file->source(), file));
    }
    files.push_back(std::move(opened));
  }
  return Status::Ok();
}

Checkpoint::Checkpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}
Checkpoint::~Checkpoint() = default;

CheckpointNaming Checkpoint::naming() const {
  return state_->naming;
}
int Checkpoint::num_files() const {
  return static_cast<int>(state_->files.size());
}
int64_t Checkpoint::file_bytes() const {
  return state_->file_bytes;
}

Result<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& path, const ModelConfig& model,
                                                     int num_layers) {
  EPMOE_RETURN_IF_ERROR(CheckLayers(model, num_layers, "checkpoint"));
  auto state = std::make_unique<State>();
  state->model = model;
  state->num_layers = num_layers;
  state->path = path;
  EPMOE_RETURN_IF_ERROR(state->Load());

  const LayerNames mlp(CheckpointNaming::kMlpExperts, model, 0), mixtral(CheckpointNaming::kBlockSparseMoe, model, 0),
      gpt_oss(CheckpointNaming::kGptOss, model, 0);
  if (state->Find(mlp.Expert(0, kGate)) != nullptr) {
    state->naming = CheckpointNaming::kMlpExperts;
  } else if (state->Find(mixtral.Expert(0, kGate)) != nullptr) {
    state->naming = CheckpointNaming::kBlockSparseMoe;
  } else if (state->Find(gpt_oss.GateUp("_blocks")) != nullptr || state->Find(gpt_oss.GateUp("")) != nullptr) {
    state->naming = CheckpointNaming::kGptOss;
  } else {
    return NotFound(fmt::format(
        "{}: none of \"{}\", \"{}\" or \"{}[_blocks]\": not a checkpoint of the first MoE layer of {} in a naming "
        "this reader knows (mlp.experts: DeepSeek-V3, GLM, Qwen3-MoE, OLMoE; block_sparse_moe: Mixtral; gpt_oss)",
        path, mlp.Expert(0, kGate), mixtral.Expert(0, kGate), gpt_oss.GateUp(""), model.name));
  }
  EPMOE_RETURN_IF_ERROR(CheckNaming(model, state->naming, path));

  const int64_t e = model.num_experts, h = model.hidden, inter = model.expert_intermediate;
  const int64_t shared = static_cast<int64_t>(model.num_shared_experts) * model.shared_intermediate;
  for (int layer = 0; layer < num_layers; ++layer) {
    const LayerNames names(state->naming, model, layer);
    EPMOE_RETURN_IF_ERROR(state->Check(names.Router(), {e, h}));
    if (model.correction_bias) EPMOE_RETURN_IF_ERROR(state->Check(names.CorrectionBias(), {e}));
    if (state->naming == CheckpointNaming::kGptOss) {
      // Every layer as MXFP4 blocks, or every layer as plain tensors (as the first).
      if (state->Find(gpt_oss.GateUp("_blocks")) != nullptr) {
        EPMOE_RETURN_IF_ERROR(state->CheckMxfp4(names.GateUp(""), e, 2 * inter, h));
        EPMOE_RETURN_IF_ERROR(state->CheckMxfp4(names.Down(""), e, h, inter));
      } else {
        EPMOE_RETURN_IF_ERROR(state->Check(names.GateUp(""), {e, h, 2 * inter}));
        EPMOE_RETURN_IF_ERROR(state->Check(names.Down(""), {e, inter, h}));
      }
      EPMOE_RETURN_IF_ERROR(state->Check(names.RouterBias(), {e}));
      EPMOE_RETURN_IF_ERROR(state->Check(names.GateUp("_bias"), {e, 2 * inter}));
      EPMOE_RETURN_IF_ERROR(state->Check(names.Down("_bias"), {e, h}));
      continue;
    }
    for (int expert = 0; expert < model.num_experts; ++expert) {
      EPMOE_RETURN_IF_ERROR(state->Check(names.Expert(expert, kGate), {inter, h}));
      EPMOE_RETURN_IF_ERROR(state->Check(names.Expert(expert, kUp), {inter, h}));
      EPMOE_RETURN_IF_ERROR(state->Check(names.Expert(expert, kDown), {h, inter}));
    }
    if (shared > 0) {
      EPMOE_RETURN_IF_ERROR(state->Check(names.Shared(kGate), {shared, h}));
      EPMOE_RETURN_IF_ERROR(state->Check(names.Shared(kUp), {shared, h}));
      EPMOE_RETURN_IF_ERROR(state->Check(names.Shared(kDown), {h, shared}));
    }
    if (model.shared_output_gate) EPMOE_RETURN_IF_ERROR(state->Check(names.SharedOutputGate(), {1, h}));
  }
  return std::unique_ptr<Checkpoint>(new Checkpoint(std::move(state)));
}

namespace {

Status CheckLayer(int layer, int num_layers) {
  if (layer < 0 || layer >= num_layers)
    return InvalidArgument(fmt::format("checkpoint: MoE layer {} is not among the {} opened", layer, num_layers));
  return Status::Ok();
}

// Resolves slice_end -1 (to the end) and checks [begin, end) lies in [0, width).
Result<int64_t> SliceEnd(int64_t begin, int64_t end, int64_t width) {
  if (end < 0) end = width;
  if (begin < 0 || begin >= end || end > width)
    return InvalidArgument(fmt::format("checkpoint: slice [{}, {}) of an intermediate size of {}", begin, end, width));
  return end;
}

}  // namespace

Result<MoeLayerWeights> Checkpoint::Routing(int layer, ThreadPool* /*pool*/) const {
  EPMOE_RETURN_IF_ERROR(CheckLayer(layer, state_->num_layers));
  const ModelConfig& model = state_->model;
  const LayerNames names(state_->naming, model, layer);
  MoeLayerWeights w;
  w.layer = layer;
  w.router = Matrix(model.num_experts, model.hidden);
  EPMOE_RETURN_IF_ERROR(state_->Read(names.Router(), 0, model.num_experts, 0, model.hidden, w.router.data.data()));
  if (model.correction_bias || model.router_bias) {
    w.router_bias.resize(model.num_experts);
    EPMOE_RETURN_IF_ERROR(state_->Read(model.router_bias ? names.RouterBias() : names.CorrectionBias(), 0, 1, 0,
                                       model.num_experts, w.router_bias.data()));
  }
  if (model.shared_output_gate) {
    w.shared_output_gate.resize(model.hidden);
    EPMOE_RETURN_IF_ERROR(state_->Read(names.SharedOutputGate(), 0, 1, 0, model.hidden, w.shared_output_gate.data()));
  }
  return w;
}

Status Checkpoint::ReadExpert(int layer, int expert, int64_t slice_begin, int64_t slice_end, ExpertWeights* out) const {
  EPMOE_RETURN_IF_ERROR(CheckLayer(layer, state_->num_layers));
  const ModelConfig& model = state_->model;
  if (expert < 0 || expert >= model.num_experts)
    return InvalidArgument(fmt::format("checkpoint: expert {} of {} experts", expert, model.num_experts));
  EPMOE_ASSIGN_OR_RETURN(const int64_t end, SliceEnd(slice_begin, slice_end, model.expert_intermediate));
  const LayerNames names(state_->naming, model, layer);
  if (state_->naming == CheckpointNaming::kGptOss)
    return state_->ReadGptOssExpert(names, expert, slice_begin, end, out);
  return state_->ReadExpert([&](Projection p) { return names.Expert(expert, p); }, 0, slice_begin, end, out);
}

Status Checkpoint::ReadSharedExpert(int layer, int index, int64_t slice_begin, int64_t slice_end,
                                    ExpertWeights* out) const {
  EPMOE_RETURN_IF_ERROR(CheckLayer(layer, state_->num_layers));
  const ModelConfig& model = state_->model;
  if (index < 0 || index >= model.num_shared_experts)
    return InvalidArgument(
        fmt::format("checkpoint: shared expert {} of {} shared experts", index, model.num_shared_experts));
  EPMOE_ASSIGN_OR_RETURN(const int64_t end, SliceEnd(slice_begin, slice_end, model.shared_intermediate));
  const LayerNames names(state_->naming, model, layer);
  return state_->ReadExpert([&](Projection p) { return names.Shared(p); },
                            static_cast<int64_t>(index) * model.shared_intermediate, slice_begin, end, out);
}

Result<CheckpointSummary> SummarizeCheckpoint(const std::string& path) {
  checkpoint_internal::Index state;
  state.path = path;
  EPMOE_RETURN_IF_ERROR(state.Load());
  CheckpointSummary summary;
  summary.files = static_cast<int>(state.files.size());
  summary.file_bytes = state.file_bytes;
  summary.tensors = static_cast<int64_t>(state.tensors.size());
  std::map<std::string, int64_t> by_dtype;
  // Transformer layers holding expert 0, in each naming.
  const std::vector<CheckpointNaming> namings = kNamings.All();
  std::vector<std::set<int>> layers(namings.size());
  const std::string kLayers = "model.layers.";
  for (const auto& [name, located] : state.tensors) {
    by_dtype[located.info->dtype_name] += located.info->bytes;
    if (!name.starts_with(kLayers)) continue;
    const size_t dot = name.find('.', kLayers.size());
    const std::string number = name.substr(kLayers.size(), dot - kLayers.size());
    if (dot == std::string::npos || number.empty() || number.size() > 6 ||
        !std::all_of(number.begin(), number.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    const int layer = std::stoi(number);
    for (size_t n = 0; n < namings.size(); ++n) {
      const CheckpointNaming naming = namings[n];
      const LayerNames names(naming, layer);
      const bool experts = naming == CheckpointNaming::kGptOss
                               ? name == names.GateUp("_blocks") || name == names.GateUp("")
                               : name == names.Expert(0, kGate);
      if (experts) layers[n].insert(layer);
    }
  }
  for (const auto& [dtype, bytes] : by_dtype) summary.bytes_by_dtype.emplace_back(dtype, bytes);
  std::stable_sort(summary.bytes_by_dtype.begin(), summary.bytes_by_dtype.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  int found = 0;
  for (int n = 1; n < static_cast<int>(layers.size()); ++n) {
    if (layers[n].size() > layers[found].size()) found = n;
  }
  if (layers[found].empty()) return summary;
  summary.has_experts = true;
  summary.naming = namings[found];
  summary.moe_layers.assign(layers[found].begin(), layers[found].end());
  const LayerNames first(summary.naming, summary.moe_layers[0]);
  if (summary.naming == CheckpointNaming::kGptOss) {
    summary.router_bias = state.Find(first.RouterBias()) != nullptr;
    summary.expert_bias = state.Find(first.GateUp("_bias")) != nullptr;
    const checkpoint_internal::Located* blocks = state.Find(first.GateUp("_blocks"));
    const TensorInfo& gate_up = blocks != nullptr ? *blocks->info : *state.Find(first.GateUp(""))->info;
    summary.expert_dtype = blocks != nullptr ? "MXFP4" : gate_up.dtype_name;
    const std::vector<int64_t>& shape = gate_up.shape;  // [E, 2I, H/32, 16] or [E, H, 2I]
    if (shape.size() == (blocks != nullptr ? 4u : 3u)) {
      summary.num_experts = static_cast<int>(shape[0]);
      summary.expert_intermediate = (blocks != nullptr ? shape[1] : shape[2]) / 2;
      summary.hidden = blocks != nullptr ? shape[2] * 32 : shape[1];
    }
    return summary;
  }
  while (state.Find(first.Expert(summary.num_experts, kGate)) != nullptr) ++summary.num_experts;
  const std::string gate_name = first.Expert(0, kGate);
  const TensorInfo& gate = *state.Find(gate_name)->info;
  const bool nvfp4 = state.IsModelOptNvfp4(gate_name, gate);  // two values a byte
  summary.expert_dtype = nvfp4 ? "NVFP4" : gate.dtype_name;
  if (gate.shape.size() == 2) {
    summary.expert_intermediate = gate.shape[0];
    summary.hidden = nvfp4 ? 2 * gate.shape[1] : gate.shape[1];
  }
  if (summary.naming == CheckpointNaming::kMlpExperts) {
    summary.shared_output_gate = state.Find(first.SharedOutputGate()) != nullptr;
    const LayerNames shared_names(summary.naming, summary.moe_layers[0], summary.shared_output_gate);
    const auto* shared = state.Find(shared_names.Shared(kGate));
    if (shared != nullptr && !shared->info->shape.empty()) summary.shared_intermediate = shared->info->shape[0];
    summary.correction_bias = state.Find(first.CorrectionBias()) != nullptr;
  }
  return summary;
}

bool CheckpointFits(const ModelConfig& model, const CheckpointSummary& s) {
  if (!s.has_experts) return false;
  const int first = s.moe_layers.front();
  const bool contiguous = s.moe_layers.back() - first + 1 == static_cast<int>(s.moe_layers.size());
  return model.hidden == s.hidden && model.num_experts == s.num_experts &&
         model.expert_intermediate == s.expert_intermediate &&
         static_cast<int64_t>(model.num_shared_experts) * model.shared_intermediate == s.shared_intermediate &&
         model.correction_bias == s.correction_bias && model.router_bias == s.router_bias &&
         model.expert_bias == s.expert_bias && model.shared_output_gate == s.shared_output_gate &&
         model.num_dense_layers == first && contiguous &&
         model.num_moe_layers() <= static_cast<int>(s.moe_layers.size());
}

namespace {

constexpr int64_t kShardBytes = int64_t{1} << 30;

// Tensors of one file being written: their encoded values, kept until the file is written.
struct Shard {
  std::vector<std::string> names;
  std::vector<TensorDtype> dtypes;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<std::byte>> bytes;
  int64_t size = 0;

  Status Add(std::string name, std::vector<int64_t> shape, std::span<const float> values, TensorDtype dtype) {
    std::vector<std::byte> encoded;
    EPMOE_RETURN_IF_ERROR(EncodeFloats(values, dtype, &encoded));
    AddEncoded(std::move(name), dtype, std::move(shape), std::move(encoded));
    return Status::Ok();
  }
  void AddEncoded(std::string name, TensorDtype dtype, std::vector<int64_t> shape, std::vector<std::byte> encoded) {
    size += static_cast<int64_t>(encoded.size());
    names.push_back(std::move(name));
    dtypes.push_back(dtype);
    shapes.push_back(std::move(shape));
    bytes.push_back(std::move(encoded));
  }
  void Append(Shard&& other) {
    for (size_t i = 0; i < other.names.size(); ++i)
      AddEncoded(std::move(other.names[i]), other.dtypes[i], std::move(other.shapes[i]), std::move(other.bytes[i]));
  }
};

// gpt-oss's experts of one layer, each tensor [experts, ...] of every expert in turn, encoded
// expert by expert (on the pool's threads) into place: MXFP4 blocks and scales when dtype is U8,
// else gate_up [E, H, 2I] and down [E, I, H] in dtype; the biases in BF16 (U8) or dtype.
Status AddGptOssExperts(const ModelConfig& model, const WeightSource& source, int layer, const LayerNames& names,
                        TensorDtype dtype, ThreadPool* pool, Shard* shard) {
  const int64_t e_count = model.num_experts, h = model.hidden, inter = model.expert_intermediate;
  const bool mxfp4 = dtype == TensorDtype::kU8;
  const TensorDtype value_dtype = mxfp4 ? TensorDtype::kBf16 : dtype;
  const int64_t value_bytes = TensorDtypeBytes(value_dtype);
  // Per expert: gate_up, down (values or MXFP4 blocks), gate_up scales, down scales, and biases.
  const int64_t gate_up_bytes = mxfp4 ? 2 * inter * h / 2 : h * 2 * inter * value_bytes;
  const int64_t down_bytes = mxfp4 ? h * inter / 2 : inter * h * value_bytes;
  std::vector<std::byte> gate_up(e_count * gate_up_bytes), down(e_count * down_bytes);
  std::vector<std::byte> gate_up_scales(mxfp4 ? e_count * 2 * inter * h / 32 : 0);
  std::vector<std::byte> down_scales(mxfp4 ? e_count * h * inter / 32 : 0);
  std::vector<float> gate_up_bias(e_count * 2 * inter), down_bias(e_count * h);
  std::vector<Status> failed(e_count);
  auto encode = [&](int64_t begin, int64_t end) {
    ExpertWeights w;  // this thread's buffers, reused
    std::vector<float> values;
    std::vector<std::byte> encoded;
    // Row `values` (32-multiple length) as MXFP4 blocks at `codes` and their scales at `scales`.
    auto quantize_row = [](const float* row, int64_t length, std::byte* codes, std::byte* scales) {
      for (int64_t b = 0; b < length / 32; ++b) {
        const BlockMxfp4 block = QuantizeMxfp4Block(row + 32 * b);
        std::memcpy(codes + 16 * b, block.packed, 16);
        scales[b] = static_cast<std::byte>(block.scale_e8m0);
      }
    };
    for (int64_t e = begin; e < end; ++e) {
      Status status = source.ReadExpert(layer, static_cast<int>(e), 0, -1, &w);
      if (status.ok() &&
          (w.gate_bias.size() != static_cast<size_t>(inter) || w.down_bias.size() != static_cast<size_t>(h)))
        status = InvalidArgument(fmt::format("checkpoint: gpt_oss: expert {} of layer {} has no biases", e, layer));
      if (!status.ok()) {
        failed[e] = status;
        continue;
      }
      for (int64_t i = 0; i < inter; ++i) {
        gate_up_bias[e * 2 * inter + 2 * i] = w.gate_bias[i];
        gate_up_bias[e * 2 * inter + 2 * i + 1] = w.up_bias[i];
      }
      std::copy(w.down_bias.begin(), w.down_bias.end(), down_bias.begin() + e * h);
      if (mxfp4) {
        // Rows 2i and 2i + 1: gate and up row i; down row by row; h / 32 and inter / 32 blocks
        // each.
        for (int64_t i = 0; i < inter; ++i) {
          for (int half = 0; half < 2; ++half) {
            const int64_t row = e * 2 * inter + 2 * i + half;
            quantize_row((half == 0 ? w.gate : w.up).row(i), h, gate_up.data() + row * h / 2,
                         gate_up_scales.data() + row * h / 32);
          }
        }
        for (int64_t r = 0; r < h; ++r)
          quantize_row(w.down.row(r), inter, down.data() + (e * h + r) * inter / 2,
                       down_scales.data() + (e * h + r) * inter / 32);
        continue;
      }
      values.resize(h * 2 * inter);
      for (int64_t r = 0; r < h; ++r) {
        for (int64_t i = 0; i < inter; ++i) {
          values[r * 2 * inter + 2 * i] = w.gate.at(i, r);
          values[r * 2 * inter + 2 * i + 1] = w.up.at(i, r);
        }
      }
      encoded.clear();  // EncodeFloats appends
      status = EncodeFloats(values, dtype, &encoded);
      if (status.ok()) std::memcpy(gate_up.data() + e * gate_up_bytes, encoded.data(), gate_up_bytes);
      values.resize(inter * h);
      for (int64_t i = 0; i < inter; ++i)
        for (int64_t r = 0; r < h; ++r) values[i * h + r] = w.down.at(r, i);
      encoded.clear();
      if (status.ok()) status = EncodeFloats(values, dtype, &encoded);
      if (status.ok()) std::memcpy(down.data() + e * down_bytes, encoded.data(), down_bytes);
      failed[e] = status;
    }
  };
  ParallelFor(pool, e_count, 1, encode);
  for (const Status& status : failed) EPMOE_RETURN_IF_ERROR(status);
  if (mxfp4) {
    shard->AddEncoded(names.GateUp("_blocks"), TensorDtype::kU8, {e_count, 2 * inter, h / 32, 16}, std::move(gate_up));
    shard->AddEncoded(names.GateUp("_scales"), TensorDtype::kU8, {e_count, 2 * inter, h / 32},
                      std::move(gate_up_scales));
    shard->AddEncoded(names.Down("_blocks"), TensorDtype::kU8, {e_count, h, inter / 32, 16}, std::move(down));
    shard->AddEncoded(names.Down("_scales"), TensorDtype::kU8, {e_count, h, inter / 32}, std::move(down_scales));
  } else {
    shard->AddEncoded(names.GateUp(""), dtype, {e_count, h, 2 * inter}, std::move(gate_up));
    shard->AddEncoded(names.Down(""), dtype, {e_count, inter, h}, std::move(down));
  }
  EPMOE_RETURN_IF_ERROR(shard->Add(names.GateUp("_bias"), {e_count, 2 * inter}, gate_up_bias, value_dtype));
  return shard->Add(names.Down("_bias"), {e_count, h}, down_bias, value_dtype);
}

}  // namespace

Status WriteCheckpoint(const std::string& dir, const ModelConfig& model, const WeightSource& source, int num_layers,
                       TensorDtype dtype, CheckpointNaming naming, ThreadPool* pool) {
  const bool mxfp4 = dtype == TensorDtype::kU8;
  if (mxfp4 && naming != CheckpointNaming::kGptOss)
    return InvalidArgument(
        fmt::format("checkpoint: MXFP4 experts (U8 blocks) are written in the gpt_oss naming "
                    "only, not {}",
                    CheckpointNamingName(naming)));
  if (dtype != TensorDtype::kF32 && dtype != TensorDtype::kBf16 && dtype != TensorDtype::kF16 && !mxfp4)
    return InvalidArgument(
        fmt::format("checkpoint: writes F32, BF16 or F16 (or U8: MXFP4 experts), not {}", TensorDtypeName(dtype)));
  EPMOE_RETURN_IF_ERROR(CheckLayers(model, num_layers, "checkpoint"));
  EPMOE_RETURN_IF_ERROR(CheckNaming(model, naming, "checkpoint"));
  if (mxfp4 && (model.hidden % 32 != 0 || model.expert_intermediate % 32 != 0))
    return InvalidArgument(fmt::format("checkpoint: MXFP4 needs hidden {} and intermediate {} in blocks of 32",
                                       model.hidden, model.expert_intermediate));
  // Routing tensors (and gpt-oss's biases) of an MXFP4 checkpoint in BF16, as gpt-oss's.
  const TensorDtype value_dtype = mxfp4 ? TensorDtype::kBf16 : dtype;
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) return IoError(fmt::format("{}: cannot create the folder: {}", dir, error.message()));

  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total_bytes = 0;
  int file_number = 0;
  auto write = [&](Shard& shard) -> Status {
    const std::string name = fmt::format("model-{:05d}.safetensors", ++file_number);
    std::vector<TensorToWrite> tensors;
    for (size_t i = 0; i < shard.names.size(); ++i) {
      tensors.push_back({shard.names[i], shard.dtypes[i], shard.shapes[i], shard.bytes[i]});
      weight_map[shard.names[i]] = name;
    }
    EPMOE_RETURN_IF_ERROR(WriteSafetensors((fs::path(dir) / name).string(), tensors, {{"format", "pt"}}));
    total_bytes += shard.size;
    shard = Shard();
    return Status::Ok();
  };

  const int64_t h = model.hidden, inter = model.expert_intermediate;
  for (int layer = 0; layer < num_layers; ++layer) {
    const LayerNames names(naming, model, layer);
    Shard shard;
    EPMOE_ASSIGN_OR_RETURN(const MoeLayerWeights routing, source.Routing(layer, pool));
    EPMOE_RETURN_IF_ERROR(shard.Add(names.Router(), {model.num_experts, h}, routing.router.data, value_dtype));
    if (model.correction_bias || model.router_bias)
      EPMOE_RETURN_IF_ERROR(shard.Add(model.router_bias ? names.RouterBias() : names.CorrectionBias(),
                                      {model.num_experts}, routing.router_bias, value_dtype));
    if (naming == CheckpointNaming::kGptOss) {
      EPMOE_RETURN_IF_ERROR(AddGptOssExperts(model, source, layer, names, dtype, pool, &shard));
      EPMOE_RETURN_IF_ERROR(write(shard));
      continue;
    }
    if (model.num_shared_experts > 0) {
      // One MLP of all shared experts: their gate and up rows one after another, their down
      // columns side by side.
      const int64_t width = model.shared_intermediate, all = model.num_shared_experts * width;
      Matrix gate(all, h), up(all, h), down(h, all);
      for (int s = 0; s < model.num_shared_experts; ++s) {
        EPMOE_ASSIGN_OR_RETURN(const ExpertWeights w, source.SharedExpert(layer, s, 0, -1));
        std::copy(w.gate.data.begin(), w.gate.data.end(), gate.row(s * width));
        std::copy(w.up.data.begin(), w.up.data.end(), up.row(s * width));
        for (int64_t r = 0; r < h; ++r) std::copy(w.down.row(r), w.down.row(r) + width, down.row(r) + s * width);
      }
      EPMOE_RETURN_IF_ERROR(shard.Add(names.Shared(kGate), {all, h}, gate.data, dtype));
      EPMOE_RETURN_IF_ERROR(shard.Add(names.Shared(kUp), {all, h}, up.data, dtype));
      EPMOE_RETURN_IF_ERROR(shard.Add(names.Shared(kDown), {h, all}, down.data, dtype));
    }
    if (model.shared_output_gate)
      EPMOE_RETURN_IF_ERROR(shard.Add(names.SharedOutputGate(), {1, h}, routing.shared_output_gate, value_dtype));
    // Experts are made and encoded in parallel, a file's worth at a time.
    const int64_t expert_bytes = 3 * h * inter * TensorDtypeBytes(dtype);
    const int per_file = static_cast<int>(std::max<int64_t>(1, kShardBytes / expert_bytes));
    for (int first = 0; first < model.num_experts; first += per_file) {
      const int count = std::min(per_file, model.num_experts - first);
      std::vector<Shard> experts(count);
      std::vector<Status> failed(count);
      auto encode = [&](int64_t begin, int64_t end) {
        ExpertWeights w;  // this thread's buffers, reused
        for (int64_t i = begin; i < end; ++i) {
          const int expert = first + static_cast<int>(i);
          Status status = source.ReadExpert(layer, expert, 0, -1, &w);
          if (status.ok()) status = experts[i].Add(names.Expert(expert, kGate), {inter, h}, w.gate.data, dtype);
          if (status.ok()) status = experts[i].Add(names.Expert(expert, kUp), {inter, h}, w.up.data, dtype);
          if (status.ok()) status = experts[i].Add(names.Expert(expert, kDown), {h, inter}, w.down.data, dtype);
          failed[i] = status;
        }
      };
      ParallelFor(pool, count, 1, encode);
      for (int i = 0; i < count; ++i) {
        EPMOE_RETURN_IF_ERROR(failed[i]);
        if (shard.size > 0 && shard.size + experts[i].size > kShardBytes) EPMOE_RETURN_IF_ERROR(write(shard));
        shard.Append(std::move(experts[i]));
      }
    }
    if (!shard.names.empty()) EPMOE_RETURN_IF_ERROR(write(shard));
  }

  const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  EPMOE_RETURN_IF_ERROR(WriteFileAtomically((fs::path(dir) / kIndexFile).string(), index.dump(2) + "\n"));
  // The model of the layers written, as a config.json, so that `--model DIR` reads it.
  ModelConfig written = model;
  written.num_layers = model.num_dense_layers + num_layers;
  const Result<std::string> config = ModelToHfConfig(written);
  if (config.ok()) EPMOE_RETURN_IF_ERROR(WriteFileAtomically((fs::path(dir) / "config.json").string(), *config + "\n"));
  return Status::Ok();
}

}  // namespace epmoe
