// LivePlacement: the one owner of a running job's current placement on this rank, with this
// rank's dispatch table and a generation number (DESIGN.md, "The step above the layers").
//
// Readers (the executor's steps, the load recorder, the rebalancer) take a Snapshot and keep it for
// a whole step, so a step never mixes two placements. Install builds the next snapshot aside and
// switches one pointer; it is called only between steps, on every rank at the same step boundary
// (the Rebalancer does), after the executor's weights for the new placement are in place.
// Thread-safe: snapshots may be taken from any thread (rank 0's asynchronous policy thread reads
// one) while the stepping thread installs.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "epmoe/dispatch.h"
#include "epmoe/placement.h"
#include "epmoe/status.h"

namespace epmoe {

class LivePlacement {
 public:
  struct Snapshot {
    PlacementPtr placement;
    DispatchTable dispatch;  // this rank's (where its picks of each expert go)
    int64_t generation = 0;  // 0 for the initial placement, +1 per Install
  };
  using SnapshotPtr = std::shared_ptr<const Snapshot>;

  // Refuses a null placement or a rank outside the placement's ranks. `dispatch_seed` is
  // DispatchTable::Build's seed, the same for every snapshot.
  static Result<std::shared_ptr<LivePlacement>> Create(PlacementPtr initial, int rank, uint64_t dispatch_seed = 0);

  SnapshotPtr current() const;
  PlacementPtr placement() const { return current()->placement; }
  int rank() const { return rank_; }
  uint64_t dispatch_seed() const { return dispatch_seed_; }

  // Makes `next` current (same layers, experts, slots, ranks and nodes, else refused and nothing
  // changes); the generation grows by one.
  Status Install(PlacementPtr next);

 private:
  LivePlacement(int rank, uint64_t dispatch_seed) : rank_(rank), dispatch_seed_(dispatch_seed) {}
  Result<SnapshotPtr> Build(PlacementPtr placement, int64_t generation) const;

  const int rank_;
  const uint64_t dispatch_seed_;
  mutable std::mutex mutex_;  // guards current_ (the pointer, not what it points to)
  SnapshotPtr current_;
};

}  // namespace epmoe
