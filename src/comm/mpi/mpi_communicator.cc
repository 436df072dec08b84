// The Communicator over MPI. Every exchange is an MPI nonblocking call whose completion is polled
// with a deadline, so a dead peer turns into Unavailable instead of a hang. Counts are checked to
// fit MPI's int before any call.
//
// The exchanges that move bytes unchanged (alltoallv, allgatherv, the int64 count exchanges), the
// barrier, the small reductions and a window's close are point-to-point messages on a private
// duplicate of the communicator, so that a timeout can say which ranks were not heard from. Only the
// float reductions (reduce-scatter, allreduce of arrays) stay MPI collectives, whose algorithm the
// library picks; their timeout cannot name a peer.
//
// MPI's communicator and window creation and MPI_Win_free are collectives with no nonblocking form
// and no time limit. Every rank enters them only after an arrival agreement (AgreeToEnter): two
// rounds of point-to-point messages, each bounded by the timeout, after which either every rank
// enters the collective or none does.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epmoe/comm.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

using Clock = std::chrono::steady_clock;

// One tag per kind of point-to-point exchange: messages between two ranks match in posting order
// within a tag, so exchanges of one kind started in the same order on every rank stay apart, and a
// rank that started a different kind of exchange than its peer times out instead of taking the
// wrong bytes.
// An arrival agreement (AgreeToEnter) uses its tag and the next one.
constexpr int kAlltoallvTag = 1;
constexpr int kAllgatherTag = 2;
constexpr int kCountsTag = 3;
constexpr int kBarrierTag = 4;
constexpr int kWindowCloseTag = 5;  // and 6
constexpr int kWindowOpenTag = 7;   // and 8
constexpr int kSplitTag = 9;        // and 10
constexpr int kCappedAlltoallvTag = 11;
// Each CappedExchange of a communicator takes a tag of its own, from this one on in creation order
// (its receives stay posted between exchanges, so another exchange's messages must never match them).
constexpr int kFirstCappedExchangeTag = 64;
constexpr int kLastCappedExchangeTag = 32763;
// The agreement before the world communicator's own creation has no private communicator yet: it
// runs on MPI_COMM_WORLD with these two tags (the MPI standard guarantees tags up to 32767), named
// in comm.h.
constexpr int kWorldCreationTag = 32766;  // and 32767
// GatherJobErrors' messages, also on MPI_COMM_WORLD (named in comm.h): a failed rank's error to
// rank 0, and rank 0's word back that every rank's error came.
constexpr int kJobErrorTag = 32764;
constexpr int kJobErrorsHeardTag = 32765;

std::string MpiErrorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

Status CheckMpi(int code, const char* what, int rank) {
  if (code == MPI_SUCCESS) return Status::Ok();
  return Internal(fmt::format("rank {}: {} failed: {}", rank, what, MpiErrorString(code)));
}

Result<int> ToInt(int64_t value, const char* what, int rank) {
  if (value < 0 || value > INT_MAX)
    return OutOfRange(fmt::format("rank {}: {} of {} does not fit MPI's int count (max {})", rank, what, value, INT_MAX));
  return static_cast<int>(value);
}

Result<std::vector<int>> ToInts(std::span<const int64_t> values, const char* what, int rank) {
  std::vector<int> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    EPMOE_ASSIGN_OR_RETURN(out[i], ToInt(values[i], what, rank));
  }
  return out;
}

// How long a wait polls before it starts sleeping between polls. Polling yields the core between
// polls (a peer that shares it can run); sleeping leaves the cores to the ranks doing work once a
// wait has lasted long enough to be a peer still computing rather than an exchange in flight.
// Polling busily without yielding was tried on a 2-vCPU machine shared with other jobs: exchanges
// were no faster overall, and ranks that kept their cores were preempted for longer afterwards
// (docs/performance.md, "Where the remaining excess goes").
// When the ranks on a node outnumber its cores (4 ranks on 2 cores), a rank that waits longer
// shares a core with a peer still packing or computing what it waits for, and a yield does not
// give that peer the core for long (the yielding rank stays runnable): there a wait starts
// sleeping after kOversubscribedYieldPhase. G = 4 on 2 cores, q8 rows at T = 256 (packing takes a
// few ms, so ranks arrive at the exchanges apart): dispatch + combine went from -2% (runs from
// -41% to +103%) to -37% against the raw MPI_Alltoallv pair, T = 64 from -17% to -27% (12
// alternated runs each; G = 2 is not oversubscribed and unchanged). Yielding after every empty
// poll instead (the core given away twice as often) made it worse: +21% and +51%.
constexpr auto kYieldPhase = std::chrono::milliseconds(2);
constexpr auto kOversubscribedYieldPhase = std::chrono::microseconds(300);
constexpr auto kSleepStep = std::chrono::microseconds(20);

// Whether the ranks on this node outnumber the cores this process may run on (UsableCores; set
// once, when the world communicator is created).
std::atomic<bool> g_cores_oversubscribed{false};

// "rank 3", "ranks 2, 3", and with several nodes the node of each: "node 1 (ranks 2, 3)" when
// every rank of node 1 is named (the node is gone or stopped), "rank 2 (node 1)" otherwise.
// node_ids: the node of every rank of the communicator (empty: one node).
std::string NameRanks(std::span<const int> ranks, std::span<const int> node_ids) {
  const auto plain = [](std::span<const int> list) {
    return fmt::format("rank{} {}", list.size() == 1 ? "" : "s", fmt::join(list, ", "));
  };
  const bool several_nodes =
      !node_ids.empty() && std::any_of(node_ids.begin(), node_ids.end(), [&](int n) { return n != node_ids[0]; });
  if (!several_nodes) return plain(ranks);
  std::map<int, std::vector<int>> by_node;
  for (int r : ranks) by_node[node_ids[r]].push_back(r);
  std::vector<std::string> parts;
  for (const auto& [node, named] : by_node) {
    const auto on_node = static_cast<size_t>(std::count(node_ids.begin(), node_ids.end(), node));
    parts.push_back(named.size() == on_node ? fmt::format("node {} ({})", node, plain(named))
                                            : fmt::format("{} (node {})", plain(named), node));
  }
  return fmt::format("{}", fmt::join(parts, " and "));
}

// What the requests of one communicator share: the node of every rank, to name nodes on a
// timeout, and whether a wait on it has timed out. After a timeout the job is expected to abort
// (comm.h), so requests destroyed unfinished from then on are abandoned at once instead of each
// waiting out the timeout while the error is on its way to the user (a rank's teardown destroys
// several).
struct CommPeers {
  std::vector<int> node_ids;
  std::atomic<bool> timed_out{false};
};
using CommPeersPtr = std::shared_ptr<CommPeers>;

// The error of a wait on a request or exchange whose earlier wait timed out (its messages were
// left to the transport).
Status AbandonedAfterTimeout(int rank, std::string_view what) {
  return Unavailable(fmt::format("rank {}: {} timed out before and was abandoned", rank, what));
}

// Polls requests until all complete or the deadline passes. peers: the rank each request waits
// for (-1: a collective, any rank), named in the timeout's message with its node (comm).
// statuses: empty, or one per request, set as each completes. some: when not null, returns as soon
// as a poll completes at least one request, appending the indices it completed.
Status WaitAll(std::span<MPI_Request> requests, std::span<const int> peers, double timeout_seconds,
               const std::string& what, int rank, CommPeers* comm = nullptr, std::span<MPI_Status> statuses = {},
               std::vector<int>* some = nullptr) {
  if (requests.empty()) return Status::Ok();
  const bool keep_statuses = !statuses.empty();
  if (timeout_seconds <= 0 && some == nullptr) {
    return CheckMpi(MPI_Waitall(static_cast<int>(requests.size()), requests.data(),
                                keep_statuses ? statuses.data() : MPI_STATUSES_IGNORE),
                    what.c_str(), rank);
  }
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds));
  // MPI_Testsome sets each completed request to MPI_REQUEST_NULL, so the ones left at the deadline
  // say whom this rank still waits for.
  const int count = static_cast<int>(requests.size());
  int remaining = 0;
  for (const MPI_Request& r : requests) remaining += r != MPI_REQUEST_NULL;
  std::vector<int> completed(requests.size());
  // A persistent request stays non-null once complete (inactive), so completion is noted here.
  std::vector<char> finished(requests.size(), 0);
  std::vector<MPI_Status> completed_statuses(keep_statuses ? requests.size() : 0);
  // Open MPI's MPI_Testsome first collects the requests already complete and, only when there are
  // none, runs the progress engine once, which is where messages land (a large receive's single
  // copy included); it does not look again, so what that progress completed is only reported by
  // the next poll. So the core is given away only after two polls in a row found nothing: the
  // poll that reports a receive completed by the previous poll's progress is not behind a yield
  // (on a loaded machine a yield can cost another process's whole time slice).
  bool previous_empty = false;
  const Clock::duration yield_phase = g_cores_oversubscribed.load(std::memory_order_relaxed)
                                          ? Clock::duration(kOversubscribedYieldPhase)
                                          : Clock::duration(kYieldPhase);
  for (;;) {
    if (remaining == 0) return Status::Ok();
    int outcount = 0;
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Testsome(count, requests.data(), &outcount, completed.data(),
                                                keep_statuses ? completed_statuses.data() : MPI_STATUSES_IGNORE),
                                   what.c_str(), rank));
    if (outcount == MPI_UNDEFINED) return Status::Ok();
    for (int i = 0; i < outcount; ++i) finished[completed[i]] = 1;
    for (int i = 0; keep_statuses && i < outcount; ++i) statuses[completed[i]] = completed_statuses[i];
    remaining -= outcount;
    if (some != nullptr && outcount > 0) {
      some->insert(some->end(), completed.begin(), completed.begin() + outcount);
      return Status::Ok();
    }
    if (remaining == 0) return Status::Ok();
    const bool give_away = outcount == 0 && previous_empty;
    previous_empty = outcount == 0 && !give_away;
    const auto now = Clock::now();
    if (timeout_seconds > 0 && now > deadline) {
      // Name the peers whose messages are still outstanding, when known.
      std::vector<int> waiting;
      for (size_t i = 0; i < requests.size() && i < peers.size(); ++i) {
        if (requests[i] != MPI_REQUEST_NULL && !finished[i] && peers[i] >= 0 &&
            std::find(waiting.begin(), waiting.end(), peers[i]) == waiting.end())
          waiting.push_back(peers[i]);
      }
      std::sort(waiting.begin(), waiting.end());
      const std::string who = waiting.empty() ? "a peer rank may have failed or stopped"
                                              : fmt::format("still waiting for {}, which may have failed or stopped",
                                                            NameRanks(waiting, comm == nullptr ? std::span<const int>()
                                                                                               : comm->node_ids));
      if (comm != nullptr) comm->timed_out.store(true, std::memory_order_relaxed);
      return Unavailable(fmt::format("rank {}: {} did not complete within {} s; {} (--comm-timeout raises the limit)",
                                     rank, what, timeout_seconds, who));
    }
    if (!give_away) continue;
    if (now - start < yield_phase) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleepStep);
    }
  }
}

// A request with the buffers MPI reads until completion (counts and displacements): one MPI
// request for a collective, or one per message for an exchange made of point-to-point messages.
class MpiRequest : public Request {
 public:
  // comm: what the communicator's requests share (null: a request of no communicator).
  MpiRequest(std::string what, int rank, double timeout_seconds, CommPeersPtr comm = nullptr)
      : what_(std::move(what)), rank_(rank), timeout_seconds_(timeout_seconds), comm_(std::move(comm)) {}
  ~MpiRequest() override {
    // A request that timed out, or whose communicator had a timeout, is abandoned (the job is about
    // to abort); any other is completed, within the timeout (a peer that stopped must not hang the
    // teardown).
    if (!timed_out_ && !(comm_ != nullptr && comm_->timed_out.load(std::memory_order_relaxed))) (void)Wait();
  }
  Status Wait() override { return WaitFor(requests_.size()); }
  Status WaitReceived() override {
    return WaitFor(receives_ < 0 ? requests_.size() : static_cast<size_t>(receives_));
  }
  Result<std::vector<int>> WaitSomeReceived() override {
    if (receives_ < 0) {
      EPMOE_RETURN_IF_ERROR(Wait());
      return std::vector<int>();
    }
    if (timed_out_) return AbandonedAfterTimeout(rank_, what_);
    const auto n = static_cast<size_t>(receives_);
    std::vector<int> completed;
    Status status =
        WaitAll(std::span<MPI_Request>(requests_.data(), n), std::span<const int>(peers_.data(), n), timeout_seconds_,
                what_, rank_, comm_.get(),
                lengths_.empty() ? std::span<MPI_Status>() : std::span<MPI_Status>(statuses_.data(), n), &completed);
    if (status.code() == StatusCode::kUnavailable) timed_out_ = true;
    EPMOE_RETURN_IF_ERROR(status);
    std::vector<int> ranks;
    for (int i : completed) {
      ranks.push_back(peers_[i]);
      if (!lengths_.empty()) lengths_[peers_[i]] = ReceivedBytes(statuses_[i]);
    }
    return ranks;
  }
  bool Test() override {
    if (requests_.empty()) return true;
    int done = 0;
    MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                lengths_.empty() ? MPI_STATUSES_IGNORE : statuses_.data());
    if (done) ReportLengths();
    return done != 0;
  }
  // Gives up on the unfinished messages without waiting (as a timeout does): the destructor then
  // leaves them to the transport, whose buffers must stay allocated.
  void Abandon() { timed_out_ = true; }
  // Marks the requests added so far as the receiving side (WaitReceived completes those).
  void MarkReceives() { receives_ = static_cast<ptrdiff_t>(requests_.size()); }
  // Once the receiving side completes, writes each receive's length in bytes to lengths[peer] (an
  // exchange whose receives are posted for a capacity, not an exact size). Call after adding every
  // request.
  void ReportReceivedBytes(std::span<int64_t> lengths) {
    lengths_ = lengths;
    statuses_.resize(requests_.size());
  }
  // A new request slot; peer: the rank it waits for (-1: a collective). The slot stays valid until
  // the next call (call reserve first when adding several).
  MPI_Request* Add(int peer = -1) {
    requests_.push_back(MPI_REQUEST_NULL);
    peers_.push_back(peer);
    return &requests_.back();
  }
  void Reserve(size_t n) {
    requests_.reserve(n);
    peers_.reserve(n);
  }

  // The length of a completed receive in bytes.
  static int64_t ReceivedBytes(const MPI_Status& status) {
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    return bytes;
  }

  // Receive counts of a reduce-scatter, read by MPI until completion.
  std::vector<int> counts;

 private:
  std::string what_;
  int rank_;
  double timeout_seconds_;
  CommPeersPtr comm_;
  // Waits for the first n requests.
  Status WaitFor(size_t n) {
    if (timed_out_) return AbandonedAfterTimeout(rank_, what_);
    Status status = WaitAll(std::span<MPI_Request>(requests_.data(), n), std::span<const int>(peers_.data(), n),
                            timeout_seconds_, what_, rank_, comm_.get(),
                            lengths_.empty() ? std::span<MPI_Status>() : std::span<MPI_Status>(statuses_.data(), n));
    if (status.code() == StatusCode::kUnavailable) timed_out_ = true;
    if (status.ok() && n >= static_cast<size_t>(std::max<ptrdiff_t>(receives_, 0))) ReportLengths();
    return status;
  }
  void ReportLengths() {
    if (lengths_.empty() || lengths_reported_) return;
    for (ptrdiff_t i = 0; i < receives_; ++i) lengths_[peers_[i]] = ReceivedBytes(statuses_[i]);
    lengths_reported_ = true;
  }

  bool timed_out_ = false;
  std::vector<MPI_Request> requests_;
  std::vector<int> peers_;
  ptrdiff_t receives_ = -1;  // requests_[0, receives_) receive; -1: the sides are not apart
  std::span<int64_t> lengths_;        // ReportReceivedBytes' destination; empty: not asked
  std::vector<MPI_Status> statuses_;  // per request, kept when lengths_ is asked for
  bool lengths_reported_ = false;
};

// One message block of a point-to-point exchange: `bytes` at `data`; post = false: no message.
struct Block {
  void* data = nullptr;
  int bytes = 0;
  bool post = false;
};

// Posts one exchange of point-to-point messages on `messages` (a communicator only these exchanges
// use): first a receive from every other rank whose block is posted, then a send to every other
// rank, peers visited from the next rank on (not every rank addresses rank 0 first). The receives
// are the request's receiving side (MpiRequest::MarkReceives). The caller copies its own block.
// receive(peer) and send(peer) give the blocks; every block must stay valid until completion.
template <typename ReceiveBlock, typename SendBlock>
Status PostMessages(MPI_Comm messages, int rank, int size, int tag, MpiRequest& request, ReceiveBlock receive,
                    SendBlock send) {
  request.Reserve(2 * static_cast<size_t>(size));
  for (int i = 1; i < size; ++i) {
    const int peer = (rank + i) % size;
    const Block block = receive(peer);
    if (!block.post) continue;
    EPMOE_RETURN_IF_ERROR(
        CheckMpi(MPI_Irecv(block.data, block.bytes, MPI_BYTE, peer, tag, messages, request.Add(peer)), "MPI_Irecv", rank));
  }
  request.MarkReceives();
  for (int i = 1; i < size; ++i) {
    const int peer = (rank + i) % size;
    const Block block = send(peer);
    if (!block.post) continue;
    EPMOE_RETURN_IF_ERROR(
        CheckMpi(MPI_Isend(block.data, block.bytes, MPI_BYTE, peer, tag, messages, request.Add(peer)), "MPI_Isend", rank));
  }
  return Status::Ok();
}

// Starts a barrier made of an empty message from every rank to every other: complete when every
// other rank's has arrived, so a timeout names exactly the ranks that have not arrived. Linear in
// the ranks (2 (G - 1) messages per rank), fine for the tens of ranks of expert parallelism.
Result<std::unique_ptr<MpiRequest>> StartNotifyAll(MPI_Comm messages, int rank, int size, int tag, std::string what,
                                                   double timeout_seconds, CommPeersPtr comm = nullptr) {
  auto request = std::make_unique<MpiRequest>(std::move(what), rank, timeout_seconds, std::move(comm));
  const auto empty = [](int) { return Block{nullptr, 0, true}; };
  EPMOE_RETURN_IF_ERROR(PostMessages(messages, rank, size, tag, *request, empty, empty));
  return request;
}

// The buffers of an agreement's second round, which a late peer may still write after this rank
// gave up: those of an abandoned round are kept until the process ends (a few bytes per rank).
struct Decisions {
  int mine = 0;             // 1: every rank arrived here in time; 0: this rank gave up
  std::vector<int> theirs;  // each peer's decision; -1 until it lands
};

void KeepUntilExit(std::unique_ptr<Decisions> decisions) {
  static auto* const kept = new std::vector<std::unique_ptr<Decisions>>();  // never destroyed: see above
  kept->push_back(std::move(decisions));
}

// Bounds a collective that MPI cannot time out (communicator creation, window allocation and
// MPI_Win_free): returns Ok only when every rank will enter it, and otherwise Unavailable naming
// the ranks that were missing, without entering it. Two rounds of point-to-point messages on
// `messages` (tags `tag` and `tag` + 1), each bounded by the timeout:
//  1. arrival: an empty message to every other rank; complete once every other rank's has landed.
//     A rank that times out here names the ranks it did not hear from.
//  2. decision: every rank then sends every other whether its first round completed (1) or timed
//     out (0), and enters the collective only when it receives 1 from every rank. So a rank that
//     arrives after its peers gave up learns it from their 0 ("ranks 1, 2 gave up") instead of
//     entering a collective they will never enter.
// A rank sends its decision even after giving up, and posts its receives for both rounds, so
// every rank that eventually gets here sends and receives exactly two messages per peer and the
// next agreement on the same tags matches its own messages. Once every first round has completed,
// each peer's decision is on its way within the timeout (a peer gives up at most that long after
// it arrived, which was before this rank's first round completed), so the second round's bound
// fails only when a peer stalls between its two messages for longer than the timeout. Then that
// rank may enter while this one does not: the job must be aborted (Communicator::Abort or
// AbortJob end ranks waiting inside MPI collectives). With no timeout (0) there is nothing to
// bound: Ok at once.
Status AgreeToEnter(MPI_Comm messages, int rank, int size, int tag, const std::string& what, const char* collective,
                    double timeout_seconds, const CommPeersPtr& comm = nullptr) {
  if (size == 1 || timeout_seconds <= 0) return Status::Ok();
  EPMOE_ASSIGN_OR_RETURN(auto arrivals,
                         StartNotifyAll(messages, rank, size, tag,
                                        fmt::format("{} (every rank's arrival before {})", what, collective),
                                        timeout_seconds, comm));
  const Status arrived = arrivals->Wait();
  if (!arrived.ok() && arrived.code() != StatusCode::kUnavailable) return arrived;
  auto decisions = std::make_unique<Decisions>();
  decisions->mine = arrived.ok() ? 1 : 0;
  decisions->theirs.assign(static_cast<size_t>(size), -1);
  MpiRequest decided(fmt::format("{} (every rank's decision to enter {})", what, collective), rank, timeout_seconds,
                     comm);
  const Status posted = PostMessages(
      messages, rank, size, tag + 1, decided,
      [&](int peer) { return Block{&decisions->theirs[peer], static_cast<int>(sizeof(int)), true}; },
      [&](int) { return Block{&decisions->mine, static_cast<int>(sizeof(int)), true}; });
  if (!arrived.ok() || !posted.ok()) {
    decided.Abandon();
    KeepUntilExit(std::move(decisions));
    if (!arrived.ok()) return Unavailable(fmt::format("{}; {} was not entered", arrived.message(), collective));
    return posted;
  }
  const Status heard = decided.Wait();
  if (!heard.ok()) {
    KeepUntilExit(std::move(decisions));
    if (heard.code() != StatusCode::kUnavailable) return heard;
    return Unavailable(fmt::format("{}; {} was not entered", heard.message(), collective));
  }
  std::vector<int> gave_up;
  for (int r = 0; r < size; ++r)
    if (r != rank && decisions->theirs[r] != 1) gave_up.push_back(r);
  if (gave_up.empty()) return Status::Ok();
  return Unavailable(fmt::format(
      "rank {}: {}: {} gave up waiting for every rank to arrive (this rank or another came later than their "
      "{} s limit, or stopped); {} was not entered (--comm-timeout raises the limit)",
      rank, what, NameRanks(gave_up, comm == nullptr ? std::span<const int>() : comm->node_ids),
      timeout_seconds, collective));
}

// A window of MPI_Win_allocate(_shared) in a passive-target epoch (lock_all) from creation to
// Close. Close completes this rank's reads, agrees with every rank to free it (AgreeToEnter:
// bounded, peer-naming) and only then calls MPI_Win_free, which is collective and unbounded: once
// every rank has agreed it returns promptly. A window whose reads or close timed out, or whose
// peers gave up on its close, is abandoned: it stays allocated and exposed, and nothing waits on it
// again.
class MpiWindow : public Window {
 public:
  MpiWindow(MPI_Win window, void* base, int64_t bytes, MPI_Comm messages, int rank, int size, double timeout_seconds,
            CommPeersPtr peers)
      : window_(window), base_(base), bytes_(bytes), messages_(messages), rank_(rank), size_(size),
        timeout_seconds_(timeout_seconds), peers_(std::move(peers)) {}
  ~MpiWindow() override {
    // The last resort when the owner did not Close: bounded like Close, abandoned on failure. A
    // window held past MPI_Finalize has nothing left to free.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (state_ == State::kOpen && !finalized) (void)Close();
  }
  void* local() override { return state_ == State::kClosed ? nullptr : base_; }
  int64_t local_bytes() const override { return bytes_; }

  Status Get(int rank, int64_t offset, int64_t bytes, void* dst) override {
    EPMOE_RETURN_IF_ERROR(CheckOpen("one-sided read"));
    constexpr int64_t kChunk = int64_t{1} << 30;  // MPI counts are int: read large ranges in pieces
    char* out = static_cast<char*>(dst);
    for (int64_t done = 0; done < bytes; done += kChunk) {
      const int count = static_cast<int>(std::min(kChunk, bytes - done));
      MPI_Request request = MPI_REQUEST_NULL;
      EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Rget(out + done, count, MPI_BYTE, rank, offset + done, count, MPI_BYTE,
                                              window_, &request),
                                     "MPI_Rget", rank_));
      pending_.push_back(request);
    }
    return Status::Ok();
  }
  Status Flush() override {
    EPMOE_RETURN_IF_ERROR(CheckOpen("flush"));
    Status status = WaitAll(pending_, {}, timeout_seconds_, "one-sided read (MPI_Rget)", rank_, peers_.get());
    if (status.code() == StatusCode::kUnavailable) state_ = State::kAbandoned;
    if (status.ok()) pending_.clear();
    return status;
  }
  bool Test() override {
    if (pending_.empty() || state_ != State::kOpen) return pending_.empty();
    int done = 0;
    MPI_Testall(static_cast<int>(pending_.size()), pending_.data(), &done, MPI_STATUSES_IGNORE);
    if (done) pending_.clear();
    return done != 0;
  }

  Status Close() override {
    if (state_ == State::kClosed) return Status::Ok();
    EPMOE_RETURN_IF_ERROR(CheckOpen("close"));
    EPMOE_RETURN_IF_ERROR(Flush());
    // Nobody frees the window while a peer may still read from it: every rank completes its reads
    // before it announces its arrival here.
    const Status status =
        AgreeToEnter(messages_, rank_, size_, kWindowCloseTag, "window close", "MPI_Win_free", timeout_seconds_, peers_);
    if (!status.ok()) {
      state_ = State::kAbandoned;
      if (status.code() != StatusCode::kUnavailable) return status;
      return Unavailable(status.message() + "; the window was not freed (it stays allocated and exposed), and the job "
                                            "should be aborted");
    }
    state_ = State::kClosed;
    const Status unlocked = CheckMpi(MPI_Win_unlock_all(window_), "MPI_Win_unlock_all", rank_);
    const Status freed = CheckMpi(MPI_Win_free(&window_), "MPI_Win_free", rank_);
    return unlocked.ok() ? freed : unlocked;
  }

 private:
  enum class State { kOpen, kClosed, kAbandoned };
  Status CheckOpen(const char* what) const {
    if (state_ == State::kOpen) return Status::Ok();
    return state_ == State::kClosed
               ? FailedPrecondition(fmt::format("rank {}: window {} after Close", rank_, what))
               : Unavailable(fmt::format("rank {}: window {} after a timeout abandoned the window", rank_, what));
  }

  MPI_Win window_;
  void* base_;
  int64_t bytes_;
  MPI_Comm messages_;  // the owning communicator's point-to-point duplicate (outlives the window)
  int rank_;
  int size_;
  double timeout_seconds_;
  CommPeersPtr peers_;  // the owning communicator's
  State state_ = State::kOpen;
  std::vector<MPI_Request> pending_;
};

class MpiCommunicator : public Communicator {
 public:
  // Takes ownership of comm unless it is MPI_COMM_WORLD. node_ids: the node of every rank.
  // Collective over comm (duplicates it for the point-to-point messages of alltoallv).
  static Result<std::unique_ptr<Communicator>> Create(MPI_Comm comm, std::vector<int> node_ids,
                                                      const CommOptions& options, int thread_level) {
    int rank = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm messages = MPI_COMM_NULL;
    const Status dup = CheckMpi(MPI_Comm_dup(comm, &messages), "MPI_Comm_dup", rank);
    if (!dup.ok()) {
      if (comm != MPI_COMM_WORLD) MPI_Comm_free(&comm);
      return dup;
    }
    return std::unique_ptr<Communicator>(
        new MpiCommunicator(comm, messages, std::move(node_ids), options, thread_level));
  }
  ~MpiCommunicator() override {
    // A communicator held past MPI_Finalize (a static in a program that finalizes MPI itself) has
    // nothing left to free.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Comm_free(&messages_);
    if (comm_ != MPI_COMM_WORLD) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int node_of(int rank) const override {
    EPMOE_CHECK(rank >= 0 && rank < size_);
    return peers_->node_ids[rank];
  }
  int num_nodes() const override { return num_nodes_; }
  bool concurrent_threads() const override { return thread_level_ >= MPI_THREAD_MULTIPLE; }
  void Progress() override {
    // A probe that finds nothing runs Open MPI's progress engine (opal_progress) once.
    int found = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, messages_, &found, MPI_STATUS_IGNORE);
  }
  std::string description() const override {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    std::string library(version, length);
    library = library.substr(0, library.find_first_of(",\n"));
    return fmt::format("MPI ({}), {} rank{} on {} node{}", library, size_, size_ == 1 ? "" : "s", num_nodes_,
                       num_nodes_ == 1 ? "" : "s");
  }

  Status Barrier() override {
    EPMOE_ASSIGN_OR_RETURN(auto request,
                           StartNotifyAll(messages_, rank_, size_, kBarrierTag, "barrier", options_.timeout_seconds, peers_));
    return request->Wait();
  }

  Result<std::unique_ptr<Request>> StartAllgatherv(const void* send, int64_t send_bytes, void* recv,
                                                   std::span<const int64_t> recv_bytes,
                                                   std::span<const int64_t> recv_offsets) override {
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv_bytes.size(), "allgatherv receive sizes"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv_offsets.size(), "allgatherv receive offsets"));
    if (send_bytes != recv_bytes[rank_])
      return InvalidArgument(fmt::format("rank {}: allgatherv sends {} bytes but expects {} from itself", rank_,
                                         send_bytes, recv_bytes[rank_]));
    EPMOE_ASSIGN_OR_RETURN(const int count, ToInt(send_bytes, "allgatherv send size", rank_));
    auto request = NewRequest("allgatherv");
    EPMOE_ASSIGN_OR_RETURN(const std::vector<int> sizes, ToInts(recv_bytes, "allgatherv receive size", rank_));
    EPMOE_RETURN_IF_ERROR(CheckOffsets(recv_offsets, "allgatherv receive offset"));
    // Every rank's block straight from its owner (what libnbc's linear allgatherv does, minus the
    // schedule that advances only when polled).
    char* const into = static_cast<char*>(recv);
    EPMOE_RETURN_IF_ERROR(PostMessages(
        messages_, rank_, size_, kAllgatherTag, *request,
        [&](int peer) {
          return Block{into + recv_offsets[peer], sizes[peer], sizes[peer] > 0};
        },
        [&](int) { return Block{const_cast<void*>(send), count, count > 0}; }));
    if (count > 0) std::memcpy(into + recv_offsets[rank_], send, static_cast<size_t>(count));
    return std::unique_ptr<Request>(std::move(request));
  }

  Result<std::unique_ptr<Request>> StartReduceScatter(const float* send, float* recv,
                                                      std::span<const int64_t> recv_counts) override {
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv_counts.size(), "reduce-scatter receive counts"));
    auto request = NewRequest("reduce-scatter");
    EPMOE_ASSIGN_OR_RETURN(request->counts, ToInts(recv_counts, "reduce-scatter receive count", rank_));
    int64_t total = 0;
    for (int64_t c : recv_counts) total += c;
    EPMOE_RETURN_IF_ERROR(ToInt(total, "reduce-scatter total count", rank_).status());
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Ireduce_scatter(send, recv, request->counts.data(), MPI_FLOAT, MPI_SUM, comm_,
                                                       request->Add()),
                                   "MPI_Ireduce_scatter", rank_));
    return std::unique_ptr<Request>(std::move(request));
  }

  Result<std::unique_ptr<Request>> StartAllreduce(float* data, int64_t count) override {
    auto request = NewRequest("allreduce");
    EPMOE_ASSIGN_OR_RETURN(const int n, ToInt(count, "allreduce count", rank_));
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Iallreduce(MPI_IN_PLACE, data, n, MPI_FLOAT, MPI_SUM, comm_, request->Add()),
                                   "MPI_Iallreduce", rank_));
    return std::unique_ptr<Request>(std::move(request));
  }

  Result<std::unique_ptr<Request>> StartAlltoallv(const void* send, std::span<const int64_t> send_bytes,
                                                  std::span<const int64_t> send_offsets, void* recv,
                                                  std::span<const int64_t> recv_bytes,
                                                  std::span<const int64_t> recv_offsets) override {
    EPMOE_RETURN_IF_ERROR(CheckRankCount(send_bytes.size(), "alltoallv send sizes"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(send_offsets.size(), "alltoallv send offsets"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv_bytes.size(), "alltoallv receive sizes"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv_offsets.size(), "alltoallv receive offsets"));
    if (send_bytes[rank_] != recv_bytes[rank_])
      return InvalidArgument(fmt::format("rank {}: alltoallv sends itself {} bytes but expects {} from itself", rank_,
                                         send_bytes[rank_], recv_bytes[rank_]));
    auto request = NewRequest("alltoallv");
    EPMOE_ASSIGN_OR_RETURN(const std::vector<int> send_sizes, ToInts(send_bytes, "alltoallv send size", rank_));
    EPMOE_RETURN_IF_ERROR(CheckOffsets(send_offsets, "alltoallv send offset"));
    EPMOE_ASSIGN_OR_RETURN(const std::vector<int> recv_sizes, ToInts(recv_bytes, "alltoallv receive size", rank_));
    EPMOE_RETURN_IF_ERROR(CheckOffsets(recv_offsets, "alltoallv receive offset"));
    // One message per non-empty block on the private duplicate communicator (PostMessages); this
    // rank's own block is copied. (Open MPI's blocking MPI_Alltoallv does the same; its
    // nonblocking one runs the messages through a schedule that only advances when polled, which
    // cost 0.1 ms and more per exchange here.) Messages between two ranks are matched in the
    // order they were posted, so exchanges started in the same order on every rank stay apart.
    EPMOE_RETURN_IF_ERROR(PostMessages(
        messages_, rank_, size_, kAlltoallvTag, *request,
        [&](int peer) {
          return Block{static_cast<char*>(recv) + recv_offsets[peer], recv_sizes[peer], recv_sizes[peer] > 0};
        },
        [&](int peer) {
          return Block{const_cast<char*>(static_cast<const char*>(send)) + send_offsets[peer], send_sizes[peer],
                       send_sizes[peer] > 0};
        }));
    if (send_bytes[rank_] > 0)
      std::memcpy(static_cast<char*>(recv) + recv_offsets[rank_], static_cast<const char*>(send) + send_offsets[rank_],
                  static_cast<size_t>(send_bytes[rank_]));
    return std::unique_ptr<Request>(std::move(request));
  }

  Result<std::unique_ptr<Request>> StartCappedAlltoallv(const void* send, std::span<const int64_t> send_bytes,
                                                        std::span<const int64_t> send_offsets, void* recv,
                                                        int64_t capacity, std::span<int64_t> received_bytes) override {
    EPMOE_ASSIGN_OR_RETURN(const int cap, CheckCappedBlocks(send_bytes, send_offsets, received_bytes, capacity));
    auto request = NewRequest("capped alltoallv");
    char* const into = static_cast<char*>(recv);
    char* const from = const_cast<char*>(static_cast<const char*>(send));
    // Every pair exchanges a message, empty ones too: the receiver learns a block's size from the
    // message itself (MPI_Get_count) instead of from counts sent first.
    EPMOE_RETURN_IF_ERROR(PostMessages(
        messages_, rank_, size_, kCappedAlltoallvTag, *request,
        [&](int peer) {
          return Block{into + static_cast<int64_t>(peer) * capacity, cap, true};
        },
        [&](int peer) {
          return Block{from + send_offsets[peer], static_cast<int>(send_bytes[peer]), true};
        }));
    request->ReportReceivedBytes(received_bytes);
    CopyOwnCappedBlock(send, send_bytes, send_offsets, recv, capacity, received_bytes);
    return std::unique_ptr<Request>(std::move(request));
  }

  Result<std::unique_ptr<CappedExchange>> CreateCappedExchange(void* recv, int64_t capacity) override;

  // A capped exchange's blocks, one per rank, each within the capacity: the capacity as MPI's int.
  Result<int> CheckCappedBlocks(std::span<const int64_t> send_bytes, std::span<const int64_t> send_offsets,
                                std::span<const int64_t> received_bytes, int64_t capacity) const {
    EPMOE_RETURN_IF_ERROR(CheckRankCount(send_bytes.size(), "capped alltoallv send sizes"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(send_offsets.size(), "capped alltoallv send offsets"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(received_bytes.size(), "capped alltoallv received sizes"));
    EPMOE_ASSIGN_OR_RETURN(const int cap, ToInt(capacity, "capped alltoallv capacity", rank_));
    EPMOE_RETURN_IF_ERROR(CheckOffsets(send_offsets, "capped alltoallv send offset"));
    for (int d = 0; d < size_; ++d) {
      if (send_bytes[d] < 0 || send_bytes[d] > capacity)
        return OutOfRange(
            fmt::format("rank {}: capped alltoallv block of {} bytes for rank {} is outside the capacity "
                        "of {} bytes per rank",
                        rank_, send_bytes[d], d, capacity));
    }
    return cap;
  }
  // This rank's own block of a capped exchange, copied (it never passes through MPI).
  void CopyOwnCappedBlock(const void* send, std::span<const int64_t> send_bytes, std::span<const int64_t> send_offsets,
                          void* recv, int64_t capacity, std::span<int64_t> received_bytes) const {
    if (send_bytes[rank_] > 0)
      std::memcpy(static_cast<char*>(recv) + static_cast<int64_t>(rank_) * capacity,
                  static_cast<const char*>(send) + send_offsets[rank_], static_cast<size_t>(send_bytes[rank_]));
    received_bytes[rank_] = send_bytes[rank_];
  }

  Status ExchangeCounts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    EPMOE_RETURN_IF_ERROR(CheckRankCount(send.size(), "count exchange send"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv.size(), "count exchange receive"));
    auto request = NewRequest("count exchange");
    int64_t* const sent = const_cast<int64_t*>(send.data());
    EPMOE_RETURN_IF_ERROR(PostMessages(
        messages_, rank_, size_, kCountsTag, *request, [&](int peer) { return Block{&recv[peer], 8, true}; },
        [&](int peer) { return Block{sent + peer, 8, true}; }));
    recv[rank_] = send[rank_];
    return request->Wait();
  }

  Status AllgatherInt64(std::span<const int64_t> send, std::span<int64_t> recv) override {
    if (recv.size() != send.size() * static_cast<size_t>(size_))
      return InvalidArgument(fmt::format("rank {}: allgather of {} values needs {} receive values, got {}", rank_,
                                         send.size(), send.size() * size_, recv.size()));
    return GatherValues(send, recv, "allgather");
  }

  Status AllgatherDouble(std::span<const double> send, std::span<double> recv) override {
    if (recv.size() != send.size() * static_cast<size_t>(size_))
      return InvalidArgument(fmt::format("rank {}: allgather of {} values needs {} receive values, got {}", rank_,
                                         send.size(), send.size() * size_, recv.size()));
    return GatherValues(send, recv, "allgather");
  }

  // The maximum and the sum are taken locally from every rank's value, in rank order, so every rank
  // gets the same result (and a timeout names the ranks not heard from).
  Result<int64_t> AllreduceMax(int64_t value) override {
    EPMOE_RETURN_IF_ERROR(GatherValues(std::span<const int64_t>(&value, 1), std::span<int64_t>(reduce_values_),
                                       "allreduce (max)"));
    return *std::max_element(reduce_values_.begin(), reduce_values_.end());
  }

  Result<double> AllreduceSum(double value) override {
    std::vector<double> values(size_);
    EPMOE_RETURN_IF_ERROR(GatherValues(std::span<const double>(&value, 1), std::span<double>(values), "allreduce (sum)"));
    double sum = 0;
    for (double v : values) sum += v;
    return sum;
  }

  Result<std::unique_ptr<Window>> AllocateWindow(int64_t bytes) override {
    if (bytes < 0) return InvalidArgument(fmt::format("rank {}: window of {} bytes", rank_, bytes));
    // MPI_Comm_split_type and MPI_Win_allocate are collective and wait without limit: enter them
    // only once every rank has agreed to (bounded, naming the ranks missing).
    EPMOE_RETURN_IF_ERROR(AgreeToEnter(messages_, rank_, size_, kWindowOpenTag, "window creation",
                                       "MPI_Win_allocate", options_.timeout_seconds, peers_));
    void* base = nullptr;
    MPI_Win window = MPI_WIN_NULL;
    // When every member shares this node's memory, a shared-memory window makes a read a plain copy
    // by the reader (Open MPI's osc/sm) that never waits for the owner to enter MPI; otherwise the
    // transport's window, whose passive-target reads can wait for a busy owner (DWDP's layer read
    // took twice as long that way on one node).
    MPI_Comm node = MPI_COMM_NULL;
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node),
                                   "MPI_Comm_split_type", rank_));
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    if (node_size == size_) {
      EPMOE_RETURN_IF_ERROR(CheckMpi(
          MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, comm_, &base, &window),
          "MPI_Win_allocate_shared", rank_));
    } else {
      // Without a one-sided transport between the nodes MPI fails the allocation on every rank:
      // return that as an error naming the cause instead of letting MPI abort the job.
      MPI_Errhandler previous = MPI_ERRHANDLER_NULL;
      MPI_Comm_get_errhandler(comm_, &previous);
      MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
      const int code = MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, comm_, &base, &window);
      MPI_Comm_set_errhandler(comm_, previous);
      MPI_Errhandler_free(&previous);
      if (code != MPI_SUCCESS) {
        return FailedPrecondition(fmt::format(
            "rank {}: MPI_Win_allocate failed across {} nodes: {}; the MPI library has no one-sided transport between "
            "these nodes (Open MPI over TCP has none for a program that asks for MPI_THREAD_MULTIPLE; an RDMA "
            "network or UCX provides one: scripts/cluster mpirun --ucx)",
            rank_, num_nodes_, MpiErrorString(code)));
      }
    }
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, window), "MPI_Win_lock_all", rank_));
    return std::unique_ptr<Window>(
        new MpiWindow(window, base, bytes, messages_, rank_, size_, options_.timeout_seconds, peers_));
  }

  Result<std::unique_ptr<Communicator>> Split(int color, int key) override {
    // MPI_Comm_split, the all-gather of nodes and Create's MPI_Comm_dup are collectives without a
    // time limit: enter them only once every rank has agreed to (bounded, naming the ranks missing).
    EPMOE_RETURN_IF_ERROR(
        AgreeToEnter(messages_, rank_, size_, kSplitTag, "split", "MPI_Comm_split", options_.timeout_seconds,
                     peers_));
    MPI_Comm sub = MPI_COMM_NULL;
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", rank_));
    int sub_size = 0;
    MPI_Comm_size(sub, &sub_size);
    // A member's node is its node in this communicator, renumbered densely in order of appearance.
    std::vector<int> parent_nodes(sub_size);
    const int my_node = peers_->node_ids[rank_];
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Allgather(&my_node, 1, MPI_INT, parent_nodes.data(), 1, MPI_INT, sub),
                                   "MPI_Allgather", rank_));
    std::map<int, int> renumber;
    std::vector<int> nodes(sub_size);
    for (int r = 0; r < sub_size; ++r) {
      auto [it, inserted] = renumber.emplace(parent_nodes[r], static_cast<int>(renumber.size()));
      nodes[r] = it->second;
    }
    return Create(sub, std::move(nodes), options_, thread_level_);
  }

  [[noreturn]] void Abort(int exit_code) override {
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::abort();
  }

 private:
  MpiCommunicator(MPI_Comm comm, MPI_Comm messages, std::vector<int> node_ids, const CommOptions& options,
                  int thread_level)
      : comm_(comm), messages_(messages), peers_(std::make_shared<CommPeers>()), options_(options),
        thread_level_(thread_level) {
    peers_->node_ids = std::move(node_ids);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    const std::vector<int>& node_ids_of = peers_->node_ids;
    num_nodes_ = node_ids_of.empty() ? 1 : *std::max_element(node_ids_of.begin(), node_ids_of.end()) + 1;
    reduce_values_.resize(size_);
  }
  std::unique_ptr<MpiRequest> NewRequest(const char* what) {
    return std::make_unique<MpiRequest>(what, rank_, options_.timeout_seconds, peers_);
  }
  Status CheckRankCount(size_t n, const char* what) const {
    if (n == static_cast<size_t>(size_)) return Status::Ok();
    return InvalidArgument(fmt::format("rank {}: {} has {} entries for {} ranks", rank_, what, n, size_));
  }
  Status CheckOffsets(std::span<const int64_t> offsets, const char* what) const {
    for (size_t i = 0; i < offsets.size(); ++i) {
      if (offsets[i] < 0) return InvalidArgument(fmt::format("rank {}: {} {} is negative: {}", rank_, what, i, offsets[i]));
    }
    return Status::Ok();
  }
  // Every rank's send.size() values into recv, in rank order (recv.size() == size_ * send.size()).
  // Every rank's values of a fixed-size type, in rank order.
  template <typename T>
  Status GatherValues(std::span<const T> send, std::span<T> recv, const char* what) {
    EPMOE_CHECK(recv.size() == send.size() * static_cast<size_t>(size_));
    EPMOE_ASSIGN_OR_RETURN(const int bytes,
                           ToInt(static_cast<int64_t>(send.size() * sizeof(T)), "allgather bytes", rank_));
    auto request = NewRequest(what);
    T* const sent = const_cast<T*>(send.data());
    EPMOE_RETURN_IF_ERROR(PostMessages(
        messages_, rank_, size_, kAllgatherTag, *request,
        [&](int peer) { return Block{recv.data() + peer * send.size(), bytes, bytes > 0}; },
        [&](int) { return Block{sent, bytes, bytes > 0}; }));
    std::copy(send.begin(), send.end(), recv.begin() + rank_ * send.size());
    return request->Wait();
  }

  MPI_Comm comm_;
  MPI_Comm messages_;  // a duplicate of comm_ that carries only the point-to-point exchanges (PostMessages)
  CommPeersPtr peers_;  // the node of every rank, and whether an exchange timed out (never null)
  CommOptions options_;
  int thread_level_;
  int rank_ = 0;
  int size_ = 1;
  int num_nodes_ = 1;
  // Every rank's value of AllreduceMax / AllreduceSum. A member, not a local: the receives of an
  // exchange that timed out are abandoned, and a late peer's value may still land here.
  std::vector<int64_t> reduce_values_;
  int next_capped_exchange_tag_ = kFirstCappedExchangeTag;  // CreateCappedExchange's next tag
};

// CappedExchange over MPI: one persistent receive (MPI_Recv_init) per peer into its block of the
// buffer, started (MPI_Startall) by Rearm or the next Start; the sends are posted per exchange
// (MPI_Send_init would fix a message's size, and a step's sizes vary). Receives started once per
// exchange instead of posted per exchange: the receives of the next exchange are posted while this
// rank still computes, so a peer's message finds its receive waiting.
class MpiCappedExchange : public CappedExchange {
 public:
  MpiCappedExchange(const MpiCommunicator& owner, MPI_Comm messages, int tag, char* recv, int64_t capacity,
                    double timeout_seconds, CommPeersPtr peers)
      : owner_(owner),
        messages_(messages),
        rank_(owner.rank()),
        size_(owner.size()),
        tag_(tag),
        recv_(recv),
        capacity_(capacity),
        timeout_seconds_(timeout_seconds),
        peers_(std::move(peers)) {}
  ~MpiCappedExchange() override { Release(); }

  // Makes the persistent receives (none started).
  Status Init(int cap) {
    receives_.reserve(size_ - 1);
    for (int i = 1; i < size_; ++i) {
      const int peer = (rank_ + i) % size_;
      receive_peers_.push_back(peer);
      receives_.push_back(MPI_REQUEST_NULL);
      EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Recv_init(recv_ + static_cast<int64_t>(peer) * capacity_, cap, MPI_BYTE, peer,
                                                   tag_, messages_, &receives_.back()),
                                     "MPI_Recv_init", rank_));
    }
    return Status::Ok();
  }

  Result<std::unique_ptr<Request>> Start(const void* send, std::span<const int64_t> send_bytes,
                                         std::span<const int64_t> send_offsets,
                                         std::span<int64_t> received_bytes) override {
    EPMOE_RETURN_IF_ERROR(owner_.CheckCappedBlocks(send_bytes, send_offsets, received_bytes, capacity_).status());
    EPMOE_RETURN_IF_ERROR(Arm());
    auto sends = std::make_unique<MpiRequest>(kWhat, rank_, timeout_seconds_, peers_);
    char* const from = const_cast<char*>(static_cast<const char*>(send));
    EPMOE_RETURN_IF_ERROR(PostMessages(
        messages_, rank_, size_, tag_, *sends, [](int) { return Block{}; },
        [&](int peer) {
          return Block{from + send_offsets[peer], static_cast<int>(send_bytes[peer]), true};
        }));
    owner_.CopyOwnCappedBlock(send, send_bytes, send_offsets, recv_, capacity_, received_bytes);
    lengths_ = received_bytes;
    state_ = receives_.empty() ? State::kReceived : State::kReceiving;  // alone: nothing to receive
    ++exchange_;
    return std::unique_ptr<Request>(new ExchangeRequest(this, exchange_, std::move(sends)));
  }

  Status Rearm() override {
    if (state_ == State::kReceiving)
      return FailedPrecondition(
          fmt::format("rank {}: {}: re-armed before the last exchange's receiving side completed", rank_, kWhat));
    return Arm();
  }

 private:
  static constexpr const char* kWhat = "capped alltoallv (pre-posted receives)";
  enum class State {
    kIdle,       // receives not started
    kArmed,      // receives started, no exchange yet
    kReceiving,  // an exchange started, its receiving side not complete
    kReceived,   // its receiving side complete, the buffer not handed back yet
    kAbandoned,  // a wait timed out: the receives are left to the transport
  };

  // One exchange's request: its sends, and the exchange's receives while they are this exchange's.
  class ExchangeRequest : public Request {
   public:
    ExchangeRequest(MpiCappedExchange* exchange, int64_t number, std::unique_ptr<MpiRequest> sends)
        : exchange_(exchange), number_(number), sends_(std::move(sends)) {}
    Status WaitReceived() override { return exchange_->WaitReceived(number_); }
    Result<std::vector<int>> WaitSomeReceived() override { return exchange_->WaitSomeReceived(number_); }
    Status Wait() override {
      EPMOE_RETURN_IF_ERROR(WaitReceived());
      return sends_->Wait();
    }
    bool Test() override { return exchange_->TestReceived(number_) && sends_->Test(); }

   private:
    MpiCappedExchange* exchange_;
    int64_t number_;  // which of the exchange's exchanges this is
    std::unique_ptr<MpiRequest> sends_;
  };

  Status Arm() {
    switch (state_) {
      case State::kArmed: return Status::Ok();
      case State::kReceiving:
        return FailedPrecondition(
            fmt::format("rank {}: {} started before the last exchange's receiving side completed", rank_, kWhat));
      case State::kAbandoned:
        return AbandonedAfterTimeout(rank_, kWhat);
      case State::kIdle:
      case State::kReceived: break;
    }
    if (!receives_.empty())
      EPMOE_RETURN_IF_ERROR(
          CheckMpi(MPI_Startall(static_cast<int>(receives_.size()), receives_.data()), "MPI_Startall", rank_));
    waiting_peers_ = receive_peers_;
    state_ = State::kArmed;
    return Status::Ok();
  }

  // Completes the receiving side of exchange `number` (a later exchange's receives are not its).
  Status WaitReceived(int64_t number) {
    if (state_ == State::kAbandoned)
      return AbandonedAfterTimeout(rank_, kWhat);
    if (number != exchange_ || state_ != State::kReceiving) return Status::Ok();
    return Land(nullptr);
  }
  // Waits until at least one more peer's block of exchange `number` has landed and returns those
  // peers (none once every block has).
  Result<std::vector<int>> WaitSomeReceived(int64_t number) {
    if (state_ == State::kAbandoned)
      return AbandonedAfterTimeout(rank_, kWhat);
    if (number != exchange_ || state_ != State::kReceiving) return std::vector<int>();
    std::vector<int> some;
    EPMOE_RETURN_IF_ERROR(Land(&some));
    std::vector<int> ranks;
    for (int i : some) ranks.push_back(receive_peers_[i]);
    return ranks;
  }
  // Waits for the receives that have not landed: all of them, or (some not null) until at least
  // one has, appending those. Notes the length of each that lands.
  Status Land(std::vector<int>* some) {
    std::vector<MPI_Status> statuses(receives_.size());
    std::vector<int> completed;
    // The landed receives are inactive (persistent), not null: their peers are not named.
    const Status status = WaitAll(receives_, waiting_peers_, timeout_seconds_, kWhat, rank_, peers_.get(), statuses,
                                  some != nullptr ? &completed : nullptr);
    if (status.code() == StatusCode::kUnavailable) state_ = State::kAbandoned;
    EPMOE_RETURN_IF_ERROR(status);
    for (size_t i = 0; i < receives_.size(); ++i) {
      const bool landed_now = some == nullptr || std::find(completed.begin(), completed.end(), i) != completed.end();
      if (waiting_peers_[i] < 0 || !landed_now) continue;
      NoteLanded(i, statuses[i]);
      if (some != nullptr) some->push_back(static_cast<int>(i));
    }
    if (std::all_of(waiting_peers_.begin(), waiting_peers_.end(), [](int peer) { return peer < 0; }))
      state_ = State::kReceived;
    return Status::Ok();
  }
  bool TestReceived(int64_t number) {
    if (number != exchange_ || state_ != State::kReceiving) return state_ != State::kAbandoned;
    std::vector<MPI_Status> statuses(receives_.size());
    int done = 0;
    MPI_Testall(static_cast<int>(receives_.size()), receives_.data(), &done, statuses.data());
    if (!done) return false;
    for (size_t i = 0; i < receives_.size(); ++i) {
      if (waiting_peers_[i] >= 0) NoteLanded(i, statuses[i]);
    }
    state_ = State::kReceived;
    return true;
  }
  void NoteLanded(size_t i, const MPI_Status& status) {
    lengths_[receive_peers_[i]] = MpiRequest::ReceivedBytes(status);
    waiting_peers_[i] = -1;
  }

  // Cancels the receives still posted, waits (bounded) until they are cancelled or complete, and
  // frees them; after a timeout they are abandoned (the buffer stays the transport's).
  void Release() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || state_ == State::kAbandoned || peers_->timed_out.load(std::memory_order_relaxed)) return;
    if (state_ == State::kArmed || state_ == State::kReceiving) {
      for (MPI_Request& receive : receives_) {
        // A receive that completed is inactive (persistent) and must not be cancelled.
        int complete = 0;
        MPI_Request_get_status(receive, &complete, MPI_STATUS_IGNORE);
        if (!complete) MPI_Cancel(&receive);
      }
      if (!WaitAll(receives_, receive_peers_, timeout_seconds_, kWhat, rank_, peers_.get()).ok()) return;
    }
    for (MPI_Request& receive : receives_) {
      if (receive != MPI_REQUEST_NULL) MPI_Request_free(&receive);
    }
  }

  const MpiCommunicator& owner_;
  MPI_Comm messages_;
  int rank_, size_, tag_;
  char* recv_;
  int64_t capacity_;
  double timeout_seconds_;
  CommPeersPtr peers_;
  std::vector<MPI_Request> receives_;  // persistent, one per peer
  std::vector<int> receive_peers_;     // the peer of each receive
  std::vector<int> waiting_peers_;     // the peer of each receive not landed yet, -1 once landed
  std::span<int64_t> lengths_;         // the last Start's received_bytes
  State state_ = State::kIdle;
  int64_t exchange_ = 0;  // exchanges started so far
};

Result<std::unique_ptr<CappedExchange>> MpiCommunicator::CreateCappedExchange(void* recv, int64_t capacity) {
  EPMOE_ASSIGN_OR_RETURN(const int cap, ToInt(capacity, "capped exchange capacity", rank_));
  if (recv == nullptr && capacity > 0)
    return InvalidArgument(
        fmt::format("rank {}: capped exchange of {} bytes per rank has no receive buffer", rank_, capacity));
  if (next_capped_exchange_tag_ > kLastCappedExchangeTag)
    return OutOfRange(fmt::format("rank {}: more than {} capped exchanges made on one communicator", rank_,
                                  kLastCappedExchangeTag - kFirstCappedExchangeTag + 1));
  auto exchange =
      std::make_unique<MpiCappedExchange>(*this, messages_, next_capped_exchange_tag_++, static_cast<char*>(recv),
                                          capacity, options_.timeout_seconds, peers_);
  EPMOE_RETURN_IF_ERROR(exchange->Init(cap));
  return std::unique_ptr<CappedExchange>(std::move(exchange));
}

void FinalizeMpiAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

void AbortJob(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

JobErrors GatherJobErrors(const Status& error, double seconds) {
  JobErrors job;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) {
    MPI_Comm_rank(MPI_COMM_WORLD, &job.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &job.size);
  }
  const std::string& mine = error.message();
  if (job.size == 1) {
    job.every_rank_reported = true;
    job.errors.push_back({mine, {job.rank}});
    return job;
  }
  const auto start = Clock::now();
  const auto after = [start](double s) {
    return start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  constexpr auto kPollStep = std::chrono::milliseconds(1);  // an error ends the job: no need to poll hard
  if (job.rank != 0) {
    auto message = std::make_unique<std::string>(mine);
    auto heard = std::make_unique<int>(0);
    MPI_Request sent = MPI_REQUEST_NULL, word = MPI_REQUEST_NULL;
    MPI_Isend(message->data(), static_cast<int>(std::min<size_t>(message->size(), INT_MAX)), MPI_BYTE, 0, kJobErrorTag,
              MPI_COMM_WORLD, &sent);
    MPI_Irecv(heard.get(), 1, MPI_INT, 0, kJobErrorsHeardTag, MPI_COMM_WORLD, &word);
    const auto deadline = after(2 * seconds);
    for (;;) {
      int done = 0;
      MPI_Test(&word, &done, MPI_STATUS_IGNORE);
      if (done) {
        // Rank 0 sends its word only after it has received every error, this one included.
        MPI_Wait(&sent, MPI_STATUS_IGNORE);
        job.every_rank_reported = true;
        return job;
      }
      if (Clock::now() > deadline) break;
      std::this_thread::sleep_for(kPollStep);
    }
    // Rank 0 did not answer (it works, or waits for this rank): the send and the receive stay
    // pending, so their buffers are kept until the job ends, which the caller does next.
    (void)message.release();
    (void)heard.release();
    job.errors.push_back({mine, {job.rank}});
    return job;
  }
  std::vector<std::string> messages(job.size);
  std::vector<bool> heard(job.size, false);
  messages[0] = mine;
  heard[0] = true;
  int count = 1;
  const auto deadline = after(seconds);
  while (count < job.size && Clock::now() <= deadline) {
    int flag = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kJobErrorTag, MPI_COMM_WORLD, &flag, &status);
    if (!flag) {
      std::this_thread::sleep_for(kPollStep);
      continue;
    }
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::string text(static_cast<size_t>(bytes), '\0');
    MPI_Recv(text.data(), bytes, MPI_BYTE, status.MPI_SOURCE, kJobErrorTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (!heard[status.MPI_SOURCE]) {
      heard[status.MPI_SOURCE] = true;
      messages[status.MPI_SOURCE] = std::move(text);
      ++count;
    }
  }
  job.every_rank_reported = count == job.size;
  if (job.every_rank_reported) {
    static const int kWord = 1;
    for (int r = 1; r < job.size; ++r) MPI_Send(&kWord, 1, MPI_INT, r, kJobErrorsHeardTag, MPI_COMM_WORLD);
  }
  for (int r = 0; r < job.size; ++r) {
    if (!heard[r]) continue;
    auto same = std::find_if(job.errors.begin(), job.errors.end(),
                             [&](const JobErrors::Error& e) { return e.message == messages[r]; });
    if (same != job.errors.end()) {
      same->ranks.push_back(r);
    } else {
      job.errors.push_back({messages[r], {r}});
    }
  }
  return job;
}

Result<std::unique_ptr<Communicator>> WorldCommunicator(const CommOptions& options) {
  if (options.ranks_per_node < 0)
    return InvalidArgument(fmt::format("ranks per node must not be negative, got {}", options.ranks_per_node));
  // The deadline is kept in nanoseconds: beyond about 292 years it would overflow into the past.
  constexpr double kMaxTimeoutSeconds = 1e8;
  if (!(options.timeout_seconds >= 0 && options.timeout_seconds <= kMaxTimeoutSeconds))
    return InvalidArgument(fmt::format("communication timeout {} s: must be from 0 (wait forever) to {:.0e} s",
                                       options.timeout_seconds, kMaxTimeoutSeconds));
  int initialized = 0;
  MPI_Initialized(&initialized);
  int thread_level = MPI_THREAD_SINGLE;
  if (!initialized) {
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &thread_level) != MPI_SUCCESS)
      return Internal("MPI_Init_thread failed: MPI could not start (is this an MPI launch environment?)");
    std::atexit(FinalizeMpiAtExit);
  } else {
    MPI_Query_thread(&thread_level);
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // MPI_Comm_split_type, the node all-gathers and Create's MPI_Comm_dup are collectives without a
  // time limit: enter them only once every rank has agreed to (bounded, naming the ranks missing).
  EPMOE_RETURN_IF_ERROR(AgreeToEnter(MPI_COMM_WORLD, rank, size, kWorldCreationTag, "world communicator creation",
                                     "MPI_Comm_split_type / MPI_Comm_dup", options.timeout_seconds));
  std::vector<int> nodes(size);
  // The ranks sharing this machine's memory (and cores), whatever --ranks-per-node says.
  MPI_Comm shared = MPI_COMM_NULL;
  EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared),
                                 "MPI_Comm_split_type", rank));
  int local_ranks = 1;
  MPI_Comm_size(shared, &local_ranks);
  g_cores_oversubscribed.store(local_ranks > UsableCores(), std::memory_order_relaxed);
  if (options.ranks_per_node > 0) {
    MPI_Comm_free(&shared);
    for (int r = 0; r < size; ++r) nodes[r] = r / options.ranks_per_node;
  } else {
    // A node is the set of ranks sharing memory; it is named by its lowest world rank, and nodes
    // are numbered in the order of those ranks.
    int leader = rank;
    MPI_Allreduce(&rank, &leader, 1, MPI_INT, MPI_MIN, shared);
    MPI_Comm_free(&shared);
    std::vector<int> leaders(size);
    EPMOE_RETURN_IF_ERROR(
        CheckMpi(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather", rank));
    std::map<int, int> node_of_leader;
    for (int l : leaders) node_of_leader.emplace(l, 0);
    int next = 0;
    for (auto& [l, node] : node_of_leader) node = next++;
    for (int r = 0; r < size; ++r) nodes[r] = node_of_leader[leaders[r]];
  }
  return MpiCommunicator::Create(MPI_COMM_WORLD, std::move(nodes), options, thread_level);
}

}  // namespace epmoe
