#include "epmoe/live_placement.h"

#include <fmt/format.h>

#include <utility>

namespace epmoe {

Result<std::shared_ptr<LivePlacement>> LivePlacement::Create(PlacementPtr initial, int rank, uint64_t dispatch_seed) {
  if (initial == nullptr) return InvalidArgument("live placement: no initial placement");
  std::shared_ptr<LivePlacement> live(new LivePlacement(rank, dispatch_seed));
  EPMOE_ASSIGN_OR_RETURN(live->current_, live->Build(std::move(initial), 0));
  return live;
}

Result<LivePlacement::SnapshotPtr> LivePlacement::Build(PlacementPtr placement, int64_t generation) const {
  EPMOE_ASSIGN_OR_RETURN(DispatchTable dispatch, DispatchTable::Build(*placement, rank_, dispatch_seed_));
  return SnapshotPtr(std::make_shared<const Snapshot>(Snapshot{std::move(placement), std::move(dispatch), generation}));
}

LivePlacement::SnapshotPtr LivePlacement::current() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_;
}

Status LivePlacement::Install(PlacementPtr next) {
  if (next == nullptr) return InvalidArgument("live placement: install of no placement");
  const SnapshotPtr live = current();
  const Placement& now = *live->placement;
  if (next->num_layers() != now.num_layers() || next->num_experts() != now.num_experts() ||
      next->num_slots() != now.num_slots() || next->num_ranks() != now.num_ranks() ||
      next->num_nodes() != now.num_nodes())
    return InvalidArgument(fmt::format(
        "live placement: the new placement has {} layers, {} experts, {} slots, {} ranks, {} nodes; the live one "
        "{}, {}, {}, {}, {}",
        next->num_layers(), next->num_experts(), next->num_slots(), next->num_ranks(), next->num_nodes(),
        now.num_layers(), now.num_experts(), now.num_slots(), now.num_ranks(), now.num_nodes()));
  EPMOE_ASSIGN_OR_RETURN(SnapshotPtr snapshot, Build(std::move(next), live->generation + 1));
  std::lock_guard<std::mutex> lock(mutex_);
  current_ = std::move(snapshot);
  return Status::Ok();
}

}  // namespace epmoe
