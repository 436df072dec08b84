// Communicator: the collective and one-sided exchanges the expert-parallel executors use, behind a
// small interface so that no MPI type reaches a public header.
//
// Every exchange is in bytes (or fp32 for reductions) with 64-bit counts; implementations refuse a
// count their transport cannot carry. Blocking calls are nonblocking ones followed by Wait, and
// every wait is bounded by CommOptions::timeout_seconds: a peer that died or stopped answering
// makes the call return Unavailable (naming the operation and the rank) instead of hanging; the
// caller should then abort the whole job (Communicator::Abort), since MPI cannot recover. Every
// exchange but the float reductions (StartReduceScatter, StartAllreduce) also names the ranks it
// was still waiting for ("still waiting for ranks 0, 3"). After a timeout the exchange is
// abandoned: a late peer may still write its receive buffers and read its send buffers, so they
// must stay allocated until the job ends.
//
// Creating a communicator (WorldCommunicator, Split), allocating a Window and closing one run MPI
// collectives that have no time limit. Each is entered only after every rank has agreed to enter it,
// in two rounds of messages bounded by the timeout each: when a rank does not arrive in time, every
// rank that did returns Unavailable naming it ("still waiting for rank 0"), and a rank that
// arrives after its peers gave up returns Unavailable naming them ("ranks 1, 2 gave up waiting"),
// instead of entering a collective the others never enter. After such an error nothing was
// created or freed, and the job is expected to abort (Communicator::Abort or AbortJob): the
// communicator it was called on (or, for WorldCommunicator, MPI_COMM_WORLD's agreement tags) may
// still have messages in flight, so it must not be used for a retry. The one case left unbounded:
// a rank that stalls for longer than the timeout between the two rounds may leave a peer inside the
// collective, which the abort then ends.
// A Communicator is used by one thread at a time (thread-compatible, not thread-safe); Requests and
// Windows belong to the communicator that made them and must not outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

struct CommOptions {
  // Ranks per node: 0 takes node membership from the transport (MPI's shared-memory split, so a
  // node is a real machine on a cluster); n > 0 groups consecutive ranks n at a time to model
  // several nodes on one machine.
  int ranks_per_node = 0;
  // Longest wait for one exchange before it fails with Unavailable; 0 waits forever. At most 1e8 s.
  double timeout_seconds = 600;
};

// A nonblocking exchange in flight. Wait() completes it (bounded by the timeout); destroying an
// unfinished Request waits for it first, up to the timeout, and then abandons it (buffers must stay
// alive until then).
class Request {
 public:
  virtual ~Request() = default;
  virtual Status Wait() = 0;
  // Completes the receiving side only: the receive buffer holds everything sent to this rank,
  // while what this rank sent may still be on its way (its send buffer must stay unchanged until
  // Wait). A rank that arrives last at an exchange then need not wait for its peers to take its
  // data. Bounded by the timeout like Wait; exchanges that cannot tell the sides apart complete
  // wholly.
  virtual Status WaitReceived() { return Wait(); }
  // Waits (bounded by the timeout like Wait) until at least one more peer's block has landed and
  // returns those peers' ranks, so a caller can work on what has arrived while the rest is in
  // flight (this rank's own block, copied at the start, and empty blocks that post no message are
  // never listed). Returns none once the receiving side is complete: every block has landed.
  // Exchanges that cannot tell the sides apart complete wholly and return none.
  virtual Result<std::vector<int>> WaitSomeReceived() {
    EPMOE_RETURN_IF_ERROR(Wait());
    return std::vector<int>();
  }
  // True when complete (does not block).
  virtual bool Test() = 0;
};

// Memory every rank exposes for one-sided reads by every rank, allocated by the transport (so it
// can be shared memory on one node). Reads are nonblocking: Get starts a read and Flush() completes
// all reads this rank started on this window. The owner writes its local() memory before a
// Barrier and keeps it constant while others may read. Created and closed collectively.
//
// Close() ends it: every rank completes its reads, then agrees with every rank (bounded by the
// timeout, see above) to free the memory, and only then is it freed (MPI_Win_free, collective and
// unbounded in MPI, returns promptly once all have agreed). When a rank does not arrive in time,
// Close returns Unavailable naming the ranks missing (on the late rank itself: naming the ranks
// that gave up) and abandons the window: its memory stays allocated and exposed (a late peer may
// still read it) and is never freed; Get, Flush and Close then fail with Unavailable, and the
// process is expected to abort the job (Communicator::Abort).
// Destroying a window that was not closed closes it as a last resort (errors dropped): call Close
// to learn whether it worked.
class Window {
 public:
  virtual ~Window() = default;
  // This rank's exposed memory.
  virtual void* local() = 0;
  virtual int64_t local_bytes() const = 0;
  // Starts reading `bytes` bytes at `offset` of `rank`'s exposed memory into dst.
  virtual Status Get(int rank, int64_t offset, int64_t bytes, void* dst) = 0;
  // Completes every read started since the last Flush (bounded by the timeout).
  virtual Status Flush() = 0;
  // True when every read started since the last Flush has completed (does not block).
  virtual bool Test() = 0;
  // Completes this rank's reads and frees the window once every rank has arrived (collective;
  // bounded, see above). local() is null afterwards; Get and Flush fail with FailedPrecondition.
  // Closing a closed window does nothing.
  virtual Status Close() = 0;
};

// StartCappedAlltoallv's exchange run again and again into one receive buffer, with its receives
// posted ahead of the data (persistent requests): a2a's low-latency mode, whose peers' records then
// land straight in place instead of in the transport's queue of messages no receive was posted for.
// Made once per buffer (Communicator::CreateCappedExchange) and in the same order on every rank
// (each exchange's messages carry a tag of its own, numbered in creation order, so several on one
// communicator stay apart). Start sends one exchange; once the receiving side has completed and the
// received blocks are no longer read, Rearm hands the buffer back and posts the receives of the next
// exchange at once, so a peer's next messages land in place. A peer's messages that arrive before
// the re-arm are kept by the transport and still land in the next exchange, in the order they were
// sent. Destroying it cancels the receives still posted (bounded by the timeout; after a timeout of
// its own or of its communicator they are abandoned: the buffer must then stay allocated until the
// job ends). Thread-compatible; its Requests must not outlive it, and it must not outlive its
// communicator.
class CappedExchange {
 public:
  virtual ~CappedExchange() = default;
  // One exchange, as StartCappedAlltoallv (the same blocks, capacity and refusals; received_bytes[s]
  // gets rank s's length once its message lands): posts the receives first unless Rearm already
  // did, then the sends. Its Request tells the sides apart and hands blocks over as they land
  // (WaitSomeReceived). Fails with FailedPrecondition while the previous exchange's
  // receiving side has not completed (wait for it first).
  virtual Result<std::unique_ptr<Request>> Start(const void* send, std::span<const int64_t> send_bytes,
                                                 std::span<const int64_t> send_offsets,
                                                 std::span<int64_t> received_bytes) = 0;
  // Hands the receive buffer back: posts the receives of the next exchange now (nothing when they
  // are posted already). Call once the last exchange's received blocks are no longer read; fails
  // with FailedPrecondition when its receiving side has not completed.
  virtual Status Rearm() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Node of a rank (0..num_nodes()-1) and node count, after any ranks_per_node override.
  virtual int node_of(int rank) const = 0;
  virtual int num_nodes() const = 0;
  // "MPI (Open MPI 4.1.4), 4 ranks on 1 node" and the like, for reports.
  virtual std::string description() const = 0;

  // Returns once every rank has entered it; a timeout names the ranks that have not.
  virtual Status Barrier() = 0;

  // Every rank contributes send_bytes; recv receives every rank's contribution in rank order, rank
  // r's at recv_offsets[r]; recv_bytes[r] must equal what rank r sends.
  virtual Result<std::unique_ptr<Request>> StartAllgatherv(const void* send, int64_t send_bytes, void* recv,
                                                           std::span<const int64_t> recv_bytes,
                                                           std::span<const int64_t> recv_offsets) = 0;
  // Sums `send` (sum of recv_counts floats) over all ranks; rank r receives floats
  // [sum(recv_counts[0..r)), + recv_counts[r]) of the sum. The order of the sum across ranks is
  // the transport's: equal to a single process only to rounding.
  virtual Result<std::unique_ptr<Request>> StartReduceScatter(const float* send, float* recv,
                                                              std::span<const int64_t> recv_counts) = 0;
  // Sums `data` (count floats) over all ranks in place.
  virtual Result<std::unique_ptr<Request>> StartAllreduce(float* data, int64_t count) = 0;
  // Rank r's send[send_offsets[d] .. + send_bytes[d]) goes to rank d, landing at rank d's
  // recv[recv_offsets[r] ..]. recv_bytes[s] must equal what rank s sends here (see ExchangeCounts).
  // Its Request tells the sides apart (WaitReceived); a timeout names the ranks not heard from.
  virtual Result<std::unique_ptr<Request>> StartAlltoallv(const void* send, std::span<const int64_t> send_bytes,
                                                          std::span<const int64_t> send_offsets, void* recv,
                                                          std::span<const int64_t> recv_bytes,
                                                          std::span<const int64_t> recv_offsets) = 0;

  // The exchange with no counts sent first, with its receives posted by this call (a2a's
  // low-latency mode runs it again and again into one buffer through a CappedExchange, whose
  // receives are posted ahead; this one-off form is the baseline that was measured against): rank r's
  // send[send_offsets[d] .. + send_bytes[d]) goes to rank d as one message, empty ones too, landing
  // at rank d's recv + r * capacity (recv holds size() * capacity bytes); received_bytes[s] gets
  // the length of rank s's message once it lands (Wait, WaitReceived, WaitSomeReceived; this
  // rank's own block is copied at once). capacity is the most bytes any rank sends one peer and
  // must be the same on every rank: a block over it is refused with OutOfRange before anything is
  // posted (the peers then time out naming this rank). Its Request tells the sides apart; a
  // timeout names the ranks not heard from.
  virtual Result<std::unique_ptr<Request>> StartCappedAlltoallv(const void* send, std::span<const int64_t> send_bytes,
                                                                std::span<const int64_t> send_offsets, void* recv,
                                                                int64_t capacity,
                                                                std::span<int64_t> received_bytes) = 0;

  // The capped exchange into `recv` (size() * capacity bytes, kept allocated and unmoved while the
  // exchange lives) with its receives posted ahead; see CappedExchange. capacity must be the same on
  // every rank.
  virtual Result<std::unique_ptr<CappedExchange>> CreateCappedExchange(void* recv, int64_t capacity) = 0;

  // One int64 to and from every rank: recv[s] = the send[r] that rank s addressed to this rank.
  // Used to exchange counts before an alltoallv so receive buffers are sized exactly.
  virtual Status ExchangeCounts(std::span<const int64_t> send, std::span<int64_t> recv) = 0;
  // Every rank's `count` int64 values, concatenated in rank order (size() * count values).
  virtual Status AllgatherInt64(std::span<const int64_t> send, std::span<int64_t> recv) = 0;
  virtual Status AllgatherDouble(std::span<const double> send, std::span<double> recv) = 0;
  // Maximum and sum of one value over all ranks.
  virtual Result<int64_t> AllreduceMax(int64_t value) = 0;
  virtual Result<double> AllreduceSum(double value) = 0;

  // Allocates `bytes` (may differ per rank) exposed for one-sided reads (collective; waits, bounded
  // and naming the ranks missing, until every rank has agreed before MPI allocates).
  virtual Result<std::unique_ptr<Window>> AllocateWindow(int64_t bytes) = 0;
  // Whether two threads may use the transport at once (its thread support): one reading a Window
  // while another runs exchanges on this communicator (else one-sided reads cannot overlap other
  // exchanges), or each running exchanges on a communicator of its own (two-batch overlap).
  virtual bool concurrent_threads() const = 0;
  // Drives the transport's progress engine once, so exchanges in flight move on while this
  // process computes (from a thread of its own, where concurrent_threads()).
  virtual void Progress() = 0;

  // Ranks with the same color form a new communicator, ordered by key (collective; bounded like
  // AllocateWindow).
  virtual Result<std::unique_ptr<Communicator>> Split(int color, int key) = 0;

  // Ends every rank of the job with this exit code (after an unrecoverable Unavailable).
  [[noreturn]] virtual void Abort(int exit_code) = 0;

  // Blocking forms: start and wait.
  Status Allgatherv(const void* send, int64_t send_bytes, void* recv, std::span<const int64_t> recv_bytes,
                    std::span<const int64_t> recv_offsets);
  Status ReduceScatter(const float* send, float* recv, std::span<const int64_t> recv_counts);
  Status Allreduce(float* data, int64_t count);
  Status Alltoallv(const void* send, std::span<const int64_t> send_bytes, std::span<const int64_t> send_offsets,
                   void* recv, std::span<const int64_t> recv_bytes, std::span<const int64_t> recv_offsets);
};

// Offsets of consecutive blocks: offsets[i] = sum(sizes[0..i)); returns size + 1 values.
std::vector<int64_t> PrefixOffsets(std::span<const int64_t> sizes);

// The whole job (MPI_COMM_WORLD). Initializes MPI on first use when the program has not (a program
// started without mpirun is a world of one rank); MPI is finalized at exit by the library when it
// initialized it. Fails with Internal when MPI cannot start, and with Unavailable when a rank does
// not arrive within options.timeout_seconds (see above; the agreement uses point-to-point messages
// on MPI_COMM_WORLD with tags 32766 and 32767, which a program sharing MPI_COMM_WORLD must not
// receive with MPI_ANY_TAG while ranks create a world communicator). Not bounded: MPI_Init itself
// (Open MPI waits for every process of the job there), and MPI_Finalize at exit (Open MPI waits
// for every process there as well); a job whose rank failed is ended by AbortJob.
Result<std::unique_ptr<Communicator>> WorldCommunicator(const CommOptions& options);

// Ends every rank of the job with this exit code (MPI_Abort on MPI_COMM_WORLD when MPI is running,
// else this process only). Needs no communicator, so a rank that gave up on a peer can end the job
// without another collective (creating a communicator to call Abort would wait for the peers).
[[noreturn]] void AbortJob(int exit_code);

// The errors of a job's failed ranks, as GatherJobErrors found them.
struct JobErrors {
  struct Error {
    std::string message;
    std::vector<int> ranks;  // the ranks that failed with this message, ascending
  };
  int rank = 0;  // this process's rank in the job
  int size = 1;  // ranks in the job
  // Every rank failed and reported within the bound: no rank waits for another, so the job can
  // end normally. Rank 0 then holds each distinct error once (in order of its lowest rank) and the
  // other ranks hold none: rank 0 prints them. Otherwise this rank holds its own error (rank 0 also
  // every error it received) and should print it and end the job (AbortJob), since the ranks that
  // did not report may be waiting for it.
  bool every_rank_reported = false;
  std::vector<Error> errors;
};

// Called by every rank whose command failed with `error` (not ok), so that a rank's error reaches
// the user with its rank and the job ends, whether or not its peers failed too. Needs no
// communicator (as AbortJob): point-to-point messages on MPI_COMM_WORLD with tags 32764 and 32765
// (a call that returns every_rank_reported false leaves its messages pending: the job must end
// then). Every failed rank sends its error to rank 0; rank 0, when it failed too, collects for up
// to `seconds` and, once every rank's error has come, tells each rank that it will print them; a
// rank that hears nothing from rank 0 within twice `seconds` (rank 0 is working or waits in an
// exchange for this rank) returns every_rank_reported false. So a refusal every rank reaches alike
// is printed once, and an error of one rank ends the job within 2 x `seconds`. Without MPI running
// (or in a world of one rank) returns at once, with every_rank_reported true.
JobErrors GatherJobErrors(const Status& error, double seconds);

}  // namespace epmoe
