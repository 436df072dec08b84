// Placement: where the copies of each logical expert live, per MoE layer.
//
// P = E + R physical slots per layer (R redundant copies) are spread over G ranks; rank g owns the
// slots [g*P/G, (g+1)*P/G) and ranks are grouped into N nodes of G/N consecutive ranks. Per layer:
//   phy2log[P]                 the logical expert held by each slot,
//   log2phy[E][max_copies]     the slots holding each logical expert, ascending, -1 padded,
//   logcnt[E]                  how many copies each logical expert has (>= 1).
// A Placement is validated on creation and immutable afterwards, so it is shared by pointer
// (PlacementPtr): a step takes the snapshot at its start and keeps it to its end while a rebalancer
// installs a new one. Thread-safe (immutable).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

class Placement;
using PlacementPtr = std::shared_ptr<const Placement>;

class Placement {
 public:
  // Builds and validates a placement from phy2log per layer (every layer the same P). Refuses:
  // no layers, E < 1, P < E, G < 1, P not a multiple of G, G not a multiple of N, ids out of range,
  // a logical expert without a copy. Errors name the layer, slot and value.
  static Result<Placement> Create(int num_experts, int num_ranks, int num_nodes,
                                  std::vector<std::vector<int32_t>> phy2log);

  // The original order: slot s holds expert s mod E (so the first R experts get a second copy).
  static Result<Placement> Trivial(int num_layers, int num_experts, int num_redundant, int num_ranks,
                                   int num_nodes);

  int num_layers() const { return static_cast<int>(phy2log_.size()); }
  int num_experts() const { return num_experts_; }
  int num_slots() const { return num_slots_; }
  int num_ranks() const { return num_ranks_; }
  int num_nodes() const { return num_nodes_; }
  int slots_per_rank() const { return num_slots_ / num_ranks_; }
  int ranks_per_node() const { return num_ranks_ / num_nodes_; }
  int rank_of_slot(int slot) const { return slot / slots_per_rank(); }
  int node_of_rank(int rank) const { return rank / ranks_per_node(); }
  // The largest logcnt over all layers (the width of log2phy).
  int max_copies() const { return max_copies_; }

  std::span<const int32_t> phy2log(int layer) const { return phy2log_[layer]; }
  std::span<const int32_t> logcnt(int layer) const { return logcnt_[layer]; }
  // The copies of `expert` in `layer`: logcnt values, ascending slots.
  std::span<const int32_t> copies(int layer, int expert) const {
    return {log2phy_[layer].data() + static_cast<size_t>(expert) * max_copies_,
            static_cast<size_t>(logcnt_[layer][expert])};
  }
  // log2phy of a layer: E * max_copies() values, -1 padded.
  std::span<const int32_t> log2phy(int layer) const { return log2phy_[layer]; }

  // Slots whose logical expert differs between this placement and `other` (same shape required),
  // summed over layers: the expert copies a change from `other` to this placement must load.
  int64_t MovedCopies(const Placement& other) const;

  bool operator==(const Placement& other) const;

 private:
  Placement() = default;
  int num_experts_ = 0;
  int num_slots_ = 0;
  int num_ranks_ = 0;
  int num_nodes_ = 1;
  int max_copies_ = 1;
  std::vector<std::vector<int32_t>> phy2log_;
  std::vector<std::vector<int32_t>> log2phy_;
  std::vector<std::vector<int32_t>> logcnt_;
};

// JSON: {"num_layers", "num_experts", "num_slots", "num_ranks", "num_nodes", "phy2log": [[..]..],
// "log2phy": [[[..]..]..], "logcnt": [[..]..]}. Reading needs phy2log and the shape fields; log2phy
// and logcnt, when present, must agree with phy2log. `source` names the data in errors.
std::string PlacementToJson(const Placement& placement);
Result<Placement> PlacementFromJson(const std::string& json_text, const std::string& source);
Status WritePlacementFile(const Placement& placement, const std::string& path);
Result<Placement> ReadPlacementFile(const std::string& path);

// SGLang's `--init-expert-location` file: {"physical_to_logical_map": [[P slots] per hidden layer]}.
// Row layer_ids[l] holds layer l's phy2log; the rows of the other hidden layers (dense layers, which
// SGLang counts in its layers too) hold the trivial order, slot s -> expert s mod E, as SGLang's own
// trivial placement does. Empty layer_ids: layer l is hidden layer l. num_hidden_layers 0: the
// placement's layers. Refuses ids out of range or repeated.
Result<std::string> PlacementToSglangJson(const Placement& placement, const std::vector<int>& layer_ids,
                                          int num_hidden_layers);

}  // namespace epmoe
