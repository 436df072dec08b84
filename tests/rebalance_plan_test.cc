// Move plans, the rebalance trigger and the metrics file: the parts of live rebalancing that need
// no MPI.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "epmoe/metrics.h"
#include "epmoe/move_plan.h"
#include "epmoe/rebalance_trigger.h"

namespace epmoe {
namespace {

Placement Make(int experts, int ranks, int nodes, std::vector<std::vector<int32_t>> phy2log) {
  auto p = Placement::Create(experts, ranks, nodes, std::move(phy2log));
  EPMOE_CHECK_MSG(p.ok(), p.status().ToString());
  return *p;
}

TEST(MovePlanTest, NothingChangedMovesNothing) {
  const Placement p = Make(4, 2, 1, {{0, 1, 2, 3}, {3, 2, 1, 0}});
  auto plan = PlanMoves(p, p, 0, 2, 1000);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->moves.empty());
  EXPECT_EQ(plan->total_bytes_moved(), 0);
}

TEST(MovePlanTest, OneMovedExpertMovesExactlyItsBytes) {
  // 4 experts + 2 redundant over 2 ranks (3 slots each). Slot 5 changes from expert 0 to expert 1:
  // rank 1 does not hold expert 1, rank 0 does (slot 1).
  const Placement from = Make(4, 2, 1, {{0, 1, 2, 3, 1, 0}});
  const Placement to = Make(4, 2, 1, {{0, 1, 2, 3, 1, 1}});
  auto plan = PlanMoves(from, to, 0, 1, 4096);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->moves.size(), 1u);
  const SlotMove& m = plan->moves[0];
  EXPECT_EQ(m.slot, 5);
  EXPECT_EQ(m.dest_rank, 1);
  EXPECT_EQ(m.expert, 1);
  // Rank 1 already held expert 1 in slot 4: a local copy, nothing crosses the network.
  EXPECT_TRUE(m.local());
  EXPECT_EQ(m.source_slot, 4);
  EXPECT_EQ(plan->total_bytes_moved(), 0);
  EXPECT_EQ(plan->local_copies, 1);

  const Placement to_remote = Make(4, 2, 1, {{0, 1, 2, 3, 1, 2}});  // expert 2 lives only on rank 0
  plan = PlanMoves(from, to_remote, 0, 1, 4096);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->moves.size(), 1u);
  EXPECT_EQ(plan->moves[0].source_rank, 0);
  EXPECT_EQ(plan->moves[0].source_slot, 2);
  EXPECT_EQ(plan->total_bytes_moved(), 4096);
  EXPECT_EQ(plan->bytes_sent[0], 4096);
  EXPECT_EQ(plan->bytes_received[1], 4096);
  EXPECT_EQ(plan->remote_copies, 1);
}

TEST(MovePlanTest, PrefersTheSameNodeAndSpreadsOverSenders) {
  // 4 ranks on 2 nodes, 2 slots per rank. Expert 0 is held by rank 0 (node 0) and rank 2 (node 1).
  const Placement from = Make(4, 4, 2, {{0, 1, 1, 2, 0, 3, 2, 3}});
  // Rank 3 (node 1) takes expert 0 in slot 6: the source must be rank 2 (same node), not rank 0.
  const Placement to = Make(4, 4, 2, {{0, 1, 1, 2, 0, 3, 0, 3}});
  auto plan = PlanMoves(from, to, 0, 1, 10);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->moves.size(), 1u);
  EXPECT_EQ(plan->moves[0].source_rank, 2);
  EXPECT_EQ(plan->inter_node_copies, 0);

  // Expert 1 is held by rank 0 and rank 1 (both node 0); two slots on node 1 want it: the second
  // comes from the other sender.
  const Placement to_two = Make(4, 4, 2, {{0, 1, 1, 2, 1, 3, 1, 3}});
  plan = PlanMoves(from, to_two, 0, 1, 10);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->moves.size(), 2u);
  EXPECT_NE(plan->moves[0].source_rank, plan->moves[1].source_rank);
  EXPECT_EQ(plan->inter_node_copies, 2);
  EXPECT_EQ(plan->bytes_sent_by_node[0], 20);
  EXPECT_EQ(plan->bytes_received_by_node[1], 20);
}

TEST(MovePlanTest, LayerRangeAndShapeAreChecked) {
  const Placement a = Make(4, 2, 1, {{0, 1, 2, 3}, {0, 1, 2, 3}});
  const Placement b = Make(4, 2, 1, {{0, 1, 2, 3}, {1, 0, 2, 3}});
  auto first = PlanMoves(a, b, 0, 1, 1);
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->moves.empty());
  auto second = PlanMoves(a, b, 1, 2, 1);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->moves.size(), 2u);
  EXPECT_FALSE(PlanMoves(a, b, 1, 3, 1).ok());
  const Placement other_shape = Make(4, 4, 1, {{0, 1, 2, 3}, {0, 1, 2, 3}});
  EXPECT_FALSE(PlanMoves(a, other_shape, 0, 2, 1).ok());
}

TEST(Trigger, IntervalThresholdAndPayback) {
  TriggerOptions o;
  o.interval_steps = 10;
  RebalanceTrigger interval(o);
  EXPECT_FALSE(interval.ShouldRebalance({.step = 5}));
  EXPECT_TRUE(interval.ShouldRebalance({.step = 10}));
  interval.Rebalanced(10);
  EXPECT_TRUE(interval.ShouldRebalance({.step = 20}));

  o.mode = TriggerMode::kThreshold;
  o.threshold = 0.8;
  RebalanceTrigger threshold(o);
  EXPECT_FALSE(threshold.ShouldRebalance({.step = 10, .windowed_balancedness = 0.9}));
  EXPECT_TRUE(threshold.ShouldRebalance({.step = 10, .windowed_balancedness = 0.7}));
  EXPECT_FALSE(threshold.ShouldRebalance({.step = 11, .windowed_balancedness = 0.1}));  // not a check step

  o.mode = TriggerMode::kPayback;
  o.payback_steps = 100;
  RebalanceTrigger payback(o);
  EXPECT_TRUE(payback.ShouldRebalance({.step = 10, .predicted_saved_us_per_step = 5, .predicted_move_us = 400}));
  EXPECT_FALSE(payback.ShouldRebalance({.step = 10, .predicted_saved_us_per_step = 5, .predicted_move_us = 600}));
  EXPECT_FALSE(payback.ShouldRebalance({.step = 10, .predicted_saved_us_per_step = -1, .predicted_move_us = 0}));

  o.mode = TriggerMode::kInterval;
  o.min_steps_between = 15;
  RebalanceTrigger spaced(o);
  spaced.Rebalanced(10);
  EXPECT_FALSE(spaced.ShouldRebalance({.step = 20}));
  EXPECT_TRUE(spaced.ShouldRebalance({.step = 30}));
}

TEST(Trigger, OptionsAreValidated) {
  TriggerOptions o;
  EXPECT_TRUE(ValidateTriggerOptions(o).ok());
  o.interval_steps = 0;
  EXPECT_FALSE(ValidateTriggerOptions(o).ok());
  o = TriggerOptions{};
  o.threshold = 1.5;
  EXPECT_FALSE(ValidateTriggerOptions(o).ok());
  EXPECT_FALSE(ParseTriggerMode("sometimes").ok());
  EXPECT_EQ(*ParseTriggerMode("payback"), TriggerMode::kPayback);
}

TEST(Metrics, RendersPrometheusTextAndRewritesAtomically) {
  const auto path = std::filesystem::temp_directory_path() / "epmoe_metrics_test.prom";
  MetricsFile metrics(path.string());
  ASSERT_TRUE(metrics.Declare("epmoe_balancedness", "gauge", "Mean/max picks per rank").ok());
  ASSERT_TRUE(metrics.Declare("epmoe_rebalances_total", "counter", "Rebalances installed").ok());
  EXPECT_FALSE(metrics.Declare("bad name", "gauge", "x").ok());
  EXPECT_FALSE(metrics.Declare("epmoe_x", "histogramm", "x").ok());
  metrics.Set("epmoe_balancedness", 0.75, {{"window", "current"}});
  metrics.Set("epmoe_balancedness", 0.5, {{"window", "100\"steps"}});
  metrics.Set("epmoe_rebalances_total", 3);
  ASSERT_TRUE(metrics.Write().ok());
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  EXPECT_EQ(text.str(),
            "# HELP epmoe_balancedness Mean/max picks per rank\n"
            "# TYPE epmoe_balancedness gauge\n"
            "epmoe_balancedness{window=\"100\\\"steps\"} 0.5\n"
            "epmoe_balancedness{window=\"current\"} 0.75\n"
            "# HELP epmoe_rebalances_total Rebalances installed\n"
            "# TYPE epmoe_rebalances_total counter\n"
            "epmoe_rebalances_total 3\n");
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".tmp"));
  std::filesystem::remove(path);
  EXPECT_FALSE(MetricsFile("/nonexistent-dir/x.prom").Write().ok());
}

// A running job's metrics are best effort: a path that cannot be written is warned about and the
// caller goes on; two writers of one path (two runs) both succeed.
TEST(Metrics, BestEffortWritesNeverFailTheRun) {
  MetricsFile lost("/nonexistent-dir/x.prom");
  ASSERT_TRUE(lost.Declare("epmoe_steps_total", "counter", "Steps run").ok());
  EXPECT_FALSE(lost.WriteOrWarnOnce());
  EXPECT_FALSE(lost.WriteOrWarnOnce());
  const auto path = std::filesystem::temp_directory_path() / "epmoe_metrics_shared.prom";
  MetricsFile first(path.string()), second(path.string());
  int written[2] = {0, 0};
  std::vector<std::thread> runs;
  for (int r = 0; r < 2; ++r) {
    runs.emplace_back([&, r] {
      MetricsFile& m = r == 0 ? first : second;
      if (!m.Declare("epmoe_steps_total", "counter", "Steps run").ok()) return;
      for (int step = 0; step < 200; ++step) {
        m.Set("epmoe_steps_total", step);
        written[r] += m.WriteOrWarnOnce();
      }
    });
  }
  for (std::thread& run : runs) run.join();
  EXPECT_EQ(written[0], 200);
  EXPECT_EQ(written[1], 200);
  std::filesystem::remove(path);
  EXPECT_FALSE(MetricsFile(std::filesystem::temp_directory_path().string()).Write().ok());
}

}  // namespace
}  // namespace epmoe
