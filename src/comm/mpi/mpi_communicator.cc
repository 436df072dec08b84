// The Communicator over MPI. Every exchange is an MPI nonblocking call whose completion is polled
// with a deadline, so a dead peer turns into Unavailable instead of a hang. Counts are checked to
// fit MPI's int before any call.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "epmoe/comm.h"

namespace epmoe {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kAlltoallvTag = 1;

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
constexpr auto kYieldPhase = std::chrono::milliseconds(2);
constexpr auto kSleepStep = std::chrono::microseconds(20);

// Polls requests until all complete or the deadline passes. peers: the rank each request waits
// for (-1: a collective, any rank), named in the timeout's message.
Status WaitAll(std::span<MPI_Request> requests, std::span<const int> peers, double timeout_seconds,
               const std::string& what, int rank) {
  if (requests.empty()) return Status::Ok();
  if (timeout_seconds <= 0) {
    return CheckMpi(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE), what.c_str(),
                    rank);
  }
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds));
  // MPI_Testsome sets each completed request to MPI_REQUEST_NULL, so the ones left at the deadline
  // say whom this rank still waits for.
  const int count = static_cast<int>(requests.size());
  int remaining = 0;
  for (const MPI_Request& r : requests) remaining += r != MPI_REQUEST_NULL;
  std::vector<int> completed(requests.size());
  for (;;) {
    if (remaining == 0) return Status::Ok();
    int outcount = 0;
    EPMOE_RETURN_IF_ERROR(CheckMpi(
        MPI_Testsome(count, requests.data(), &outcount, completed.data(), MPI_STATUSES_IGNORE), what.c_str(), rank));
    if (outcount == MPI_UNDEFINED) return Status::Ok();
    remaining -= outcount;
    if (remaining == 0) return Status::Ok();
    const auto now = Clock::now();
    if (now > deadline) {
      // Name the peers whose messages are still outstanding, when known.
      std::vector<int> waiting;
      for (size_t i = 0; i < requests.size() && i < peers.size(); ++i) {
        if (requests[i] != MPI_REQUEST_NULL && peers[i] >= 0 &&
            std::find(waiting.begin(), waiting.end(), peers[i]) == waiting.end())
          waiting.push_back(peers[i]);
      }
      std::sort(waiting.begin(), waiting.end());
      const std::string who =
          waiting.empty() ? "a peer rank may have failed or stopped"
                          : fmt::format("still waiting for rank{} {}, which may have failed or stopped",
                                        waiting.size() == 1 ? "" : "s", fmt::join(waiting, ", "));
      return Unavailable(fmt::format("rank {}: {} did not complete within {} s; {} (--comm-timeout raises the limit)",
                                     rank, what, timeout_seconds, who));
    }
    if (now - start < kYieldPhase) {
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
  MpiRequest(std::string what, int rank, double timeout_seconds)
      : what_(std::move(what)), rank_(rank), timeout_seconds_(timeout_seconds) {}
  ~MpiRequest() override {
    // A request that timed out is abandoned (the job is about to abort); any other is completed,
    // within the timeout (a peer that stopped must not hang the teardown).
    if (!timed_out_) (void)Wait();
  }
  Status Wait() override { return WaitFor(requests_.size()); }
  Status WaitReceived() override {
    return WaitFor(receives_ < 0 ? requests_.size() : static_cast<size_t>(receives_));
  }
  bool Test() override {
    if (requests_.empty()) return true;
    int done = 0;
    MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE);
    return done != 0;
  }
  // Marks the requests added so far as the receiving side (WaitReceived completes those).
  void MarkReceives() { receives_ = static_cast<ptrdiff_t>(requests_.size()); }
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

  std::vector<int> counts_a, displs_a, counts_b, displs_b;

 private:
  std::string what_;
  int rank_;
  double timeout_seconds_;
  // Waits for the first n requests.
  Status WaitFor(size_t n) {
    if (timed_out_) return Unavailable(fmt::format("rank {}: {} timed out before and was abandoned", rank_, what_));
    Status status =
        WaitAll(std::span<MPI_Request>(requests_.data(), n), std::span<const int>(peers_.data(), n), timeout_seconds_,
                what_, rank_);
    if (status.code() == StatusCode::kUnavailable) timed_out_ = true;
    return status;
  }

  bool timed_out_ = false;
  std::vector<MPI_Request> requests_;
  std::vector<int> peers_;
  ptrdiff_t receives_ = -1;  // requests_[0, receives_) receive; -1: the sides are not apart
};

class MpiWindow : public Window {
 public:
  MpiWindow(MPI_Win window, void* base, int64_t bytes, int rank, double timeout_seconds)
      : window_(window), base_(base), bytes_(bytes), rank_(rank), timeout_seconds_(timeout_seconds) {}
  ~MpiWindow() override {
    if (!timed_out_) {
      for (MPI_Request& r : pending_) MPI_Wait(&r, MPI_STATUS_IGNORE);
      MPI_Win_unlock_all(window_);
      MPI_Win_free(&window_);
    }
  }
  void* local() override { return base_; }
  int64_t local_bytes() const override { return bytes_; }

  Status Get(int rank, int64_t offset, int64_t bytes, void* dst) override {
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
    Status status = WaitAll(pending_, {}, timeout_seconds_, "one-sided read (MPI_Rget)", rank_);
    if (status.code() == StatusCode::kUnavailable) timed_out_ = true;
    if (status.ok()) pending_.clear();
    return status;
  }
  bool Test() override {
    if (pending_.empty()) return true;
    int done = 0;
    MPI_Testall(static_cast<int>(pending_.size()), pending_.data(), &done, MPI_STATUSES_IGNORE);
    if (done) pending_.clear();
    return done != 0;
  }

 private:
  MPI_Win window_;
  void* base_;
  int64_t bytes_;
  int rank_;
  double timeout_seconds_;
  bool timed_out_ = false;
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
    return node_ids_[rank];
  }
  int num_nodes() const override { return num_nodes_; }
  bool concurrent_windows() const override { return thread_level_ >= MPI_THREAD_MULTIPLE; }
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
    auto request = NewRequest("barrier");
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Ibarrier(comm_, request->Add()), "MPI_Ibarrier", rank_));
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
    auto request = NewRequest("allgatherv");
    EPMOE_ASSIGN_OR_RETURN(const int count, ToInt(send_bytes, "allgatherv send size", rank_));
    EPMOE_ASSIGN_OR_RETURN(request->counts_a, ToInts(recv_bytes, "allgatherv receive size", rank_));
    EPMOE_ASSIGN_OR_RETURN(request->displs_a, ToInts(recv_offsets, "allgatherv receive offset", rank_));
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Iallgatherv(send, count, MPI_BYTE, recv, request->counts_a.data(),
                                                   request->displs_a.data(), MPI_BYTE, comm_, request->Add()),
                                   "MPI_Iallgatherv", rank_));
    return std::unique_ptr<Request>(std::move(request));
  }

  Result<std::unique_ptr<Request>> StartReduceScatter(const float* send, float* recv,
                                                      std::span<const int64_t> recv_counts) override {
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv_counts.size(), "reduce-scatter receive counts"));
    auto request = NewRequest("reduce-scatter");
    EPMOE_ASSIGN_OR_RETURN(request->counts_a, ToInts(recv_counts, "reduce-scatter receive count", rank_));
    int64_t total = 0;
    for (int64_t c : recv_counts) total += c;
    EPMOE_RETURN_IF_ERROR(ToInt(total, "reduce-scatter total count", rank_).status());
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Ireduce_scatter(send, recv, request->counts_a.data(), MPI_FLOAT, MPI_SUM, comm_,
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
    EPMOE_ASSIGN_OR_RETURN(request->counts_a, ToInts(send_bytes, "alltoallv send size", rank_));
    EPMOE_ASSIGN_OR_RETURN(request->displs_a, ToInts(send_offsets, "alltoallv send offset", rank_));
    EPMOE_ASSIGN_OR_RETURN(request->counts_b, ToInts(recv_bytes, "alltoallv receive size", rank_));
    EPMOE_ASSIGN_OR_RETURN(request->displs_b, ToInts(recv_offsets, "alltoallv receive offset", rank_));
    // One message per non-empty block on the private duplicate communicator, receives posted
    // first, peers visited from the next rank on so that not every rank sends to rank 0 first;
    // this rank's own block is copied. (Open MPI's blocking MPI_Alltoallv does the same; its
    // nonblocking one runs the messages through a schedule that only advances when polled, which
    // cost 0.1 ms and more per exchange here.) Messages between two ranks are matched in the
    // order they were posted, so exchanges started in the same order on every rank stay apart.
    request->Reserve(2 * static_cast<size_t>(size_));
    for (int i = 1; i < size_; ++i) {
      const int peer = (rank_ + i) % size_;
      if (recv_bytes[peer] == 0) continue;
      EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Irecv(static_cast<char*>(recv) + recv_offsets[peer], request->counts_b[peer],
                                               MPI_BYTE, peer, kAlltoallvTag, messages_, request->Add(peer)),
                                     "MPI_Irecv", rank_));
    }
    request->MarkReceives();
    for (int i = 1; i < size_; ++i) {
      const int peer = (rank_ + i) % size_;
      if (send_bytes[peer] == 0) continue;
      EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Isend(static_cast<const char*>(send) + send_offsets[peer],
                                               request->counts_a[peer], MPI_BYTE, peer, kAlltoallvTag, messages_,
                                               request->Add(peer)),
                                     "MPI_Isend", rank_));
    }
    if (send_bytes[rank_] > 0)
      std::memcpy(static_cast<char*>(recv) + recv_offsets[rank_], static_cast<const char*>(send) + send_offsets[rank_],
                  static_cast<size_t>(send_bytes[rank_]));
    return std::unique_ptr<Request>(std::move(request));
  }

  Status ExchangeCounts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    EPMOE_RETURN_IF_ERROR(CheckRankCount(send.size(), "count exchange send"));
    EPMOE_RETURN_IF_ERROR(CheckRankCount(recv.size(), "count exchange receive"));
    auto request = NewRequest("count exchange (alltoall)");
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Ialltoall(send.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, comm_,
                                                 request->Add()),
                                   "MPI_Ialltoall", rank_));
    return request->Wait();
  }

  Status AllgatherInt64(std::span<const int64_t> send, std::span<int64_t> recv) override {
    if (recv.size() != send.size() * static_cast<size_t>(size_))
      return InvalidArgument(fmt::format("rank {}: allgather of {} values needs {} receive values, got {}", rank_,
                                         send.size(), send.size() * size_, recv.size()));
    auto request = NewRequest("allgather");
    EPMOE_ASSIGN_OR_RETURN(const int n, ToInt(static_cast<int64_t>(send.size()), "allgather count", rank_));
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Iallgather(send.data(), n, MPI_INT64_T, recv.data(), n, MPI_INT64_T, comm_,
                                                  request->Add()),
                                   "MPI_Iallgather", rank_));
    return request->Wait();
  }

  Result<int64_t> AllreduceMax(int64_t value) override {
    int64_t result = 0;
    auto request = NewRequest("allreduce (max)");
    EPMOE_RETURN_IF_ERROR(
        CheckMpi(MPI_Iallreduce(&value, &result, 1, MPI_INT64_T, MPI_MAX, comm_, request->Add()), "MPI_Iallreduce",
                 rank_));
    EPMOE_RETURN_IF_ERROR(request->Wait());
    return result;
  }

  Result<double> AllreduceSum(double value) override {
    double result = 0;
    auto request = NewRequest("allreduce (sum)");
    EPMOE_RETURN_IF_ERROR(
        CheckMpi(MPI_Iallreduce(&value, &result, 1, MPI_DOUBLE, MPI_SUM, comm_, request->Add()), "MPI_Iallreduce",
                 rank_));
    EPMOE_RETURN_IF_ERROR(request->Wait());
    return result;
  }

  Result<std::unique_ptr<Window>> AllocateWindow(int64_t bytes) override {
    if (bytes < 0) return InvalidArgument(fmt::format("rank {}: window of {} bytes", rank_, bytes));
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
      EPMOE_RETURN_IF_ERROR(CheckMpi(
          MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, comm_, &base, &window), "MPI_Win_allocate",
          rank_));
    }
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, window), "MPI_Win_lock_all", rank_));
    return std::unique_ptr<Window>(new MpiWindow(window, base, bytes, rank_, options_.timeout_seconds));
  }

  Result<std::unique_ptr<Communicator>> Split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", rank_));
    int sub_size = 0;
    MPI_Comm_size(sub, &sub_size);
    // A member's node is its node in this communicator, renumbered densely in order of appearance.
    std::vector<int> parent_nodes(sub_size);
    const int my_node = node_ids_[rank_];
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
      : comm_(comm), messages_(messages), node_ids_(std::move(node_ids)), options_(options), thread_level_(thread_level) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    num_nodes_ = node_ids_.empty() ? 1 : *std::max_element(node_ids_.begin(), node_ids_.end()) + 1;
  }
  std::unique_ptr<MpiRequest> NewRequest(const char* what) {
    return std::make_unique<MpiRequest>(what, rank_, options_.timeout_seconds);
  }
  Status CheckRankCount(size_t n, const char* what) const {
    if (n == static_cast<size_t>(size_)) return Status::Ok();
    return InvalidArgument(fmt::format("rank {}: {} has {} entries for {} ranks", rank_, what, n, size_));
  }

  MPI_Comm comm_;
  MPI_Comm messages_;  // a duplicate of comm_ that carries only alltoallv's point-to-point messages
  std::vector<int> node_ids_;
  CommOptions options_;
  int thread_level_;
  int rank_ = 0;
  int size_ = 1;
  int num_nodes_ = 1;
};

void FinalizeMpiAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

Result<std::unique_ptr<Communicator>> WorldCommunicator(const CommOptions& options) {
  if (options.ranks_per_node < 0)
    return InvalidArgument(fmt::format("ranks per node must not be negative, got {}", options.ranks_per_node));
  if (options.timeout_seconds < 0)
    return InvalidArgument(fmt::format("communication timeout must not be negative, got {}", options.timeout_seconds));
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
  std::vector<int> nodes(size);
  if (options.ranks_per_node > 0) {
    for (int r = 0; r < size; ++r) nodes[r] = r / options.ranks_per_node;
  } else {
    // A node is the set of ranks sharing memory; it is named by its lowest world rank, and nodes
    // are numbered in the order of those ranks.
    MPI_Comm shared = MPI_COMM_NULL;
    EPMOE_RETURN_IF_ERROR(CheckMpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared),
                                   "MPI_Comm_split_type", rank));
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
