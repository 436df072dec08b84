// `epmoe trace` as a user meets it: help, one-line refusals, convert round trips through files,
// gen + stats in JSON, show.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

using epmoe::testing::CommandResult;
using epmoe::testing::Epmoe;

const std::string kTraces = EPMOE_TEST_DATA_DIR;
const std::string kDecode = kTraces + "/flame_moe_290m/decode_32seqs_pos1-10";

std::string TempDir() {
  const auto dir = std::filesystem::path(EPMOE_BINARY_DIR) / "trace_cli_test";
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(TraceCli, EverySubcommandHasHelp) {
  for (const char* cmd :
       {"trace --help", "trace convert --help", "trace gen --help", "trace stats --help", "trace show --help"}) {
    const CommandResult r = Epmoe(cmd);
    EXPECT_EQ(r.exit_code, 0) << cmd << ": " << r.out;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << cmd;
  }
}

TEST(TraceCli, RefusesBadInputWithOneLine) {
  const std::string missing = TempDir() + "/no_such.bin";
  for (const std::string& cmd :
       {std::string("trace stats --bogus"), "trace stats " + kDecode + " --ranks 0",
        "trace stats " + kDecode + " --ranks 65", "trace stats " + kDecode + " --from nosuch", "trace stats " + missing,
        "trace gen " + TempDir() + "/x.bin --dist pareto", "trace gen " + TempDir() + "/x.bin --experts 4 --top-k 8",
        "trace gen " + TempDir() + "/x.bin --correlation 2", "trace convert " + kDecode,
        "trace convert " + kDecode + " " + TempDir() + "/x.bin --to xml", "trace show " + kDecode + " --step 10",
        "trace show " + kDecode + " --layer 8", "trace stats " + kDecode + " --batch 8"}) {
    const CommandResult r = Epmoe(cmd);
    EXPECT_NE(r.exit_code, 0) << cmd;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << cmd << ": " << r.out;
  }
}

TEST(TraceCli, ConvertRoundTripKeepsTheStats) {
  const std::string dir = TempDir();
  ASSERT_EQ(Epmoe("trace convert " + kDecode + " " + dir + "/decode.bin").exit_code, 0);
  ASSERT_EQ(Epmoe("trace convert " + dir + "/decode.bin " + dir + "/decode.jsonl").exit_code, 0);
  ASSERT_EQ(Epmoe("trace convert " + dir + "/decode.jsonl " + dir + "/decode.csv").exit_code, 0);
  std::string first;
  for (const std::string& file : {kDecode, dir + "/decode.bin", dir + "/decode.jsonl", dir + "/decode.csv"}) {
    const CommandResult r = Epmoe("trace stats " + file + " --ranks 8 --format json --experts 64");
    ASSERT_EQ(r.exit_code, 0) << file << ": " << r.out;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["steps"], 10);
    EXPECT_EQ(j["rows"], 320);
    EXPECT_EQ(j["per_layer"][0]["layer"], 2);
    const std::string per_layer = j["per_layer"].dump();
    if (first.empty()) first = per_layer;
    EXPECT_EQ(per_layer, first) << file;
  }
}

TEST(TraceCli, GenStatsAndShow) {
  const std::string file = TempDir() + "/zipf.bin";
  const CommandResult gen = Epmoe("trace gen " + file +
                                  " --dist zipf --zipf-s 1.2 --layers 2 --experts 32 "
                                  "--top-k 4 --steps 5 --batch 16 --seed 3");
  ASSERT_EQ(gen.exit_code, 0) << gen.out;
  const CommandResult stats = Epmoe("trace stats " + file + " --ranks 4 --format json");
  ASSERT_EQ(stats.exit_code, 0) << stats.out;
  auto j = nlohmann::json::parse(stats.out);
  EXPECT_EQ(j["steps"], 5);
  EXPECT_EQ(j["experts"], 32);
  EXPECT_EQ(j["top_k"], 4);
  EXPECT_EQ(j["per_layer"][1]["picks"], 5 * 16 * 4);
  EXPECT_LT(j["balancedness"].get<double>(), 1.0);
  const CommandResult text = Epmoe("trace stats " + file + " --ranks 4");
  ASSERT_EQ(text.exit_code, 0);
  EXPECT_NE(text.out.find("balancedness"), std::string::npos);
  const CommandResult show = Epmoe("trace show " + kTraces + "/flame_moe_290m/prefill_4seqs_x64tok --rows 1");
  ASSERT_EQ(show.exit_code, 0) << show.out;
  EXPECT_NE(show.out.find("row 0: 34:0.0998 28:0.0523 21:0.0417 47:0.0384 3:0.0326 12:0.0296"), std::string::npos)
      << show.out;
  const CommandResult counts = Epmoe("trace stats " + kTraces +
                                     "/olmoe_paper_expert_counts/expert_counts.csv "
                                     "--filter model=olmoe,domain=arxiv,selection=topk --format json");
  ASSERT_EQ(counts.exit_code, 0) << counts.out;
  auto c = nlohmann::json::parse(counts.out);
  EXPECT_EQ(c["has_picks"], false);
  EXPECT_EQ(c["per_layer"][0]["hottest"][0]["expert"], 0);
}

}  // namespace
