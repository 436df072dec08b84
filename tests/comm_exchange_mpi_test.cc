// The MPI Communicator against what each exchange must deliver, computed locally from the ranks'
// known contributions. Runs under mpirun with 1, 2, 4 and 8 ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "epmoe/comm.h"

namespace epmoe {
namespace {

std::unique_ptr<Communicator> World(int ranks_per_node = 0, double timeout_seconds = 120) {
  CommOptions options;
  options.ranks_per_node = ranks_per_node;
  options.timeout_seconds = timeout_seconds;
  auto comm = WorldCommunicator(options);
  EPMOE_CHECK_MSG(comm.ok(), comm.status().ToString());
  return std::move(comm).value();
}

// Rank r contributes r % 3 + 1 (or 0 for every fourth rank) values r*100 + i.
int64_t ContributionSize(int rank) { return rank % 4 == 3 ? 0 : rank % 3 + 1; }

TEST(Comm, RankSizeAndNodes) {
  auto comm = World();
  EXPECT_GE(comm->size(), 1);
  EXPECT_GE(comm->rank(), 0);
  EXPECT_LT(comm->rank(), comm->size());
  EXPECT_EQ(comm->num_nodes(), 1);  // every test rank runs on this machine
  for (int r = 0; r < comm->size(); ++r) EXPECT_EQ(comm->node_of(r), 0);
  EXPECT_NE(comm->description().find("MPI"), std::string::npos);

  auto two_per_node = World(2);
  EXPECT_EQ(two_per_node->num_nodes(), (comm->size() + 1) / 2);
  for (int r = 0; r < comm->size(); ++r) EXPECT_EQ(two_per_node->node_of(r), r / 2);
  EXPECT_TRUE(comm->Barrier().ok());
}

TEST(Comm, RefusesBadOptions) {
  CommOptions options;
  options.ranks_per_node = -1;
  EXPECT_EQ(WorldCommunicator(options).status().code(), StatusCode::kInvalidArgument);
}

TEST(Comm, AllgathervUnevenAndEmpty) {
  auto comm = World();
  const int g = comm->size();
  std::vector<int64_t> bytes(g);
  for (int r = 0; r < g; ++r) bytes[r] = ContributionSize(r) * static_cast<int64_t>(sizeof(int32_t));
  const auto offsets = PrefixOffsets(bytes);
  std::vector<int32_t> mine(ContributionSize(comm->rank()));
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = comm->rank() * 100 + static_cast<int>(i);
  std::vector<int32_t> all(offsets[g] / sizeof(int32_t), -1);
  ASSERT_TRUE(comm->Allgatherv(mine.data(), bytes[comm->rank()], all.data(), bytes,
                               std::span<const int64_t>(offsets.data(), g)).ok());
  size_t at = 0;
  for (int r = 0; r < g; ++r)
    for (int64_t i = 0; i < ContributionSize(r); ++i) EXPECT_EQ(all[at++], r * 100 + i);

  // A send size that disagrees with the receive sizes is refused before any exchange.
  EXPECT_EQ(comm->Allgatherv(mine.data(), bytes[comm->rank()] + 4, all.data(), bytes,
                             std::span<const int64_t>(offsets.data(), g)).code(),
            StatusCode::kInvalidArgument);
  // A size list of the wrong length too.
  EXPECT_EQ(comm->Allgatherv(mine.data(), 0, all.data(), std::span<const int64_t>(bytes.data(), g - 1),
                             std::span<const int64_t>(offsets.data(), g - 1)).code(),
            StatusCode::kInvalidArgument);
}

TEST(Comm, ReduceScatterAndAllreduce) {
  auto comm = World();
  const int g = comm->size();
  std::vector<int64_t> counts(g);
  for (int r = 0; r < g; ++r) counts[r] = ContributionSize(r) + 1;
  const auto offsets = PrefixOffsets(counts);
  // Small integers: every summation order gives the same exact result.
  std::vector<float> send(offsets[g]);
  for (int64_t i = 0; i < offsets[g]; ++i) send[i] = static_cast<float>(comm->rank() + i);
  std::vector<float> recv(counts[comm->rank()], -1);
  ASSERT_TRUE(comm->ReduceScatter(send.data(), recv.data(), counts).ok());
  const float rank_sum = static_cast<float>(g * (g - 1) / 2);
  for (int64_t i = 0; i < counts[comm->rank()]; ++i)
    EXPECT_EQ(recv[i], rank_sum + g * static_cast<float>(offsets[comm->rank()] + i));

  std::vector<float> data = {1.0f, static_cast<float>(comm->rank())};
  ASSERT_TRUE(comm->Allreduce(data.data(), 2).ok());
  EXPECT_EQ(data[0], static_cast<float>(g));
  EXPECT_EQ(data[1], rank_sum);

  auto max = comm->AllreduceMax(comm->rank() * 7);
  ASSERT_TRUE(max.ok());
  EXPECT_EQ(*max, (g - 1) * 7);
  auto sum = comm->AllreduceSum(0.5);
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, 0.5 * g);
  // Values that round: every rank gets the sum taken in rank order, bit for bit.
  auto rounded = comm->AllreduceSum(0.1 * (comm->rank() + 1));
  ASSERT_TRUE(rounded.ok());
  double in_rank_order = 0;
  for (int r = 0; r < g; ++r) in_rank_order += 0.1 * (r + 1);
  EXPECT_EQ(*rounded, in_rank_order);
}

TEST(Comm, AlltoallvWithCountsExchangedFirst) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  // Rank s sends (s + d) % 3 values to rank d (some pairs send nothing): value s*1000 + d*10 + i.
  std::vector<int64_t> send_bytes(g);
  std::vector<int32_t> send;
  for (int d = 0; d < g; ++d) {
    const int n = (me + d) % 3;
    send_bytes[d] = n * static_cast<int64_t>(sizeof(int32_t));
    for (int i = 0; i < n; ++i) send.push_back(me * 1000 + d * 10 + i);
  }
  std::vector<int64_t> recv_bytes(g);
  ASSERT_TRUE(comm->ExchangeCounts(send_bytes, recv_bytes).ok());
  for (int s = 0; s < g; ++s) EXPECT_EQ(recv_bytes[s], ((s + me) % 3) * static_cast<int64_t>(sizeof(int32_t)));
  const auto send_offsets = PrefixOffsets(send_bytes);
  const auto recv_offsets = PrefixOffsets(recv_bytes);
  std::vector<int32_t> recv(recv_offsets[g] / sizeof(int32_t), -1);
  ASSERT_TRUE(comm->Alltoallv(send.data(), send_bytes, std::span<const int64_t>(send_offsets.data(), g), recv.data(),
                              recv_bytes, std::span<const int64_t>(recv_offsets.data(), g)).ok());
  size_t at = 0;
  for (int s = 0; s < g; ++s)
    for (int i = 0; i < (s + me) % 3; ++i) EXPECT_EQ(recv[at++], s * 1000 + me * 10 + i);
}

// The low-latency exchange: no counts first; each receiver learns a block's size from its message.
// Rank s sends (s + d) % 3 values to rank d (empty messages included), twice in flight at once
// (the second with the values negated), into receives of a fixed capacity per peer.
TEST(Comm, CappedAlltoallvLearnsSizesFromTheMessages) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  constexpr int64_t kCapacity = 3 * sizeof(int32_t);  // room for one more value than anyone sends
  std::vector<int64_t> send_bytes(g);
  std::vector<int32_t> send, negated;
  for (int d = 0; d < g; ++d) {
    const int n = (me + d) % 3;
    send_bytes[d] = n * static_cast<int64_t>(sizeof(int32_t));
    for (int i = 0; i < n; ++i) send.push_back(me * 1000 + d * 10 + i);
  }
  for (int32_t v : send) negated.push_back(-v);
  const auto offsets = PrefixOffsets(send_bytes);
  const std::span<const int64_t> send_offsets(offsets.data(), g);
  std::vector<int32_t> recv(g * kCapacity / sizeof(int32_t), -1), recv_negated(recv);
  std::vector<int64_t> received(g, -1), received_negated(g, -1);
  auto first = comm->StartCappedAlltoallv(send.data(), send_bytes, send_offsets, recv.data(), kCapacity, received);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = comm->StartCappedAlltoallv(negated.data(), send_bytes, send_offsets, recv_negated.data(), kCapacity,
                                           received_negated);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_TRUE((*second)->WaitReceived().ok());
  ASSERT_TRUE((*first)->Wait().ok());
  ASSERT_TRUE((*second)->Wait().ok());
  for (int s = 0; s < g; ++s) {
    const int n = (s + me) % 3;
    EXPECT_EQ(received[s], n * static_cast<int64_t>(sizeof(int32_t))) << "from rank " << s;
    EXPECT_EQ(received_negated[s], received[s]) << "from rank " << s;
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(recv[s * 3 + i], s * 1000 + me * 10 + i);
      EXPECT_EQ(recv_negated[s * 3 + i], -(s * 1000 + me * 10 + i));
    }
    for (int i = n; i < 3; ++i) EXPECT_EQ(recv[s * 3 + i], -1) << "beyond rank " << s << "'s message";
  }
  // A block over the capacity is refused before anything is posted, naming it.
  std::vector<int64_t> too_big(g, kCapacity + 1);
  std::vector<int32_t> big(4 * g);
  const std::vector<int64_t> big_offsets(g, 0);
  const auto refused = comm->StartCappedAlltoallv(big.data(), too_big, big_offsets, recv.data(), kCapacity, received);
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(refused.status().message().find("capacity of 12 bytes"), std::string::npos) << refused.status().message();
}

// The capped exchange with its receives posted ahead (CappedExchange), run several times into one
// buffer: in exchange `round` rank s sends (s + d + round) % 3 values to rank d (empty messages
// included). Odd rounds hand the buffer back with Rearm, even rounds let Start post the receives.
int32_t CappedValue(int round, int from, int to, int i) {
  return round * 100000 + from * 1000 + to * 10 + i;
}

// Starts exchange `round` of the pattern above on `exchange` (send and received are kept by the
// caller until the exchange completes).
std::unique_ptr<Request> StartCappedRound(CappedExchange& exchange, int round, int me, int g,
                                          std::vector<int32_t>& send, std::vector<int64_t>& received) {
  std::vector<int64_t> send_bytes(g);
  send.clear();
  for (int d = 0; d < g; ++d) {
    const int n = (me + d + round) % 3;
    send_bytes[d] = n * static_cast<int64_t>(sizeof(int32_t));
    for (int i = 0; i < n; ++i) send.push_back(CappedValue(round, me, d, i));
  }
  const auto offsets = PrefixOffsets(send_bytes);
  received.assign(g, -1);
  auto started = exchange.Start(send.data(), send_bytes, std::span<const int64_t>(offsets.data(), g), received);
  EPMOE_CHECK_MSG(started.ok(), started.status().ToString());
  return std::move(started).value();
}

// Checks exchange `round`'s blocks in recv (3 values of room per peer, -1 beyond each message).
void ExpectCappedRound(int round, int me, int g, const std::vector<int32_t>& recv,
                       const std::vector<int64_t>& received) {
  for (int s = 0; s < g; ++s) {
    const int n = (s + me + round) % 3;
    EXPECT_EQ(received[s], n * static_cast<int64_t>(sizeof(int32_t))) << "round " << round << " from rank " << s;
    for (int i = 0; i < n; ++i) EXPECT_EQ(recv[s * 3 + i], CappedValue(round, s, me, i)) << "round " << round;
    for (int i = n; i < 3; ++i) EXPECT_EQ(recv[s * 3 + i], -1) << "round " << round << " beyond rank " << s;
  }
}

TEST(Comm, CappedExchangeRunsAgainIntoOneBuffer) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  constexpr int64_t kCapacity = 3 * sizeof(int32_t);
  std::vector<int32_t> recv(g * 3, -1), send;
  std::vector<int64_t> received;
  auto exchange = comm->CreateCappedExchange(recv.data(), kCapacity);
  ASSERT_TRUE(exchange.ok()) << exchange.status().ToString();
  for (int round = 0; round < 6; ++round) {
    auto request = StartCappedRound(**exchange, round, me, g, send, received);
    // Neither a second exchange nor a re-arm before this one's receiving side completed (alone,
    // there is nothing to receive: it is complete at once).
    if (g > 1) {
      const auto early =
          (*exchange)->Start(send.data(), std::vector<int64_t>(g, 0), std::vector<int64_t>(g, 0), received);
      EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition) << early.status().ToString();
      EXPECT_EQ((*exchange)->Rearm().code(), StatusCode::kFailedPrecondition);
    }
    ASSERT_TRUE(request->WaitReceived().ok());
    ExpectCappedRound(round, me, g, recv, received);
    std::fill(recv.begin(), recv.end(), -1);  // before the buffer is handed back
    if (round % 2 == 1) {
      ASSERT_TRUE((*exchange)->Rearm().ok());
      ASSERT_TRUE((*exchange)->Rearm().ok());  // posted already: nothing more
    }
    ASSERT_TRUE(request->Wait().ok());  // the sends; the receives posted since are the next round's
  }
  // A block over the capacity is refused before anything is posted, naming it; the next exchange
  // works.
  const std::vector<int64_t> too_big(g, kCapacity + 1), big_offsets(g, 0);
  std::vector<int32_t> big(4);
  const auto refused = (*exchange)->Start(big.data(), too_big, big_offsets, received);
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(refused.status().message().find("capacity of 12 bytes"), std::string::npos) << refused.status().message();
  auto request = StartCappedRound(**exchange, 6, me, g, send, received);
  ASSERT_TRUE(request->Wait().ok());
  ExpectCappedRound(6, me, g, recv, received);
}

// A peer's message that arrives before this rank hands its buffer back lands in the next exchange:
// rank 0 re-arms 0.3 s after the others, who have sent it their next message by then.
TEST(Comm, CappedExchangeMessagesBeforeTheRearmLandInTheNextExchange) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  std::vector<int32_t> recv(g * 3, -1), send, next_send;
  std::vector<int64_t> received, next_received;
  auto exchange = comm->CreateCappedExchange(recv.data(), 3 * sizeof(int32_t));
  ASSERT_TRUE(exchange.ok()) << exchange.status().ToString();
  auto first = StartCappedRound(**exchange, 1, me, g, send, received);
  ASSERT_TRUE(first->WaitReceived().ok());
  ExpectCappedRound(1, me, g, recv, received);
  std::fill(recv.begin(), recv.end(), -1);
  if (me == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    // The others' next messages are here, with no receive posted for them: the first exchange's
    // receives are complete and the next ones are not posted yet.
    EXPECT_TRUE(std::all_of(recv.begin(), recv.end(), [](int32_t v) { return v == -1; }));
  }
  ASSERT_TRUE((*exchange)->Rearm().ok());
  auto second = StartCappedRound(**exchange, 2, me, g, next_send, next_received);
  ASSERT_TRUE(second->Wait().ok());
  ASSERT_TRUE(first->Wait().ok());
  ExpectCappedRound(2, me, g, recv, next_received);
}

// Two exchanges on one communicator stay apart (each has a tag of its own): the second's messages
// never land in the first's posted receives. Destroying an exchange whose receives are posted
// cancels them promptly, and the communicator's other exchanges then still work.
TEST(Comm, CappedExchangesStayApartAndCancelAtTeardown) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  std::vector<int32_t> recv_a(g * 3, -1), recv_b(g * 3, -1), send;
  std::vector<int64_t> received;
  auto a = comm->CreateCappedExchange(recv_a.data(), 3 * sizeof(int32_t));
  auto b = comm->CreateCappedExchange(recv_b.data(), 3 * sizeof(int32_t));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Rearm().ok());  // a's receives posted from every peer
  auto request = StartCappedRound(**b, 4, me, g, send, received);
  ASSERT_TRUE(request->Wait().ok());
  ExpectCappedRound(4, me, g, recv_b, received);
  EXPECT_TRUE(std::all_of(recv_a.begin(), recv_a.end(), [](int32_t v) { return v == -1; }));
  request.reset();
  const auto start = std::chrono::steady_clock::now();
  a->reset();  // armed, never started: its receives are cancelled
  b->reset();  // its last exchange received: nothing posted
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
  ASSERT_TRUE(comm->Barrier().ok());
  auto again = comm->CreateCappedExchange(recv_a.data(), 3 * sizeof(int32_t));
  ASSERT_TRUE(again.ok());
  request = StartCappedRound(**again, 5, me, g, send, received);
  ASSERT_TRUE(request->Wait().ok());
  ExpectCappedRound(5, me, g, recv_a, received);
  // A capacity MPI's int cannot carry is refused.
  EXPECT_EQ(comm->CreateCappedExchange(recv_a.data(), int64_t{1} << 40).status().code(), StatusCode::kOutOfRange);
}

// WaitSomeReceived hands over each peer's block as it lands: every peer that sends this rank
// something is listed exactly once, its block (and, capped, its length) already in place, and then
// none. Rank 0 starts 1 s late, so with a third rank its block is never among the first handed over.
TEST(Comm, ExchangesHandOverBlocksAsTheyLand) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  constexpr int64_t kCapacity = 3 * sizeof(int32_t);
  // Rank s sends (s + d) % 3 values s*1000 + d*10 + i to rank d, as in the tests above.
  std::vector<int64_t> send_bytes(g), recv_bytes(g);
  std::vector<int32_t> send;
  for (int d = 0; d < g; ++d) {
    const int n = (me + d) % 3;
    send_bytes[d] = n * static_cast<int64_t>(sizeof(int32_t));
    recv_bytes[d] = ((d + me) % 3) * static_cast<int64_t>(sizeof(int32_t));
    for (int i = 0; i < n; ++i) send.push_back(me * 1000 + d * 10 + i);
  }
  const auto send_offsets = PrefixOffsets(send_bytes);
  const auto recv_offsets = PrefixOffsets(recv_bytes);
  // 0: alltoallv, 1: capped alltoallv, 2: the capped exchange with its receives posted ahead.
  for (const int kind : {0, 1, 2}) {
    const bool capped = kind > 0;
    SCOPED_TRACE(kind == 2 ? "pre-posted capped exchange" : capped ? "capped alltoallv" : "alltoallv");
    std::vector<int32_t> recv(g * 3, -1);
    std::vector<int64_t> received(g, -1);
    std::unique_ptr<CappedExchange> pre_posted;
    if (kind == 2) {
      auto made = comm->CreateCappedExchange(recv.data(), kCapacity);
      ASSERT_TRUE(made.ok()) << made.status().ToString();
      pre_posted = std::move(made).value();
      ASSERT_TRUE(pre_posted->Rearm().ok());
    }
    if (me == 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    const std::span<const int64_t> offsets(send_offsets.data(), g);
    auto exchange = kind == 2 ? pre_posted->Start(send.data(), send_bytes, offsets, received)
                    : capped
                        ? comm->StartCappedAlltoallv(send.data(), send_bytes, offsets, recv.data(), kCapacity, received)
                        : comm->StartAlltoallv(send.data(), send_bytes, offsets, recv.data(), recv_bytes,
                                               std::span<const int64_t>(recv_offsets.data(), g));
    ASSERT_TRUE(exchange.ok()) << exchange.status().ToString();
    // Where rank s's values land, and whether its block travels as a message at all.
    const auto landed_at = [&](int s) { return capped ? s * 3 : static_cast<int>(recv_offsets[s] / 4); };
    const auto sends_here = [&](int s) { return s != me && (capped || recv_bytes[s] > 0); };
    std::vector<int> listed(g, 0);
    for (int call = 0;; ++call) {
      auto arrived = (*exchange)->WaitSomeReceived();
      ASSERT_TRUE(arrived.ok()) << arrived.status().ToString();
      if (arrived->empty()) break;
      for (int s : *arrived) {
        ASSERT_TRUE(s >= 0 && s < g && sends_here(s)) << "listed rank " << s;
        ++listed[s];
        if (call == 0 && me != 0 && g > 2) {
          EXPECT_NE(s, 0) << "rank 0 started 1 s late";
        }
        for (int i = 0; i < (s + me) % 3; ++i)
          EXPECT_EQ(recv[landed_at(s) + i], s * 1000 + me * 10 + i) << "from " << s;
        if (capped) {
          EXPECT_EQ(received[s], recv_bytes[s]) << "from " << s;
        }
      }
    }
    for (int s = 0; s < g; ++s) EXPECT_EQ(listed[s], sends_here(s) ? 1 : 0) << "rank " << s;
    ASSERT_TRUE((*exchange)->Wait().ok());
    for (int i = 0; i < (me + me) % 3; ++i) EXPECT_EQ(recv[landed_at(me) + i], me * 1000 + me * 10 + i);
    ASSERT_TRUE(comm->Barrier().ok());
  }
}

TEST(Comm, NonblockingExchangesOverlap) {
  auto comm = World();
  const int g = comm->size();
  std::vector<int64_t> bytes(g, sizeof(int64_t));
  const auto offsets = PrefixOffsets(bytes);
  const int64_t mine = comm->rank() + 1;
  std::vector<int64_t> first(g), second(g);
  std::vector<float> reduced = {static_cast<float>(comm->rank())};
  // Two exchanges in flight at once, completed in the opposite order.
  auto a = comm->StartAllgatherv(&mine, sizeof(mine), first.data(), bytes, std::span<const int64_t>(offsets.data(), g));
  ASSERT_TRUE(a.ok());
  auto b = comm->StartAllreduce(reduced.data(), 1);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*b)->Wait().ok());
  ASSERT_TRUE((*a)->Wait().ok());
  EXPECT_TRUE((*a)->Test());
  for (int r = 0; r < g; ++r) EXPECT_EQ(first[r], r + 1);
  EXPECT_EQ(reduced[0], static_cast<float>(g * (g - 1) / 2));
}

// Blocks large enough to go by rendezvous (hundreds of KB) and small ones, two alltoallv in flight
// at once between the same ranks, completed in the opposite order: each block lands in its own
// exchange and place (MPI matches messages between two ranks in the order they were posted).
TEST(Comm, AlltoallvTwoInFlightLargeAndSmallBlocks) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  // Exchange x: rank s sends rank d Size(x, s, d) bytes of value (x * 64 + s * 8 + d) % 251.
  auto size = [](int x, int s, int d) -> int64_t { return x == 0 ? 200000 + 1000 * s + 10 * d : (s + d) % 3 * 5; };
  auto value = [](int x, int s, int d) { return static_cast<uint8_t>((x * 64 + s * 8 + d) % 251); };
  std::vector<int64_t> send_bytes[2], recv_bytes[2], send_offsets[2], recv_offsets[2];
  std::vector<uint8_t> send[2], recv[2];
  std::unique_ptr<Request> started[2];
  for (int x = 0; x < 2; ++x) {
    send_bytes[x].resize(g);
    recv_bytes[x].resize(g);
    for (int r = 0; r < g; ++r) {
      send_bytes[x][r] = size(x, me, r);
      recv_bytes[x][r] = size(x, r, me);
    }
    send_offsets[x] = PrefixOffsets(send_bytes[x]);
    recv_offsets[x] = PrefixOffsets(recv_bytes[x]);
    send[x].resize(send_offsets[x][g]);
    for (int d = 0; d < g; ++d)
      std::fill_n(send[x].begin() + send_offsets[x][d], send_bytes[x][d], value(x, me, d));
    recv[x].assign(recv_offsets[x][g], 255);
    auto request =
        comm->StartAlltoallv(send[x].data(), send_bytes[x], std::span<const int64_t>(send_offsets[x].data(), g),
                             recv[x].data(), recv_bytes[x], std::span<const int64_t>(recv_offsets[x].data(), g));
    ASSERT_TRUE(request.ok()) << request.status().ToString();
    started[x] = std::move(request).value();
  }
  // The small exchange wholly, then the large one's receiving side: its blocks have all landed
  // before this rank's own sends are known to have been taken.
  ASSERT_TRUE(started[1]->Wait().ok());
  ASSERT_TRUE(started[0]->WaitReceived().ok());
  for (int x = 0; x < 2; ++x) {
    for (int s = 0; s < g; ++s) {
      for (int64_t i = 0; i < recv_bytes[x][s]; ++i) {
        ASSERT_EQ(recv[x][recv_offsets[x][s] + i], value(x, s, me)) << "exchange " << x << " from rank " << s;
      }
    }
  }
  ASSERT_TRUE(started[0]->Wait().ok());
  EXPECT_TRUE(started[0]->Test());
}

TEST(Comm, AlltoallvRefusesSelfSizeMismatch) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  std::vector<int64_t> send_bytes(g, 0), recv_bytes(g, 0), offsets(g, 0);
  send_bytes[me] = 4;  // to itself, but it expects nothing from itself
  std::vector<uint8_t> buffer(8);
  auto request = comm->StartAlltoallv(buffer.data(), send_bytes, offsets, buffer.data() + 4, recv_bytes, offsets);
  EXPECT_EQ(request.status().code(), StatusCode::kInvalidArgument) << request.status().ToString();
  EXPECT_TRUE(comm->Barrier().ok());
}

TEST(Comm, OneSidedWindowReads) {
  auto comm = World();
  const int g = comm->size(), me = comm->rank();
  // Rank r exposes (r + 1) * 16 bytes holding r*256 + i.
  auto window = comm->AllocateWindow((me + 1) * 16 * static_cast<int64_t>(sizeof(int32_t)));
  ASSERT_TRUE(window.ok()) << window.status().ToString();
  auto* local = static_cast<int32_t*>((*window)->local());
  for (int i = 0; i < (me + 1) * 16; ++i) local[i] = me * 256 + i;
  ASSERT_TRUE(comm->Barrier().ok());
  std::vector<std::vector<int32_t>> read(g);
  for (int r = 0; r < g; ++r) {
    read[r].assign(r + 1, -1);
    // Elements [r*15 ... ] of rank r: offset r*15 values, r + 1 of them (inside its (r+1)*16).
    ASSERT_TRUE((*window)->Get(r, r * 15 * static_cast<int64_t>(sizeof(int32_t)),
                               (r + 1) * static_cast<int64_t>(sizeof(int32_t)), read[r].data()).ok());
  }
  ASSERT_TRUE((*window)->Flush().ok());
  EXPECT_TRUE((*window)->Test());
  for (int r = 0; r < g; ++r)
    for (int i = 0; i <= r; ++i) EXPECT_EQ(read[r][i], r * 256 + r * 15 + i);
  // Close waits for every rank (nobody frees its window while another still reads); the window is
  // unusable afterwards, and a second Close does nothing.
  const Status closed = (*window)->Close();
  ASSERT_TRUE(closed.ok()) << closed.ToString();
  EXPECT_EQ((*window)->local(), nullptr);
  EXPECT_EQ((*window)->Get(0, 0, 4, read[0].data()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*window)->Flush().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*window)->Close().ok());
}

// A window dropped without Close is closed by its destructor (collective, bounded), and windows of
// zero bytes work too.
TEST(Comm, WindowDestructorClosesIt) {
  auto comm = World();
  for (int i = 0; i < 3; ++i) {
    auto window = comm->AllocateWindow(comm->rank() % 2 == 0 ? 0 : 64);
    ASSERT_TRUE(window.ok()) << window.status().ToString();
  }
  EXPECT_TRUE(comm->Barrier().ok());
}

TEST(Comm, SplitFormsGroups) {
  auto comm = World(2);
  const int g = comm->size(), me = comm->rank();
  // Even and odd ranks, ordered by descending world rank.
  auto sub = comm->Split(me % 2, -me);
  ASSERT_TRUE(sub.ok());
  const int expected_size = (g + 1 - me % 2) / 2;
  EXPECT_EQ((*sub)->size(), expected_size);
  std::vector<int64_t> members((*sub)->size());
  const int64_t world_rank = me;
  ASSERT_TRUE((*sub)->AllgatherInt64(std::span<const int64_t>(&world_rank, 1), members).ok());
  for (size_t i = 1; i < members.size(); ++i) EXPECT_GT(members[i - 1], members[i]);
  EXPECT_EQ(members[(*sub)->rank()], me);
  // Node ids are renumbered densely inside the group; equal world nodes stay equal.
  for (int a = 0; a < (*sub)->size(); ++a)
    for (int b = 0; b < (*sub)->size(); ++b)
      EXPECT_EQ((*sub)->node_of(a) == (*sub)->node_of(b), members[a] / 2 == members[b] / 2);
}

// Whether a timeout's message names rank 0 first among the ranks not heard from (on a loaded
// machine other ranks may be late too).
bool NamesRankZeroFirst(const std::string& message) {
  return message.find("still waiting for rank 0,") != std::string::npos ||
         message.find("still waiting for ranks 0,") != std::string::npos;
}

TEST(Comm, LatePeerTurnsIntoUnavailableNotAHang) {
  auto world = World();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  // A communicator with a 0.5 s limit; rank 0 joins its barrier 2 s late.
  auto impatient = World(0, 0.5);
  auto group = impatient->Split(0, world->rank());
  ASSERT_TRUE(group.ok());
  const auto start = std::chrono::steady_clock::now();
  if (world->rank() == 0) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    // The others entered long ago: the barrier completes.
    EXPECT_TRUE((*group)->Barrier().ok());
  } else {
    const Status status = (*group)->Barrier();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
    EXPECT_NE(status.message().find("rank " + std::to_string(world->rank())), std::string::npos) << status.message();
    // The barrier is point-to-point: it names the rank it still waits for.
    EXPECT_TRUE(NamesRankZeroFirst(status.message())) << status.message();
    EXPECT_LT(waited, 1.9);
  }
  ASSERT_TRUE(world->Barrier().ok());
}

// An alltoallv whose peer never arrives in time names that peer: rank 0 joins 2 s late, and every
// other rank's exchange fails within its 0.5 s limit saying it still waits for rank 0 (the others
// answered). Rank 0's own exchange then completes: the others posted theirs before giving up.
TEST(Comm, LatePeerInAlltoallvIsNamed) {
  auto world = World();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  auto impatient = World(0, 0.5);
  const int g = world->size(), me = world->rank();
  std::vector<int64_t> bytes(g, 4096);
  const auto offsets = PrefixOffsets(bytes);
  // Kept until the end of the program: the abandoned receives of the ranks that gave up may still
  // be written when rank 0 arrives.
  static std::vector<uint8_t> send, recv;
  send.assign(offsets[g], static_cast<uint8_t>(me));
  recv.assign(offsets[g], 255);
  const auto start = std::chrono::steady_clock::now();
  if (me == 0) std::this_thread::sleep_for(std::chrono::seconds(2));
  const Status status = impatient->Alltoallv(send.data(), bytes, std::span<const int64_t>(offsets.data(), g),
                                                recv.data(), bytes, std::span<const int64_t>(offsets.data(), g));
  if (me == 0) {
    EXPECT_TRUE(status.ok()) << status.ToString();
    for (int s = 0; s < g; ++s) EXPECT_EQ(recv[offsets[s]], s);
  } else {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
    EXPECT_NE(status.message().find("rank " + std::to_string(me) + ": alltoallv"), std::string::npos)
        << status.message();
    EXPECT_TRUE(NamesRankZeroFirst(status.message())) << status.message();
    EXPECT_LT(waited, 1.9);
  }
  ASSERT_TRUE(world->Barrier().ok());
}

// With several nodes a timeout names the node of the ranks it waited for: the whole node when all
// its ranks are missing ("node 0 (ranks 0, 1)"), each rank with its node otherwise.
TEST(Comm, LateNodeIsNamedWithItsRanks) {
  auto world = World();
  const int g = world->size(), me = world->rank();
  if (g < 2) GTEST_SKIP() << "needs a peer";
  const int per_node = g >= 3 ? 2 : 1;
  auto impatient = World(per_node, 0.5);
  const auto expect_names = [&](bool late, const std::string& named) {
    if (late) std::this_thread::sleep_for(std::chrono::seconds(2));
    const Status status = impatient->Barrier();
    if (late) {
      EXPECT_TRUE(status.ok()) << status.ToString();  // every other rank's message was there
    } else if (impatient->node_of(me) == 0) {
      EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();  // waited for its own node's rank
    } else {
      EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
      EXPECT_NE(status.message().find("still waiting for " + named + ","), std::string::npos) << status.message();
    }
    ASSERT_TRUE(world->Barrier().ok());
  };
  expect_names(impatient->node_of(me) == 0, per_node == 1 ? "node 0 (rank 0)" : "node 0 (ranks 0, 1)");
  if (per_node == 2) expect_names(me == 0, "rank 0 (node 0)");
}

// The capped exchanges name a late peer the same way: rank 0 starts 2 s late, the others give up
// within their 0.5 s limit naming it, and rank 0's own exchange then completes with every size.
// pre_posted: through a CappedExchange whose receives were posted before, which after the timeout
// refuses to run again and is torn down at once; otherwise StartCappedAlltoallv.
void ExpectLatePeerInCappedExchangeNamed(bool pre_posted) {
  auto world = World();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  auto impatient = World(0, 0.5);
  const int g = world->size(), me = world->rank();
  constexpr int64_t kCapacity = 64;
  std::vector<int64_t> bytes(g, 16);
  const std::vector<int64_t> offsets(g, 0);
  // Kept until the end of the program: abandoned receives may still be written when rank 0 arrives.
  static std::vector<uint8_t> sends[2], recvs[2];
  static std::vector<int64_t> receiveds[2];
  std::vector<uint8_t>& send = sends[pre_posted];
  std::vector<uint8_t>& recv = recvs[pre_posted];
  std::vector<int64_t>& received = receiveds[pre_posted];
  send.assign(16, static_cast<uint8_t>(me));
  recv.assign(g * kCapacity, 255);
  received.assign(g, -1);
  std::unique_ptr<CappedExchange> exchange;
  if (pre_posted) {
    auto made = impatient->CreateCappedExchange(recv.data(), kCapacity);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    exchange = std::move(made).value();
    ASSERT_TRUE(exchange->Rearm().ok());
  }
  const auto start = std::chrono::steady_clock::now();
  if (me == 0) std::this_thread::sleep_for(std::chrono::seconds(2));
  auto request = pre_posted
                     ? exchange->Start(send.data(), bytes, offsets, received)
                     : impatient->StartCappedAlltoallv(send.data(), bytes, offsets, recv.data(), kCapacity, received);
  ASSERT_TRUE(request.ok()) << request.status().ToString();
  const Status status = (*request)->Wait();
  if (me == 0) {
    EXPECT_TRUE(status.ok()) << status.ToString();
    for (int s = 0; s < g; ++s) {
      EXPECT_EQ(received[s], 16);
      EXPECT_EQ(recv[s * kCapacity], s);
    }
  } else {
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
    const std::string what = pre_posted ? "capped alltoallv (pre-posted receives)" : "capped alltoallv";
    EXPECT_NE(status.message().find("rank " + std::to_string(me) + ": " + what), std::string::npos) << status.message();
    EXPECT_TRUE(NamesRankZeroFirst(status.message())) << status.message();
    if (pre_posted) {
      const auto again = exchange->Start(send.data(), bytes, offsets, received);
      EXPECT_EQ(again.status().code(), StatusCode::kUnavailable) << again.status().ToString();
      EXPECT_EQ(exchange->Rearm().code(), StatusCode::kUnavailable);
      request->reset();
      exchange.reset();  // abandoned: returns without waiting
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 1.9);
  }
  ASSERT_TRUE(world->Barrier().ok());
}

TEST(Comm, LatePeerInCappedAlltoallvIsNamed) {
  ExpectLatePeerInCappedExchangeNamed(false);
}
TEST(Comm, LatePeerInCappedExchangeIsNamed) {
  ExpectLatePeerInCappedExchangeNamed(true);
}

// The count exchanges are point-to-point like alltoallv: when rank 0 never arrives, every other
// rank's count exchange, all-gather of counts (the a2a executor's count matrix) and small
// allreduce fail within the 0.5 s limit, each naming rank 0.
TEST(Comm, MissingPeerInCountExchangesIsNamed) {
  auto world = World();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  auto impatient = World(0, 0.5);
  const int g = world->size(), me = world->rank();
  // Kept until the end of the program: the receives abandoned at the timeouts stay posted.
  static std::vector<int64_t> counts_out, counts_in, matrix;
  counts_out.assign(g, me);
  counts_in.assign(g, -1);
  matrix.assign(static_cast<size_t>(g) * g, -1);
  if (me != 0) {
    const auto expect_names_rank_zero = [&](const Status& status, const std::string& what, double started) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count() - started;
      EXPECT_EQ(status.code(), StatusCode::kUnavailable) << what << ": " << status.ToString();
      EXPECT_NE(status.message().find("rank " + std::to_string(me) + ": " + what), std::string::npos)
          << status.message();
      EXPECT_TRUE(NamesRankZeroFirst(status.message())) << status.message();
      EXPECT_LT(waited, 1.5) << what;
    };
    const auto now = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
    double started = now();
    expect_names_rank_zero(impatient->ExchangeCounts(counts_out, counts_in), "count exchange", started);

    started = now();
    std::vector<int64_t> bytes(g, g * 8), offsets(g);
    for (int r = 0; r < g; ++r) offsets[r] = r * g * 8;
    auto gather = impatient->StartAllgatherv(counts_out.data(), g * 8, matrix.data(), bytes, offsets);
    ASSERT_TRUE(gather.ok()) << gather.status().ToString();
    expect_names_rank_zero((*gather)->Wait(), "allgatherv", started);

    started = now();
    expect_names_rank_zero(impatient->AllreduceMax(me).status(), "allreduce (max)", started);
  }
  ASSERT_TRUE(world->Barrier().ok());
}

// Creating and closing a window wait for every rank, bounded: when rank 0 never arrives (a stalled
// or dead peer), every other rank's AllocateWindow, and then its Close, fail within the 0.5 s
// limit naming rank 0, instead of hanging in MPI_Win_allocate or MPI_Win_free; the abandoned
// window refuses further use.
TEST(Comm, MissingPeerAtWindowCreateAndCloseIsNamed) {
  auto world = World();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  auto impatient = World(0, 0.5);
  const int me = world->rank();
  auto window = impatient->AllocateWindow(64);
  ASSERT_TRUE(window.ok()) << window.status().ToString();
  // Creation is bounded too: a second window that rank 0 never comes to create.
  if (me != 0) {
    const Status created = impatient->AllocateWindow(64).status();
    EXPECT_EQ(created.code(), StatusCode::kUnavailable) << created.ToString();
    EXPECT_NE(created.message().find("rank " + std::to_string(me) + ": window creation"), std::string::npos)
        << created.message();
    EXPECT_TRUE(NamesRankZeroFirst(created.message())) << created.message();
  }
  if (me == 0) {
    // Stalls: never closes. A real job would be aborted by the ranks that gave up; here the
    // window is left as it is, never freed (destroying it would close it, which waits for peers
    // that have already given up).
    (void)window->release();
  } else {
    const auto start = std::chrono::steady_clock::now();
    const Status status = (*window)->Close();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
    EXPECT_NE(status.message().find("rank " + std::to_string(me) + ": window close"), std::string::npos)
        << status.message();
    EXPECT_TRUE(NamesRankZeroFirst(status.message())) << status.message();
    EXPECT_NE(status.message().find("not freed"), std::string::npos) << status.message();
    EXPECT_LT(waited, 1.5);
    EXPECT_NE((*window)->local(), nullptr);  // still allocated: a late peer may read it
    std::vector<uint8_t> byte(1);
    EXPECT_EQ((*window)->Get(0, 0, 1, byte.data()).code(), StatusCode::kUnavailable);
    EXPECT_EQ((*window)->Close().code(), StatusCode::kUnavailable);
  }
  ASSERT_TRUE(world->Barrier().ok());
}

// Creating a communicator, splitting one, and creating and closing a window are MPI collectives
// without a time limit, entered only after every rank agreed to. Rank 0 comes 1.2 s late to each
// in turn, against a 0.4 s limit: every other rank gives up naming rank 0, and rank 0, arriving
// after they gave up, returns naming them instead of entering a collective nobody else enters
// (before, it hung there). Each is followed by a world barrier: the job stays usable for the test.
TEST(Comm, LatePeerAtCreationSplitAndWindowsIsNamedNotAHang) {
  auto world = World();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  const int me = world->rank();
  constexpr double kLimit = 0.4;
  constexpr auto kLate = std::chrono::milliseconds(1200);
  const auto seconds_since = [](std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // Runs `step` with rank 0 late and checks every rank's error: the others name rank 0 (or, when
  // one of them was itself descheduled past the limit, the ranks that gave up), rank 0 names the
  // ranks that gave up; nobody waits for the late rank.
  const auto expect_named = [&](const std::string& what, const std::function<Status()>& step) {
    SCOPED_TRACE(what);
    if (me == 0) std::this_thread::sleep_for(kLate);
    const auto start = std::chrono::steady_clock::now();
    const Status status = step();
    const double waited = seconds_since(start);
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
    EXPECT_NE(status.message().find("rank " + std::to_string(me) + ": " + what), std::string::npos)
        << status.message();
    if (me == 0) {
      EXPECT_NE(status.message().find("gave up"), std::string::npos) << status.message();
      // Rank 1 is among the ranks named first (each names the ranks that gave up, in order).
      EXPECT_TRUE(status.message().find("rank 1 gave up") != std::string::npos ||
                  status.message().find("ranks 1, ") != std::string::npos)
          << status.message();
      EXPECT_LT(waited, 0.5);  // the others' decisions were waiting for it
    } else {
      EXPECT_TRUE(NamesRankZeroFirst(status.message()) || status.message().find("gave up") != std::string::npos)
          << status.message();
      EXPECT_LT(waited, 1.1);  // gave up before rank 0 came
    }
    EXPECT_NE(status.message().find("was not entered"), std::string::npos) << status.message();
    ASSERT_TRUE(world->Barrier().ok());
  };

  CommOptions impatient_options;
  impatient_options.timeout_seconds = kLimit;
  expect_named("world communicator creation", [&] { return WorldCommunicator(impatient_options).status(); });

  auto impatient = World(0, kLimit);
  expect_named("split", [&] { return impatient->Split(me % 2, me).status(); });
  expect_named("window creation", [&] { return impatient->AllocateWindow(64).status(); });

  // The same communicator still creates a window when every rank comes: each agreement's messages
  // were all matched, the late rank's included.
  auto window = impatient->AllocateWindow(64);
  ASSERT_TRUE(window.ok()) << window.status().ToString();
  ASSERT_TRUE(world->Barrier().ok());
  expect_named("window close", [&] { return (*window)->Close(); });
  EXPECT_NE((*window)->local(), nullptr);  // abandoned, not freed, on every rank
}

}  // namespace
}  // namespace epmoe
