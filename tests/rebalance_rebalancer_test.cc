// WindowBalancedness and RebalanceMetrics (the parts of the Rebalancer that need no ranks).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "epmoe/rebalancer.h"

namespace epmoe {
namespace {

TEST(WindowBalancedness, AveragesPerLayerMeanOverMaxOfTheSummedSteps) {
  // 2 ranks, 4 experts, no redundancy: rank 0 holds experts 0, 1; rank 1 holds 2, 3.
  auto placement = Placement::Trivial(2, 4, 0, 2, 1);
  ASSERT_TRUE(placement.ok());
  ExpertLoad load(2, 2, 4);
  // Layer 0: step 0 all on rank 0, step 1 all on rank 1 -> summed: even (1.0).
  load.at(0, 0)[0] = 6;
  load.at(1, 0)[3] = 6;
  // Layer 1: 3 picks on rank 0, 1 on rank 1 -> mean 2 / max 3.
  load.at(0, 1)[1] = 3;
  load.at(1, 1)[2] = 1;
  EXPECT_DOUBLE_EQ(WindowBalancedness(*placement, load), (1.0 + 2.0 / 3.0) / 2);
  // Second copies of experts 1 and 0 on rank 1 (slots 4, 5) split their picks evenly. Rank 0 holds
  // slots 0..2 (experts 0, 1, 2), rank 1 slots 3..5 (experts 3, 1, 0).
  auto replicated = Placement::Create(4, 2, 1, {{0, 1, 2, 3, 1, 0}, {0, 1, 2, 3, 1, 0}});
  ASSERT_TRUE(replicated.ok());
  // Layer 0: rank 0 gets 3 (half of expert 0), rank 1 gets 3 + 6: 6 / 9. Layer 1: rank 0 gets
  // 1.5 + 1, rank 1 gets 1.5: 2 / 2.5.
  EXPECT_DOUBLE_EQ(WindowBalancedness(*replicated, load), (6.0 / 9.0 + 2.0 / 2.5) / 2);
  // No picks at all: nothing to balance.
  EXPECT_DOUBLE_EQ(WindowBalancedness(*placement, ExpertLoad(1, 2, 4)), 1.0);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(RebalanceMetrics, WritesPrometheusTextWithQuantilesAndTotals) {
  const std::string path = (std::filesystem::temp_directory_path() / "epmoe_rebalance_metrics_test.prom").string();
  auto metrics = RebalanceMetrics::Create(path);
  ASSERT_TRUE(metrics.ok());
  for (int i = 1; i <= 100; ++i) metrics->RecordStep(i * 0.001, {{"dispatch", 0.0005}, {"experts", 0.0002}});
  metrics->RecordBalance(0.5, 0.75);
  RebalanceReport report;
  report.bytes_moved = 4096;
  report.stall_seconds_max = 0.25;
  metrics->RecordRebalance(report);
  metrics->RecordRebalance(report);
  ASSERT_TRUE(metrics->Write().ok());
  const std::string text = ReadFile(path);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  EXPECT_NE(text.find("# TYPE epmoe_step_seconds summary"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_step_seconds{quantile=\"0.5\"} 0.051"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_step_seconds{quantile=\"0.99\"} 0.1"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_rebalances_total 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_rebalance_bytes_moved_total 8192\n"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_rebalance_stall_seconds_total 0.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_balancedness 0.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_balancedness_windowed 0.75\n"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_stage_seconds_total{stage=\"dispatch\"} 0.05"), std::string::npos) << text;
  EXPECT_NE(text.find("epmoe_steps_total 100\n"), std::string::npos) << text;
  std::remove(path.c_str());
}

TEST(RebalanceMetrics, RefusesAnUnwritablePath) {
  auto metrics = RebalanceMetrics::Create("/nonexistent-dir/epmoe.prom");
  ASSERT_TRUE(metrics.ok());
  const Status written = metrics->Write();
  EXPECT_FALSE(written.ok());
  EXPECT_NE(written.message().find("/nonexistent-dir/epmoe.prom"), std::string::npos);
}

TEST(RebalancerOptions, RefusesBadValuesNamingThem) {
  RebalancerOptions options;
  options.layers_per_chunk = -1;
  EXPECT_NE(ValidateRebalancerOptions(options).message().find("-1"), std::string::npos);
  options = {};
  options.move_bytes_per_second = 0;
  EXPECT_FALSE(ValidateRebalancerOptions(options).ok());
  options = {};
  options.trigger.threshold = 1.5;
  EXPECT_FALSE(ValidateRebalancerOptions(options).ok());
  EXPECT_TRUE(ValidateRebalancerOptions(RebalancerOptions{}).ok());
}

}  // namespace
}  // namespace epmoe
