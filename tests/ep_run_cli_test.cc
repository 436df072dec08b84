// `epmoe run` end to end: one process (a world of one rank, no mpirun) and two ranks under mpirun,
// every option side by side with --check, JSON output, and refusals of shapes and flags.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

using CommandRun = epmoe::testing::CommandResult;
using epmoe::testing::RunCommand;

std::string Binary() {
  return epmoe::testing::EpmoeBinary();
}
CommandRun Shell(const std::string& command, bool with_stderr) {
  return RunCommand(command, with_stderr);
}

const char* kSmall = " --hidden 64 --intermediate 32 --tokens 9 --steps 2 --layers 2 --no-progress";

void ExpectEveryOptionChecked(const nlohmann::json& j, int ranks) {
  EXPECT_EQ(j["ranks"], ranks);
  EXPECT_TRUE(j["checked"].get<bool>());
  ASSERT_EQ(j["options"].size(), 5u);
  for (const auto& o : j["options"]) {
    SCOPED_TRACE(o["option"].get<std::string>());
    ASSERT_FALSE(o.contains("refused")) << o.dump();
    EXPECT_GT(o["step_ms_median"].get<double>(), 0);
    EXPECT_LE(o["max_normalized_error"].get<double>(), 2e-2);
    EXPECT_GT(o["balancedness_picks"].get<double>(), 0);
    EXPECT_LE(o["balancedness_picks"].get<double>(), 1.0);
  }
}

TEST(EpRunCli, OneProcessWithoutMpirun) {
  const CommandRun run = Shell(Binary() + " run --option all --check --format json" + kSmall, false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out);
  ExpectEveryOptionChecked(j, 1);
  EXPECT_FALSE(j["interleaved"].get<bool>());
  for (const auto& o : j["options"]) {
    EXPECT_EQ(o["bytes_sent_per_rank_step"].get<double>(), 0);  // one rank: nothing travels
    EXPECT_EQ(o["step_ms"].size(), 2u);                          // one time per step
  }
}

TEST(EpRunCli, TwoRanksUnderMpirun) {
  const std::string mpirun =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
      "mpirun --oversubscribe --bind-to none -np 2 ";
  // Interleaved: every option's executor alive at once, their steps alternating (dwdp settles its
  // read-ahead after each step), every layer checked.
  const CommandRun run = Shell(
      mpirun + Binary() + " run --option all --check --interleave --format json --origin tp --model deepseek-v3" +
          kSmall,
      false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out);
  ExpectEveryOptionChecked(j, 2);
  EXPECT_TRUE(j["interleaved"].get<bool>());
  for (const auto& o : j["options"]) {
    if (o["option"] == "a2a") {
      EXPECT_GT(o["bytes_sent_per_rank_step"].get<double>(), 0);
      EXPECT_GT(o["copies_per_row"].get<double>(), 1.0);
      EXPECT_LE(o["copies_per_row"].get<double>(), 2.0);
    }
  }
  // Text output names every option.
  const CommandRun text = Shell(mpirun + Binary() + " run --option all" + std::string(kSmall), true);
  ASSERT_EQ(text.exit_code, 0) << text.out;
  for (const char* name : {"sliced", "whole", "hybrid", "a2a", "dwdp", "step ms"})
    EXPECT_NE(text.out.find(name), std::string::npos) << name;
}

TEST(EpRunCli, RunsTheListedOptionsInTheirOrder) {
  const CommandRun run = Shell(Binary() + " run --option dwdp,sliced --check --format json" + kSmall, false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out);
  ASSERT_EQ(j["options"].size(), 2u);
  EXPECT_EQ(j["options"][0]["option"], "dwdp");
  EXPECT_EQ(j["options"][1]["option"], "sliced");
  for (const auto& o : j["options"]) EXPECT_LE(o["max_normalized_error"].get<double>(), 2e-2);
}

TEST(EpRunCli, RefusesWithOneLineReasons) {
  // q8 rows need a hidden size that is a multiple of 32.
  CommandRun run = Shell(Binary() + " run --option a2a --dispatch-format q8 --hidden 48 --intermediate 32", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("multiple of 32"), std::string::npos) << run.out;
  // Under --option all an option that cannot run is listed as refused, the others run.
  run = Shell(Binary() + " run --option all --shared sliced --model deepseek-v3 --format json" + std::string(kSmall),
              false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out);
  int refused = 0;
  for (const auto& o : j["options"]) refused += o.contains("refused");
  EXPECT_EQ(refused, 0);  // a2a and dwdp copy the shared expert whatever --shared says
  run = Shell(Binary() + " run --option sideways", true);
  EXPECT_NE(run.exit_code, 0);
  run = Shell(Binary() + " run --option a2a,a2a", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("listed twice"), std::string::npos) << run.out;
  run = Shell(Binary() + " run --option all,a2a", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("all cannot be listed"), std::string::npos) << run.out;
  // A listed option that cannot run for the shape fails the command (all would skip it).
  run = Shell(Binary() + " run --option dwdp,a2a --dispatch-format q8 --hidden 48 --intermediate 32", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("multiple of 32"), std::string::npos) << run.out;
  run = Shell(Binary() + " run --tokens -3", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("must not be negative"), std::string::npos) << run.out;
  run = Shell(Binary() + " run --frobnicate", true);
  EXPECT_NE(run.exit_code, 0);
  run = Shell(Binary() + " run --layers 99", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("--layers 99"), std::string::npos) << run.out;
}

}  // namespace

namespace {

// Numbers that overflow or mean nothing are refused before MPI starts or any memory is taken.
TEST(EpRunCli, RefusesNumbersThatOverflowBeforeAnyWork) {
  for (const char* flags : {"--comm-timeout inf", "--comm-timeout nan", "--max-buffer-mb inf", "--max-buffer-mb 1e300",
                            "--seed -1", "--threads 100000"}) {
    const CommandRun run = Shell(Binary() + " run " + flags, true);
    EXPECT_EQ(run.exit_code, 2) << flags << ": " << run.out;
    EXPECT_EQ(std::count(run.out.begin(), run.out.end(), '\n'), 1) << flags << ": " << run.out;
  }
  CommandRun run = Shell(Binary() + " run --comm-timeout 1e10" + std::string(kSmall), true);
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("communication timeout 10000000000 s: must be from 0"), std::string::npos) << run.out;
  run = Shell(Binary() + " run --tokens 2147483647 --no-progress", true);
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("use fewer --tokens"), std::string::npos) << run.out;
  run = Shell(Binary() + " run --option a2a --eplb --eplb-redundant 1000000000" + std::string(kSmall), true);
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("1000000000 redundant copies: at most 128"), std::string::npos) << run.out;
}

TEST(EpRunCli, AReportThatCannotBeWrittenFailsTheRun) {
  const CommandRun run =
      Shell(Binary() + " run --format json" + std::string(kSmall) + " > /dev/full 2>/dev/null; echo $?", false);
  EXPECT_EQ(run.out, "1\n");
}

// A trace shorter than --steps is replayed from its start, as `epmoe layer` does; --steps holds.
TEST(EpRunCli, AShortTraceIsReplayedForEveryStep) {
  const std::string trace = ::testing::TempDir() + "/epmoe_run_short_trace.bin";
  CommandRun run =
      Shell(Binary() + " trace gen " + trace + " --model qwen3-30b-a3b --layers 2 --steps 2 --batch 9", true);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  run = Shell(Binary() + " run --trace " + trace +
                  " --format json --hidden 64 --intermediate 32 --steps 5 --layers 2 "
                  "--no-progress --check",
              false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out);
  EXPECT_EQ(j["steps"], 5);
  EXPECT_EQ(j["options"][0]["step_ms"].size(), 5u);
}

}  // namespace
