#include <fmt/format.h>

#include "ep/executor_internal.h"

namespace epmoe::ep_internal {

int SlotStoresTarget::LocalSlot(int layer, int slot) const {
  const PlacementPtr placement = live_->placement();
  const Placement& p = *placement;
  if (layer < 0 || layer >= static_cast<int>(stores_->size()) || (*stores_)[layer] == nullptr) return -1;
  if (slot < 0 || slot >= p.num_slots() || p.rank_of_slot(slot) != rank_) return -1;
  return slot - rank_ * p.slots_per_rank();
}

int64_t SlotStoresTarget::expert_bytes() const {
  for (const auto& store : *stores_)
    if (store != nullptr && store->num_experts() > 0) return store->expert_bytes(0);
  return 0;
}

std::span<const std::byte> SlotStoresTarget::slot_bytes(int layer, int slot) const {
  const int local = LocalSlot(layer, slot);
  if (local < 0) return {};  // the mover reports the wrong length, naming layer and slot
  auto [it, inserted] = exported_.try_emplace({layer, slot});
  if (inserted) {
    const ExpertStore& store = *(*stores_)[layer];
    it->second.resize(store.expert_bytes(local));
    if (!store.ExportExpert(local, it->second).ok()) {
      exported_.erase(it);
      return {};
    }
  }
  return it->second;
}

Status SlotStoresTarget::Stage(int layer, int slot, std::span<const std::byte> bytes) {
  const int local = LocalSlot(layer, slot);
  if (local < 0)
    return InvalidArgument(fmt::format("rank {}: cannot stage layer {} slot {}: not one of its slots", rank_, layer, slot));
  if (static_cast<int64_t>(bytes.size()) != (*stores_)[layer]->expert_bytes(local))
    return InvalidArgument(fmt::format("rank {}: layer {} slot {} got {} bytes, a stored expert has {}", rank_, layer,
                                       slot, bytes.size(), (*stores_)[layer]->expert_bytes(local)));
  staged_[{layer, slot}].assign(bytes.begin(), bytes.end());
  return Status::Ok();
}

Status SlotStoresTarget::Install(int layer_begin, int layer_end, PlacementPtr next) {
  if (next == nullptr) return InvalidArgument("install: no placement");
  const PlacementPtr placement = live_->placement();
  const Placement& live = *placement;
  if (next->num_layers() != live.num_layers() || next->num_slots() != live.num_slots() ||
      next->num_ranks() != live.num_ranks() || next->num_experts() != live.num_experts())
    return InvalidArgument("install: the new placement's shape differs from the live one");
  if (layer_begin < 0 || layer_begin > layer_end || layer_end > live.num_layers())
    return InvalidArgument(fmt::format("install: layers [{}, {}) outside [0, {})", layer_begin, layer_end,
                                       live.num_layers()));
  // Indices under the live placement (the same slots on this rank under the new one).
  std::vector<std::pair<int, const std::vector<std::byte>*>> imports;
  std::vector<std::pair<int, int>> keys;
  for (const auto& [key, bytes] : staged_) {
    if (key.first < layer_begin || key.first >= layer_end) continue;
    imports.emplace_back(LocalSlot(key.first, key.second), &bytes);
    keys.push_back(key);
  }
  for (size_t i = 0; i < imports.size(); ++i) {
    const Status imported = (*stores_)[keys[i].first]->ImportExpert(imports[i].first, *imports[i].second);
    EPMOE_CHECK_MSG(imported.ok(), imported.ToString());  // sizes were checked when staged
  }
  for (const auto& key : keys) staged_.erase(key);
  exported_.clear();
  return Status::Ok();
}

void SlotStoresTarget::DropStaged() {
  staged_.clear();
  exported_.clear();
}

}  // namespace epmoe::ep_internal
