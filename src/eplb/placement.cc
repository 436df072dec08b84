#include "epmoe/placement.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace epmoe {

Result<Placement> Placement::Create(int num_experts, int num_ranks, int num_nodes,
                                    std::vector<std::vector<int32_t>> phy2log) {
  if (phy2log.empty()) return InvalidArgument("placement: no layers");
  if (num_experts < 1) return InvalidArgument(fmt::format("placement: num_experts {} must be >= 1", num_experts));
  if (num_ranks < 1) return InvalidArgument(fmt::format("placement: num_ranks {} must be >= 1", num_ranks));
  if (num_nodes < 1 || num_ranks % num_nodes != 0)
    return InvalidArgument(fmt::format("placement: num_nodes {} must be >= 1 and divide num_ranks {}", num_nodes,
                                       num_ranks));
  const int num_slots = static_cast<int>(phy2log[0].size());
  if (num_slots < num_experts)
    return InvalidArgument(fmt::format("placement: {} slots cannot hold {} experts", num_slots, num_experts));
  if (num_slots % num_ranks != 0)
    return InvalidArgument(fmt::format("placement: {} slots do not split evenly over {} ranks", num_slots,
                                       num_ranks));
  Placement p;
  p.num_experts_ = num_experts;
  p.num_slots_ = num_slots;
  p.num_ranks_ = num_ranks;
  p.num_nodes_ = num_nodes;
  p.logcnt_.assign(phy2log.size(), std::vector<int32_t>(num_experts, 0));
  int max_copies = 1;
  for (size_t layer = 0; layer < phy2log.size(); ++layer) {
    if (static_cast<int>(phy2log[layer].size()) != num_slots)
      return InvalidArgument(fmt::format("placement: layer {} has {} slots, layer 0 has {}", layer,
                                         phy2log[layer].size(), num_slots));
    for (int slot = 0; slot < num_slots; ++slot) {
      const int32_t expert = phy2log[layer][slot];
      if (expert < 0 || expert >= num_experts)
        return InvalidArgument(fmt::format("placement: layer {} slot {} holds expert {}, outside [0, {})", layer,
                                           slot, expert, num_experts));
      max_copies = std::max(max_copies, ++p.logcnt_[layer][expert]);
    }
    for (int expert = 0; expert < num_experts; ++expert)
      if (p.logcnt_[layer][expert] == 0)
        return InvalidArgument(fmt::format("placement: layer {} has no copy of expert {}", layer, expert));
  }
  p.max_copies_ = max_copies;
  p.log2phy_.assign(phy2log.size(), std::vector<int32_t>(static_cast<size_t>(num_experts) * max_copies, -1));
  for (size_t layer = 0; layer < phy2log.size(); ++layer) {
    std::vector<int32_t> filled(num_experts, 0);
    for (int slot = 0; slot < num_slots; ++slot) {
      const int32_t expert = phy2log[layer][slot];
      p.log2phy_[layer][static_cast<size_t>(expert) * max_copies + filled[expert]++] = slot;
    }
  }
  p.phy2log_ = std::move(phy2log);
  return p;
}

Result<Placement> Placement::Trivial(int num_layers, int num_experts, int num_redundant, int num_ranks,
                                     int num_nodes) {
  if (num_layers < 1) return InvalidArgument(fmt::format("placement: num_layers {} must be >= 1", num_layers));
  if (num_experts < 1 || num_redundant < 0)
    return InvalidArgument(fmt::format("placement: {} experts and {} redundant copies", num_experts, num_redundant));
  const int num_slots = num_experts + num_redundant;
  std::vector<int32_t> order(num_slots);
  for (int slot = 0; slot < num_slots; ++slot) order[slot] = slot % num_experts;
  return Create(num_experts, num_ranks, num_nodes, std::vector<std::vector<int32_t>>(num_layers, order));
}

int64_t Placement::MovedCopies(const Placement& other) const {
  EPMOE_CHECK(other.num_layers() == num_layers() && other.num_slots() == num_slots());
  int64_t moved = 0;
  for (int layer = 0; layer < num_layers(); ++layer)
    for (int slot = 0; slot < num_slots_; ++slot) moved += phy2log_[layer][slot] != other.phy2log_[layer][slot];
  return moved;
}

bool Placement::operator==(const Placement& other) const {
  return num_experts_ == other.num_experts_ && num_ranks_ == other.num_ranks_ && num_nodes_ == other.num_nodes_ &&
         phy2log_ == other.phy2log_;
}

std::string PlacementToJson(const Placement& placement) {
  nlohmann::json out;
  out["num_layers"] = placement.num_layers();
  out["num_experts"] = placement.num_experts();
  out["num_slots"] = placement.num_slots();
  out["num_ranks"] = placement.num_ranks();
  out["num_nodes"] = placement.num_nodes();
  nlohmann::json phy2log = nlohmann::json::array(), log2phy = nlohmann::json::array(),
                 logcnt = nlohmann::json::array();
  for (int layer = 0; layer < placement.num_layers(); ++layer) {
    phy2log.push_back(std::vector<int32_t>(placement.phy2log(layer).begin(), placement.phy2log(layer).end()));
    logcnt.push_back(std::vector<int32_t>(placement.logcnt(layer).begin(), placement.logcnt(layer).end()));
    nlohmann::json rows = nlohmann::json::array();
    for (int expert = 0; expert < placement.num_experts(); ++expert) {
      std::vector<int32_t> row(placement.max_copies(), -1);
      auto copies = placement.copies(layer, expert);
      std::copy(copies.begin(), copies.end(), row.begin());
      rows.push_back(row);
    }
    log2phy.push_back(rows);
  }
  out["phy2log"] = phy2log;
  out["log2phy"] = log2phy;
  out["logcnt"] = logcnt;
  return out.dump();
}

namespace {

Result<int> IntField(const nlohmann::json& json, const char* field, const std::string& source) {
  if (!json.contains(field)) return InvalidArgument(fmt::format("{}: missing field \"{}\"", source, field));
  const auto& value = json[field];
  if (!value.is_number_integer())
    return InvalidArgument(fmt::format("{}: field \"{}\" must be an integer, got {}", source, field, value.dump()));
  return value.get<int>();
}

}  // namespace

Result<Placement> PlacementFromJson(const std::string& json_text, const std::string& source) {
  nlohmann::json json = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object())
    return InvalidArgument(fmt::format("{}: not a JSON object", source));
  EPMOE_ASSIGN_OR_RETURN(const int num_layers, IntField(json, "num_layers", source));
  EPMOE_ASSIGN_OR_RETURN(const int num_experts, IntField(json, "num_experts", source));
  EPMOE_ASSIGN_OR_RETURN(const int num_slots, IntField(json, "num_slots", source));
  EPMOE_ASSIGN_OR_RETURN(const int num_ranks, IntField(json, "num_ranks", source));
  EPMOE_ASSIGN_OR_RETURN(const int num_nodes, IntField(json, "num_nodes", source));
  if (!json.contains("phy2log") || !json["phy2log"].is_array())
    return InvalidArgument(fmt::format("{}: missing array \"phy2log\"", source));
  const auto& layers = json["phy2log"];
  if (static_cast<int>(layers.size()) != num_layers)
    return InvalidArgument(fmt::format("{}: phy2log has {} layers, num_layers is {}", source, layers.size(),
                                       num_layers));
  std::vector<std::vector<int32_t>> phy2log(num_layers);
  for (int layer = 0; layer < num_layers; ++layer) {
    const auto& row = layers[layer];
    if (!row.is_array() || static_cast<int>(row.size()) != num_slots)
      return InvalidArgument(fmt::format("{}: phy2log[{}] must be an array of {} slots", source, layer, num_slots));
    for (int slot = 0; slot < num_slots; ++slot) {
      if (!row[slot].is_number_integer())
        return InvalidArgument(fmt::format("{}: phy2log[{}][{}] is not an integer: {}", source, layer, slot,
                                           row[slot].dump()));
      phy2log[layer].push_back(row[slot].get<int32_t>());
    }
  }
  if (num_slots < 1) return InvalidArgument(fmt::format("{}: num_slots {} must be >= 1", source, num_slots));
  auto created = Placement::Create(num_experts, num_ranks, num_nodes, std::move(phy2log));
  if (!created.ok()) return created.status().WithContext(source);
  const Placement& placement = *created;
  if (json.contains("logcnt")) {
    const auto& logcnt = json["logcnt"];
    for (int layer = 0; layer < num_layers; ++layer) {
      if (!logcnt.is_array() || static_cast<int>(logcnt.size()) != num_layers || !logcnt[layer].is_array() ||
          static_cast<int>(logcnt[layer].size()) != num_experts)
        return InvalidArgument(fmt::format("{}: logcnt must be {} x {} integers", source, num_layers, num_experts));
      for (int expert = 0; expert < num_experts; ++expert)
        if (!logcnt[layer][expert].is_number_integer() ||
            logcnt[layer][expert].get<int64_t>() != placement.logcnt(layer)[expert])
          return InvalidArgument(fmt::format("{}: logcnt[{}][{}] = {} but phy2log holds {} copies", source, layer,
                                             expert, logcnt[layer][expert].dump(), placement.logcnt(layer)[expert]));
    }
  }
  if (json.contains("log2phy")) {
    const auto& log2phy = json["log2phy"];
    if (!log2phy.is_array() || static_cast<int>(log2phy.size()) != num_layers)
      return InvalidArgument(fmt::format("{}: log2phy must have {} layers", source, num_layers));
    for (int layer = 0; layer < num_layers; ++layer) {
      if (!log2phy[layer].is_array() || static_cast<int>(log2phy[layer].size()) != num_experts)
        return InvalidArgument(fmt::format("{}: log2phy[{}] must have {} experts", source, layer, num_experts));
      for (int expert = 0; expert < num_experts; ++expert) {
        const auto& row = log2phy[layer][expert];
        std::vector<int32_t> listed;
        for (const auto& value : row) {
          if (!value.is_number_integer())
            return InvalidArgument(fmt::format("{}: log2phy[{}][{}] holds {}", source, layer, expert, value.dump()));
          if (value.get<int64_t>() >= 0) listed.push_back(value.get<int32_t>());
        }
        std::sort(listed.begin(), listed.end());
        auto copies = placement.copies(layer, expert);
        if (!std::equal(listed.begin(), listed.end(), copies.begin(), copies.end()))
          return InvalidArgument(fmt::format("{}: log2phy[{}][{}] = {} does not match the slots of phy2log", source,
                                             layer, expert, row.dump()));
      }
    }
  }
  return created;
}

Status WritePlacementFile(const Placement& placement, const std::string& path) {
  std::ofstream out(path);
  if (!out) return IoError(fmt::format("{}: cannot open for writing", path));
  out << PlacementToJson(placement) << "\n";
  out.close();
  if (!out) return IoError(fmt::format("{}: write failed", path));
  return Status::Ok();
}

Result<Placement> ReadPlacementFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("{}: cannot open placement file", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return PlacementFromJson(buffer.str(), path);
}

Result<std::string> PlacementToSglangJson(const Placement& placement, const std::vector<int>& layer_ids,
                                          int num_hidden_layers) {
  const int num_layers = placement.num_layers();
  if (!layer_ids.empty() && static_cast<int>(layer_ids.size()) != num_layers)
    return InvalidArgument(
        fmt::format("{} layer ids for a placement of {} layers: give one per layer", layer_ids.size(), num_layers));
  if (num_hidden_layers == 0)
    num_hidden_layers = layer_ids.empty() ? num_layers : 1 + *std::max_element(layer_ids.begin(), layer_ids.end());
  if (num_hidden_layers < num_layers)
    return InvalidArgument(
        fmt::format("{} hidden layers cannot hold the placement's {} MoE layers", num_hidden_layers, num_layers));
  nlohmann::json rows = nlohmann::json::array();
  std::vector<int> layer_of_row(num_hidden_layers, -1);
  for (int layer = 0; layer < num_layers; ++layer) {
    const int id = layer_ids.empty() ? layer : layer_ids[layer];
    if (id < 0 || id >= num_hidden_layers)
      return InvalidArgument(fmt::format("layer id {} is outside the {} hidden layers", id, num_hidden_layers));
    if (layer_of_row[id] >= 0) return InvalidArgument(fmt::format("layer id {} is given twice", id));
    layer_of_row[id] = layer;
  }
  for (int row = 0; row < num_hidden_layers; ++row) {
    std::vector<int32_t> slots(placement.num_slots());
    if (layer_of_row[row] >= 0) {
      auto phy2log = placement.phy2log(layer_of_row[row]);
      slots.assign(phy2log.begin(), phy2log.end());
    } else {
      for (int slot = 0; slot < placement.num_slots(); ++slot) slots[slot] = slot % placement.num_experts();
    }
    rows.push_back(slots);
  }
  return nlohmann::json{{"physical_to_logical_map", rows}}.dump();
}

}  // namespace epmoe
