// Placement validation and JSON, the dispatch table's preferences, and the load recorder.
#include <algorithm>
#include <cstdio>
#include <numeric>

#include <gtest/gtest.h>

#include "epmoe/balance.h"
#include "epmoe/dispatch.h"
#include "epmoe/placement.h"
#include "epmoe/recorder.h"

namespace epmoe {
namespace {

TEST(EplbPlacement, ValidatesOnCreation) {
  auto ok = Placement::Create(4, 2, 1, {{0, 1, 2, 3, 0, 1}});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->slots_per_rank(), 3);
  EXPECT_EQ(ok->logcnt(0)[0], 2);
  EXPECT_EQ(ok->max_copies(), 2);
  EXPECT_EQ(std::vector<int32_t>(ok->copies(0, 1).begin(), ok->copies(0, 1).end()), (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(ok->log2phy(0)[2 * 2 + 1], -1);  // expert 2 has one copy: padded
  auto missing = Placement::Create(4, 2, 1, {{0, 1, 2, 2, 0, 1}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no copy of expert 3"), std::string::npos);
  EXPECT_FALSE(Placement::Create(4, 2, 1, {{0, 1, 2, 3, 4, 1}}).ok());   // id out of range
  EXPECT_FALSE(Placement::Create(4, 4, 1, {{0, 1, 2, 3, 0, 1}}).ok());   // 6 slots over 4 ranks
  EXPECT_FALSE(Placement::Create(4, 2, 3, {{0, 1, 2, 3, 0, 1}}).ok());   // 3 nodes, 2 ranks
  EXPECT_FALSE(Placement::Create(4, 2, 1, {{0, 1, 2, 3}, {0, 1, 2}}).ok());  // layers differ
  EXPECT_FALSE(Placement::Create(4, 2, 1, {}).ok());
}

TEST(EplbPlacement, JsonRoundTripAndConsistencyChecks) {
  auto p = Placement::Create(4, 2, 2, {{0, 1, 2, 3, 0, 1}, {3, 2, 1, 0, 3, 3}});
  ASSERT_TRUE(p.ok());
  const std::string json = PlacementToJson(*p);
  auto back = PlacementFromJson(json, "mem");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(*back == *p);
  std::string bad = json;
  bad.replace(bad.find("\"logcnt\":[[2"), 12, "\"logcnt\":[[1");
  auto refused = PlacementFromJson(bad, "mem");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("logcnt[0][0]"), std::string::npos) << refused.status().message();
  EXPECT_FALSE(PlacementFromJson("{\"num_layers\": 1}", "mem").ok());
  EXPECT_FALSE(PlacementFromJson("not json", "mem").ok());
  const std::string path = std::string(EPMOE_BINARY_DIR) + "/eplb_placement_test.json";
  ASSERT_TRUE(WritePlacementFile(*p, path).ok());
  auto read = ReadPlacementFile(path);
  ASSERT_TRUE(read.ok());
  EXPECT_TRUE(*read == *p);
  std::remove(path.c_str());
  EXPECT_FALSE(ReadPlacementFile(path).ok());
}

TEST(EplbDispatch, PrefersSameRankThenSameNodeThenSpreads) {
  // 4 ranks, 2 nodes (ranks 0-1, 2-3), 2 slots per rank, 5 experts + 3 copies.
  // Expert 0: slots 0 (rank 0) and 2 (rank 1); expert 1: slots 1 (rank 0) and 6 (rank 3);
  // expert 4: slots 5 (rank 2), 7 (rank 3).
  auto p = Placement::Create(5, 4, 2, {{0, 1, 0, 2, 3, 4, 1, 4}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  auto rank0 = DispatchTable::Build(*p, 0, 1);
  ASSERT_TRUE(rank0.ok());
  EXPECT_EQ(rank0->SlotFor(0, 0, 5), 0);      // own copy
  EXPECT_EQ(rank0->SlotFor(0, 1, 0), 1);      // own copy
  auto c4 = rank0->candidates(0, 4);          // both copies on the other node: spread
  EXPECT_EQ(c4.size(), 2u);
  auto rank1 = DispatchTable::Build(*p, 1, 1);
  ASSERT_TRUE(rank1.ok());
  EXPECT_EQ(rank1->candidates(0, 1).size(), 1u);  // same node narrows: slot 1 on rank 0
  EXPECT_EQ(rank1->SlotFor(0, 1, 3), 1);
  auto rank2 = DispatchTable::Build(*p, 2, 1);
  EXPECT_EQ(rank2->SlotFor(0, 1, 0), 6);      // same node: slot 6 on rank 3
  EXPECT_EQ(rank2->candidates(0, 0).size(), 2u);  // no copy in node 1: spread over both
  // Spreading deals picks evenly; the same seed gives the same table.
  std::vector<int64_t> counts = {7, 0, 0, 0, 0}, slots(8);
  rank2->SlotPicks(0, counts, slots);
  EXPECT_EQ(slots[0] + slots[2], 7);
  EXPECT_LE(std::abs(slots[0] - slots[2]), 1);
  auto again = DispatchTable::Build(*p, 2, 1);
  EXPECT_TRUE(std::equal(again->candidates(0, 0).begin(), again->candidates(0, 0).end(),
                         rank2->candidates(0, 0).begin()));
  EXPECT_FALSE(DispatchTable::Build(*p, 4).ok());
  // Over many experts with two copies on other nodes, ranks start on different copies.
  std::vector<int32_t> layout;
  for (int e = 0; e < 32; ++e) layout.push_back(e);
  for (int e = 0; e < 32; ++e) layout.push_back(e);
  auto wide = Placement::Create(32, 4, 2, {layout});  // copies of e on rank e/16 and 2 + e/16
  ASSERT_TRUE(wide.ok());
  auto table = DispatchTable::Build(*wide, 0, 9);
  int first = 0;
  for (int e = 16; e < 32; ++e) first += table->SlotFor(0, e, 0) == e;
  EXPECT_EQ(first, 16);  // rank 0 holds none of 16..31 but its node (rank 1) holds one copy of each
}

TEST(EplbRecorder, CountsBalancednessAndWindows) {
  auto placement = Placement::Create(4, 2, 1, {{0, 1, 2, 3}, {0, 2, 1, 3}});
  ASSERT_TRUE(placement.ok());
  auto live = LivePlacement::Create(std::make_shared<const Placement>(*placement), 0);
  ASSERT_TRUE(live.ok());
  RecorderOptions options;
  options.window_steps = 3;
  options.mode = RecorderMode::kPerToken;
  auto recorder = LoadRecorder::Create(options, *live);
  ASSERT_TRUE(recorder.ok());
  // Step: 4 rows, k = 2. Layer 0 picks 0,1 each row: rank 0 gets all 8 -> balancedness 0.5.
  Picks picks{4, 2, {0, 1, 0, 1, 0, 1, 0, 1}, std::vector<float>(8, 0.5f)};
  for (int step = 0; step < 5; ++step) {
    ASSERT_TRUE(recorder->Record(0, picks).ok());
    ASSERT_TRUE(recorder->Record(1, picks).ok());  // layer 1: experts 0 and 1 on different ranks: 1.0
    recorder->EndStep();
  }
  const BalanceReport report = recorder->Balance();
  EXPECT_EQ(report.steps, 5);
  EXPECT_DOUBLE_EQ(report.current, 0.75);  // mean over layers of 0.5 and 1.0, not a ratio of sums
  EXPECT_DOUBLE_EQ(report.last10, 0.75);
  EXPECT_DOUBLE_EQ(report.bytes_current, 0.75);
  EXPECT_EQ(recorder->ExpertPicks(0)[0], 4);
  EXPECT_DOUBLE_EQ(recorder->RankPicks(0)[0], 8);
  EXPECT_DOUBLE_EQ(recorder->SlotPicks(1)[2], 4);
  const ExpertLoad series = recorder->Load();
  EXPECT_EQ(series.num_steps, 3);  // window of 3
  EXPECT_EQ(series.at(2, 1)[1], 4);
  EXPECT_EQ(series.rows[0], 4);
  EXPECT_EQ(recorder->TokenPicks(0, 0).rows, 4);
  EXPECT_EQ(recorder->TokenPicks(0, 0).experts, picks.experts);
  // Bad picks are refused and leave no counts.
  Picks bad{1, 2, {0, 7}, {}};
  EXPECT_FALSE(recorder->Record(0, bad).ok());
  EXPECT_FALSE(recorder->Record(2, picks).ok());
  recorder->EndStep();
  EXPECT_EQ(recorder->ExpertPicks(0)[0], 0);
  // Stat mode sums the window.
  options.mode = RecorderMode::kStat;
  auto stat = LoadRecorder::Create(options, *live);
  ASSERT_TRUE(stat.ok());
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(stat->Record(0, picks).ok());
    stat->EndStep();
  }
  const ExpertLoad sum = stat->Load();
  EXPECT_EQ(sum.num_steps, 1);
  EXPECT_EQ(sum.at(0, 0)[0], 12);  // 3 steps kept x 4
  EXPECT_DOUBLE_EQ(stat->Balance().current, 0.5);  // only layer 0 recorded
  // Series keeps the steps in every mode, consecutive ones summed into at most max_steps.
  const ExpertLoad steps = stat->Series(8);
  ASSERT_EQ(steps.num_steps, 3);
  for (int64_t step = 0; step < 3; ++step) EXPECT_EQ(steps.at(step, 0)[0], 4);
  const ExpertLoad two = stat->Series(2);
  ASSERT_EQ(two.num_steps, 2);
  EXPECT_EQ(two.at(0, 0)[0], 4);  // step 0 of the window
  EXPECT_EQ(two.at(1, 0)[0], 8);  // steps 1 and 2
  EXPECT_EQ(two.rows[1], 8);
  // A placement installed during a step applies from the next step; a wrong shape is refused.
  auto swapped = Placement::Create(4, 2, 1, {{0, 2, 1, 3}, {0, 2, 1, 3}});
  ASSERT_TRUE(stat->Record(0, picks).ok());
  ASSERT_TRUE((*live)->Install(std::make_shared<const Placement>(*swapped)).ok());
  EXPECT_EQ((*live)->current()->generation, 1);
  stat->EndStep();
  EXPECT_DOUBLE_EQ(stat->Balance().current, 0.5);  // the step started under the old placement
  ASSERT_TRUE(stat->Record(0, picks).ok());
  stat->EndStep();
  EXPECT_DOUBLE_EQ(stat->Balance().current, 1.0);
  auto other = Placement::Trivial(2, 6, 0, 2, 1);
  EXPECT_FALSE((*live)->Install(std::make_shared<const Placement>(*other)).ok());
  EXPECT_EQ((*live)->current()->generation, 1);
  EXPECT_FALSE(ParseRecorderMode("sometimes").ok());
}

// Per-slot picks are what the rank's dispatch table sends, call by call as an executor deals them:
// a rank holding a copy of a replicated expert keeps its picks; another deals them over the copies.
TEST(EplbRecorder, SlotPicksFollowTheDispatchTable) {
  // E = 3, 4 slots on 2 ranks: expert 0 on slot 0 (rank 0) and slot 3 (rank 1).
  auto placement = Placement::Create(3, 2, 1, {{0, 1, 2, 0}});
  ASSERT_TRUE(placement.ok());
  const PlacementPtr shared = std::make_shared<const Placement>(*placement);
  Picks picks{5, 1, {0, 0, 0, 1, 0}, {}};
  for (int rank = 0; rank < 2; ++rank) {
    auto live = LivePlacement::Create(shared, rank);
    ASSERT_TRUE(live.ok());
    auto recorder = LoadRecorder::Create({}, *live);
    ASSERT_TRUE(recorder.ok());
    ASSERT_TRUE(recorder->Record(0, picks).ok());
    ASSERT_TRUE(recorder->Record(0, picks).ok());  // a second micro-batch is dealt afresh
    recorder->EndStep();
    std::vector<double> sent(4, 0.0);
    const DispatchTable& table = (*live)->current()->dispatch;
    for (int call = 0; call < 2; ++call) {
      std::vector<int64_t> nth(3, 0);
      for (int32_t e : picks.experts) sent[table.SlotFor(0, e, nth[e]++)] += 1;
    }
    const auto slots = recorder->SlotPicks(0);
    EXPECT_EQ(std::vector<double>(slots.begin(), slots.end()), sent) << "rank " << rank;
    // The rank's own copy takes all of expert 0's picks (8 of them), not half.
    EXPECT_EQ(slots[rank == 0 ? 0 : 3], 8) << "rank " << rank;
  }
}

}  // namespace
}  // namespace epmoe
