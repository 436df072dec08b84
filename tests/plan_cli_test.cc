// `epmoe plan` and `epmoe hardware` end to end: every output format, the SVG, refusals of bad flags.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "run_command.h"

namespace {

using CommandRun = epmoe::testing::CommandResult;
using epmoe::testing::Epmoe;

TEST(PlanCliTest, JsonOutputParses) {
  const CommandRun run =
      Epmoe("plan --model glm-5.3 --hardware b300x8 --gpus 8,16 --batch 8,64 --samples 4 --format json");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out);
  EXPECT_EQ(j["model"], "glm-5.3");
  EXPECT_EQ(j["hardware"], "b300x8");
  EXPECT_EQ(j["costs"].size(), 2u * 2u * 5u);
  EXPECT_EQ(j["winners"].size(), 4u);
  EXPECT_EQ(j["derived"]["bytes_per_expert"], 21'233'676);
  EXPECT_EQ(j["derived"]["four_bit_bytes_per_layer"], 4'831'838'208);
  for (const auto& c : j["costs"])
    if (c["applicable"].get<bool>()) {
      EXPECT_GT(c["step_ms"].get<double>(), 0.0) << c.dump();
    }
}

TEST(PlanCliTest, TextMarkdownCsvAndPlot) {
  const CommandRun text = Epmoe("plan --model deepseek-v3 --hardware h200x8 --gpus 32 --batch 256 --samples 2");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("winner:"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("copies sent per row"), std::string::npos) << text.out;

  const CommandRun md =
      Epmoe("plan --model deepseek-v3 --hardware h200x8 --gpus 32 --batch 256 --samples 2 --format md");
  ASSERT_EQ(md.exit_code, 0) << md.out;
  EXPECT_NE(md.out.find("| batch | GPUs | option |"), std::string::npos) << md.out;

  const CommandRun csv =
      Epmoe("plan --model deepseek-v3 --hardware h200x8 --gpus 16,32 --batch 256 --samples 2 --format csv");
  ASSERT_EQ(csv.exit_code, 0) << csv.out;
  std::istringstream lines(csv.out);
  std::string line;
  int rows = 0;
  std::getline(lines, line);
  EXPECT_EQ(line.rfind("model,hardware,phase,batch,gpus,option", 0), 0u) << line;
  while (std::getline(lines, line)) ++rows;
  EXPECT_EQ(rows, 10);

  const std::string svg_path = ::testing::TempDir() + "plan_cli_test.svg";
  const CommandRun plot = Epmoe(
      "plan --model glm-5.3 --hardware b300x8 --gpus 8,16,32 --batch 8,64,256 --samples 2 "
      "--format csv --plot " +
      svg_path);
  ASSERT_EQ(plot.exit_code, 0) << plot.out;
  std::ifstream in(svg_path);
  std::stringstream svg;
  svg << in.rdbuf();
  EXPECT_EQ(svg.str().rfind("<svg", 0), 0u);
  EXPECT_NE(svg.str().find("copies sent per row"), std::string::npos);
  EXPECT_NE(svg.str().find("</svg>"), std::string::npos);
  EXPECT_NE(svg.str().find("<polyline"), std::string::npos);
}

TEST(PlanCliTest, BadInputIsRefusedWithOneLine) {
  for (const char* args :
       {"plan --model glm-5.3 --hardware b300x8 --gpus 0", "plan --model glm-5.3 --hardware b300x8 --batch -5",
        "plan --model glm-5.3 --hardware nope", "plan --model nope --hardware b300x8",
        "plan --model glm-5.3 --hardware b300x8 --phase train",
        "plan --model glm-5.3 --hardware b300x8 --options sliced,teleport",
        "plan --model glm-5.3 --hardware b300x8 --frobnicate",
        "plan --model glm-5.3 --hardware b300x8 --trace /nonexistent/trace.bin",
        "hardware show /nonexistent/profile.json"}) {
    const CommandRun run = Epmoe(args);
    EXPECT_NE(run.exit_code, 0) << args << "\n" << run.out;
    EXPECT_FALSE(run.out.empty()) << args;
    EXPECT_LE(std::count(run.out.begin(), run.out.end(), '\n'), 1) << args << "\n" << run.out;
  }
}

TEST(PlanCliTest, MeasuredRunIsCompared) {
  // A minimal `epmoe run --format json` result: 8 ranks, 64 tokens, 2 layers, two options.
  const std::string path = ::testing::TempDir() + "plan_cli_run.json";
  {
    std::ofstream out(path);
    out << R"({"ranks": 8, "tokens": 64, "layers": 2, "options": [)"
        << R"({"option": "sliced", "step_ms_median": 0.4}, {"option": "a2a", "step_ms_median": 0.5}]})";
  }
  const CommandRun run =
      Epmoe("plan --model glm-5.3 --hardware b300x8 --gpus 8 --batch 64 --samples 2 --format json --measured " + path);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out)["calibration_check"];
  ASSERT_EQ(j["options"].size(), 2u);
  EXPECT_DOUBLE_EQ(j["options"][0]["measured_us_per_layer"].get<double>(), 200.0);  // 0.4 ms / 2 layers
  EXPECT_EQ(j["measured_order"][0], "sliced");
  EXPECT_TRUE(j["pairs"].empty());  // no per-step times: the medians' order is all there is
  // A run at another rank count is refused, naming what to pass.
  const CommandRun other =
      Epmoe("plan --model glm-5.3 --hardware b300x8 --gpus 16 --batch 64 --samples 2 --measured " + path);
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.out.find("--gpus 8 --batch 64"), std::string::npos) << other.out;
  // A run of another model shape or weight format is refused, naming the field; --hidden and
  // --intermediate give the plan the run's shape.
  const std::string scaled = ::testing::TempDir() + "plan_cli_scaled_run.json";
  {
    std::ofstream out(scaled);
    out << R"({"ranks": 8, "tokens": 64, "layers": 2, "hidden": 1024, "expert_intermediate": 512, "num_experts": 256,)"
        << R"( "top_k": 8, "weight_format": "nvfp4", "options": [{"option": "a2a", "step_ms_median": 0.5}]})";
  }
  const std::string plan =
      "plan --model glm-5.3 --hardware b300x8 --gpus 8 --batch 64 --samples 2 --measured " + scaled;
  CommandRun refused = Epmoe(plan);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("hidden 1024"), std::string::npos) << refused.out;
  refused = Epmoe(plan + " --hidden 1024 --intermediate 512 --weights bf16");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("nvfp4"), std::string::npos) << refused.out;
  const CommandRun matched = Epmoe(plan + " --hidden 1024 --intermediate 512");
  EXPECT_EQ(matched.exit_code, 0) << matched.out;
  // A field of the wrong type is refused in one line naming the file, not a crash.
  const std::string typo = ::testing::TempDir() + "plan_cli_typo_run.json";
  {
    std::ofstream out(typo);
    out << R"({"ranks": 8, "tokens": 64, "layers": 2, "options": [{"option": "a2a", "step_ms_median": 0.5,)"
        << R"( "step_ms": [0.5, "fast"]}]})";
  }
  refused = Epmoe("plan --model glm-5.3 --hardware b300x8 --gpus 8 --batch 64 --samples 2 --measured " + typo);
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_NE(refused.out.find(typo), std::string::npos) << refused.out;
  EXPECT_LE(std::count(refused.out.begin(), refused.out.end(), '\n'), 1) << refused.out;
}

// `epmoe calibrate` measures this machine into a profile `plan` loads, and `calibrate --links`
// under mpirun adds the links to it (small settings: one format, one thread, 1 MB all-gathers).
TEST(PlanCliTest, CalibrateWritesAProfileThePlannerLoads) {
  const std::string machine = ::testing::TempDir() + "plan_cli_calibrated.json";
  const std::string linked = ::testing::TempDir() + "plan_cli_linked.json";
  CommandRun run = Epmoe("calibrate --formats int8 --prefill-tokens 64 --threads 1 --out " + machine);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  std::ifstream in(machine);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["name"], "local");
  EXPECT_TRUE(j["ranks_share_device"].get<bool>());
  EXPECT_EQ(j["partial_sums"], "fp32");  // epmoe's executors sum in fp32
  EXPECT_GT(j["memory"]["bandwidth_gbs"].get<double>(), 0.1);
  EXPECT_GT(j["memory"]["copy_gbs"].get<double>(), 0.1);
  EXPECT_EQ(j["cores"], 1);  // the threads it measured with
  EXPECT_GT(j["row_codec_ns"].get<double>(), 0);
  ASSERT_EQ(j["kernel_lines"].size(), 1u);
  EXPECT_EQ(j["kernel_lines"][0]["format"], "int8");
  EXPECT_GT(j["kernel_lines"][0]["us_per_gb"].get<double>(), 0);
  run = Epmoe("plan --model qwen3-30b-a3b --hardware " + machine +
              " --gpus 2 --batch 64 --weights int8 --samples 2 --format json");
  ASSERT_EQ(run.exit_code, 0) << run.out;

  // Two large sizes (1 and 4 MB), so that a small all-gather stalled on loaded cores does not
  // leave every large one looking no slower (calibrate refuses that measurement).
  run = epmoe::testing::RunCommand(
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
      "mpirun --oversubscribe --bind-to none -np 2 " +
      epmoe::testing::EpmoeBinary() + " calibrate --links --max-link-bytes 4194304 --base " + machine + " --out " +
      linked);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  std::ifstream linked_in(linked);
  const auto l = nlohmann::json::parse(linked_in);
  EXPECT_EQ(l["kernel_lines"], j["kernel_lines"]);  // the machine part is kept
  EXPECT_GT(l["intra_node"]["bandwidth_gbs"].get<double>(), 0);
  EXPECT_GT(l["intra_node"]["one_sided_efficiency"].get<double>(), 0);
  EXPECT_GT(l["intra_node"]["exchange_latency_us"].get<double>(), 0);  // a small all-to-all step
  EXPECT_EQ(l["inter_node"]["exchange_latency_us"], l["intra_node"]["exchange_latency_us"]);
  run = Epmoe("plan --model qwen3-30b-a3b --hardware " + linked + " --gpus 2 --batch 64 --weights int8 --samples 2");
  EXPECT_EQ(run.exit_code, 0) << run.out;
  // Several nodes (modeled here, 1 rank each): the inter-node link measured between them, recorded
  // against the rate --link-gbit gives each node's link; the intra-node link kept from the base.
  const std::string cluster = ::testing::TempDir() + "plan_cli_cluster.json";
  const std::string mpirun =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
      "mpirun --oversubscribe --bind-to none -np 2 " +
      epmoe::testing::EpmoeBinary() + " calibrate --links --max-link-bytes 4194304 --base " + linked;
  run = epmoe::testing::RunCommand(mpirun + " --ranks-per-node 1 --link-gbit 1000 --out " + cluster);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  std::ifstream cluster_in(cluster);
  const auto c = nlohmann::json::parse(cluster_in);
  EXPECT_EQ(c["name"], "local-cluster");
  EXPECT_EQ(c["gpus_per_node"], 1);
  EXPECT_TRUE(c["nodes_share_device"].get<bool>());  // both ranks ran on this machine
  EXPECT_EQ(c["inter_node"]["bandwidth_gbs"], 125);  // 1000 Gbit/s / 8 / 1 rank per node
  EXPECT_LT(c["inter_node"]["efficiency"].get<double>(), 1);
  EXPECT_EQ(c["intra_node"], l["intra_node"]);
  EXPECT_GT(c["inter_node"]["exchange_latency_us"].get<double>(), 0);  // among both ranks, across the nodes
  run = Epmoe("plan --model qwen3-30b-a3b --hardware " + cluster +
              " --gpus 2 --batch 64 --weights int8 --samples 2 --a2a-levels flat,two-level");
  EXPECT_EQ(run.exit_code, 0) << run.out;
  // 2 nodes of 2 ranks: both links measured, each among its own ranks.
  const std::string four = ::testing::TempDir() + "plan_cli_cluster4.json";
  run = epmoe::testing::RunCommand(
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
      "mpirun --oversubscribe --bind-to none -np 4 " +
      epmoe::testing::EpmoeBinary() + " calibrate --links --max-link-bytes 4194304 --ranks-per-node 2 --base " +
      linked + " --out " + four);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  std::ifstream four_in(four);
  const auto f = nlohmann::json::parse(four_in);
  EXPECT_EQ(f["gpus_per_node"], 2);
  EXPECT_GT(f["intra_node"]["bandwidth_gbs"].get<double>(), 0);
  EXPECT_GT(f["inter_node"]["bandwidth_gbs"].get<double>(), 0);
  EXPECT_GT(f["intra_node"]["exchange_latency_us"].get<double>(), 0);
  EXPECT_GT(f["inter_node"]["exchange_latency_us"].get<double>(), 0);
  const std::string notes = f["sources"].dump();
  EXPECT_NE(notes.find("intra_node among the ranks of each node: fixed cost"), std::string::npos) << notes;
  // Between nodes the bandwidth comes from every rank sending to every rank of the other nodes at once.
  EXPECT_NE(notes.find("of the other nodes at once, an alltoallv"), std::string::npos) << notes;
  EXPECT_NE(notes.find("4 ranks on 2 nodes"), std::string::npos) << notes;
  // A link measured faster than --link-gbit is not that link; --link-gbit on one node has no link.
  run = epmoe::testing::RunCommand(mpirun + " --ranks-per-node 1 --link-gbit 0.001");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("above the"), std::string::npos) << run.out;
  run = epmoe::testing::RunCommand(mpirun + " --link-gbit 1");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("on one node"), std::string::npos) << run.out;
  // --links needs peers.
  run = Epmoe("calibrate --links --base " + machine);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("at least 2 ranks"), std::string::npos) << run.out;
}

TEST(PlanCliTest, SeveralMeasuredRunsPoolTheirSteps) {
  // Run A favours a2a over whole in all 6 steps, run B (the options in the other order) whole in all
  // 6: pooled, a2a is faster in 6 of 12 paired steps, which separates nothing; each option's measured
  // time is the median of its 12 steps.
  const std::string a = ::testing::TempDir() + "plan_cli_pool_a.json";
  const std::string b = ::testing::TempDir() + "plan_cli_pool_b.json";
  const std::string other = ::testing::TempDir() + "plan_cli_pool_other.json";
  auto write = [](const std::string& path, int ranks, const char* options) {
    std::ofstream out(path);
    out << R"({"ranks": )" << ranks << R"(, "tokens": 64, "layers": 1, "interleaved": true, "options": [)" << options
        << "]}";
  };
  write(a, 8,
        R"({"option": "whole", "step_ms_median": 5, "step_ms": [5, 5, 5, 5, 5, 5]},)"
        R"({"option": "a2a", "step_ms_median": 4, "step_ms": [4, 4, 4, 4, 4, 4]})");
  write(b, 8,
        R"({"option": "a2a", "step_ms_median": 5, "step_ms": [5, 5, 5, 5, 5, 5]},)"
        R"({"option": "whole", "step_ms_median": 4, "step_ms": [4, 4, 4, 4, 4, 4]})");
  write(other, 4, R"({"option": "a2a", "step_ms_median": 5, "step_ms": [5, 5]})");
  const std::string plan =
      "plan --model glm-5.3 --hardware b300x8 --gpus 8 --batch 64 --samples 2 --format json --measured ";
  CommandRun run = Epmoe(plan + a);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  auto j = nlohmann::json::parse(run.out)["calibration_check"];
  ASSERT_EQ(j["pairs"].size(), 1u);
  EXPECT_TRUE(j["pairs"][0]["separated"].get<bool>());  // one run alone: 6 of 6
  run = Epmoe(plan + a + "," + b);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  j = nlohmann::json::parse(run.out)["calibration_check"];
  ASSERT_EQ(j["pairs"].size(), 1u);
  EXPECT_EQ(j["pairs"][0]["steps"], 12);
  EXPECT_EQ(j["pairs"][0]["steps_faster"], 6);
  EXPECT_FALSE(j["pairs"][0]["separated"].get<bool>());
  for (const auto& o : j["options"]) {
    EXPECT_EQ(o["steps"], 12);
    EXPECT_DOUBLE_EQ(o["measured_us_per_layer"].get<double>(), 4500.0);
  }
  EXPECT_EQ(j["runs"].size(), 2u);
  // Runs of different shapes are not pooled.
  run = Epmoe(plan + a + "," + other);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("compare runs of one shape"), std::string::npos) << run.out;
}

TEST(PlanCliTest, MeasuredOrderIsJudgedOnPairsTheStepsSeparate) {
  // 6 paired steps: a2a beats sliced in all 6 (sign test p = 1/64, separated); dwdp beats a2a in 4
  // of 6 (p = 0.34, not separated, so the plan's order of that pair is not judged).
  const std::string path = ::testing::TempDir() + "plan_cli_pairs.json";
  {
    std::ofstream out(path);
    out << R"({"ranks": 8, "tokens": 64, "layers": 1, "interleaved": true, "options": [)"
        << R"({"option": "sliced", "step_ms_median": 9, "step_ms": [9, 9, 9, 9, 9, 9]},)"
        << R"({"option": "a2a", "step_ms_median": 5, "step_ms": [5, 5, 5, 5, 5, 5]},)"
        << R"({"option": "dwdp", "step_ms_median": 4.5, "step_ms": [4, 4, 4, 4, 6, 6]}]})";
  }
  const CommandRun run =
      Epmoe("plan --model glm-5.3 --hardware b300x8 --gpus 8 --batch 64 --samples 2 --format json --measured " + path);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out)["calibration_check"];
  ASSERT_EQ(j["pairs"].size(), 3u);
  int separated = 0;
  for (const auto& p : j["pairs"]) {
    SCOPED_TRACE(p.dump());
    if (p["faster"] == "a2a" && p["slower"] == "sliced") {
      EXPECT_TRUE(p["separated"].get<bool>());
      EXPECT_NEAR(p["sign_test_p"].get<double>(), 1.0 / 64, 1e-12);
    }
    if (p["faster"] == "dwdp" && p["slower"] == "a2a") {
      EXPECT_EQ(p["steps_faster"], 4);
      EXPECT_FALSE(p["separated"].get<bool>());
    }
    separated += p["separated"].get<bool>();
  }
  EXPECT_EQ(j["pairs_separated"], separated);
  // On 8 B300 the plan puts DWDP far behind both at 64 tokens, so a pair the steps separate with
  // dwdp first is predicted the other way and the orders disagree.
  EXPECT_FALSE(j["same_order"].get<bool>());
}

TEST(PlanCliTest, OptionsAndFormatsUseTheExecutorsNames) {
  const std::string plan = "plan --model glm-5.3 --hardware b300x8 --gpus 8 --batch 64 --samples 2 --format json";
  const CommandRun run = Epmoe(plan + " --options a2a,dwdp --rows q4 --shared copied");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto j = nlohmann::json::parse(run.out);
  ASSERT_EQ(j["costs"].size(), 2u);
  EXPECT_EQ(j["costs"][0]["option"], "a2a");
  EXPECT_EQ(j["costs"][0]["option_number"], 4);
  EXPECT_EQ(j["costs"][1]["option"], "dwdp");
  EXPECT_EQ(j["costs"][1]["option_number"], 5);
  // The row bytes priced are row_codec's: 6,144 / 32 blocks of 20 B.
  EXPECT_EQ(j["derived"]["row_bytes_q4"], 3'840);
  EXPECT_TRUE(j["derived"]["per_gpus"][0].contains("copies_sent_per_row_a2a"));
  // The former planner names are aliases and price the same.
  const CommandRun old = Epmoe(plan + " --options rows,weights --rows nvfp4 --shared copied");
  ASSERT_EQ(old.exit_code, 0) << old.out;
  EXPECT_EQ(nlohmann::json::parse(old.out)["costs"], j["costs"]);
  const CommandRun aliased = Epmoe(plan + " --options 4,5 --rows fp4 --shared copied");
  ASSERT_EQ(aliased.exit_code, 0) << aliased.out;
  EXPECT_EQ(nlohmann::json::parse(aliased.out)["costs"], j["costs"]);
  // An unknown name is refused with every name listed.
  const CommandRun bad = Epmoe(plan + " --options teleport");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--options: unknown option 'teleport' (sliced, whole, hybrid, a2a, dwdp)"), std::string::npos)
      << bad.out;
  const CommandRun bad_rows = Epmoe(plan + " --rows fp8");
  EXPECT_NE(bad_rows.exit_code, 0);
  EXPECT_NE(bad_rows.out.find("--rows"), std::string::npos) << bad_rows.out;
}

// --a2a-levels and --a2a-mode take lists, --tbo and --sbo add the overlapped lines: one a2a line
// per variant (auto resolved), the winner among them all; bad names are refused with the list.
TEST(PlanCliTest, A2aVariantsAreLinesOfTheirOwn) {
  const std::string plan =
      "plan --model deepseek-v3 --hardware h200x8 --gpus 16 --batch 256 --samples 2 --options whole,a2a";
  CommandRun run = Epmoe(plan + " --a2a-levels flat,two-level --a2a-mode normal,low-latency --tbo --sbo --format json");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  auto j = nlohmann::json::parse(run.out);
  // whole, then 2 levels x 2 modes x {plain, sbo, tbo, tbo + sbo}.
  ASSERT_EQ(j["costs"].size(), 1u + 16u) << run.out;
  int not_applicable = 0;
  for (const auto& c : j["costs"]) {
    if (c["option"] != "a2a") continue;
    ASSERT_TRUE(c.contains("a2a")) << c.dump();
    if (!c["applicable"].get<bool>()) {
      ++not_applicable;  // two-level low-latency
      EXPECT_EQ(c["a2a"]["levels"], "two-level");
      EXPECT_EQ(c["a2a"]["mode"], "low-latency");
      continue;
    }
    EXPECT_GE(c["exposed_comm_us"].get<double>(), 0);
    EXPECT_GT(c["inter_node_mb_per_rank"].get<double>(), 0);  // 16 ranks on 2 nodes of 8
  }
  EXPECT_EQ(not_applicable, 4);
  EXPECT_FALSE(j["winners"][0]["label"].get<std::string>().empty());
  run = Epmoe(plan + " --a2a-levels flat,two-level --tbo");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  for (const char* line :
       {"a2a low-latency ", "a2a low-latency +tbo", "not applicable: low-latency", "exposed us", "inter MB"})
    EXPECT_NE(run.out.find(line), std::string::npos) << line << "\n" << run.out;
  run = Epmoe(plan + " --phase prefill --batch 16384 --format csv");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  // auto above 512 rows per rank, as epmoe run resolves it
  EXPECT_NE(run.out.find(",a2a,1,two-level,normal,0,0,1,"), std::string::npos) << run.out;
  // The combine as `epmoe run` makes it by default (one output per pick) moves more than summed rows.
  const std::string a2a_only =
      "plan --model deepseek-v3 --hardware h200x8 --gpus 16 --batch 256 --samples 2 "
      "--options a2a --format json";
  run = Epmoe(a2a_only);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const double summed = nlohmann::json::parse(run.out)["costs"][0]["comm_us"].get<double>();
  run = Epmoe(a2a_only + " --a2a-combine per-pick --combine-format fp32");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  EXPECT_GT(nlohmann::json::parse(run.out)["costs"][0]["comm_us"].get<double>(), summed);
  for (const char* bad :
       {" --a2a-levels three-level", " --a2a-mode fast", " --a2a-combine sums", " --combine-format q4"}) {
    run = Epmoe(plan + bad);
    EXPECT_NE(run.exit_code, 0) << bad << run.out;
    EXPECT_LE(std::count(run.out.begin(), run.out.end(), '\n'), 1) << run.out;
  }
  run = Epmoe(plan + " --a2a-levels three-level");
  EXPECT_NE(run.out.find("--a2a-levels: unknown a2a levels 'three-level' (auto, flat, two-level)"), std::string::npos)
      << run.out;
  run = Epmoe(plan + " --a2a-mode fast");
  EXPECT_NE(run.out.find("--a2a-mode: unknown a2a mode 'fast' (normal, low-latency, auto)"), std::string::npos)
      << run.out;
}

TEST(PlanCliTest, HardwareListAndShow) {
  const CommandRun list = Epmoe("hardware list");
  ASSERT_EQ(list.exit_code, 0);
  EXPECT_NE(list.out.find("gb200nvl72"), std::string::npos);
  const CommandRun show = Epmoe("hardware show mi355xx8");
  ASSERT_EQ(show.exit_code, 0) << show.out;
  EXPECT_EQ(nlohmann::json::parse(show.out)["gpus_per_node"], 8);
}

}  // namespace

namespace {

// Sizes whose byte counts overflow and report paths that are folders are refused with exit 1
// (they printed negative sizes with exit 0, and ended in an uncaught ios_base::failure).
TEST(PlanCliTest, RefusesOverflowingSizesAndFolderInputs) {
  CommandRun run = Epmoe("plan --model glm-5.3 --hardware b300x8 --hidden 2000000000 --intermediate 2000000000");
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("weights in one matrix"), std::string::npos) << run.out;
  run = Epmoe("plan --model glm-5.3 --hardware b300x8 --measured " + ::testing::TempDir());
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("cannot read run report"), std::string::npos) << run.out;
  run = Epmoe("plot-balance " + ::testing::TempDir() + "/plot.svg --run a=" + ::testing::TempDir());
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("cannot read run report"), std::string::npos) << run.out;
  // An output that cannot be written is refused before the minute of measuring.
  const auto start = std::chrono::steady_clock::now();
  run = Epmoe("calibrate --out /nonexistent/x.json");
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("/nonexistent/x.json: cannot create"), std::string::npos) << run.out;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10);
}

}  // namespace
