// Dispatch table: for one rank, per layer and logical expert, the physical copies (slots) that
// this rank sends the expert's picks to. Preference (as SGLang's expert_location does):
//   1. a copy on this rank (the first one if several);
//   2. else the copies on this rank's node, if that narrows the choice (some, not all, copies);
//   3. else all copies.
// When several candidates remain, the rank deals its picks round robin over them in an order
// shuffled from (seed, rank, layer, expert), so picks spread evenly over the copies and different
// ranks start on different copies. Built once per placement; immutable and thread-safe after Build.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/placement.h"
#include "epmoe/status.h"

namespace epmoe {

class DispatchTable {
 public:
  // Refuses a rank outside [0, G).
  static Result<DispatchTable> Build(const Placement& placement, int rank, uint64_t seed = 0);

  int rank() const { return rank_; }
  int num_layers() const { return num_layers_; }
  int num_experts() const { return num_experts_; }

  // The candidate slots for `expert` in `layer`, in dealing order (at least one).
  std::span<const int32_t> candidates(int layer, int expert) const {
    const size_t index = static_cast<size_t>(layer) * num_experts_ + expert;
    return {candidates_.data() + offsets_[index], static_cast<size_t>(offsets_[index + 1] - offsets_[index])};
  }
  // The slot that this rank's nth pick of `expert` in a step goes to (n counts from 0 each step).
  int32_t SlotFor(int layer, int expert, int64_t nth) const {
    auto c = candidates(layer, expert);
    return c[static_cast<size_t>(nth % static_cast<int64_t>(c.size()))];
  }
  // Per slot picks when this rank sends counts[e] picks of each expert (P values, overwritten).
  void SlotPicks(int layer, std::span<const int64_t> counts, std::span<int64_t> out) const;

 private:
  DispatchTable() = default;
  int rank_ = 0;
  int num_layers_ = 0;
  int num_experts_ = 0;
  int num_slots_ = 0;
  std::vector<int64_t> offsets_;      // [layer][expert] + 1 offsets into candidates_
  std::vector<int32_t> candidates_;
};

}  // namespace epmoe
