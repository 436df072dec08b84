// Moving expert copies between ranks for a new placement, and agreeing on that placement.
//
// MoveExperts carries out a MovePlan (move_plan.h): every rank sends the stored bytes of its old
// slots that other ranks need and receives the bytes of its own changed slots; local copies are
// plain copies. Bytes are opaque: a quantized expert travels exactly as stored, scales included.
// The exchange runs in rounds so that no rank holds more than max_buffer_bytes of send plus receive
// buffers; every rank derives the same rounds from the same plan, so no counts are exchanged.
// Generation safety: `source` must keep returning the OLD placement's content and `sink` must
// stage what it gets (not change what `source` returns) until MoveExperts has returned on this
// rank; installing the staged copies is the caller's next, separate step. Collective; waits are
// bounded by the communicator's timeout (a failed peer gives Unavailable naming the operation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/move_plan.h"
#include "epmoe/placement.h"

namespace epmoe {

// The bytes of this rank's slot `slot` of `layer` in the old placement (expert_bytes long).
using SlotBytesSource = std::function<std::span<const std::byte>(int layer, int slot)>;
// Receives the new content of this rank's slot move.slot of move.layer (expert_bytes long).
using SlotBytesSink = std::function<Status(const SlotMove& move, std::span<const std::byte> bytes)>;

struct MoveStats {
  int64_t bytes_sent = 0;         // this rank, over the network
  int64_t bytes_received = 0;     // this rank, over the network
  int64_t local_copies = 0;       // this rank's slots filled from its own old slots
  int64_t remote_copies = 0;      // this rank's slots filled from other ranks
  int rounds = 0;                 // exchange rounds (the same on every rank)
  int64_t peak_buffer_bytes = 0;  // largest send + receive buffers held at once on this rank
  double seconds = 0;             // wall time of the move on this rank
};

// Carries out `plan` (the same plan on every rank). max_buffer_bytes must hold at least one copy
// going each way (2 * expert_bytes). A failing source or sink on this rank is returned after every
// round has run (this rank sends zeros from then on), so the other ranks' exchanges still match;
// the delivered copies are then incomplete and must not be installed. The buffers of an exchange
// that timed out are parked for good (the transport may still write into them).
Result<MoveStats> MoveExperts(Communicator& comm, const MovePlan& plan, int64_t expert_bytes, int64_t max_buffer_bytes,
                              const SlotBytesSource& source, const SlotBytesSink& sink);

// The same transfer as MoveExperts, run in the background between steps: each round is one
// nonblocking Alltoallv, so steps (and their own exchanges on the same communicator) run while the
// copies travel. Rounds start collectively: StartNextRound must be called by every rank at the
// same point of its sequence of exchanges (the Rebalancer calls it at a step boundary once every
// rank has reported the previous round done), so every rank issues the same exchanges in the same
// order. Poll() never blocks; it delivers a finished round to the sink. Local copies are delivered
// by Start. The buffers of one round are held until it is delivered (bounded by max_buffer_bytes).
// A source or sink failure is reported by Poll (from then on this rank sends zeros and delivers
// nothing, but keeps taking part so the others are not left waiting). Destroying a move whose
// round has not completed (a failed or stalled peer) parks that round's buffers for good instead of
// waiting; the job is then expected to abort.
// Not thread-safe; the source/sink contract of MoveExperts applies until finished().
class AsyncExpertMove {
 public:
  // Checks the arguments like MoveExperts, delivers local copies and starts the first round.
  // Collective (every rank, same plan).
  static Result<std::unique_ptr<AsyncExpertMove>> Start(Communicator& comm, const MovePlan& plan,
                                                        int64_t expert_bytes, int64_t max_buffer_bytes,
                                                        SlotBytesSource source, SlotBytesSink sink);
  ~AsyncExpertMove();
  AsyncExpertMove(const AsyncExpertMove&) = delete;
  AsyncExpertMove& operator=(const AsyncExpertMove&) = delete;

  // True when this rank's part of the round in flight has arrived and been delivered (or no round
  // is in flight). Does not block; errors come from the sink or the transport.
  Result<bool> Poll();
  // Starts the next round; false when every round has run. Collective. Requires Poll() == true.
  Result<bool> StartNextRound();
  // Every round started and delivered on this rank.
  bool finished() const;
  const MoveStats& stats() const { return stats_; }

 private:
  struct Round;
  AsyncExpertMove(Communicator& comm, int64_t expert_bytes, SlotBytesSource source, SlotBytesSink sink);
  Status Launch(size_t round_index);
  Status Deliver();

  Communicator& comm_;
  int64_t expert_bytes_;
  SlotBytesSource source_;
  SlotBytesSink sink_;
  std::vector<std::vector<SlotMove>> rounds_;
  size_t next_round_ = 0;  // rounds started so far
  std::unique_ptr<Round> in_flight_;
  MoveStats stats_;
  Status local_error_;     // first source/sink failure; rounds still run so exchanges stay matched
  double started_at_ = 0;  // steady clock seconds, for stats_.seconds
};

// Rank `root`'s placement, delivered to every rank and validated there (Placement::Create) before
// it is returned: a corrupt or inconsistent placement is refused on every rank before anything is
// installed. `placement` is only read on root. Collective.
Result<PlacementPtr> BroadcastPlacement(Communicator& comm, int root, const PlacementPtr& placement);

// Sums `values` element-wise over all ranks, in place (e.g. the recorder's window of pick counts
// before rank 0 computes a placement from it). Collective; every rank passes the same length.
Status SumOverRanks(Communicator& comm, std::span<int64_t> values);

}  // namespace epmoe
