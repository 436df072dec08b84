// Checkpoint (reading a model's MoE weights from safetensors files) against the synthetic weights
// it was written from, in both namings, with 8-bit float weights and their scales, and every
// refusal.
#include "epmoe/checkpoint.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "epmoe/layer.h"
#include "epmoe/quantize.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("epmoe_checkpoint_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Dir(const std::string& sub = "") const { return (dir_ / sub).string(); }

  fs::path dir_;
};

ModelConfig Scaled(const std::string& name, int hidden = 64, int intermediate = 32) {
  auto model = LoadModel(name);
  EPMOE_CHECK(model.ok());
  return ScaledModel(*model, hidden, intermediate);
}

void ExpectSameExpert(const ExpertWeights& a, const ExpertWeights& b) {
  EXPECT_EQ(a.gate.rows, b.gate.rows);
  EXPECT_EQ(a.down.cols, b.down.cols);
  EXPECT_EQ(a.gate.data, b.gate.data);
  EXPECT_EQ(a.up.data, b.up.data);
  EXPECT_EQ(a.down.data, b.down.data);
}

// F32 tensors hold the synthetic values exactly: every read must give them back bit for bit.
TEST_F(CheckpointTest, F32RoundTripIsExactInBothNamings) {
  for (const std::string name : {"deepseek-v3", "mixtral-8x7b"}) {
    SCOPED_TRACE(name);
    const ModelConfig model = Scaled(name);
    const auto synthetic = SyntheticWeights(model, 5);
    const CheckpointNaming naming =
        name == "deepseek-v3" ? CheckpointNaming::kMlpExperts : CheckpointNaming::kBlockSparseMoe;
    ThreadPool pool(2);
    ASSERT_TRUE(WriteCheckpoint(Dir(name), model, *synthetic, 2, TensorDtype::kF32, naming, &pool).ok());
    auto opened = Checkpoint::Open(Dir(name), model, 2);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    const Checkpoint& checkpoint = **opened;
    EXPECT_EQ(checkpoint.naming(), naming);
    for (int layer = 0; layer < 2; ++layer) {
      auto routing = checkpoint.Routing(layer, nullptr);
      auto expected = synthetic->Routing(layer, nullptr);
      ASSERT_TRUE(routing.ok() && expected.ok());
      EXPECT_EQ(routing->router.data, expected->router.data);
      EXPECT_EQ(routing->router_bias, expected->router_bias);
      for (int e : {0, 3, model.num_experts - 1}) {
        auto read = checkpoint.Expert(layer, e, 0, -1);
        ASSERT_TRUE(read.ok()) << read.status().ToString();
        ExpectSameExpert(*read, *synthetic->Expert(layer, e, 0, -1));
        auto slice = checkpoint.Expert(layer, e, 8, 24);  // a sliced option's share
        ASSERT_TRUE(slice.ok());
        ExpectSameExpert(*slice, *synthetic->Expert(layer, e, 8, 24));
      }
      for (int s = 0; s < model.num_shared_experts; ++s) {
        auto read = checkpoint.SharedExpert(layer, s, 4, 20);
        ASSERT_TRUE(read.ok()) << read.status().ToString();
        ExpectSameExpert(*read, *synthetic->SharedExpert(layer, s, 4, 20));
      }
    }
  }
}

// Several shared experts are one MLP in a checkpoint; each is its slice of it.
TEST_F(CheckpointTest, SharedExpertsAreSlicesOfOneMlp) {
  ModelConfig model = Scaled("deepseek-v3");
  model.num_shared_experts = 2;
  model.shared_intermediate = 16;
  const auto synthetic = SyntheticWeights(model, 9);
  ASSERT_TRUE(WriteCheckpoint(Dir(), model, *synthetic, 1, TensorDtype::kF32, CheckpointNaming::kMlpExperts).ok());
  auto checkpoint = Checkpoint::Open(Dir(), model, 1);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  for (int s = 0; s < 2; ++s)
    ExpectSameExpert(*(*checkpoint)->SharedExpert(0, s, 0, -1), *synthetic->SharedExpert(0, s, 0, -1));
}

// BF16 and F16 files hold the values rounded to nearest: within half a unit in the last place.
TEST_F(CheckpointTest, SixteenBitValuesAreTheRoundedOnes) {
  const ModelConfig model = Scaled("qwen3-30b-a3b");
  const auto synthetic = SyntheticWeights(model, 3);
  for (TensorDtype dtype : {TensorDtype::kBf16, TensorDtype::kF16}) {
    const std::string sub = TensorDtypeName(dtype);
    ASSERT_TRUE(WriteCheckpoint(Dir(sub), model, *synthetic, 1, dtype, CheckpointNaming::kMlpExperts).ok());
    auto checkpoint = Checkpoint::Open(Dir(sub), model, 1);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    const double half_ulp = dtype == TensorDtype::kBf16 ? 0x1p-8 : 0x1p-11;  // relative: 7 and 10 bits
    const ExpertWeights read = *(*checkpoint)->Expert(0, 7, 0, -1), made = *synthetic->Expert(0, 7, 0, -1);
    for (size_t i = 0; i < made.gate.data.size(); ++i) {
      const double x = made.gate.data[i];
      ASSERT_LE(std::abs(read.gate.data[i] - x), half_ulp * std::abs(x) + 1e-7) << sub << " at " << i;
    }
  }
}

// A layer packed from the checkpoint is the layer packed from the weights it was written from.
TEST_F(CheckpointTest, LayerFromCheckpointEqualsSyntheticLayer) {
  const ModelConfig model = Scaled("deepseek-v3");
  const auto synthetic = SyntheticWeights(model, 4);
  ThreadPool pool(2);
  ASSERT_TRUE(WriteCheckpoint(Dir(), model, *synthetic, 1, TensorDtype::kF32, CheckpointNaming::kMlpExperts).ok());
  auto checkpoint = Checkpoint::Open(Dir(), model, 1);
  ASSERT_TRUE(checkpoint.ok());
  const PackOptions pack{WeightFormat::kInt8, "auto", &pool};
  auto from_file = MoeLayer::Create(model, **checkpoint, 0, pack);
  auto made = MoeLayer::Create(model, *synthetic, 0, pack);
  ASSERT_TRUE(from_file.ok() && made.ok());
  const Matrix rows = SyntheticRows(4, model, 0, 0, 21);
  Picks picks;
  ASSERT_TRUE((*from_file)->Route(rows, &picks).ok());
  Matrix x, y;
  ASSERT_TRUE((*from_file)->Forward(rows, picks, &x, pool, nullptr).ok());
  ASSERT_TRUE((*made)->Forward(rows, picks, &y, pool, nullptr).ok());
  EXPECT_EQ(x.data, y.data);
}

std::vector<float> Values(const Matrix& m) {
  return std::vector<float>(m.data.begin(), m.data.end());
}

// E4M3 decoded independently of the reader: sign, 4 exponent bits (bias 7), 3 mantissa bits.
float E4m3(uint8_t code) {
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  const float magnitude =
      exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return code & 0x80 ? -magnitude : magnitude;
}

// A one-expert model whose expert is stored in F8_E4M3 with scales in one of the three layouts a
// checkpoint uses; the read weights must be code x its block's scale.
TEST_F(CheckpointTest, Float8WeightsAreScaledByTheirBlocks) {
  ModelConfig model = Scaled("qwen3-30b-a3b", 32, 16);
  model.num_experts = 1;
  model.top_k = 1;
  struct Layout {
    const char* name;
    std::vector<int64_t> gate_scale_shape;  // of the [16 x 32] gate; down's is its transpose's
    std::string suffix;                     // "_scale_inv" after the weight's name, or ".weight_scale"
  };
  const Layout layouts[] = {{"blocks", {2, 4}, "_scale_inv"},  // 8 x 8 blocks, as DeepSeek-V3's 128 x 128
                            {"rows", {16}, ".weight_scale"},   // one scale per output row
                            {"tensor", {}, ".weight_scale"}};  // one scale for the tensor
  for (const Layout& layout : layouts) {
    SCOPED_TRACE(layout.name);
    std::vector<std::vector<std::byte>> storage;
    std::vector<TensorToWrite> tensors;
    auto add = [&](std::string name, TensorDtype dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes) {
      storage.push_back(std::move(bytes));
      tensors.push_back({std::move(name), dtype, std::move(shape), storage.back()});
    };
    storage.reserve(16);
    std::vector<std::byte> router;
    ASSERT_TRUE(EncodeFloats(std::vector<float>(32, 0.5f), TensorDtype::kF32, &router).ok());
    add("model.layers.0.mlp.gate.weight", TensorDtype::kF32, {1, 32}, router);
    std::vector<std::vector<float>> expected;
    for (const char* projection : {"gate_proj", "up_proj", "down_proj"}) {
      const bool down = std::string(projection) == "down_proj";
      const int64_t rows = down ? 32 : 16, cols = down ? 16 : 32;
      std::vector<std::byte> codes(rows * cols);
      std::vector<float> values(rows * cols);
      for (int64_t i = 0; i < rows * cols; ++i) {
        uint8_t code = static_cast<uint8_t>((i * 37 + 11) & 0xff);
        if ((code & 0x7f) == 0x7f) code ^= 1;  // not NaN
        codes[i] = std::byte{code};
        values[i] = E4m3(code);
      }
      // The scale grid: per block, per row or one.
      std::vector<int64_t> scale_shape = layout.gate_scale_shape;
      if (down && scale_shape.size() == 2) std::swap(scale_shape[0], scale_shape[1]);
      if (down && scale_shape.size() == 1) scale_shape[0] = rows;
      int64_t grid_rows = 1, grid_cols = 1;
      if (scale_shape.size() >= 1) grid_rows = scale_shape[0];
      if (scale_shape.size() == 2) grid_cols = scale_shape[1];
      std::vector<float> scales(grid_rows * grid_cols);
      for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.25f * static_cast<float>(i + 1);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c)
          values[r * cols + c] *=
              scales[(r / ((rows + grid_rows - 1) / grid_rows)) * grid_cols + c / ((cols + grid_cols - 1) / grid_cols)];
      }
      expected.push_back(values);
      const std::string weight = std::string("model.layers.0.mlp.experts.0.") + projection + ".weight";
      add(weight, TensorDtype::kF8E4M3, {rows, cols}, codes);
      std::vector<std::byte> scale_bytes;
      ASSERT_TRUE(EncodeFloats(scales, TensorDtype::kF32, &scale_bytes).ok());
      const std::string scale_name = layout.suffix == "_scale_inv"
                                         ? weight + "_scale_inv"
                                         : std::string("model.layers.0.mlp.experts.0.") + projection + ".weight_scale";
      add(scale_name, TensorDtype::kF32, scale_shape, scale_bytes);
    }
    const std::string file = Dir(std::string(layout.name) + ".safetensors");
    fs::create_directories(dir_);
    ASSERT_TRUE(WriteSafetensors(file, tensors).ok());
    auto checkpoint = Checkpoint::Open(file, model, 1);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    auto expert = (*checkpoint)->Expert(0, 0, 0, -1);
    ASSERT_TRUE(expert.ok()) << expert.status().ToString();
    EXPECT_EQ(Values(expert->gate), expected[0]);
    EXPECT_EQ(Values(expert->up), expected[1]);
    EXPECT_EQ(Values(expert->down), expected[2]);
    auto slice = (*checkpoint)->Expert(0, 0, 5, 13);  // rows 5..12 of gate, columns 5..12 of down
    ASSERT_TRUE(slice.ok());
    EXPECT_EQ(Values(slice->gate), std::vector<float>(expected[0].begin() + 5 * 32, expected[0].begin() + 13 * 32));
    EXPECT_EQ(slice->down.at(3, 0), expected[2][3 * 16 + 5]);
  }
}

// The summary of a written checkpoint, and which models it fits.
TEST_F(CheckpointTest, SummaryFindsTheLayersAndFitsTheModel) {
  const ModelConfig model = Scaled("deepseek-v3");
  ASSERT_TRUE(
      WriteCheckpoint(Dir(), model, *SyntheticWeights(model, 1), 2, TensorDtype::kBf16, CheckpointNaming::kMlpExperts)
          .ok());
  auto summary = SummarizeCheckpoint(Dir());
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  const CheckpointSummary& s = *summary;
  EXPECT_TRUE(s.has_experts);
  EXPECT_EQ(s.naming, CheckpointNaming::kMlpExperts);
  EXPECT_EQ(s.moe_layers, (std::vector<int>{3, 4}));  // after deepseek-v3's three dense layers
  EXPECT_EQ(s.num_experts, model.num_experts);
  EXPECT_EQ(s.hidden, 64);
  EXPECT_EQ(s.expert_intermediate, 32);
  EXPECT_EQ(s.shared_intermediate, 32);
  EXPECT_TRUE(s.correction_bias);
  EXPECT_EQ(s.expert_dtype, "BF16");
  ASSERT_EQ(s.bytes_by_dtype.size(), 1u);
  EXPECT_EQ(s.bytes_by_dtype[0].first, "BF16");
  // Two MoE layers: a model of two fits, the preset's 58 do not; nor do other shapes.
  ModelConfig two = model;
  two.num_layers = two.num_dense_layers + 2;
  EXPECT_TRUE(CheckpointFits(two, s));
  EXPECT_FALSE(CheckpointFits(model, s));
  two.num_layers = two.num_dense_layers + 1;  // fewer layers than the checkpoint has: fits
  EXPECT_TRUE(CheckpointFits(two, s));
  ModelConfig wider = two;
  wider.hidden = 128;
  EXPECT_FALSE(CheckpointFits(wider, s));
  ModelConfig unbiased = two;
  unbiased.correction_bias = false;
  EXPECT_FALSE(CheckpointFits(unbiased, s));
  ModelConfig no_dense = two;
  no_dense.num_dense_layers = 0;
  EXPECT_FALSE(CheckpointFits(no_dense, s));

  // A file with no expert tensors: summarized, without experts.
  std::vector<std::byte> bytes;
  ASSERT_TRUE(EncodeFloats(std::vector<float>(4, 1.0f), TensorDtype::kF32, &bytes).ok());
  const std::vector<TensorToWrite> other = {{"lm_head.weight", TensorDtype::kF32, {2, 2}, bytes}};
  ASSERT_TRUE(WriteSafetensors(Dir("other.safetensors"), other).ok());
  auto none = SummarizeCheckpoint(Dir("other.safetensors"));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_experts);
  EXPECT_EQ(none->tensors, 1);
  EXPECT_FALSE(CheckpointFits(two, *none));
}

void ExpectError(const Result<std::unique_ptr<Checkpoint>>& result, const std::string& part) {
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find(part), std::string::npos) << result.status().message();
}

// NVFP4 as ModelOpt writes it, made from epmoe's own nvfp4 quantization of synthetic weights (the
// same recipe: a tensor scale of amax / (6 x 448), an E4M3 scale per 16): the reader gives the
// dequantized values exactly, and packing them into nvfp4 again gives back the same codes.
TEST_F(CheckpointTest, Nvfp4InModelOptsLayoutIsReadAsItsValues) {
  ModelConfig model = Scaled("qwen3-30b-a3b", 64, 32);
  model.num_experts = 2;
  model.top_k = 1;
  const auto synthetic = SyntheticWeights(model, 11);
  std::vector<std::vector<std::byte>> storage;
  storage.reserve(32);
  std::vector<TensorToWrite> tensors;
  auto add = [&](std::string name, TensorDtype dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes) {
    storage.push_back(std::move(bytes));
    tensors.push_back({std::move(name), dtype, std::move(shape), storage.back()});
  };
  std::vector<std::byte> router;
  ASSERT_TRUE(EncodeFloats((*synthetic->Routing(0, nullptr)).router.data, TensorDtype::kF32, &router).ok());
  add("model.layers.0.mlp.gate.weight", TensorDtype::kF32, {2, 64}, router);
  std::vector<QuantizedMatrix> quantized;  // expert e's gate, up, down at 3e .. 3e + 2
  for (int e = 0; e < 2; ++e) {
    const ExpertWeights w = *synthetic->Expert(0, e, 0, -1);
    const char* projections[] = {"gate_proj", "up_proj", "down_proj"};
    const Matrix* matrices[] = {&w.gate, &w.up, &w.down};
    for (int m = 0; m < 3; ++m) {
      auto q = Quantize(WeightFormat::kNvfp4, *matrices[m]);
      ASSERT_TRUE(q.ok());
      std::vector<std::byte> codes, scales;
      for (const BlockNvfp4& block : q->nvfp4) {
        for (uint8_t byte : block.packed) codes.push_back(std::byte{byte});
        scales.push_back(std::byte{block.scale_e4m3});
      }
      std::vector<std::byte> global;
      ASSERT_TRUE(EncodeFloats(std::vector<float>{q->tensor_scale}, TensorDtype::kF32, &global).ok());
      const std::string stem = fmt::format("model.layers.0.mlp.experts.{}.{}", e, projections[m]);
      add(stem + ".weight", TensorDtype::kU8, {q->rows, q->cols / 2}, codes);
      add(stem + ".weight_scale", TensorDtype::kF8E4M3, {q->rows, q->cols / 16}, scales);
      add(stem + ".weight_scale_2", TensorDtype::kF32, {}, global);
      quantized.push_back(*q);
    }
  }
  fs::create_directories(dir_);
  ASSERT_TRUE(WriteSafetensors(Dir("model.safetensors"), tensors).ok());
  auto checkpoint = Checkpoint::Open(Dir(), model, 1);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  for (int e = 0; e < 2; ++e) {
    const ExpertWeights read = *(*checkpoint)->Expert(0, e, 0, -1);
    EXPECT_EQ(Values(read.gate), Values(Dequantize(quantized[3 * e])));
    EXPECT_EQ(Values(read.up), Values(Dequantize(quantized[3 * e + 1])));
    EXPECT_EQ(Values(read.down), Values(Dequantize(quantized[3 * e + 2])));
    const ExpertWeights slice = *(*checkpoint)->Expert(0, e, 8, 24);
    EXPECT_EQ(slice.down.at(5, 0), Dequantize(quantized[3 * e + 2]).at(5, 8));
  }
  // Packed again into nvfp4: the codes and scales of the synthetic weights packed directly, which
  // are the checkpoint's, byte for byte.
  const PackOptions pack{WeightFormat::kNvfp4, "reference"};
  auto from_file = MoeLayer::Create(model, **checkpoint, 0, pack);
  auto direct = MoeLayer::Create(model, *synthetic, 0, pack);
  ASSERT_TRUE(from_file.ok() && direct.ok()) << from_file.status().ToString();
  for (int e = 0; e < 2; ++e) {
    std::vector<std::byte> a((*from_file)->routed().expert_bytes(e)), b((*direct)->routed().expert_bytes(e));
    ASSERT_TRUE((*from_file)->routed().ExportExpert(e, a).ok());
    ASSERT_TRUE((*direct)->routed().ExportExpert(e, b).ok());
    EXPECT_TRUE(a == b) << "expert " << e;
  }
  auto summary = SummarizeCheckpoint(Dir());
  ASSERT_TRUE(summary.ok());
  EXPECT_EQ(summary->expert_dtype, "NVFP4");
  EXPECT_EQ(summary->hidden, 64);
  // Codes of another shape are refused with both shapes.
  ModelConfig narrower = model;
  narrower.expert_intermediate = 16;
  ExpectError(Checkpoint::Open(Dir(), narrower, 1),
              "gate_proj.weight\" has shape [32, 32] (NVFP4: two values a byte), qwen3-30b-a3b needs [16, 64]");
}

TEST_F(CheckpointTest, RefusesWhatDoesNotFitTheModel) {
  const ModelConfig model = Scaled("qwen3-30b-a3b");
  ASSERT_TRUE(
      WriteCheckpoint(Dir(), model, *SyntheticWeights(model, 1), 1, TensorDtype::kBf16, CheckpointNaming::kMlpExperts)
          .ok());
  // Another hidden size: the first tensor checked names both shapes.
  ExpectError(Checkpoint::Open(Dir(), Scaled("qwen3-30b-a3b", 128, 32), 1),
              "\"model.layers.0.mlp.gate.weight\" has shape [128, 64], qwen3-30b-a3b needs [128, 128]");
  // More layers than written: the missing tensor is named.
  ExpectError(Checkpoint::Open(Dir(), model, 2), "no tensor \"model.layers.1.mlp.gate.weight\"");
  // A model with a correction bias the checkpoint lacks.
  ModelConfig biased = model;
  biased.scoring = Scoring::kSigmoid;
  biased.correction_bias = true;
  ExpectError(Checkpoint::Open(Dir(), biased, 1), "no tensor \"model.layers.0.mlp.gate.e_score_correction_bias\"");
  // Another model's dense layers shift the transformer layer numbers: its first MoE layer is gone.
  ModelConfig shifted = model;
  shifted.num_dense_layers = 1;
  ExpectError(Checkpoint::Open(Dir(), shifted, 1), "model.layers.1.mlp.experts.0.gate_proj.weight");
  ExpectError(Checkpoint::Open(Dir(), model, model.num_moe_layers() + 1), "MoE layers");
  auto opened = Checkpoint::Open(Dir(), model, 1);
  ASSERT_TRUE(opened.ok());
  EXPECT_FALSE((*opened)->Expert(1, 0, 0, -1).ok());                             // layer not opened
  EXPECT_FALSE((*opened)->Expert(0, model.num_experts, 0, -1).ok());             // no such expert
  EXPECT_FALSE((*opened)->Expert(0, 0, 8, model.expert_intermediate + 1).ok());  // slice past the end
  EXPECT_FALSE((*opened)->SharedExpert(0, 0, 0, -1).ok());                       // the model has none
}

TEST_F(CheckpointTest, RefusesBrokenFolders) {
  ExpectError(Checkpoint::Open(Dir("absent"), Scaled("qwen3-30b-a3b"), 1), "no such file or folder");
  fs::create_directories(dir_);
  ExpectError(Checkpoint::Open(Dir(), Scaled("qwen3-30b-a3b"), 1), "no .safetensors files");
  { std::ofstream(Dir("model.safetensors.index.json")) << "{\"weight_map\": [1, 2]}"; }
  ExpectError(Checkpoint::Open(Dir(), Scaled("qwen3-30b-a3b"), 1), "\"weight_map\" object");
  { std::ofstream(Dir("model.safetensors.index.json")) << "{\"weight_map\": {\"a\": \"../x.safetensors\"}}"; }
  ExpectError(Checkpoint::Open(Dir(), Scaled("qwen3-30b-a3b"), 1), "is not a file in its folder");
  fs::remove(Dir("model.safetensors.index.json"));
  // A file of a model whose naming is not read (Llama 4's fused experts): the names looked for are
  // given.
  std::vector<std::byte> bytes;
  ASSERT_TRUE(EncodeFloats(std::vector<float>(4, 1.0f), TensorDtype::kF32, &bytes).ok());
  const std::vector<TensorToWrite> other = {
      {"model.layers.0.feed_forward.experts.gate_up_proj", TensorDtype::kF32, {4}, bytes}};
  ASSERT_TRUE(WriteSafetensors(Dir("a.safetensors"), other).ok());
  ExpectError(Checkpoint::Open(Dir(), Scaled("qwen3-30b-a3b"), 1), "block_sparse_moe.experts.0.w1.weight");
  // The same tensor in two files.
  ASSERT_TRUE(WriteSafetensors(Dir("b.safetensors"), other).ok());
  ExpectError(Checkpoint::Open(Dir(), Scaled("qwen3-30b-a3b"), 1), "is in both");
}

// Integer or packed 4-bit weights, and 8-bit floats without scales, are refused by name.
TEST_F(CheckpointTest, RefusesWeightsItCannotRead) {
  ModelConfig model = Scaled("qwen3-30b-a3b", 32, 16);
  model.num_experts = 1;
  model.top_k = 1;
  for (TensorDtype dtype : {TensorDtype::kU8, TensorDtype::kF8E4M3}) {
    SCOPED_TRACE(TensorDtypeName(dtype));
    std::vector<std::byte> router, codes(16 * 32);
    ASSERT_TRUE(EncodeFloats(std::vector<float>(32, 0.5f), TensorDtype::kF32, &router).ok());
    const std::vector<TensorToWrite> tensors = {
        {"model.layers.0.mlp.gate.weight", TensorDtype::kF32, {1, 32}, router},
        {"model.layers.0.mlp.experts.0.gate_proj.weight", dtype, {16, 32}, codes}};
    const std::string file = Dir(std::string(TensorDtypeName(dtype)) + ".safetensors");
    fs::create_directories(dir_);
    ASSERT_TRUE(WriteSafetensors(file, tensors).ok());
    ExpectError(Checkpoint::Open(file, model, 1),
                dtype == TensorDtype::kU8 ? "is U8: weights are read in F32, BF16, F16" : "has no scales");
  }
}

// gpt-oss's layout written by hand, from transformers' dequantization (convert_moe_packed_tensors
// then GptOssExperts): a [E, 2I, H/32, 16] block tensor is E x 2I rows of H values, the low nibble
// value 2j of byte j, scaled by 2^(scale - 127) per 32; as [E, H, 2I] (transposed), gate is the
// even columns and up the odd ones. Nothing here uses the writer.
TEST_F(CheckpointTest, GptOssMxfp4LayoutReadsAsTransformersDequantizesIt) {
  ModelConfig model = Scaled("gpt-oss-20b", 64, 32);
  model.num_experts = 2;
  model.top_k = 1;
  model.num_layers = 1;
  const int64_t e_count = 2, h = 64, inter = 32;
  static constexpr float kFp4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  auto code = [](int64_t e, int64_t row, int64_t col) {
    return static_cast<uint8_t>((e * 7 + row * 3 + col * 5) % 16);
  };
  auto scale = [](int64_t e, int64_t row, int64_t block) {
    return static_cast<uint8_t>(120 + (e + row + 2 * block) % 9);
  };
  auto blocks = [&](int64_t rows, int64_t cols, std::vector<std::byte>* codes, std::vector<std::byte>* scales) {
    for (int64_t e = 0; e < e_count; ++e) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; c += 2)
          codes->push_back(std::byte(static_cast<uint8_t>(code(e, r, c) | code(e, r, c + 1) << 4)));
        for (int64_t b = 0; b < cols / 32; ++b) scales->push_back(std::byte{scale(e, r, b)});
      }
    }
  };
  auto value = [&](int64_t e, int64_t row, int64_t col) {
    return kFp4[code(e, row, col)] * std::ldexp(1.0f, scale(e, row, col / 32) - 127);
  };
  std::vector<std::byte> gate_up, gate_up_scales, down, down_scales, router, router_bias, gate_up_bias, down_bias;
  blocks(2 * inter, h, &gate_up, &gate_up_scales);
  blocks(h, inter, &down, &down_scales);
  std::vector<float> biases(e_count * 2 * inter);
  for (size_t i = 0; i < biases.size(); ++i) biases[i] = 0.25f * static_cast<float>(i % 7);
  ASSERT_TRUE(EncodeFloats(biases, TensorDtype::kBf16, &gate_up_bias).ok());
  ASSERT_TRUE(EncodeFloats(std::vector<float>(e_count * h, -0.5f), TensorDtype::kBf16, &down_bias).ok());
  ASSERT_TRUE(EncodeFloats(std::vector<float>(e_count * h, 0.125f), TensorDtype::kBf16, &router).ok());
  ASSERT_TRUE(EncodeFloats(std::vector<float>{1.0f, -1.0f}, TensorDtype::kBf16, &router_bias).ok());
  const std::string p = "model.layers.0.mlp.";
  const std::vector<TensorToWrite> tensors = {
      {p + "router.weight", TensorDtype::kBf16, {e_count, h}, router},
      {p + "router.bias", TensorDtype::kBf16, {e_count}, router_bias},
      {p + "experts.gate_up_proj_blocks", TensorDtype::kU8, {e_count, 2 * inter, h / 32, 16}, gate_up},
      {p + "experts.gate_up_proj_scales", TensorDtype::kU8, {e_count, 2 * inter, h / 32}, gate_up_scales},
      {p + "experts.gate_up_proj_bias", TensorDtype::kBf16, {e_count, 2 * inter}, gate_up_bias},
      {p + "experts.down_proj_blocks", TensorDtype::kU8, {e_count, h, inter / 32, 16}, down},
      {p + "experts.down_proj_scales", TensorDtype::kU8, {e_count, h, inter / 32}, down_scales},
      {p + "experts.down_proj_bias", TensorDtype::kBf16, {e_count, h}, down_bias}};
  fs::create_directories(dir_);
  ASSERT_TRUE(WriteSafetensors(Dir("model.safetensors"), tensors).ok());
  auto checkpoint = Checkpoint::Open(Dir(), model, 1);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ((*checkpoint)->naming(), CheckpointNaming::kGptOss);
  EXPECT_EQ((*checkpoint)->Routing(0, nullptr)->router_bias, (std::vector<float>{1.0f, -1.0f}));
  for (int64_t e = 0; e < e_count; ++e) {
    const ExpertWeights w = *(*checkpoint)->Expert(0, static_cast<int>(e), 0, -1);
    for (int64_t i = 0; i < inter; ++i) {
      for (int64_t c = 0; c < h; ++c) {
        ASSERT_EQ(w.gate.at(i, c), value(e, 2 * i, c)) << e << " " << i << " " << c;
        ASSERT_EQ(w.up.at(i, c), value(e, 2 * i + 1, c)) << e << " " << i << " " << c;
      }
      EXPECT_EQ(w.gate_bias[i], biases[e * 2 * inter + 2 * i]);
      EXPECT_EQ(w.up_bias[i], biases[e * 2 * inter + 2 * i + 1]);
    }
    for (int64_t r = 0; r < h; ++r)
      for (int64_t i = 0; i < inter; ++i) ASSERT_EQ(w.down.at(r, i), value(e, r, i)) << e << " " << r << " " << i;
    EXPECT_EQ(w.down_bias, std::vector<float>(h, -0.5f));
    // A later slice of the intermediate dimension: its rows, and no down bias (the first slice's).
    const ExpertWeights slice = *(*checkpoint)->Expert(0, static_cast<int>(e), 16, 32);
    EXPECT_EQ(slice.gate.at(3, 5), value(e, 2 * 19, 5));
    EXPECT_EQ(slice.down.at(7, 2), value(e, 7, 18));
    EXPECT_EQ(slice.up_bias[1], biases[e * 2 * inter + 2 * 17 + 1]);
    EXPECT_TRUE(slice.down_bias.empty());
  }
  auto summary = SummarizeCheckpoint(Dir());
  ASSERT_TRUE(summary.ok());
  EXPECT_EQ(summary->naming, CheckpointNaming::kGptOss);
  EXPECT_EQ(summary->expert_dtype, "MXFP4");
  EXPECT_EQ(summary->num_experts, 2);
  EXPECT_EQ(summary->hidden, 64);
  EXPECT_EQ(summary->expert_intermediate, 32);
  EXPECT_TRUE(summary->router_bias && summary->expert_bias);
  EXPECT_TRUE(CheckpointFits(model, *summary));
  // A model without gpt-oss's biases is refused, and blocks of another shape name both shapes.
  ExpectError(Checkpoint::Open(Dir(), Scaled("mixtral-8x7b", 64, 32), 1), "the gpt_oss naming holds gpt-oss's");
  ModelConfig wider = model;
  wider.expert_intermediate = 64;
  ExpectError(Checkpoint::Open(Dir(), wider, 1),
              "gate_up_proj_blocks\" is U8 [2, 64, 2, 16]; gpt-oss-20b needs U8 [2, 128, 2, 16]");
}

// The writer's two gpt-oss forms read back as written: F32 exactly (the synthetic values, biases
// included), MXFP4 as each row's MXFP4 quantization; the MXFP4 layer runs as the reference says.
TEST_F(CheckpointTest, GptOssWrittenInBothFormsReadsBack) {
  const ModelConfig model = Scaled("gpt-oss-20b", 64, 64);
  const auto synthetic = SyntheticWeights(model, 8);
  ThreadPool pool(2);
  ASSERT_TRUE(
      WriteCheckpoint(Dir("f32"), model, *synthetic, 2, TensorDtype::kF32, CheckpointNaming::kGptOss, &pool).ok());
  ASSERT_TRUE(
      WriteCheckpoint(Dir("u8"), model, *synthetic, 2, TensorDtype::kU8, CheckpointNaming::kGptOss, &pool).ok());
  auto f32 = Checkpoint::Open(Dir("f32"), model, 2);
  auto u8 = Checkpoint::Open(Dir("u8"), model, 2);
  ASSERT_TRUE(f32.ok() && u8.ok()) << f32.status().ToString() << u8.status().ToString();
  for (int e : {0, model.num_experts - 1}) {
    const ExpertWeights made = *synthetic->Expert(1, e, 0, -1);
    const ExpertWeights exact = *(*f32)->Expert(1, e, 0, -1);
    ExpectSameExpert(exact, made);
    EXPECT_EQ(exact.gate_bias, made.gate_bias);
    EXPECT_EQ(exact.up_bias, made.up_bias);
    EXPECT_EQ(exact.down_bias, made.down_bias);
    const ExpertWeights slice = *(*f32)->Expert(1, e, 32, 64);
    ExpectSameExpert(slice, *synthetic->Expert(1, e, 32, 64));
    EXPECT_TRUE(slice.down_bias.empty());
    const ExpertWeights quantized = *(*u8)->Expert(1, e, 0, -1);
    EXPECT_EQ(Values(quantized.gate), Values(Dequantize(*Quantize(WeightFormat::kMxfp4, made.gate))));
    EXPECT_EQ(Values(quantized.up), Values(Dequantize(*Quantize(WeightFormat::kMxfp4, made.up))));
    EXPECT_EQ(Values(quantized.down), Values(Dequantize(*Quantize(WeightFormat::kMxfp4, made.down))));
    for (size_t i = 0; i < made.down_bias.size(); ++i)
      EXPECT_NEAR(quantized.down_bias[i], made.down_bias[i], 0x1p-8 * std::abs(made.down_bias[i]));
  }
  EXPECT_EQ((*f32)->Routing(1, nullptr)->router_bias, synthetic->Routing(1, nullptr)->router_bias);
  auto weights = LoadLayerWeights(model, **u8, 1, &pool);
  ASSERT_TRUE(weights.ok());
  auto layer = MoeLayer::Create(model, **u8, 1, PackOptions{WeightFormat::kMxfp4, "auto", &pool});
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  const Matrix rows = SyntheticRows(8, model, 0, 0, 33);
  Picks picks;
  ASSERT_TRUE((*layer)->Route(rows, &picks).ok());
  Matrix out, reference;
  ASSERT_TRUE((*layer)->Forward(rows, picks, &out, pool, nullptr).ok());
  ASSERT_TRUE(ReferenceMoeForward(model, *weights, rows, picks, &reference).ok());
  // int8 activations are the only error: the weights read are exact.
  EXPECT_LT(NormalizedMaxError(out, reference), 5e-2);
  // The MXFP4 form is for the gpt_oss naming only.
  EXPECT_FALSE(WriteCheckpoint(Dir("bad"), Scaled("qwen3-30b-a3b"), *synthetic, 1, TensorDtype::kU8,
                               CheckpointNaming::kMlpExperts)
                   .ok());
}

// Qwen2-MoE and Qwen3-Next: one shared expert named mlp.shared_expert (singular) and the gate on
// its output, mlp.shared_expert_gate.weight [1 x hidden], read back exactly.
TEST_F(CheckpointTest, GatedSharedExpertOfQwenNext) {
  ModelConfig model = Scaled("qwen3-next-80b-a3b", 64, 32);
  model.num_experts = 16;
  model.num_layers = 2;
  const auto synthetic = SyntheticWeights(model, 6);
  ASSERT_TRUE(WriteCheckpoint(Dir(), model, *synthetic, 2, TensorDtype::kF32, CheckpointNaming::kMlpExperts).ok());
  const std::string index = [&] {
    std::ifstream in(Dir("model.safetensors.index.json"));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  EXPECT_NE(index.find("\"model.layers.1.mlp.shared_expert.down_proj.weight\""), std::string::npos);
  EXPECT_NE(index.find("\"model.layers.1.mlp.shared_expert_gate.weight\""), std::string::npos);
  auto checkpoint = Checkpoint::Open(Dir(), model, 2);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const MoeLayerWeights routing = *(*checkpoint)->Routing(1, nullptr);
  EXPECT_EQ(routing.shared_output_gate, synthetic->Routing(1, nullptr)->shared_output_gate);
  EXPECT_EQ(routing.shared_output_gate.size(), 64u);
  ExpectSameExpert(*(*checkpoint)->SharedExpert(1, 0, 0, -1), *synthetic->SharedExpert(1, 0, 0, -1));
  auto summary = SummarizeCheckpoint(Dir());
  ASSERT_TRUE(summary.ok());
  EXPECT_TRUE(summary->shared_output_gate);
  EXPECT_EQ(summary->shared_intermediate, 32);
  EXPECT_TRUE(CheckpointFits(model, *summary));
  ModelConfig ungated = model;
  ungated.shared_output_gate = false;
  EXPECT_FALSE(CheckpointFits(ungated, *summary));
  ExpectError(Checkpoint::Open(Dir(), ungated, 1), "mlp.shared_experts.gate_proj.weight");
}

}  // namespace
}  // namespace epmoe
