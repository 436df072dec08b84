// `epmoe checkpoint write` and `--weights` end to end: a written checkpoint run through
// `epmoe layer` and `epmoe run` (two ranks, every option, checked) gives what the synthetic weights
// it holds give.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

using epmoe::testing::CommandResult;
using epmoe::testing::EpmoeBinary;
using epmoe::testing::RunCommand;

const std::string kShape = " --model deepseek-v3 --hidden 64 --intermediate 32 --layers 2";

// `epmoe run --option all --check` with `args` on two ranks: every option runs and matches the
// single-process layer. Returns the report (empty when the run failed).
nlohmann::json RunEveryOptionOnTwoRanks(const std::string& args) {
  const std::string mpirun =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
      "mpirun --oversubscribe --bind-to none -np 2 ";
  const CommandResult run = RunCommand(
      mpirun + EpmoeBinary() + " run --option all --check --tokens 9 --steps 2 --no-progress --format json" + args,
      false);
  EXPECT_EQ(run.exit_code, 0) << run.out;
  if (run.exit_code != 0) return {};
  const auto j = nlohmann::json::parse(run.out);
  EXPECT_EQ(j["options"].size(), 5u);
  for (const auto& o : j["options"]) {
    EXPECT_FALSE(o.contains("refused")) << o.dump();
    EXPECT_LE(o["max_normalized_error"].get<double>(), 2e-2) << o["option"];
  }
  return j;
}

class CheckpointCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (std::filesystem::path(::testing::TempDir()) / "epmoe_checkpoint_cli").string();
    std::filesystem::remove_all(dir_);
    const CommandResult write = RunCommand(
        EpmoeBinary() + " checkpoint write --dtype f32 --seed 3 --format json --out " + dir_ + kShape, false);
    ASSERT_EQ(write.exit_code, 0) << write.out;
    const auto j = nlohmann::json::parse(write.out);
    EXPECT_EQ(j["naming"], "mlp.experts");
    EXPECT_EQ(j["dtype"], "F32");
    EXPECT_GE(j["files"].get<int>(), 1);
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(dir_); }
  static std::string dir_;
};
std::string CheckpointCli::dir_;

// F32 values are the synthetic ones exactly: every layer's checksum is the synthetic run's.
TEST_F(CheckpointCli, LayerReadsTheSameWeights) {
  const std::string args = " layer --tokens 11 --steps 2 --weight-format int8 --seed 3 --check --format json" + kShape;
  const CommandResult from_file = RunCommand(EpmoeBinary() + args + " --weights " + dir_, false);
  const CommandResult made = RunCommand(EpmoeBinary() + args, false);
  ASSERT_EQ(from_file.exit_code, 0) << from_file.out;
  ASSERT_EQ(made.exit_code, 0) << made.out;
  const auto a = nlohmann::json::parse(from_file.out), b = nlohmann::json::parse(made.out);
  EXPECT_EQ(a["weights"]["source"], "checkpoint");
  EXPECT_EQ(b["weights"]["source"], "synthetic");
  ASSERT_EQ(a["layers"].size(), 2u);
  for (int l = 0; l < 2; ++l) EXPECT_EQ(a["layers"][l]["checksum"], b["layers"][l]["checksum"]) << "layer " << l;
  // The folder's config.json is the model: --model FOLDER runs the same layers.
  const CommandResult by_folder = RunCommand(EpmoeBinary() +
                                                 " layer --tokens 11 --steps 2 --weight-format int8 "
                                                 "--seed 3 --layers 2 --format json --model " +
                                                 dir_ + " --weights " + dir_,
                                             false);
  ASSERT_EQ(by_folder.exit_code, 0) << by_folder.out;
  const auto c = nlohmann::json::parse(by_folder.out);
  for (int l = 0; l < 2; ++l) EXPECT_EQ(c["layers"][l]["checksum"], b["layers"][l]["checksum"]) << "layer " << l;
  // With another seed the rows and the synthetic weights change, the checkpoint's weights do not.
  const std::string seed5 = " layer --tokens 11 --steps 1 --seed 5 --format json" + kShape;
  const CommandResult file5 = RunCommand(EpmoeBinary() + seed5 + " --weights " + dir_, false);
  const CommandResult made5 = RunCommand(EpmoeBinary() + seed5, false);
  ASSERT_EQ(file5.exit_code, 0) << file5.out;
  ASSERT_EQ(made5.exit_code, 0) << made5.out;
  EXPECT_NE(nlohmann::json::parse(file5.out)["layers"][0]["checksum"],
            nlohmann::json::parse(made5.out)["layers"][0]["checksum"]);
}

// Every option's ranks read their experts from the checkpoint: the reference (the single-process
// layer packed from it) would differ from synthetic weights of the run's seed, 5.
TEST_F(CheckpointCli, RunOnTwoRanksReadsEachRanksExperts) {
  const auto j = RunEveryOptionOnTwoRanks(" --seed 5 --weights " + dir_ + kShape);
  EXPECT_EQ(j["weights"]["source"], "checkpoint");
}

// gpt-oss as it ships (MXFP4 experts, router and expert biases, its clamped SwiGLU), its folder the
// model: every option on two ranks, routed by the checkpoint's router, matches the single-process
// layer packed from it, and `layer --check` matches the fp32 reference.
TEST(CheckpointCliGptOss, Mxfp4CheckpointRunsEveryOption) {
  const std::string dir = (std::filesystem::path(::testing::TempDir()) / "epmoe_checkpoint_cli_gpt_oss").string();
  std::filesystem::remove_all(dir);
  const CommandResult write =
      RunCommand(EpmoeBinary() +
                     " checkpoint write --model gpt-oss-20b --hidden 64 --intermediate 64 --layers 2 "
                     "--dtype mxfp4 --format json --out " +
                     dir,
                 false);
  ASSERT_EQ(write.exit_code, 0) << write.out;
  EXPECT_EQ(nlohmann::json::parse(write.out)["naming"], "gpt_oss");
  RunEveryOptionOnTwoRanks(" --routing scores --weight-format mxfp4 --model " + dir + " --weights " + dir);
  const CommandResult layer = RunCommand(
      EpmoeBinary() + " layer --tokens 16 --steps 1 --weight-format mxfp4 --check --model " + dir + " --weights " + dir,
      false);
  EXPECT_EQ(layer.exit_code, 0) << layer.out;
  std::filesystem::remove_all(dir);
}

TEST_F(CheckpointCli, ShowFindsTheMoeLayersAndShapes) {
  const CommandResult show = RunCommand(EpmoeBinary() + " checkpoint show --format json " + dir_, false);
  ASSERT_EQ(show.exit_code, 0) << show.out;
  const auto j = nlohmann::json::parse(show.out);
  EXPECT_EQ(j["naming"], "mlp.experts");
  EXPECT_EQ(j["moe_layers"], 2);
  EXPECT_EQ(j["first_moe_layer"], 3);  // deepseek-v3's three dense layers come first
  EXPECT_EQ(j["num_experts"], 256);
  EXPECT_EQ(j["hidden"], 64);
  EXPECT_EQ(j["expert_intermediate"], 32);
  EXPECT_EQ(j["shared_intermediate"], 32);
  EXPECT_EQ(j["correction_bias"], true);
  EXPECT_EQ(j["expert_dtype"], "F32");
  EXPECT_TRUE(j["presets"].empty());  // two layers of a scaled model fit no preset
  ASSERT_EQ(j["bytes_by_dtype"].size(), 1u);
  EXPECT_EQ(j["bytes_by_dtype"][0]["dtype"], "F32");
}

TEST_F(CheckpointCli, RefusesAModelOfOtherShapes) {
  const CommandResult run = RunCommand(EpmoeBinary() +
                                       " layer --model deepseek-v3 --hidden 128 --intermediate 32 "
                                       "--layers 1 --weights " +
                                       dir_);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.out.find("has shape [256, 64], deepseek-v3 needs [256, 128]"), std::string::npos) << run.out;
  const CommandResult absent = RunCommand(EpmoeBinary() + " layer --weights " + dir_ + "/absent" + kShape);
  EXPECT_EQ(absent.exit_code, 1);
  EXPECT_NE(absent.out.find("no such file or folder"), std::string::npos) << absent.out;
}

}  // namespace
