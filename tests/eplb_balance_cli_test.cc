// `epmoe balance` as a user meets it: help, one-line refusals, held-out scoring on a real trace,
// writing a placement and starting min-move from it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "epmoe/placement.h"
#include "run_command.h"

namespace {

using epmoe::testing::CommandResult;
using epmoe::testing::Epmoe;

std::string Decode() {
  return EPMOE_TEST_DATA_DIR "/flame_moe_290m/decode_32seqs_pos1-10";
}

// The result row of one policy.
nlohmann::json Row(const nlohmann::json& report, const std::string& policy) {
  for (const auto& p : report["results"])
    if (p["policy"] == policy) return p;
  ADD_FAILURE() << "no row for " << policy;
  return {};
}

TEST(EplbBalanceCli, HelpAndOneLineRefusals) {
  const CommandResult help = Epmoe("balance --help");
  EXPECT_EQ(help.exit_code, 0) << help.out;
  EXPECT_NE(help.out.find("--redundant"), std::string::npos);
  const std::string trace = " --trace " + Decode();
  for (const std::string& args : std::vector<std::string>{
           "balance --bogus", "balance" + trace + " --ranks 0 --redundant 8", "balance" + trace + " --ranks 8",
           "balance" + trace + " --ranks 8 --redundant 8 --policy magic",
           "balance" + trace + " --ranks 8 --redundant 8 --train 1.5",
           "balance" + trace + " --ranks 8 --redundant 8 --policy auto --validation 1",
           "balance" + trace + " --ranks 8 --redundant 8 --policy per-step --uniform-prior -1",
           "balance" + trace + " --ranks 3 --redundant 0",
           "balance" + trace + " --ranks 8 --redundant 8 --out /tmp/x.json",
           "balance" + trace + " --ranks 8 --redundant 8 --train 1 --oracle",
           "balance --trace /nonexistent/trace --ranks 8 --redundant 8",
           "balance" + trace + " --ranks 8 --redundant 8 --model deepseek-v3"}) {
    const CommandResult r = Epmoe(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << args << ": " << r.out;
  }
  const CommandResult shape = Epmoe("balance --trace " + Decode() + " --ranks 3 --redundant 0");
  EXPECT_NE(shape.out.find("do not split evenly over 3 ranks"), std::string::npos) << shape.out;
}

TEST(EplbBalanceCli, ScoresEveryPolicyHeldOutAndWritesAPlacement) {
  const CommandResult r = Epmoe("balance --trace " + Decode() + " --ranks 8 --redundant 8 --format json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["steps"], 10);
  EXPECT_EQ(j["train_steps"], 5);
  EXPECT_EQ(j["held_out_steps"], 5);
  std::vector<std::string> names;
  for (const auto& p : j["results"]) {
    names.push_back(p["policy"]);
    const double b = p["held_out"]["balancedness"];
    EXPECT_GT(b, 0.3) << p["policy"];
    EXPECT_LE(b, 1.0) << p["policy"];
    EXPECT_NEAR(p["held_out"]["mean_picks_per_rank"].get<double>(), 32 * 6 / 8.0, 1e-9);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"trivial", "even-router", "deepseek", "deepseek-guarded", "per-step",
                                             "cost", "min-move", "uniform", "auto"}));
  EXPECT_TRUE(j["results"][2].contains("solve_seconds"));

  const std::string out = std::string(EPMOE_BINARY_DIR) + "/eplb_balance_cli_test_placement.json";
  const CommandResult fit =
      Epmoe("balance --trace " + Decode() +
            " --ranks 8 --redundant 8 --policy deepseek-guarded --train 1 --format json --out " + out);
  ASSERT_EQ(fit.exit_code, 0) << fit.out;
  const auto f = nlohmann::json::parse(fit.out);
  EXPECT_EQ(f["held_out_steps"], 0);
  EXPECT_FALSE(f["results"][1].contains("held_out"));
  auto placement = epmoe::ReadPlacementFile(out);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  EXPECT_EQ(placement->num_slots(), 72);
  EXPECT_EQ(placement->num_layers(), 8);
  // min-move from the placement just fitted on the same steps has nothing to move.
  const CommandResult keep =
      Epmoe("balance --trace " + Decode() +
            " --ranks 8 --redundant 8 --policy min-move --train 1 --format json --current " + out);
  ASSERT_EQ(keep.exit_code, 0) << keep.out;
  EXPECT_EQ(Row(nlohmann::json::parse(keep.out), "min-move")["moved_copies"], 0);
  std::remove(out.c_str());
}

// The oracle line bounds the table: fitted on the held-out steps, it is at least as balanced there as
// every placement fitted on the earlier steps, and well above them on a few noisy decode steps.
TEST(EplbBalanceCli, OracleIsTheCeilingOfTheHeldOutTable) {
  const CommandResult r = Epmoe("balance --trace " + Decode() + " --ranks 8 --redundant 8 --oracle --format json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const double oracle = Row(j, "oracle")["held_out"]["balancedness"];
  EXPECT_LE(oracle, 1.0);
  for (const auto& p : j["results"]) {
    if (p["policy"] == "even-router") continue;  // another router, not a placement
    EXPECT_GE(oracle, p["held_out"]["balancedness"].get<double>()) << p["policy"];
  }
  EXPECT_GT(oracle, Row(j, "deepseek")["held_out"]["balancedness"].get<double>() + 0.02);
  const CommandResult text = Epmoe("balance --trace " + Decode() + " --ranks 8 --redundant 8 --oracle");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("\noracle "), std::string::npos) << text.out;
}

TEST(EplbBalanceCli, HeldOutTableHasTheReferenceLinesAndAutosCandidates) {
  // A synthetic trace (8 experts, top-2), so the test needs no shared data.
  const std::string trace = std::string(EPMOE_BINARY_DIR) + "/eplb_balance_cli_test_trace.bin";
  ASSERT_EQ(
      Epmoe("trace gen " + trace + " --experts 8 --top-k 2 --layers 2 --steps 40 --batch 32 --dist zipf").exit_code, 0);
  const std::string args = "balance --trace " + trace + " --ranks 4 --redundant 4 --policy auto";
  const CommandResult text = Epmoe(args);
  ASSERT_EQ(text.exit_code, 0) << text.out;
  // One table line each for trivial, uniform, deepseek and auto, with held-out and fitted balancedness.
  for (const std::string policy : {"trivial", "uniform", "deepseek", "auto"}) {
    const size_t at = text.out.find("\n" + policy + " ");
    ASSERT_NE(at, std::string::npos) << policy << "\n" << text.out;
    const std::string line = text.out.substr(at + 1, text.out.find('\n', at + 1) - at - 1);
    double held_out = 0, fitted = 0;
    ASSERT_EQ(std::sscanf(line.c_str() + policy.size(), "%lf %lf", &held_out, &fitted), 2) << line;
    EXPECT_GT(held_out, 0.2) << line;
    EXPECT_LE(fitted, 1.0) << line;
  }
  EXPECT_NE(text.out.find("balanced  fit bal"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("auto: fitted on the first 10 of those steps, validated on the other 10"), std::string::npos)
      << text.out;
  // The same figures in JSON: every row fitted and held out; auto's candidates, one chosen.
  const CommandResult json = Epmoe(args + " --format json");
  ASSERT_EQ(json.exit_code, 0) << json.out;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["held_out_steps"], 20);
  for (const std::string policy : {"trivial", "deepseek", "uniform", "auto"}) {
    const auto row = Row(j, policy);
    EXPECT_TRUE(row.contains("held_out") && row.contains("train")) << policy;
    const std::string needle = "\n" + policy + " ";
    const size_t at = text.out.find(needle);
    ASSERT_NE(at, std::string::npos);
    EXPECT_NEAR(std::stod(text.out.substr(at + needle.size())), row["held_out"]["balancedness"].get<double>(), 1e-4)
        << policy;
  }
  const nlohmann::json candidates = Row(j, "auto")["validation"]["candidates"];
  int chosen = 0;
  for (const auto& c : candidates) chosen += c["chosen"].get<bool>();
  EXPECT_EQ(chosen, 1);
  EXPECT_EQ(candidates.size(), 7u);  // current (the trivial one), uniform, deepseek, guarded, min-move, per-step, cost
  std::remove(trace.c_str());
}

}  // namespace

namespace {

// A --current placement of another shape is refused for every policy, naming both shapes, instead
// of an internal check's abort; a redundant count that would allocate without bound is refused.
TEST(EplbBalanceCli, RefusesACurrentPlacementOfAnotherShapeAndHugeCopyCounts) {
  const std::string out = std::string(EPMOE_BINARY_DIR) + "/eplb_balance_cli_test_other_shape.json";
  ASSERT_EQ(Epmoe("balance --trace " + Decode() + " --ranks 8 --redundant 8 --policy deepseek --train 1 --out " + out)
                .exit_code,
            0);
  for (const char* policy : {"deepseek", "cost", "min-move"}) {
    const CommandResult r =
        Epmoe("balance --trace " + Decode() + " --ranks 4 --redundant 4 --policy " + policy + " --current " + out);
    EXPECT_EQ(r.exit_code, 1) << policy << ": " << r.out;
    EXPECT_NE(r.out.find("the current placement has 8 layers, 64 experts, 72 slots, 8 ranks"), std::string::npos)
        << policy << ": " << r.out;
  }
  std::remove(out.c_str());
  const CommandResult huge = Epmoe("balance --trace " + Decode() + " --ranks 8 --redundant 2000000000");
  EXPECT_EQ(huge.exit_code, 1) << huge.out;
  EXPECT_NE(huge.out.find("2000000000 redundant copies: at most 512"), std::string::npos) << huge.out;
}

}  // namespace
