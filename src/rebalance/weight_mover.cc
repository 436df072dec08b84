#include "epmoe/weight_mover.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace epmoe {
namespace {

// Splits the plan's network moves into rounds in plan order: a move joins the current round unless
// that would push its sender's or its receiver's buffers (send + receive) past the bound.
std::vector<std::vector<const SlotMove*>> PlanRounds(const MovePlan& plan, int ranks, int64_t expert_bytes,
                                                     int64_t max_buffer_bytes) {
  std::vector<std::vector<const SlotMove*>> rounds;
  std::vector<int64_t> held(ranks, 0);
  for (const SlotMove& move : plan.moves) {
    if (move.local()) continue;
    if (rounds.empty() || held[move.source_rank] + expert_bytes > max_buffer_bytes ||
        held[move.dest_rank] + expert_bytes > max_buffer_bytes) {
      rounds.emplace_back();
      std::fill(held.begin(), held.end(), 0);
    }
    rounds.back().push_back(&move);
    held[move.source_rank] += expert_bytes;
    held[move.dest_rank] += expert_bytes;
  }
  return rounds;
}

Status CheckSpan(std::span<const std::byte> bytes, int64_t expert_bytes, int layer, int slot) {
  if (static_cast<int64_t>(bytes.size()) == expert_bytes) return Status::Ok();
  return Internal(fmt::format("weight move: layer {} slot {} holds {} bytes, expected {}", layer, slot, bytes.size(),
                              expert_bytes));
}

}  // namespace

Result<MoveStats> MoveExperts(Communicator& comm, const MovePlan& plan, int64_t expert_bytes, int64_t max_buffer_bytes,
                              const SlotBytesSource& source, const SlotBytesSink& sink) {
  const auto start = std::chrono::steady_clock::now();
  const int ranks = comm.size();
  const int me = comm.rank();
  if (static_cast<int>(plan.bytes_sent.size()) != ranks)
    return InvalidArgument(
        fmt::format("weight move: the plan is for {} ranks, the communicator has {}", plan.bytes_sent.size(), ranks));
  if (expert_bytes <= 0 || max_buffer_bytes < 2 * expert_bytes)
    return InvalidArgument(
        fmt::format("weight move: a buffer bound of {} bytes cannot hold a copy of {} bytes each way", max_buffer_bytes,
                    expert_bytes));
  MoveStats stats;
  for (const SlotMove& move : plan.moves) {
    if (move.dest_rank != me || !move.local()) continue;
    const auto bytes = source(move.layer, move.source_slot);
    EPMOE_RETURN_IF_ERROR(CheckSpan(bytes, expert_bytes, move.layer, move.source_slot));
    EPMOE_RETURN_IF_ERROR(sink(move, bytes));
    ++stats.local_copies;
  }

  const auto rounds = PlanRounds(plan, ranks, expert_bytes, max_buffer_bytes);
  std::vector<std::byte> send_buffer, recv_buffer;
  for (const auto& round : rounds) {
    std::vector<int64_t> send_bytes(ranks, 0), recv_bytes(ranks, 0);
    for (const SlotMove* move : round) {
      if (move->source_rank == me) send_bytes[move->dest_rank] += expert_bytes;
      if (move->dest_rank == me) recv_bytes[move->source_rank] += expert_bytes;
    }
    const auto send_offsets = PrefixOffsets(send_bytes);
    const auto recv_offsets = PrefixOffsets(recv_bytes);
    send_buffer.resize(send_offsets.back());
    recv_buffer.resize(recv_offsets.back());
    stats.peak_buffer_bytes = std::max<int64_t>(stats.peak_buffer_bytes, send_offsets.back() + recv_offsets.back());
    // Moves to one peer are packed (and unpacked) in plan order.
    std::vector<int64_t> cursor(send_offsets.begin(), send_offsets.end() - 1);
    for (const SlotMove* move : round) {
      if (move->source_rank != me) continue;
      const auto bytes = source(move->layer, move->source_slot);
      EPMOE_RETURN_IF_ERROR(CheckSpan(bytes, expert_bytes, move->layer, move->source_slot));
      std::memcpy(send_buffer.data() + cursor[move->dest_rank], bytes.data(), expert_bytes);
      cursor[move->dest_rank] += expert_bytes;
    }
    EPMOE_RETURN_IF_ERROR(comm.Alltoallv(send_buffer.data(), send_bytes, std::span(send_offsets).first(ranks),
                                         recv_buffer.data(), recv_bytes, std::span(recv_offsets).first(ranks))
                              .WithContext("weight move"));
    std::vector<int64_t> read(recv_offsets.begin(), recv_offsets.end() - 1);
    for (const SlotMove* move : round) {
      if (move->dest_rank != me) continue;
      EPMOE_RETURN_IF_ERROR(
          sink(*move, {recv_buffer.data() + read[move->source_rank], static_cast<size_t>(expert_bytes)}));
      read[move->source_rank] += expert_bytes;
      ++stats.remote_copies;
    }
    stats.bytes_sent += send_offsets.back();
    stats.bytes_received += recv_offsets.back();
  }
  stats.rounds = static_cast<int>(rounds.size());
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

Result<PlacementPtr> BroadcastPlacement(Communicator& comm, int root, const PlacementPtr& placement) {
  const int ranks = comm.size();
  if (root < 0 || root >= ranks)
    return InvalidArgument(fmt::format("broadcast placement: root {} outside [0, {})", root, ranks));
  constexpr int kShapeFields = 5;  // layers, experts, slots, ranks, nodes
  std::vector<int64_t> shape(kShapeFields, 0), all_shapes(static_cast<size_t>(ranks) * kShapeFields);
  // A root without a placement sends an empty shape, so every rank refuses together (no rank is left
  // waiting in the next exchange).
  if (comm.rank() == root && placement != nullptr) {
    shape = {placement->num_layers(), placement->num_experts(), placement->num_slots(), placement->num_ranks(),
             placement->num_nodes()};
  }
  EPMOE_RETURN_IF_ERROR(comm.AllgatherInt64(shape, all_shapes));
  const int64_t* root_shape = all_shapes.data() + static_cast<size_t>(root) * kShapeFields;
  const int64_t layers = root_shape[0], slots = root_shape[2];
  if (layers <= 0 || slots <= 0 || layers * slots > (int64_t{1} << 31))
    return InvalidArgument(
        fmt::format("broadcast placement: root rank {} sent a shape of {} layers x {} slots", root, layers, slots));
  const int64_t payload = layers * slots * static_cast<int64_t>(sizeof(int32_t));
  std::vector<int32_t> flat(static_cast<size_t>(layers * slots));
  if (comm.rank() == root) {
    for (int l = 0; l < layers; ++l) {
      const auto p2l = placement->phy2log(l);
      std::copy(p2l.begin(), p2l.end(), flat.begin() + l * slots);
    }
  }
  std::vector<int64_t> recv_bytes(ranks, 0);
  recv_bytes[root] = payload;
  std::vector<int64_t> recv_offsets(ranks, 0);  // only the root contributes: everything lands at 0
  std::vector<int32_t> received(flat.size());
  EPMOE_RETURN_IF_ERROR(
      comm.Allgatherv(flat.data(), comm.rank() == root ? payload : 0, received.data(), recv_bytes, recv_offsets)
          .WithContext("broadcast placement"));
  std::vector<std::vector<int32_t>> phy2log(layers);
  for (int l = 0; l < layers; ++l) phy2log[l].assign(received.begin() + l * slots, received.begin() + (l + 1) * slots);
  auto created = Placement::Create(static_cast<int>(root_shape[1]), static_cast<int>(root_shape[3]),
                                   static_cast<int>(root_shape[4]), std::move(phy2log));
  if (!created.ok()) return created.status().WithContext(fmt::format("placement broadcast by rank {} refused", root));
  return std::make_shared<const Placement>(std::move(created).value());
}

Status SumOverRanks(Communicator& comm, std::span<int64_t> values) {
  const int ranks = comm.size();
  const int64_t length = static_cast<int64_t>(values.size());
  // Every rank learns the longest and the shortest length, so all refuse together on a mismatch.
  EPMOE_ASSIGN_OR_RETURN(int64_t longest, comm.AllreduceMax(length));
  EPMOE_ASSIGN_OR_RETURN(int64_t minus_shortest, comm.AllreduceMax(-length));
  if (longest != -minus_shortest)
    return InvalidArgument(fmt::format("sum over ranks: ranks hold between {} and {} values (this rank {})",
                                       -minus_shortest, longest, length));
  std::vector<int64_t> all(static_cast<size_t>(ranks) * length);
  EPMOE_RETURN_IF_ERROR(comm.AllgatherInt64(values, all));
  for (int64_t i = 0; i < length; ++i) {
    int64_t sum = 0;
    for (int r = 0; r < ranks; ++r) sum += all[static_cast<size_t>(r) * length + i];
    values[i] = sum;
  }
  return Status::Ok();
}

}  // namespace epmoe
