#include "epmoe/move_plan.h"

#include <fmt/format.h>

namespace epmoe {

int64_t MovePlan::total_bytes_moved() const {
  int64_t total = 0;
  for (int64_t b : bytes_sent) total += b;
  return total;
}

Result<MovePlan> PlanMoves(const Placement& from, const Placement& to, int layer_begin, int layer_end,
                           int64_t expert_bytes) {
  if (from.num_layers() != to.num_layers() || from.num_experts() != to.num_experts() ||
      from.num_slots() != to.num_slots() || from.num_ranks() != to.num_ranks() || from.num_nodes() != to.num_nodes())
    return InvalidArgument(fmt::format(
        "move plan: placements differ in shape (layers {} vs {}, experts {} vs {}, slots {} vs {}, ranks {} vs {}, "
        "nodes {} vs {})",
        from.num_layers(), to.num_layers(), from.num_experts(), to.num_experts(), from.num_slots(), to.num_slots(),
        from.num_ranks(), to.num_ranks(), from.num_nodes(), to.num_nodes()));
  if (layer_begin < 0 || layer_begin > layer_end || layer_end > from.num_layers())
    return InvalidArgument(fmt::format("move plan: layers [{}, {}) outside [0, {})", layer_begin, layer_end,
                                       from.num_layers()));
  if (expert_bytes < 0) return InvalidArgument(fmt::format("move plan: expert_bytes {} < 0", expert_bytes));

  const int ranks = from.num_ranks();
  MovePlan plan;
  plan.bytes_sent.assign(ranks, 0);
  plan.bytes_received.assign(ranks, 0);
  plan.bytes_sent_by_node.assign(from.num_nodes(), 0);
  plan.bytes_received_by_node.assign(from.num_nodes(), 0);
  for (int layer = layer_begin; layer < layer_end; ++layer) {
    const auto old_experts = from.phy2log(layer);
    const auto new_experts = to.phy2log(layer);
    for (int slot = 0; slot < from.num_slots(); ++slot) {
      const int expert = new_experts[slot];
      if (old_experts[slot] == expert) continue;
      SlotMove move;
      move.layer = layer;
      move.slot = slot;
      move.dest_rank = from.rank_of_slot(slot);
      move.expert = expert;
      // Prefer the destination rank itself, then its node, then anywhere; least-loaded sender first.
      int best_slot = -1, best_class = 3;
      for (int32_t candidate : from.copies(layer, expert)) {
        const int rank = from.rank_of_slot(candidate);
        const int klass = rank == move.dest_rank                                          ? 0
                          : from.node_of_rank(rank) == from.node_of_rank(move.dest_rank) ? 1
                                                                                          : 2;
        if (best_slot < 0 || klass < best_class ||
            (klass == best_class && klass > 0 &&
             plan.bytes_sent[rank] < plan.bytes_sent[from.rank_of_slot(best_slot)])) {
          best_slot = candidate;
          best_class = klass;
        }
      }
      EPMOE_CHECK(best_slot >= 0);  // every expert has a copy in a valid placement
      move.source_slot = best_slot;
      move.source_rank = from.rank_of_slot(best_slot);
      if (move.local()) {
        ++plan.local_copies;
      } else {
        ++plan.remote_copies;
        plan.bytes_sent[move.source_rank] += expert_bytes;
        plan.bytes_received[move.dest_rank] += expert_bytes;
        const int source_node = from.node_of_rank(move.source_rank);
        const int dest_node = from.node_of_rank(move.dest_rank);
        if (source_node != dest_node) {
          ++plan.inter_node_copies;
          plan.bytes_sent_by_node[source_node] += expert_bytes;
          plan.bytes_received_by_node[dest_node] += expert_bytes;
        }
      }
      plan.moves.push_back(move);
    }
  }
  return plan;
}

}  // namespace epmoe
