// MovePlan: which expert copies must travel, and from where, to go from one placement to another.
//
// Only slots whose logical expert changes are listed. A slot that needs an expert its own rank
// already held (in any slot of the old placement) copies it locally; otherwise the copy comes from
// a rank that held the expert in the old placement: one on the destination's node when there is
// one, and among the candidates the sender with the fewest bytes assigned so far (ties: lower rank),
// so transfers spread over senders. Sources always read the OLD placement's content, so moves can
// run in any order when the receiver stages them before switching. Pure computation (thread-safe).
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/placement.h"

namespace epmoe {

struct SlotMove {
  int layer = 0;
  int slot = 0;         // destination slot (owned by dest_rank)
  int dest_rank = 0;
  int expert = 0;       // logical expert the slot holds afterwards
  int source_rank = 0;  // rank that holds `expert` in the old placement (== dest_rank: local copy)
  int source_slot = 0;  // a slot of source_rank holding `expert` in the old placement
  bool local() const { return source_rank == dest_rank; }
};

struct MovePlan {
  std::vector<SlotMove> moves;          // ordered by layer, then slot
  std::vector<int64_t> bytes_sent;      // per rank, over the network (local copies excluded)
  std::vector<int64_t> bytes_received;  // per rank, over the network
  std::vector<int64_t> bytes_sent_by_node;     // per node, leaving the node
  std::vector<int64_t> bytes_received_by_node; // per node, entering the node
  int64_t local_copies = 0;
  int64_t remote_copies = 0;
  int64_t inter_node_copies = 0;

  int64_t total_bytes_moved() const;
};

// Plans layers [layer_begin, layer_end) of the change from `from` to `to` (same shape; checked).
// expert_bytes: bytes of one expert copy as stored (scales included).
Result<MovePlan> PlanMoves(const Placement& from, const Placement& to, int layer_begin, int layer_end,
                           int64_t expert_bytes);

}  // namespace epmoe
