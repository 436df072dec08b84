// The JSONL importer on files as collectors write them: sequence keys by other names (problem_id
// strings) and tokens whose record is missing for some layer, refused by default or dropped and
// counted with on_missing = "drop-token".
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "epmoe/trace.h"
#include "run_command.h"

namespace {

std::string WriteJsonl(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// Two problems of two tokens each through layers 3 and 7; problem "b" token 1 lacks layer 7.
std::string Collected() {
  return WriteJsonl("collected.jsonl",
                    R"({"problem_id": "a", "token_idx": 0, "layer": 3, "experts": [0, 1]}
{"problem_id": "a", "token_idx": 0, "layer": 7, "experts": [2, 3]}
{"problem_id": "a", "token_idx": 1, "layer": 3, "experts": [1, 2]}
{"problem_id": "a", "token_idx": 1, "layer": 7, "experts": [3, 0]}
{"problem_id": "b", "token_idx": 0, "layer": 7, "experts": [1, 3]}
{"problem_id": "b", "token_idx": 0, "layer": 3, "experts": [0, 2]}
{"problem_id": "b", "token_idx": 1, "layer": 3, "experts": [3, 1]}
)");
}

TEST(TraceJsonlMissing, RefusedByDefaultNamingTheToken) {
  auto load = epmoe::ReadExpertLoad(Collected(), epmoe::LoadReadOptions{});
  ASSERT_FALSE(load.ok());
  EXPECT_NE(load.status().message().find("token 1 of step 0 (line 7) has no record for layer 7"), std::string::npos)
      << load.status().message();
  EXPECT_NE(load.status().message().find("drop-token"), std::string::npos);
}

TEST(TraceJsonlMissing, DropTokenCountsAndKeepsTheRest) {
  epmoe::LoadReadOptions options;
  options.on_missing = "drop-token";
  epmoe::TraceInfo info;
  auto load = epmoe::ReadExpertLoad(Collected(), options, &info);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  EXPECT_EQ(info.dropped_tokens, 1);
  EXPECT_EQ(info.layer_ids, (std::vector<int>{3, 7}));
  ASSERT_EQ(load->num_steps, 1);
  EXPECT_EQ(load->rows[0], 3);
  // Layer 3 (renumbered 0): experts {0,1} {1,2} {0,2}; layer 7: {2,3} {3,0} {1,3}.
  EXPECT_EQ(std::vector<int64_t>(load->at(0, 0).begin(), load->at(0, 0).end()), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(std::vector<int64_t>(load->at(0, 1).begin(), load->at(0, 1).end()), (std::vector<int64_t>{1, 1, 1, 3}));
  options.on_missing = "ignore";
  EXPECT_FALSE(epmoe::ReadExpertLoad(Collected(), options).ok());
}

TEST(TraceJsonlMissing, EveryTokenIncompleteIsAnError) {
  epmoe::LoadReadOptions options;
  options.on_missing = "drop-token";
  const std::string path =
      WriteJsonl("incomplete.jsonl", R"({"request_id": 4, "token_idx": 0, "layer": 0, "experts": [0]}
{"request_id": 5, "token_idx": 0, "layer": 1, "experts": [1]}
)");
  auto load = epmoe::ReadExpertLoad(path, options);
  ASSERT_FALSE(load.ok());
  EXPECT_NE(load.status().message().find("all 2 tokens"), std::string::npos) << load.status().message();
}

TEST(TraceJsonlMissing, CliFlag) {
  const auto refused = epmoe::testing::Epmoe("trace stats " + Collected());
  EXPECT_NE(refused.exit_code, 0);
  const auto stats = epmoe::testing::Epmoe("trace stats " + Collected() + " --ranks 2 --on-missing drop-token");
  EXPECT_EQ(stats.exit_code, 0) << stats.out;
  EXPECT_NE(stats.out.find("dropped 1 tokens"), std::string::npos) << stats.out;
}

}  // namespace
