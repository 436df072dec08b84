// Importers on the excerpts of real traces in tests/data (README.md there): FLAME-MoE CSV folders
// and files, its derived top-k CSV, the OLMoE expert counts; regrouping tokens into decode steps and
// prefill chunks.
#include <filesystem>
#include <fstream>
#include <numeric>

#include <gtest/gtest.h>

#include "epmoe/trace.h"

namespace epmoe {
namespace {

const std::string kTraces = EPMOE_TEST_DATA_DIR;
const std::string kFlame = kTraces + "/flame_moe_290m";
const std::string kPrefill = kFlame + "/prefill_4seqs_x64tok";
const std::string kDecode = kFlame + "/decode_32seqs_pos1-10";
const std::string kTopk = kFlame + "/prefill_4seqs_x64tok_topk_derived.csv";
const std::string kCounts = kTraces + "/olmoe_paper_expert_counts/expert_counts.csv";

std::vector<StepPicks> ReadAll(const std::string& path, const LoadReadOptions& options, TraceInfo* info) {
  auto reader = TraceReader::Open(path, options);
  EXPECT_TRUE(reader.ok()) << reader.status().ToString();
  if (!reader.ok()) return {};
  *info = (*reader)->info();
  std::vector<StepPicks> steps;
  while (true) {
    StepPicks step;
    auto more = (*reader)->Next(&step);
    EXPECT_TRUE(more.ok()) << more.status().ToString();
    if (!more.ok() || !*more) break;
    steps.push_back(std::move(step));
  }
  return steps;
}

TEST(TraceImport, FlamePrefillFolderLayer2Row0) {
  TraceInfo info;
  auto steps = ReadAll(kPrefill, {}, &info);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(info.format, "flame-csv");
  EXPECT_EQ(info.num_layers, 8);
  EXPECT_EQ(info.num_experts, 64);
  EXPECT_EQ(info.top_k, 6);
  EXPECT_TRUE(info.has_weights);
  EXPECT_EQ(info.layer_ids, (std::vector<int>{2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(steps[0].rows, 256);
  const Picks& layer2 = steps[0].layers[0];
  EXPECT_EQ(std::vector<int32_t>(layer2.experts.begin(), layer2.experts.begin() + 6),
            (std::vector<int32_t>{34, 28, 21, 47, 3, 12}));
  EXPECT_NEAR(layer2.weight(0, 0), 0.0998, 1e-4);
  EXPECT_NEAR(layer2.weight(0, 5), 0.0296, 1e-4);
  // Every layer counts 256 x 6 picks.
  for (int l = 0; l < 8; ++l) {
    int64_t sum = 0;
    for (int e = 0; e < 64; ++e) sum += steps[0].counts[l * 64 + e];
    EXPECT_EQ(sum, 256 * 6);
  }
}

TEST(TraceImport, FlamePrefillHottestExpertPerLayer) {
  auto load = ReadExpertLoad(kPrefill, {});
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  // The busiest expert's picks per layer, counted from the CSV files' non-zero scores by a separate
  // script: max/mean 4.29, 2.33, 1.79, 2.00, 1.75, 1.67, 2.71, 3.79 over the mean of 256 x 6 / 64.
  const std::vector<int64_t> hottest = {103, 56, 43, 48, 42, 40, 65, 91};
  for (int l = 0; l < 8; ++l) {
    auto counts = load->at(0, l);
    EXPECT_EQ(*std::max_element(counts.begin(), counts.end()), hottest[l]) << "layer " << l;
  }
}

TEST(TraceImport, FlameSingleLayerFile) {
  TraceInfo info;
  auto steps = ReadAll(kPrefill + "/layer02.csv", {}, &info);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(info.num_layers, 1);
  EXPECT_EQ(info.layer_ids, std::vector<int>{2});
  EXPECT_EQ(steps[0].layers[0].expert(0, 0), 34);
}

TEST(TraceImport, FlameDecodeFolderIsTenStepsOf32) {
  TraceInfo info;
  auto load = ReadExpertLoad(kDecode, {}, &info);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  EXPECT_EQ(info.layer_ids, (std::vector<int>{2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(info.num_steps, 10);
  EXPECT_EQ(load->num_steps, 10);
  EXPECT_EQ(load->num_layers, 8);
  EXPECT_EQ(load->num_experts, 64);
  EXPECT_EQ(load->top_k, 6);
  for (int64_t s = 0; s < 10; ++s) {
    EXPECT_EQ(load->rows[s], 32);
    for (int l = 0; l < 8; ++l) {
      auto counts = load->at(s, l);
      EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), 192);
    }
  }
}

TEST(TraceImport, TopkCsvMatchesFlameFolder) {
  TraceInfo folder_info, topk_info;
  auto folder = ReadAll(kPrefill, {}, &folder_info);
  LoadReadOptions options;
  options.num_experts = 64;
  auto topk = ReadAll(kTopk, options, &topk_info);
  ASSERT_EQ(folder.size(), 1u);
  ASSERT_EQ(topk.size(), 1u);
  EXPECT_EQ(topk_info.format, "flame-topk-csv");
  EXPECT_EQ(topk_info.layer_ids, folder_info.layer_ids);
  ASSERT_EQ(topk[0].rows, 256);
  for (int l = 0; l < 8; ++l) {
    EXPECT_EQ(topk[0].layers[l].experts, folder[0].layers[l].experts) << "layer " << l;
    for (size_t i = 0; i < topk[0].layers[l].weights.size(); ++i)
      ASSERT_NEAR(topk[0].layers[l].weights[i], folder[0].layers[l].weights[i], 1e-6);
  }
  EXPECT_EQ(topk[0].counts, folder[0].counts);
}

TEST(TraceImport, PrefillChunksAndDecodeSteps) {
  LoadReadOptions prefill;
  prefill.phase = "prefill";
  prefill.batch = 96;
  auto chunks = ReadExpertLoad(kPrefill, prefill);
  ASSERT_TRUE(chunks.ok()) << chunks.status().ToString();
  EXPECT_EQ(chunks->num_steps, 3);
  EXPECT_EQ(chunks->rows, (std::vector<int64_t>{96, 96, 64}));
  // C = 0: one chunk per sequence (the folder name says 4 sequences of 64 tokens).
  prefill.batch = 0;
  auto per_sequence = ReadExpertLoad(kPrefill, prefill);
  ASSERT_TRUE(per_sequence.ok()) << per_sequence.status().ToString();
  EXPECT_EQ(per_sequence->num_steps, 4);
  EXPECT_EQ(per_sequence->rows, (std::vector<int64_t>{64, 64, 64, 64}));
  // Decode: 2 concurrent sequences -> 2 groups x 64 positions of 2 rows.
  LoadReadOptions decode;
  decode.phase = "decode";
  decode.batch = 2;
  TraceInfo info;
  auto steps = ReadAll(kTopk, decode, &info);
  ASSERT_EQ(steps.size(), 2u * 64);
  for (const StepPicks& step : steps) EXPECT_EQ(step.rows, 2);
  // Step 1 (position 1 of sequences 0 and 1), row 0 is token 1 of the derived CSV.
  EXPECT_EQ(std::vector<int32_t>(steps[1].layers[0].experts.begin(), steps[1].layers[0].experts.begin() + 6),
            (std::vector<int32_t>{1, 38, 16, 21, 47, 34}));
  // Totals are kept by any grouping.
  auto whole = ReadExpertLoad(kPrefill, {});
  ASSERT_TRUE(whole.ok());
  int64_t total = 0;
  for (const StepPicks& step : steps) total += std::accumulate(step.counts.begin(), step.counts.end(), int64_t{0});
  EXPECT_EQ(total, std::accumulate(whole->counts.begin(), whole->counts.end(), int64_t{0}));
}

TEST(TraceImport, DecodeFolderRegroupedIntoPrefill) {
  // The decode folder holds positions 1..10 of 32 sequences; prefill chunks per sequence have 10 rows.
  LoadReadOptions options;
  options.phase = "prefill";
  auto load = ReadExpertLoad(kDecode, options);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  EXPECT_EQ(load->num_steps, 32);
  EXPECT_EQ(load->rows[0], 10);
}

TEST(TraceImport, OlmoeExpertCounts) {
  LoadReadOptions options;
  options.filter = "model=olmoe,domain=arxiv,selection=topk";
  TraceInfo info;
  auto steps = ReadAll(kCounts, options, &info);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(info.format, "expert-counts-csv");
  EXPECT_FALSE(info.has_picks);
  EXPECT_EQ(info.num_layers, 3);
  EXPECT_EQ(info.num_experts, 64);
  EXPECT_EQ(info.layer_ids, (std::vector<int>{0, 7, 15}));
  // The matching top1 series gives the tokens, and so k = 8.
  EXPECT_EQ(info.top_k, 8);
  const int64_t tokens = steps[0].rows;
  EXPECT_GT(tokens, 200000);
  // Layer 0 on arxiv sends 97.7% of tokens to expert 0 (one of their 8 picks).
  EXPECT_NEAR(static_cast<double>(steps[0].counts[0]) / tokens, 0.977, 0.001);
  options.filter = "model=olmoe,domain=arxiv,selection=top1";
  auto top1 = ReadExpertLoad(kCounts, options);
  ASSERT_TRUE(top1.ok()) << top1.status().ToString();
  EXPECT_EQ(top1->top_k, 1);
  EXPECT_EQ(top1->rows[0], tokens);
}

TEST(TraceImport, OlmoeSeriesBecomeSteps) {
  LoadReadOptions options;
  options.filter = "model=mistral,selection=topk";
  auto load = ReadExpertLoad(kCounts, options);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  EXPECT_EQ(load->num_steps, 5);  // arxiv, book, c4, github, wikipedia
  EXPECT_EQ(load->num_experts, 8);
  EXPECT_EQ(load->top_k, 2);
  options.filter = "selection=topk";
  auto mixed = ReadExpertLoad(kCounts, options);
  ASSERT_FALSE(mixed.ok());
  EXPECT_NE(mixed.status().message().find("add model="), std::string::npos) << mixed.status().message();
  options.filter = "model=nosuch";
  auto none = ReadExpertLoad(kCounts, options);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no series matches"), std::string::npos);
  options.filter = "colour=red";
  EXPECT_FALSE(ReadExpertLoad(kCounts, options).ok());
}

TEST(TraceImport, OptionErrors) {
  LoadReadOptions options;
  options.format = "nosuch";
  EXPECT_FALSE(ReadExpertLoad(kPrefill, options).ok());
  options = {};
  options.batch = 4;  // needs a phase
  EXPECT_FALSE(ReadExpertLoad(kPrefill, options).ok());
  options = {};
  options.phase = "decode";
  options.filter = "model=olmoe,domain=arxiv,selection=topk";
  auto counts_only = ReadExpertLoad(kCounts, options);  // counts cannot be regrouped
  ASSERT_FALSE(counts_only.ok());
  EXPECT_EQ(counts_only.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(ReadExpertLoad(kTraces + "/no_such_file.csv", {}).ok());
}

}  // namespace
}  // namespace epmoe
