// The epmoe program as a user meets it: help, refusals of bad flags, JSON output, a checked run.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

using epmoe::testing::CommandResult;
using epmoe::testing::Epmoe;

TEST(Cli, EveryCommandHasHelp) {
  for (const char* cmd : {"--help", "model --help", "model show --help", "layer --help"}) {
    const CommandResult r = Epmoe(cmd);
    EXPECT_EQ(r.exit_code, 0) << cmd << ": " << r.out;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << cmd;
  }
}

TEST(Cli, RefusesUnknownFlagsAndBadValuesWithOneLine) {
  for (const char* cmd : {"layer --bogus", "layer --tokens -3", "layer --tokens abc", "layer --routing magic",
                          "layer --weight-format fp8", "model show", "nonsense"}) {
    const CommandResult r = Epmoe(cmd);
    EXPECT_NE(r.exit_code, 0) << cmd;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << cmd << ": " << r.out;
  }
}

TEST(Cli, ModelShowJsonParsesWithDerivedSizes) {
  const CommandResult r = Epmoe("model show glm-5.3 --format json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["hidden"], 6144);
  EXPECT_EQ(j["derived"]["weights_per_expert"], 3LL * 6144 * 2048);
  bool found_bf16 = false;
  for (const auto& s : j["derived"]["sizes"]) {
    if (s["format"] == "bf16") {
      found_bf16 = true;
      EXPECT_EQ(s["bytes_per_expert"], 2LL * 3 * 6144 * 2048);
    }
  }
  EXPECT_TRUE(found_bf16);
}

TEST(Cli, ModelErrorsNameTheProblem) {
  CommandResult r = Epmoe("model show nosuch");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("nosuch"), std::string::npos);
  r = Epmoe("layer --model olmoe-1b-7b --layers 17");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("16 MoE layers"), std::string::npos) << r.out;
}

TEST(Cli, CheckedLayerRunMatchesTheReference) {
  for (const char* routing : {"scores", "round_robin", "uniform"}) {
    const CommandResult r =
        Epmoe(std::string("layer --model deepseek-v3 --hidden 64 --intermediate 32 --tokens 9 --layers 3 "
                          "--steps 2 --check --format json --routing ") +
              routing);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    ASSERT_EQ(j["layers"].size(), 3u);
    for (const auto& l : j["layers"]) {
      EXPECT_LE(l["max_normalized_error"].get<double>(), 1e-4);
      EXPECT_GT(l["experts_touched"].get<int>(), 0);
    }
  }
}

TEST(Cli, ZeroTokensRunsAndReportsNothingTouched) {
  const CommandResult r = Epmoe("layer --hidden 64 --intermediate 32 --tokens 0 --format json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layers"][0]["experts_touched"], 0);
}

TEST(Cli, RefusesARunThatWouldNotFitTheMemoryBudget) {
  CommandResult r = Epmoe("layer --model glm-5.3 --layers 4 --max-memory-gb 1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("budget"), std::string::npos) << r.out;
  // The rows count too: 6 M rows of 2048 values, 8 picks each, take hundreds of GB.
  r = Epmoe("layer --tokens 6000000 --hidden 512 --max-memory-gb 10");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("over the budget of 10.00 GB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rows 3"), std::string::npos) << r.out;
}

}  // namespace

namespace {

// A model with FLAME-MoE-290M's routing shape (64 experts, top-6) at small widths, for replay.
std::string WriteFlameShapedModel() {
  const std::string path = ::testing::TempDir() + "/epmoe_flame_shape.json";
  std::ofstream(path) << R"({"name": "flame-shape", "hidden": 64, "num_experts": 64, "expert_intermediate": 32,
    "top_k": 6, "num_shared_experts": 0, "shared_intermediate": 0, "num_layers": 9, "num_dense_layers": 1,
    "dense_intermediate": 64, "scoring": "softmax", "correction_bias": false, "num_expert_groups": 1,
    "topk_groups": 1, "renormalize": false, "routed_scaling": 1.0})";
  return path;
}

const std::string kFlameDecode = EPMOE_TEST_DATA_DIR "/flame_moe_290m/decode_32seqs_pos1-10";

TEST(Cli, ReplaysARealTraceAndMatchesTheReference) {
  const std::string model = WriteFlameShapedModel();
  const CommandResult r = Epmoe("layer --model " + model + " --routing replay --trace " + kFlameDecode +
                                " --layers 8 --steps 11 --check --format json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["tokens"], 32);  // a decode step of the FLAME-MoE excerpt holds 32 rows
  EXPECT_EQ(j["layers"].size(), 8u);
  // Step 11 wrapped around to the trace's first step (10 steps); every layer saw 32 x 6 picks.
  for (const auto& l : j["layers"])
    EXPECT_NEAR(l["mean_picks_per_touched_expert"].get<double>() * l["experts_touched"].get<int>(), 192, 1e-6);
}

TEST(Cli, ReplayRefusesAMismatchedModelOrAMissingTrace) {
  CommandResult r = Epmoe("layer --routing replay --trace " + kFlameDecode);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("top-6"), std::string::npos) << r.out;
  r = Epmoe("layer --routing replay");
  EXPECT_EQ(r.exit_code, 1);
  r = Epmoe("layer --model " + WriteFlameShapedModel() + " --routing replay --trace /nonexistent/trace.bin");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/nonexistent/trace.bin"), std::string::npos) << r.out;
}

}  // namespace

namespace {

TEST(Cli, RefusesThreadCountsAndSeedsOutOfRangeAtParse) {
  for (const char* cmd :
       {"layer --threads 100000", "layer --seed -1", "layer --tokens inf", "layer --tokens nan",
        "checkpoint write --model qwen3-30b-a3b --out x --threads 100000", "trace gen x.bin --seed -1"}) {
    const CommandResult r = Epmoe(cmd);
    EXPECT_EQ(r.exit_code, 2) << cmd << ": " << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << cmd << ": " << r.out;
  }
}

// Rows beyond the machine's memory are refused by the memory admission before allocating (no
// bad_alloc), with the rows named.
TEST(Cli, RefusesRowsThatCannotFitBeforeAllocating) {
  const CommandResult r = Epmoe("layer --tokens 100000000 --layers 1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("100000000 rows per step: about"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rows 22.18 TB"), std::string::npos) << r.out;
}

// Inputs read whole are bounded: a device that never ends or a directory is refused, not read.
TEST(Cli, RefusesEndlessAndDirectoryInputs) {
  CommandResult r = Epmoe("model show /dev/zero");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("larger than"), std::string::npos) << r.out;
  const std::string folder = ::testing::TempDir() + "/epmoe_cli_folder.json";
  std::filesystem::create_directories(folder);
  r = Epmoe("hardware show " + folder);  // (a folder given as a model is a checkpoint's, read for config.json)
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("cannot read hardware profile file: Is a directory"), std::string::npos) << r.out;
  std::filesystem::remove(folder);
  // Sizes whose byte counts would overflow are refused, not printed negative.
  r = Epmoe("layer --hidden 2000000000 --intermediate 2000000000");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("weights in one matrix"), std::string::npos) << r.out;
}

// Output that does not reach stdout (a full disk, a closed pipe) fails the command.
TEST(Cli, AnOutputThatCannotBeWrittenFailsTheCommand) {
  const CommandResult r =
      epmoe::testing::RunCommand(epmoe::testing::EpmoeBinary() + " model list > /dev/full 2>/dev/null; echo $?", false);
  EXPECT_EQ(r.out, "1\n");
}

}  // namespace
