#include "epmoe/dispatch.h"

#include <algorithm>
#include <random>

#include <fmt/format.h>

namespace epmoe {

Result<DispatchTable> DispatchTable::Build(const Placement& placement, int rank, uint64_t seed) {
  if (rank < 0 || rank >= placement.num_ranks())
    return InvalidArgument(fmt::format("dispatch table: rank {} outside [0, {})", rank, placement.num_ranks()));
  DispatchTable table;
  table.rank_ = rank;
  table.num_layers_ = placement.num_layers();
  table.num_experts_ = placement.num_experts();
  table.num_slots_ = placement.num_slots();
  table.offsets_.reserve(static_cast<size_t>(table.num_layers_) * table.num_experts_ + 1);
  table.offsets_.push_back(0);
  const int node = placement.node_of_rank(rank);
  std::vector<int32_t> local, same_node;
  for (int layer = 0; layer < table.num_layers_; ++layer) {
    for (int expert = 0; expert < table.num_experts_; ++expert) {
      auto copies = placement.copies(layer, expert);
      local.clear();
      same_node.clear();
      for (int32_t slot : copies) {
        const int owner = placement.rank_of_slot(slot);
        if (owner == rank) local.push_back(slot);
        if (placement.node_of_rank(owner) == node) same_node.push_back(slot);
      }
      if (!local.empty()) {
        table.candidates_.push_back(local.front());
      } else {
        std::vector<int32_t> chosen = !same_node.empty() && same_node.size() < copies.size()
                                          ? same_node
                                          : std::vector<int32_t>(copies.begin(), copies.end());
        if (chosen.size() > 1) {
          std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                            static_cast<uint32_t>(rank), static_cast<uint32_t>(layer), static_cast<uint32_t>(expert)};
          std::mt19937 rng(seq);
          // Fisher-Yates with our own index draws: std::shuffle's output differs between libraries.
          for (size_t i = chosen.size() - 1; i > 0; --i) std::swap(chosen[i], chosen[rng() % (i + 1)]);
        }
        table.candidates_.insert(table.candidates_.end(), chosen.begin(), chosen.end());
      }
      table.offsets_.push_back(static_cast<int64_t>(table.candidates_.size()));
    }
  }
  return table;
}

void DispatchTable::SlotPicks(int layer, std::span<const int64_t> counts, std::span<int64_t> out) const {
  EPMOE_CHECK(static_cast<int>(counts.size()) == num_experts_ && static_cast<int>(out.size()) == num_slots_);
  std::fill(out.begin(), out.end(), 0);
  for (int expert = 0; expert < num_experts_; ++expert) {
    auto c = candidates(layer, expert);
    const int64_t n = static_cast<int64_t>(c.size());
    // SlotFor's dealing: candidate i gets picks i, i + n, i + 2n, ...
    for (int64_t i = 0; i < n; ++i) out[c[i]] += counts[expert] / n + (i < counts[expert] % n ? 1 : 0);
  }
}

}  // namespace epmoe
