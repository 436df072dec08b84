// `epmoe run` end to end: one process (a world of one rank, no mpirun) and two ranks under mpirun,
// every option side by side with --check, JSON output, refusals of shapes, flags and memory, and
// one rank's error ending the job.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
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

// --a2a-mode: low-latency and auto at decode sizes match the single-process layer on two ranks and
// say which mode ran; a bound its fixed buffers cannot fit is refused before any work.
TEST(EpRunCli, A2aModes) {
  const std::string mpirun =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
      "mpirun --oversubscribe --bind-to none -np 2 ";
  for (const auto& [requested, ran] :
       {std::pair{"low-latency", "low-latency"}, std::pair{"auto", "low-latency"}, std::pair{"normal", "normal"}}) {
    SCOPED_TRACE(requested);
    const CommandRun run =
        Shell(mpirun + Binary() + " run --option a2a --check --format json --a2a-mode " + requested + kSmall, false);
    ASSERT_EQ(run.exit_code, 0) << run.out;
    const auto j = nlohmann::json::parse(run.out);
    EXPECT_EQ(j["a2a_mode_requested"], requested);
    const auto& a2a = j["options"][0];
    EXPECT_EQ(a2a["a2a_mode"], ran);
    EXPECT_NE(a2a["description"].get<std::string>().find(std::string("a2a (") + ran), std::string::npos)
        << a2a["description"];
    EXPECT_LE(a2a["max_normalized_error"].get<double>(), 2e-2);
  }
  // Whatever drives the exchanges' progress, the same rows; the report says which.
  for (const char* progress : {"poll", "thread"}) {
    SCOPED_TRACE(progress);
    const CommandRun run = Shell(mpirun + Binary() + " run --option a2a --check --sbo --format json --a2a-progress " +
                                     progress + kSmall,
                                 false);
    ASSERT_EQ(run.exit_code, 0) << run.out;
    const auto j = nlohmann::json::parse(run.out);
    EXPECT_EQ(j["a2a_progress"], progress);
    EXPECT_NE(j["options"][0]["description"].get<std::string>().find(std::string("progress: ") + progress),
              std::string::npos);
    EXPECT_LE(j["options"][0]["max_normalized_error"].get<double>(), 2e-2);
  }
  const CommandRun text = Shell(mpirun + Binary() + " run --option a2a --a2a-mode low-latency" + kSmall, true);
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("a2a (low-latency, buffers for 5 rows per rank)"), std::string::npos) << text.out;
  const CommandRun refused =
      Shell(Binary() + " run --option a2a --a2a-mode low-latency --max-buffer-mb 0.01" + kSmall, true);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("a2a low-latency: the fixed buffers for 9 rows per rank"), std::string::npos)
      << refused.out;
}

// Two modeled nodes of two ranks: the two-level exchange passes the check and sends fewer bytes
// between nodes than flat (rows visit both ranks of the other node), reported in JSON and text.
TEST(EpRunCli, TwoLevelExchangeSendsFewerBytesBetweenNodes) {
  const std::string mpirun =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
      "mpirun --oversubscribe --bind-to none -np 4 ";
  double inter_node[2] = {0, 0};
  const char* levels[2] = {"flat", "two-level"};
  for (int i = 0; i < 2; ++i) {
    const CommandRun run = Shell(mpirun + Binary() + " run --option a2a --check --ranks-per-node 2 --format json" +
                                     " --a2a-levels " + levels[i] + kSmall,
                                 false);
    ASSERT_EQ(run.exit_code, 0) << run.out;
    const auto j = nlohmann::json::parse(run.out);
    EXPECT_EQ(j["nodes"], 2);
    EXPECT_EQ(j["a2a_levels"], levels[i]);
    EXPECT_EQ(j["a2a_levels_requested"], levels[i]);
    const auto& o = j["options"][0];
    inter_node[i] = o["inter_node_bytes_sent_per_rank_step"].get<double>();
    EXPECT_GT(o["intra_node_bytes_sent_per_rank_step"].get<double>(), 0);
    EXPECT_DOUBLE_EQ(
        o["inter_node_bytes_sent_per_rank_step"].get<double>() + o["intra_node_bytes_sent_per_rank_step"].get<double>(),
        o["bytes_sent_per_rank_step"].get<double>());
    EXPECT_NE(o["description"].get<std::string>().find(levels[i]), std::string::npos) << o["description"];
  }
  EXPECT_GT(inter_node[1], 0);
  EXPECT_LT(inter_node[1], inter_node[0]);
  const CommandRun text = Shell(mpirun + Binary() + " run --option a2a --ranks-per-node 2" + std::string(kSmall), true);
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("inter-node"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("a2a exchange: two-level, from --a2a-levels auto"), std::string::npos) << text.out;
  const CommandRun bad = Shell(Binary() + " run --a2a-levels three" + std::string(kSmall), true);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--a2a-levels"), std::string::npos) << bad.out;
  // Low-latency is flat only: with auto levels it runs flat on the same nodes (and counts its
  // bytes between them); asked for with two levels it is refused before any work.
  const CommandRun low = Shell(mpirun + Binary() + " run --option a2a --check --ranks-per-node 2 --format json" +
                                   " --a2a-mode low-latency" + kSmall,
                               false);
  ASSERT_EQ(low.exit_code, 0) << low.out;
  const auto lj = nlohmann::json::parse(low.out);
  EXPECT_EQ(lj["a2a_levels"], "flat");
  EXPECT_EQ(lj["options"][0]["a2a_mode"], "low-latency");
  EXPECT_GT(lj["options"][0]["inter_node_bytes_sent_per_rank_step"].get<double>(), 0);
  const CommandRun both =
      Shell(Binary() + " run --option a2a --a2a-mode low-latency --a2a-levels two-level" + std::string(kSmall), true);
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.out.find("cannot run the two-level exchange"), std::string::npos) << both.out;
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

// mpirun with `ranks` ranks, ended after 120 s (exit code 124) should it hang.
std::string Mpirun(int ranks) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
         "timeout 120 mpirun --oversubscribe --bind-to none -np " +
         std::to_string(ranks) + " ";
}

size_t Occurrences(const std::string& text, const std::string& word) {
  size_t n = 0;
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) ++n;
  return n;
}

// Memory is admitted before anything is allocated: the runs below would take tens of GB.
TEST(EpRunCli, RefusesARunOverTheMemoryBudgetBeforeAllocating) {
  CommandRun run = Shell(
      "timeout 60 " + Binary() + " run --model qwen3-30b-a3b --layers 12 --option a2a --steps 1 --max-memory-gb 10",
      true);
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("over the budget of 10.00 GB"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("packed weights 28.99 GB"), std::string::npos) << run.out;  // 12 x 128 x 18.9 MB
  // Four ranks with --check: each holds the single-process layers as well; summed over the
  // machine, refused once (every rank reaches the same refusal).
  run = Shell(Mpirun(4) + Binary() +
                  " run --model qwen3-30b-a3b --option all --tokens 64 --steps 3 --layers 2 --check "
                  "--max-memory-gb 20",
              true);
  EXPECT_NE(run.exit_code, 0) << run.out;
  EXPECT_EQ(Occurrences(run.out, "over the budget"), 1u) << run.out;
  EXPECT_NE(run.out.find("ranks 0, 1, 2, 3 (on one machine, summed)"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("fp32 and reference weights 19.33 GB"), std::string::npos) << run.out;  // 4 x 2 x 2.42 GB
  // What one rank holds fits, the same run on two ranks of one machine does not: the ranks' sum
  // counts (each rank keeps its own single-process layers for --check).
  const std::string shape =
      " run --model qwen3-30b-a3b --hidden 256 --intermediate 128 --layers 2 --option a2a --check --tokens 8 "
      "--steps 1 --no-progress --max-memory-gb 0.25";
  run = Shell("timeout 120 " + Binary() + shape, true);
  EXPECT_EQ(run.exit_code, 0) << run.out;
  run = Shell(Mpirun(2) + Binary() + shape, true);
  EXPECT_NE(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("ranks 0, 1 (on one machine, summed)"), std::string::npos) << run.out;
}

// Writes NaN over the first value of every tensor whose name contains `name` in the F32
// safetensors files of `dir`; returns how many it changed.
int PoisonTensors(const std::string& dir, const std::string& name) {
  int changed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::fstream file(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header_bytes = 0;
    file.read(reinterpret_cast<char*>(&header_bytes), 8);
    std::string header(header_bytes, '\0');
    file.read(header.data(), static_cast<std::streamsize>(header_bytes));
    const auto tensors = nlohmann::json::parse(header);
    for (const auto& [key, tensor] : tensors.items()) {
      if (key.find(name) == std::string::npos || !tensor.contains("data_offsets")) continue;
      EXPECT_EQ(tensor["dtype"], "F32");
      const float nan = std::numeric_limits<float>::quiet_NaN();
      file.seekp(static_cast<std::streamoff>(8 + header_bytes + tensor["data_offsets"][0].get<uint64_t>()));
      file.write(reinterpret_cast<const char*>(&nan), sizeof nan);
      ++changed;
    }
  }
  return changed;
}

// Expert 127 is held by rank 3 alone (of 4), expert 0 by rank 0: a NaN in it fails that rank while
// the others wait for it in an exchange. The job ends well before the exchange timeout, with the
// rank's error and its number.
TEST(EpRunCli, OneRanksErrorEndsTheJobWithItsRank) {
  const std::string dir = (std::filesystem::path(::testing::TempDir()) / "epmoe_run_cli_nan").string();
  for (const auto& [expert, rank] : {std::pair{127, 3}, std::pair{0, 0}}) {
    SCOPED_TRACE("NaN in expert " + std::to_string(expert));
    std::filesystem::remove_all(dir);
    const std::string args = " --model qwen3-30b-a3b --hidden 64 --intermediate 32 --layers 1 --dtype f32 --out ";
    const CommandRun write = Shell(Binary() + " checkpoint write" + args + dir, true);
    ASSERT_EQ(write.exit_code, 0) << write.out;
    ASSERT_EQ(PoisonTensors(dir, "experts." + std::to_string(expert) + ".down_proj"), 1);
    const auto start = std::chrono::steady_clock::now();
    const CommandRun run = Shell(Mpirun(4) + Binary() + " run --model " + dir + " --weights " + dir +
                                     " --option a2a --tokens 16 --steps 2 --layers 1 --comm-timeout 20 --no-progress",
                                 true);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(run.exit_code, 0) << run.out;
    EXPECT_NE(run.exit_code, 124) << "timed out: " << run.out;
    EXPECT_LT(seconds, 15) << run.out;  // the healthy ranks would give up on it only after 20 s
    EXPECT_NE(run.out.find("epmoe: rank " + std::to_string(rank) + ": "), std::string::npos) << run.out;
    EXPECT_NE(run.out.find("is nan"), std::string::npos) << run.out;
    EXPECT_EQ(run.out.find("still waiting"), std::string::npos) << run.out;
  }
  std::filesystem::remove_all(dir);
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

// --warmup runs the first steps as any other and leaves them out of every figure, interleaved or
// not; a trace shorter than the warm-up and timed steps together is replayed.
TEST(EpRunCli, WarmupStepsAreLeftOutOfTheFigures) {
  for (const char* interleave : {"", " --interleave"}) {
    SCOPED_TRACE(interleave);
    const CommandRun run =
        Shell(Binary() + " run --option a2a,whole --check --format json --warmup 3" + kSmall + interleave, false);
    ASSERT_EQ(run.exit_code, 0) << run.out;
    const auto j = nlohmann::json::parse(run.out);
    EXPECT_EQ(j["steps"], 2);
    EXPECT_EQ(j["warmup_steps"], 3);
    for (const auto& o : j["options"]) {
      EXPECT_EQ(o["step_ms"].size(), 2u);
      EXPECT_LE(o["max_normalized_error"].get<double>(), 2e-2);
    }
  }
  CommandRun run = Shell(Binary() + " run --warmup 1" + std::string(kSmall), false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("2 steps x 2 layers after 1 warm-up steps,"), std::string::npos) << run.out;
  const std::string trace = ::testing::TempDir() + "/epmoe_run_warmup_trace.bin";
  run = Shell(Binary() + " trace gen " + trace + " --model qwen3-30b-a3b --layers 2 --steps 2 --batch 9", true);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  run = Shell(Binary() + " run --trace " + trace +
                  " --format json --hidden 64 --intermediate 32 --steps 2 --warmup 5 --layers 2 --no-progress --check",
              false);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_EQ(nlohmann::json::parse(run.out)["options"][0]["step_ms"].size(), 2u);
  run = Shell(Binary() + " run --warmup -1" + std::string(kSmall), true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("--warmup"), std::string::npos) << run.out;
}

}  // namespace
