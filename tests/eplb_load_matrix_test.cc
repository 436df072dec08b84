// Load matrices (any non-negative numbers per layer and expert): the readers of every format
// against the values written, their refusals, and placements from them against the same values
// as a trace's picks and DeepSeek's published example.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "epmoe/eplb_policy.h"
#include "epmoe/load_matrix.h"
#include "epmoe/placement.h"
#include "run_command.h"

namespace {

using epmoe::LoadMatrix;

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// A version-1 .npy file of `count` items of `descr` (e.g. "<f8") in `shape` (e.g. "(2, 3)").
std::string Npy(const std::string& descr, const std::string& shape, const void* data, size_t bytes) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  out += header;
  out.append(static_cast<const char*>(data), bytes);
  return out;
}

TEST(LoadMatrix, JsonFormsGiveTheirValuesAndShape) {
  auto two = epmoe::LoadMatrixFromJson("[[1.5, 2, 0], [4, 5e3, 6]]", "two");
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(two->num_steps, 1);
  EXPECT_EQ(two->num_layers, 2);
  EXPECT_EQ(two->num_experts, 3);
  EXPECT_EQ(two->values, (std::vector<double>{1.5, 2, 0, 4, 5e3, 6}));
  auto object = epmoe::LoadMatrixFromJson(R"({"weight": [[1, 2], [3, 4]], "num_replicas": 4})", "object");
  ASSERT_TRUE(object.ok()) << object.status().ToString();
  EXPECT_EQ(object->values, (std::vector<double>{1, 2, 3, 4}));
  auto three = epmoe::LoadMatrixFromJson("[[[1, 2]], [[3, 4]], [[5, 6]]]", "three");
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(three->num_steps, 3);
  EXPECT_EQ(three->num_layers, 1);
  EXPECT_EQ(three->at(2, 0)[1], 6);
  auto one = epmoe::LoadMatrixFromJson("[7, 8, 9]", "one");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->num_layers, 1);
  EXPECT_EQ(one->num_experts, 3);
}

TEST(LoadMatrix, BadJsonIsRefusedWithWhere) {
  const std::vector<std::pair<std::string, std::string>> cases = {{"[[1, 2], [3]]", "src[1]"},
                                                                  {"[[1, 2], [3, -1]]", "layer 1 expert 1"},
                                                                  {"[[1, \"x\"]]", "src[0][1]"},
                                                                  {"{\"w\": [[1]]}", "\"weight\""},
                                                                  {"[[1, 2], [[3], 4]]", "src[1][0]"},
                                                                  {"[]", "empty"},
                                                                  {"[[[[1]]]]", "1 to 3 dimensions"},
                                                                  {"[[1, 2]", "not valid JSON"},
                                                                  {"[1, [2]]", "src[1]"}};
  for (const auto& [text, expected] : cases) {
    auto load = epmoe::LoadMatrixFromJson(text, "src");
    ASSERT_FALSE(load.ok()) << text;
    EXPECT_NE(load.status().message().find(expected), std::string::npos) << text << ": " << load.status().message();
  }
}

TEST(LoadMatrix, CsvWithHeaderAndSteps) {
  const std::string path = WriteFile("load.csv", "e0,e1,e2\r\n1,2,3\n4.5, 5 ,6\n\n7,8,9\n10,11,12\n");
  auto load = epmoe::ReadLoadMatrix(path);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  EXPECT_EQ(load->num_steps, 2);
  EXPECT_EQ(load->num_layers, 2);
  EXPECT_EQ(load->num_experts, 3);
  EXPECT_EQ(load->values, (std::vector<double>{1, 2, 3, 4.5, 5, 6, 7, 8, 9, 10, 11, 12}));
  auto ragged = epmoe::ReadLoadMatrix(WriteFile("ragged.csv", "1,2,3\n4,5\n"));
  ASSERT_FALSE(ragged.ok());
  EXPECT_NE(ragged.status().message().find("ragged.csv:2"), std::string::npos) << ragged.status().message();
  auto text = epmoe::ReadLoadMatrix(WriteFile("text.csv", "a,b\n1,2\nx,3\n"));
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("text.csv:3"), std::string::npos) << text.status().message();
  auto steps = epmoe::ReadLoadMatrix(WriteFile("steps.csv", "1,2\n3,4\n\n5,6\n"));
  ASSERT_FALSE(steps.ok());
  EXPECT_NE(steps.status().message().find("layers"), std::string::npos) << steps.status().message();
  EXPECT_FALSE(epmoe::ReadLoadMatrix(::testing::TempDir() + "/absent.csv").ok());
}

TEST(LoadMatrix, NpyTypes) {
  const double f8[] = {1.25, 2, 3, 4, 5, 6};
  auto d = epmoe::ReadLoadMatrix(WriteFile("f8.npy", Npy("<f8", "(2, 3)", f8, sizeof(f8))));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->num_layers, 2);
  EXPECT_EQ(d->values, std::vector<double>(f8, f8 + 6));
  const float f4[] = {0.5f, 1, 2, 3};
  auto f = epmoe::ReadLoadMatrix(WriteFile("f4.npy", Npy("<f4", "(2, 1, 2)", f4, sizeof(f4))));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->num_steps, 2);
  EXPECT_EQ(f->values, (std::vector<double>{0.5, 1, 2, 3}));
  const int64_t i8[] = {9, 8, 7};
  auto i = epmoe::ReadLoadMatrix(WriteFile("i8.npy", Npy("<i8", "(3,)", i8, sizeof(i8))));
  ASSERT_TRUE(i.ok()) << i.status().ToString();
  EXPECT_EQ(i->values, (std::vector<double>{9, 8, 7}));
  const uint16_t f2[] = {0x3c00, 0x4000};  // 1.0 and 2.0 in IEEE half precision
  auto h = epmoe::ReadLoadMatrix(WriteFile("f2.npy", Npy("<f2", "(1, 2)", f2, sizeof(f2))));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->values, (std::vector<double>{1, 2}));
  const int32_t negative[] = {1, -2};
  auto n = epmoe::ReadLoadMatrix(WriteFile("neg.npy", Npy("<i4", "(1, 2)", negative, sizeof(negative))));
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("expert 1"), std::string::npos) << n.status().message();
  auto short_data = epmoe::ReadLoadMatrix(WriteFile("short.npy", Npy("<f8", "(2, 3)", f8, 40)));
  ASSERT_FALSE(short_data.ok());
  EXPECT_NE(short_data.status().message().find("40 bytes"), std::string::npos) << short_data.status().message();
  auto big_endian = epmoe::ReadLoadMatrix(WriteFile("be.npy", Npy(">f8", "(2, 3)", f8, sizeof(f8))));
  ASSERT_FALSE(big_endian.ok());
  EXPECT_NE(big_endian.status().message().find("little-endian"), std::string::npos);
  auto objects = epmoe::ReadLoadMatrix(WriteFile("obj.npy", Npy("|O", "(2, 3)", f8, sizeof(f8))));
  EXPECT_FALSE(objects.ok());
}

// Integer values as a load matrix and as a trace's picks give the same placement, every policy.
TEST(LoadMatrix, PlacementsMatchTheTracePath) {
  epmoe::ExpertLoad picks(3, 2, 16, 2);
  uint64_t state = 7;
  for (int64_t& c : picks.counts) c = static_cast<int64_t>((state = state * 6364136223846793005ULL + 1) >> 58);
  const LoadMatrix weights = epmoe::ToLoadMatrix(picks);
  epmoe::PolicyOptions options;
  options.shape = {4, 2, 4, 4};
  auto trivial = epmoe::Placement::Trivial(2, 16, 4, 4, 2);
  ASSERT_TRUE(trivial.ok());
  options.current = &*trivial;
  for (epmoe::Policy policy : epmoe::AllPolicies()) {
    options.policy = policy;
    auto from_picks = epmoe::ComputePlacement(picks, options);
    auto from_weights = epmoe::ComputePlacement(weights, options);
    ASSERT_TRUE(from_picks.ok() && from_weights.ok()) << epmoe::PolicyName(policy);
    EXPECT_TRUE(*from_picks == *from_weights) << epmoe::PolicyName(policy);
    const epmoe::PlacementScore a = epmoe::ScorePlacement(*from_picks, picks, options.cost);
    const epmoe::PlacementScore b = epmoe::ScorePlacement(*from_weights, weights, options.cost);
    EXPECT_DOUBLE_EQ(a.balancedness, b.balancedness);
    EXPECT_DOUBLE_EQ(a.max_picks, b.max_picks);
    EXPECT_DOUBLE_EQ(a.step_seconds, b.step_seconds);
  }
}

TEST(LoadMatrix, DeepseekReadmeExampleGivesItsPublishedOutput) {
  auto file = epmoe::ReadLoadMatrix(EPMOE_TEST_DATA_DIR "/deepseek_eplb_reference_example.json");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::ifstream in(EPMOE_TEST_DATA_DIR "/deepseek_eplb_reference_example.json");
  const nlohmann::json reference = nlohmann::json::parse(in);
  epmoe::PolicyOptions options;
  options.shape = {reference["num_gpus"], reference["num_nodes"], reference["num_groups"],
                   reference["num_replicas"].get<int>() - file->num_experts};
  auto placement = epmoe::ComputePlacement(*file, options);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  for (int layer = 0; layer < 2; ++layer) {
    auto phy2log = placement->phy2log(layer);
    EXPECT_EQ(std::vector<int32_t>(phy2log.begin(), phy2log.end()),
              reference["expected_phy2log"][layer].get<std::vector<int32_t>>());
  }
  // Fractions of the same loads (any unit) place the same.
  LoadMatrix scaled = *file;
  for (double& v : scaled.values) v *= 0.001;
  auto fractional = epmoe::ComputePlacement(scaled, options);
  ASSERT_TRUE(fractional.ok());
  EXPECT_TRUE(*fractional == *placement);
}

// `epmoe balance --load`: DeepSeek's example (layers totalling differently) through the CLI, and
// one-line refusals.
TEST(LoadMatrix, BalanceCommandTakesAnyLoadMatrix) {
  const std::string reference = EPMOE_TEST_DATA_DIR "/deepseek_eplb_reference_example.json";
  const std::string out = ::testing::TempDir() + "/deepseek_example_placement.json";
  const auto r = epmoe::testing::Epmoe("balance --load " + reference +
                                       " --ranks 8 --nodes 2 --groups 4 --redundant 4 --policy deepseek --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto placement = epmoe::ReadPlacementFile(out);
  ASSERT_TRUE(placement.ok()) << placement.status().ToString();
  std::ifstream in(reference);
  const nlohmann::json expected = nlohmann::json::parse(in)["expected_phy2log"];
  for (int layer = 0; layer < 2; ++layer) {
    auto phy2log = placement->phy2log(layer);
    EXPECT_EQ(std::vector<int32_t>(phy2log.begin(), phy2log.end()), expected[layer].get<std::vector<int32_t>>());
  }
  const std::string csv = WriteFile("cli.csv", "0.5,1.5,2,3\n4,3,2,1\n\n1,1,1,1\n2,2,2,2\n");
  const auto json = epmoe::testing::RunCommand(
      epmoe::testing::EpmoeBinary() + " balance --load " + csv + " --ranks 2 --redundant 2 --format json", false);
  ASSERT_EQ(json.exit_code, 0) << json.out;
  const nlohmann::json report = nlohmann::json::parse(json.out);
  EXPECT_EQ(report["steps"], 2);
  EXPECT_EQ(report["results"].size(), 8u);  // trivial and the seven policies
  // SGLang's recorder JSON in, SGLang's --init-expert-location file out: one row per layer.
  const std::string sglang_in = WriteFile("dump.json", R"({"logical_count": [[[0, 0, 0, 0], [5, 1, 2, 9]]]})");
  const std::string sglang_out = ::testing::TempDir() + "/expert_location.json";
  const auto sglang = epmoe::testing::Epmoe("balance --load " + sglang_in +
                                            " --ranks 2 --redundant 2 --policy deepseek --out-sglang " + sglang_out);
  ASSERT_EQ(sglang.exit_code, 0) << sglang.out;
  std::ifstream sglang_file(sglang_out);
  const nlohmann::json map = nlohmann::json::parse(sglang_file)["physical_to_logical_map"];
  ASSERT_EQ(map.size(), 2u);
  EXPECT_EQ(map[0].size(), 6u);
  // DeepSeek's replication of [5, 1, 2, 9]: 9 -> two copies of 4.5, then 5 -> two copies of 2.5.
  EXPECT_EQ(std::count(map[1].begin(), map[1].end(), 3), 2);
  EXPECT_EQ(std::count(map[1].begin(), map[1].end(), 0), 2);
  EXPECT_NE(
      epmoe::testing::Epmoe("balance --load " + sglang_in + " --ranks 2 --redundant 2 --out-sglang x.json").exit_code,
      0);  // several policies
  for (const std::string& bad :
       std::vector<std::string>{"balance --load " + csv + " --ranks 2 --redundant 2 --train 0.5",
                                "balance --load " + csv + " --trace x --ranks 2 --redundant 2",
                                "balance --ranks 2 --redundant 2", "balance --load " + csv + " --ranks 4 --redundant 2",
                                "balance --load " + WriteFile("neg.json", "[[1, -1]]") + " --ranks 1 --redundant 0"}) {
    const auto refused = epmoe::testing::Epmoe(bad);
    EXPECT_NE(refused.exit_code, 0) << bad;
    EXPECT_EQ(std::count(refused.out.begin(), refused.out.end(), '\n'), 1) << bad << ": " << refused.out;
  }
}

}  // namespace
