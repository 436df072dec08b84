// RebalanceTarget: what a running executor exposes to live rebalancing (rebalancer.h), per MoE
// layer, for this rank's slots. Header only (an interface), so executors can implement it without
// linking the rebalance module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "epmoe/placement.h"
#include "epmoe/status.h"

namespace epmoe {

// Called only between steps, from the thread that runs them (implementations need not be
// thread-safe).
class RebalanceTarget {
 public:
  virtual ~RebalanceTarget() = default;
  // Bytes of one stored expert copy, scales included (the same in every layer).
  virtual int64_t expert_bytes() const = 0;
  // The stored content of this rank's `slot` of `layer` in the live placement (expert_bytes long).
  // Must stay valid and unchanged until the next Install or DropStaged.
  virtual std::span<const std::byte> slot_bytes(int layer, int slot) const = 0;
  // New content for this rank's `slot` of `layer`, kept aside: not used by steps until Install.
  virtual Status Stage(int layer, int slot, std::span<const std::byte> bytes) = 0;
  // Makes `next` the live placement: layers [layer_begin, layer_end) switch their dispatch tables
  // and the staged slots' weights together (the other layers of `next` equal the live ones).
  virtual Status Install(int layer_begin, int layer_end, PlacementPtr next) = 0;
  // Forgets every staged slot (a refused or failed rebalance).
  virtual void DropStaged() = 0;
};

}  // namespace epmoe
