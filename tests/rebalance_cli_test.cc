// `epmoe run --eplb` end to end under mpirun: a run that rebalances every few steps, with fp32
// weights, rows and combine, matches the single-process layer exactly at every layer of every step
// (--check reports the largest normalized difference), as the same run without --eplb does, so the
// two runs' outputs are identical bit for bit. Also the metrics file, text output and refusals.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "run_command.h"

namespace {

using epmoe::testing::CommandResult;
using epmoe::testing::EpmoeBinary;
using epmoe::testing::RunCommand;

const std::string kMpirun =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
    "mpirun --oversubscribe --bind-to none -np 2 ";
const std::string kShape =
    " --model olmoe-1b-7b --hidden 64 --intermediate 32 --tokens 24 --steps 12 --layers 2 --no-progress"
    " --dispatch-format fp32 --combine-format fp32 --weight-format fp32 --check";

// `steps` replaces the shape's 12 steps (async runs need more: a placement computed on rank 0's
// helper thread switches a few of these millisecond steps after its look, or after the run).
nlohmann::json RunJson(const std::string& args, int steps = 12) {
  std::string shape = kShape;
  shape.replace(shape.find("--steps 12"), 10, "--steps " + std::to_string(steps));
  const CommandResult run = RunCommand(kMpirun + EpmoeBinary() + " run --format json" + shape + args, false);
  EXPECT_EQ(run.exit_code, 0) << run.out;
  if (run.exit_code != 0) return {};
  return nlohmann::json::parse(run.out);
}

TEST(RebalanceCli, RebalancingA2aRunMatchesTheFixedOneBitForBit) {
  const std::string metrics = (std::filesystem::temp_directory_path() / "epmoe_rebalance_cli_test.prom").string();
  std::remove(metrics.c_str());
  const auto fixed = RunJson(" --option a2a");
  const auto live = RunJson(" --option a2a --eplb --eplb-interval 3 --eplb-redundant 2 --eplb-policy deepseek-guarded"
                            " --metrics-file " + metrics);
  ASSERT_FALSE(fixed.is_null());
  ASSERT_FALSE(live.is_null());
  EXPECT_EQ(fixed["options"][0]["max_normalized_error"].get<double>(), 0.0);
  EXPECT_EQ(live["options"][0]["max_normalized_error"].get<double>(), 0.0);
  const auto& eplb = live["options"][0]["eplb"];
  ASSERT_GE(eplb["rebalances"].size(), 3u) << eplb.dump();
  EXPECT_GT(eplb["bytes_moved_total"].get<int64_t>(), 0);
  for (const auto& r : eplb["rebalances"]) {
    EXPECT_EQ(r["bytes_sent_by_rank"].size(), 2u);
    EXPECT_GE(r["stall_ms_max_rank"].get<double>(), 0);
  }
  std::ifstream in(metrics);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("epmoe_rebalances_total " + std::to_string(eplb["rebalances"].size()) + "\n"), std::string::npos)
      << text.str();
  EXPECT_NE(text.str().find("epmoe_step_seconds{quantile=\"0.9\"}"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("epmoe_stage_seconds_total{stage=\"rebalance\"}"), std::string::npos) << text.str();
  std::remove(metrics.c_str());
}

// a2a's low-latency mode (fixed buffers sized for the redundant placement's slots) follows every
// installed placement too, exactly.
TEST(RebalanceCli, RebalancingLowLatencyA2aMatchesTheSingleProcessLayer) {
  const auto live = RunJson(
      " --option a2a --a2a-mode low-latency --eplb --eplb-interval 3 --eplb-redundant 2"
      " --eplb-policy deepseek-guarded");
  ASSERT_FALSE(live.is_null());
  EXPECT_EQ(live["options"][0]["a2a_mode"], "low-latency");
  EXPECT_EQ(live["options"][0]["max_normalized_error"].get<double>(), 0.0);
  ASSERT_GE(live["options"][0]["eplb"]["rebalances"].size(), 3u) << live["options"][0]["eplb"].dump();
}

TEST(RebalanceCli, WholeAsyncChunkedMatchesTheSingleProcessLayer) {
  // Enough steps that the placement thread gets the core (two ranks poll on two cores) several
  // times over: a run's step count, not wall time, bounds how many rebalances it can see.
  const auto live = RunJson(" --option whole --eplb --eplb-interval 3 --eplb-async --eplb-layers-per-chunk 1", 200);
  ASSERT_FALSE(live.is_null());
  EXPECT_LE(live["options"][0]["max_normalized_error"].get<double>(), 1e-5);
  const auto& eplb = live["options"][0]["eplb"];
  ASSERT_GE(eplb["rebalances"].size(), 2u) << eplb.dump();
  for (const auto& r : eplb["rebalances"]) EXPECT_EQ(r["chunks"].get<int>(), 2);
}

// Async: rank 0 computes each placement on a helper thread while steps run; a2a stays exact.
TEST(RebalanceCli, AsyncPlacementThreadA2aMatchesTheSingleProcessLayerExactly) {
  const auto live = RunJson(" --option a2a --eplb --eplb-interval 3 --eplb-async --eplb-redundant 2"
                            " --eplb-policy deepseek-guarded", 200);
  ASSERT_FALSE(live.is_null());
  EXPECT_EQ(live["options"][0]["max_normalized_error"].get<double>(), 0.0);
  const auto& eplb = live["options"][0]["eplb"];
  ASSERT_GE(eplb["rebalances"].size(), 1u) << eplb.dump();
  for (const auto& r : eplb["rebalances"])
    EXPECT_GT(r["placement_ready_at_step"].get<int64_t>(), r["decided_at_step"].get<int64_t>()) << r.dump();
  EXPECT_EQ(eplb["wall_ms_per_step"].size(), 200u);
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = (std::filesystem::temp_directory_path() / name).string();
  std::ofstream(path) << text;
  return path;
}

TEST(RebalanceCli, PlotBalanceDrawsOneLinePerRun) {
  const auto off = RunJson(" --option a2a --eplb --eplb-interval 1000");  // records, never rebalances
  const auto on = RunJson(" --option a2a --eplb --eplb-interval 3");
  ASSERT_FALSE(off.is_null());
  ASSERT_FALSE(on.is_null());
  EXPECT_EQ(off["options"][0]["eplb"]["rebalances"].size(), 0u);
  const std::string off_path = WriteTemp("epmoe_plot_off.json", off.dump());
  const std::string on_path = WriteTemp("epmoe_plot_on.json", on.dump());
  const std::string svg = (std::filesystem::temp_directory_path() / "epmoe_plot_balance.svg").string();
  const CommandResult run = RunCommand(EpmoeBinary() + " plot-balance " + svg + " --run 'EPLB off=" + off_path +
                                           "' --run 'EPLB on=" + on_path + "' --smooth 4",
                                       true);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("EPLB off"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("12 steps"), std::string::npos) << run.out;
  std::ifstream in(svg);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str().rfind("<svg", 0), 0u);
  size_t lines = 0;
  for (size_t at = text.str().find("<polyline"); at != std::string::npos; at = text.str().find("<polyline", at + 1))
    ++lines;
  EXPECT_EQ(lines, 2u);
  EXPECT_NE(text.str().find(">EPLB on</text>"), std::string::npos);

  CommandResult bad = RunCommand(EpmoeBinary() + " plot-balance " + svg + " --run " + on_path, true);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("expected LABEL=PATH"), std::string::npos) << bad.out;
  bad = RunCommand(EpmoeBinary() + " plot-balance " + svg + " --run x=/nonexistent/run.json", true);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("/nonexistent/run.json: cannot open"), std::string::npos) << bad.out;
  const std::string fixed_path = WriteTemp("epmoe_plot_fixed.json", RunJson(" --option a2a").dump());
  bad = RunCommand(EpmoeBinary() + " plot-balance " + svg + " --run x=" + fixed_path, true);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("no option has an \"eplb\" object"), std::string::npos) << bad.out;
  for (const auto& path : {off_path, on_path, fixed_path, svg}) std::remove(path.c_str());
}

TEST(RebalanceCli, TextOutputAndOneProcess) {
  const CommandResult run =
      RunCommand(EpmoeBinary() + " run --option a2a --eplb --eplb-interval 2" + kShape, true);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("eplb (interval trigger, looks every 2 steps"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("rebalance(s)"), std::string::npos) << run.out;
}

TEST(RebalanceCli, RefusesWithOneLineReasons) {
  CommandResult run = RunCommand(EpmoeBinary() + " run --option dwdp --eplb", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("--eplb rebalances the a2a and whole options, not dwdp"), std::string::npos) << run.out;
  run = RunCommand(EpmoeBinary() + " run --option a2a --metrics-file /tmp/x.prom", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("--metrics-file needs --eplb"), std::string::npos) << run.out;
  run = RunCommand(EpmoeBinary() + " run --option a2a --eplb --eplb-threshold 2", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("--eplb-threshold 2"), std::string::npos) << run.out;
  run = RunCommand(kMpirun + EpmoeBinary() + " run --option a2a --eplb --eplb-redundant 1 --model olmoe-1b-7b", true);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("do not split evenly over 2 ranks"), std::string::npos) << run.out;
  run = RunCommand(EpmoeBinary() + " run --option a2a --eplb --eplb-trigger sometimes", true);
  EXPECT_NE(run.exit_code, 0);
  run = RunCommand(EpmoeBinary() + " run --option a2a --eplb --eplb-policy magic", true);
  EXPECT_NE(run.exit_code, 0);
}

// Measure, place, run: a run records its load, `epmoe balance` places from it, a run starts from
// that placement (and matches the single-process layer); a placement of another shape is refused
// naming the field.
TEST(RebalanceCli, RecordedLoadPlacesTheNextRun) {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string load = (dir / "epmoe_rebalance_cli_load.bin").string();
  const std::string placement = (dir / "epmoe_rebalance_cli_placement.json").string();
  std::remove(load.c_str());
  std::remove(placement.c_str());
  const auto recorded = RunJson(" --option a2a --routing scores --record-load " + load + " --eplb-record per-step");
  ASSERT_FALSE(recorded.is_null());
  CommandResult balance = RunCommand(EpmoeBinary() + " balance --trace " + load +
                                         " --ranks 2 --redundant 2 --policy deepseek --out " + placement,
                                     true);
  ASSERT_EQ(balance.exit_code, 0) << balance.out;
  const auto placed = RunJson(" --option a2a,whole --routing scores --placement " + placement + " --eplb-redundant 2");
  ASSERT_FALSE(placed.is_null());
  EXPECT_EQ(placed["options"][0]["max_normalized_error"].get<double>(), 0.0);
  CommandResult wrong = RunCommand(EpmoeBinary() + " run --option a2a --layers 2 --model olmoe-1b-7b --placement " +
                                       placement + " --eplb-redundant 2",
                                   true);
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.out.find("num_ranks is 2, the run needs 1"), std::string::npos) << wrong.out;
  wrong = RunCommand(kMpirun + EpmoeBinary() + " run --option a2a --layers 2 --model olmoe-1b-7b --placement " +
                         placement,
                     true);
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.out.find("num_slots (experts + --eplb-redundant) is 66, the run needs 64"), std::string::npos)
      << wrong.out;
  wrong = RunCommand(EpmoeBinary() + " run --option sliced --placement " + placement, true);
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.out.find("--placement places the experts of the a2a and whole options, not sliced"),
            std::string::npos)
      << wrong.out;
  std::remove(load.c_str());
  std::remove(placement.c_str());
}

// Shapes the policy cannot place are refused before the first step, not at the first rebalance;
// a metrics path that cannot be written is refused before the first step and leaves nothing.
TEST(RebalanceCli, RefusesImpossibleShapesAndMetricsPathsAtTheStart) {
  CommandResult run = RunCommand(kMpirun + EpmoeBinary() +
                                     " run --option a2a --eplb --eplb-policy deepseek-guarded "
                                     "--eplb-redundant 66 --eplb-interval 30 --steps 40" +
                                     kShape.substr(0, kShape.find(" --tokens")),
                                 true);
  EXPECT_NE(run.exit_code, 0);
  // Named by the flags, as the start's check words it (the first rebalance's would name a step).
  EXPECT_NE(run.out.find("--eplb-policy deepseek-guarded --eplb-redundant 66: 65 slots per rank cannot hold distinct"),
            std::string::npos)
      << run.out;
  const auto dir = std::filesystem::temp_directory_path() / "epmoe_rebalance_cli_metrics_dir";
  std::filesystem::create_directories(dir);
  run = RunCommand(EpmoeBinary() + " run --option a2a --eplb --metrics-file " + dir.string() +
                       " --hidden 64 --intermediate 32 --no-progress",
                   true);
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("is a directory"), std::string::npos) << run.out;
  for (const auto& entry : std::filesystem::directory_iterator(dir.parent_path()))
    EXPECT_EQ(entry.path().filename().string().find("epmoe_rebalance_cli_metrics_dir.tmp"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
