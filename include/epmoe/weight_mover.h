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
#include <span>

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
// going each way (2 * expert_bytes).
Result<MoveStats> MoveExperts(Communicator& comm, const MovePlan& plan, int64_t expert_bytes, int64_t max_buffer_bytes,
                              const SlotBytesSource& source, const SlotBytesSink& sink);

// Rank `root`'s placement, delivered to every rank and validated there (Placement::Create) before
// it is returned: a corrupt or inconsistent placement is refused on every rank before anything is
// installed. `placement` is only read on root. Collective.
Result<PlacementPtr> BroadcastPlacement(Communicator& comm, int root, const PlacementPtr& placement);

// Sums `values` element-wise over all ranks, in place (e.g. the recorder's window of pick counts
// before rank 0 computes a placement from it). Collective; every rank passes the same length.
Status SumOverRanks(Communicator& comm, std::span<int64_t> values);

}  // namespace epmoe
