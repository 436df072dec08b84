// Moving expert copies between ranks (MoveExperts), agreeing on a placement (BroadcastPlacement)
// and summing loads over ranks, under mpirun with 1, 2, 4 and 8 ranks.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

#include "epmoe/comm.h"
#include "epmoe/weight_mover.h"
#include "mpi_world.h"

namespace epmoe {
namespace {

Communicator& World() { return testing::SharedWorld(60); }

// The stored bytes of expert `expert` of `layer`: distinct for every (layer, expert, byte).
std::vector<std::byte> ExpertContent(int layer, int expert, int64_t bytes) {
  std::vector<std::byte> out(bytes);
  for (int64_t i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>((layer * 131 + expert * 31 + i * 7) & 0xff);
  return out;
}

// A random valid placement: every expert once, the redundant slots to random experts, shuffled.
Placement RandomPlacement(int layers, int experts, int redundant, int ranks, int nodes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> phy2log(layers);
  for (auto& slots : phy2log) {
    slots.resize(experts + redundant);
    std::iota(slots.begin(), slots.begin() + experts, 0);
    for (int r = 0; r < redundant; ++r) slots[experts + r] = static_cast<int32_t>(rng() % experts);
    std::shuffle(slots.begin(), slots.end(), rng);
  }
  auto p = Placement::Create(experts, ranks, nodes, std::move(phy2log));
  EPMOE_CHECK_MSG(p.ok(), p.status().ToString());
  return *p;
}

// Moves from `from` to `to` with this rank's slots held in a map, and checks every slot of this
// rank holds the new placement's expert afterwards.
MoveStats MoveAndCheck(const Placement& from, const Placement& to, int64_t expert_bytes, int64_t bound) {
  Communicator& comm = World();
  const int me = comm.rank();
  std::map<std::pair<int, int>, std::vector<std::byte>> live, staged;
  for (int l = 0; l < from.num_layers(); ++l)
    for (int s = me * from.slots_per_rank(); s < (me + 1) * from.slots_per_rank(); ++s)
      live[{l, s}] = ExpertContent(l, from.phy2log(l)[s], expert_bytes);
  auto plan = PlanMoves(from, to, 0, from.num_layers(), expert_bytes);
  EPMOE_CHECK(plan.ok());
  auto stats = MoveExperts(
      comm, *plan, expert_bytes, bound,
      [&](int layer, int slot) -> std::span<const std::byte> {
        return live.at({layer, slot});
      },
      [&](const SlotMove& move, std::span<const std::byte> bytes) {
        if (move.dest_rank != me) return Internal("delivered to the wrong rank");
        staged[{move.layer, move.slot}].assign(bytes.begin(), bytes.end());
        return Status::Ok();
      });
  EPMOE_CHECK_MSG(stats.ok(), stats.status().ToString());
  for (auto& [key, bytes] : staged) live[key] = bytes;  // install
  for (const auto& [key, bytes] : live)
    EXPECT_EQ(bytes, ExpertContent(key.first, to.phy2log(key.first)[key.second], expert_bytes))
        << "rank " << me << " layer " << key.first << " slot " << key.second;
  return *stats;
}

TEST(WeightMover, MovesEveryChangedCopyToItsNewSlot) {
  const int ranks = World().size();
  const int nodes = ranks % 2 == 0 ? 2 : 1;
  const Placement from = RandomPlacement(3, 6 * ranks, 2 * ranks, ranks, nodes, 11);
  const Placement to = RandomPlacement(3, 6 * ranks, 2 * ranks, ranks, nodes, 12);
  const MoveStats stats = MoveAndCheck(from, to, 100, 1 << 20);
  if (ranks > 1) {
    EXPECT_EQ(stats.rounds, 1);
  }
  // A tight bound (one copy each way) forces rounds and gives the same result.
  const MoveStats tight = MoveAndCheck(from, to, 100, 200);
  EXPECT_LE(tight.peak_buffer_bytes, 200);
  if (ranks > 1) {
    EXPECT_GT(tight.rounds, stats.rounds);
  }
  EXPECT_EQ(tight.bytes_received, stats.bytes_received);
}

TEST(WeightMover, NothingChangedMovesZeroBytes) {
  const int ranks = World().size();
  const Placement p = RandomPlacement(2, 4 * ranks, ranks, ranks, 1, 5);
  const MoveStats stats = MoveAndCheck(p, p, 64, 1 << 20);
  EXPECT_EQ(stats.bytes_sent, 0);
  EXPECT_EQ(stats.bytes_received, 0);
  EXPECT_EQ(stats.rounds, 0);
}

TEST(WeightMover, OneMovedExpertMovesExactlyItsBytes) {
  const int ranks = World().size();
  if (ranks < 2) GTEST_SKIP() << "needs two ranks";
  // E = 2G experts and G redundant slots, 3 per rank: slot s < 2G holds expert s, slot 2G + i holds a
  // second copy of expert i. The last slot (a second copy of expert G-1) takes an expert its rank
  // does not hold: exactly one copy crosses the network.
  std::vector<int32_t> slots(3 * ranks);
  for (int s = 0; s < 3 * ranks; ++s) slots[s] = s < 2 * ranks ? s : s - 2 * ranks;
  auto from = Placement::Create(2 * ranks, ranks, 1, {slots});
  ASSERT_TRUE(from.ok());
  const int last_rank = ranks - 1;
  int newcomer = 0;
  auto held_by_last = [&](int expert) {
    for (int32_t slot : from->copies(0, expert))
      if (from->rank_of_slot(slot) == last_rank) return true;
    return false;
  };
  while (held_by_last(newcomer)) ++newcomer;
  slots.back() = newcomer;
  auto to = Placement::Create(2 * ranks, ranks, 1, {slots});
  ASSERT_TRUE(to.ok());
  auto plan = PlanMoves(*from, *to, 0, 1, 1000);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->remote_copies, 1);
  EXPECT_EQ(plan->total_bytes_moved(), 1000);
  const MoveStats stats = MoveAndCheck(*from, *to, 1000, 1 << 20);
  auto received = World().AllreduceSum(static_cast<double>(stats.bytes_received));
  ASSERT_TRUE(received.ok());
  EXPECT_EQ(*received, 1000.0);
}

TEST(WeightMover, RefusesABoundThatCannotHoldOneCopy) {
  const int ranks = World().size();
  const Placement p = RandomPlacement(1, 2 * ranks, 0, ranks, 1, 3);
  auto plan = PlanMoves(p, p, 0, 1, 100);
  ASSERT_TRUE(plan.ok());
  auto stats = MoveExperts(
      World(), *plan, 100, 150, [](int, int) { return std::span<const std::byte>(); },
      [](const SlotMove&, std::span<const std::byte>) { return Status::Ok(); });
  EXPECT_FALSE(stats.ok());
}

// A sink that fails on one rank: that rank reports it, and still takes part in every round, so the
// other ranks finish and the communicator stays usable.
TEST(WeightMover, ALocalFailureKeepsTheExchangesMatched) {
  Communicator& comm = World();
  const int ranks = comm.size();
  if (ranks < 2) GTEST_SKIP() << "needs two ranks";
  const Placement from = RandomPlacement(2, 4 * ranks, ranks, ranks, 1, 21);
  const Placement to = RandomPlacement(2, 4 * ranks, ranks, ranks, 1, 22);
  auto plan = PlanMoves(from, to, 0, 2, 64);
  ASSERT_TRUE(plan.ok());
  const int failing = ranks - 1;
  const std::vector<std::byte> content(64, std::byte{7});
  int delivered = 0;
  auto stats = MoveExperts(
      comm, *plan, 64, 4 * 64, [&](int, int) { return std::span<const std::byte>(content); },
      [&](const SlotMove&, std::span<const std::byte>) {
        if (comm.rank() == failing) return Internal("sink refused");
        ++delivered;
        return Status::Ok();
      });
  if (comm.rank() == failing) {
    ASSERT_FALSE(stats.ok());
    EXPECT_NE(stats.status().message().find("sink refused"), std::string::npos);
  } else {
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  }
  ASSERT_TRUE(comm.Barrier().ok());
}

// The background form moves the same bytes, one round per StartNextRound, with steps' own
// exchanges (here all-reduces) running between rounds.
TEST(AsyncWeightMover, MovesEveryChangedCopyBetweenOtherExchanges) {
  Communicator& comm = World();
  const int ranks = comm.size();
  const int me = comm.rank();
  const Placement from = RandomPlacement(3, 6 * ranks, 2 * ranks, ranks, 1, 31);
  const Placement to = RandomPlacement(3, 6 * ranks, 2 * ranks, ranks, 1, 32);
  constexpr int64_t kBytes = 100;
  std::map<std::pair<int, int>, std::vector<std::byte>> live, staged;
  for (int l = 0; l < 3; ++l)
    for (int s = me * from.slots_per_rank(); s < (me + 1) * from.slots_per_rank(); ++s)
      live[{l, s}] = ExpertContent(l, from.phy2log(l)[s], kBytes);
  auto plan = PlanMoves(from, to, 0, 3, kBytes);
  ASSERT_TRUE(plan.ok());
  auto move = AsyncExpertMove::Start(
      comm, *plan, kBytes, 2 * kBytes,
      [&](int layer, int slot) -> std::span<const std::byte> { return live.at({layer, slot}); },
      [&](const SlotMove& m, std::span<const std::byte> bytes) {
        staged[{m.layer, m.slot}].assign(bytes.begin(), bytes.end());
        return Status::Ok();
      });
  ASSERT_TRUE(move.ok()) << move.status().ToString();
  int boundaries = 0;
  while (!(*move)->finished()) {
    ++boundaries;
    float step_value = 1.0f;  // a step's own exchange while the round travels
    ASSERT_TRUE(comm.Allreduce(&step_value, 1).ok());
    EXPECT_EQ(step_value, static_cast<float>(ranks));
    auto ready = (*move)->Poll();
    ASSERT_TRUE(ready.ok()) << ready.status().ToString();
    auto all = comm.AllreduceMax(*ready ? 0 : 1);
    ASSERT_TRUE(all.ok());
    if (*all == 0) {
      ASSERT_TRUE((*move)->StartNextRound().ok());
    }
    ASSERT_LT(boundaries, 100000);
  }
  for (auto& [key, bytes] : staged) live[key] = bytes;
  for (const auto& [key, bytes] : live)
    EXPECT_EQ(bytes, ExpertContent(key.first, to.phy2log(key.first)[key.second], kBytes))
        << "rank " << me << " layer " << key.first << " slot " << key.second;
  if (ranks > 1) {
    EXPECT_GT((*move)->stats().rounds, 1);
  }
  EXPECT_LE((*move)->stats().peak_buffer_bytes, 2 * kBytes);
}

TEST(PlacementBroadcast, EveryRankGetsTheRootsPlacement) {
  Communicator& comm = World();
  const int ranks = comm.size();
  const int root = ranks - 1;
  PlacementPtr mine;
  if (comm.rank() == root) mine = std::make_shared<const Placement>(RandomPlacement(4, 3 * ranks, ranks, ranks, 1, 77));
  auto got = BroadcastPlacement(comm, root, mine);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(**got == RandomPlacement(4, 3 * ranks, ranks, ranks, 1, 77));
}

TEST(PlacementBroadcast, AMissingPlacementIsRefusedOnEveryRank) {
  auto got = BroadcastPlacement(World(), 0, nullptr);
  EXPECT_FALSE(got.ok());
}

TEST(SumOverRanksTest, SumsElementWise) {
  Communicator& comm = World();
  std::vector<int64_t> values = {comm.rank(), 1, 10 * comm.rank()};
  ASSERT_TRUE(SumOverRanks(comm, values).ok());
  const int64_t g = comm.size();
  EXPECT_EQ(values[0], g * (g - 1) / 2);
  EXPECT_EQ(values[1], g);
  EXPECT_EQ(values[2], 10 * g * (g - 1) / 2);
}

}  // namespace
}  // namespace epmoe
