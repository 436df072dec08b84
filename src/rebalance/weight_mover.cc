#include "epmoe/weight_mover.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
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

// Exchanges that timed out are abandoned, not completed (a dead peer would block forever), but MPI
// may still write into their buffers if the peer comes back: such buffers are parked here and
// never freed. The job is expected to abort after a timeout, so this holds at most a few rounds.
std::mutex abandoned_mutex;
std::vector<std::shared_ptr<void>>& Abandoned() {
  static auto* parked = new std::vector<std::shared_ptr<void>>();
  return *parked;
}
template <typename T>
void Abandon(T value) {
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  Abandoned().push_back(std::make_shared<T>(std::move(value)));
}

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Status CheckMoveArguments(const Communicator& comm, const MovePlan& plan, int64_t expert_bytes,
                          int64_t max_buffer_bytes) {
  if (static_cast<int>(plan.bytes_sent.size()) != comm.size())
    return InvalidArgument(fmt::format("weight move: the plan is for {} ranks, the communicator has {}",
                                       plan.bytes_sent.size(), comm.size()));
  if (expert_bytes <= 0 || max_buffer_bytes < 2 * expert_bytes)
    return InvalidArgument(
        fmt::format("weight move: a buffer bound of {} bytes cannot hold a copy of {} bytes each way", max_buffer_bytes,
                    expert_bytes));
  return Status::Ok();
}

}  // namespace

// One round's buffers and nonblocking exchange.
struct AsyncExpertMove::Round {
  std::vector<SlotMove> moves;
  std::vector<int64_t> send_bytes, recv_bytes, send_offsets, recv_offsets;
  std::vector<std::byte> send_buffer, recv_buffer;
  std::unique_ptr<Request> request;
};

AsyncExpertMove::AsyncExpertMove(Communicator& comm, int64_t expert_bytes, SlotBytesSource source, SlotBytesSink sink)
    : comm_(comm), expert_bytes_(expert_bytes), source_(std::move(source)), sink_(std::move(sink)) {}

AsyncExpertMove::~AsyncExpertMove() {
  // A round still in flight when the move is given up (a failed or stalled peer) is parked, not
  // waited for: waiting could block forever, and the transport may still write into its buffers.
  if (in_flight_ != nullptr && !in_flight_->request->Test()) Abandon(std::move(in_flight_));
}

Result<std::unique_ptr<AsyncExpertMove>> AsyncExpertMove::Start(Communicator& comm, const MovePlan& plan,
                                                                int64_t expert_bytes, int64_t max_buffer_bytes,
                                                                SlotBytesSource source, SlotBytesSink sink) {
  EPMOE_RETURN_IF_ERROR(CheckMoveArguments(comm, plan, expert_bytes, max_buffer_bytes));
  std::unique_ptr<AsyncExpertMove> move(
      new AsyncExpertMove(comm, expert_bytes, std::move(source), std::move(sink)));
  move->started_at_ = SteadySeconds();
  const int me = comm.rank();
  for (const SlotMove& m : plan.moves) {
    if (m.dest_rank != me || !m.local() || !move->local_error_.ok()) continue;
    const auto bytes = move->source_(m.layer, m.source_slot);
    move->local_error_ = CheckSpan(bytes, expert_bytes, m.layer, m.source_slot);
    if (move->local_error_.ok()) move->local_error_ = move->sink_(m, bytes);
    if (move->local_error_.ok()) ++move->stats_.local_copies;
  }
  for (const auto& round : PlanRounds(plan, comm.size(), expert_bytes, max_buffer_bytes)) {
    auto& copy = move->rounds_.emplace_back();
    for (const SlotMove* m : round) copy.push_back(*m);
  }
  move->stats_.rounds = static_cast<int>(move->rounds_.size());
  EPMOE_ASSIGN_OR_RETURN(bool started, move->StartNextRound());
  (void)started;
  return move;
}

Status AsyncExpertMove::Launch(size_t round_index) {
  const int ranks = comm_.size();
  const int me = comm_.rank();
  auto round = std::make_unique<Round>();
  round->moves = std::move(rounds_[round_index]);
  round->send_bytes.assign(ranks, 0);
  round->recv_bytes.assign(ranks, 0);
  for (const SlotMove& m : round->moves) {
    if (m.source_rank == me) round->send_bytes[m.dest_rank] += expert_bytes_;
    if (m.dest_rank == me) round->recv_bytes[m.source_rank] += expert_bytes_;
  }
  round->send_offsets = PrefixOffsets(round->send_bytes);
  round->recv_offsets = PrefixOffsets(round->recv_bytes);
  round->send_buffer.assign(round->send_offsets.back(), std::byte{0});
  round->recv_buffer.resize(round->recv_offsets.back());
  stats_.peak_buffer_bytes =
      std::max<int64_t>(stats_.peak_buffer_bytes, round->send_offsets.back() + round->recv_offsets.back());
  std::vector<int64_t> cursor(round->send_offsets.begin(), round->send_offsets.end() - 1);
  for (const SlotMove& m : round->moves) {
    if (m.source_rank != me) continue;
    if (local_error_.ok()) {
      const auto bytes = source_(m.layer, m.source_slot);
      local_error_ = CheckSpan(bytes, expert_bytes_, m.layer, m.source_slot);
      if (local_error_.ok()) std::memcpy(round->send_buffer.data() + cursor[m.dest_rank], bytes.data(), expert_bytes_);
    }
    cursor[m.dest_rank] += expert_bytes_;
  }
  auto request = comm_.StartAlltoallv(round->send_buffer.data(), round->send_bytes,
                                      std::span(round->send_offsets).first(ranks), round->recv_buffer.data(),
                                      round->recv_bytes, std::span(round->recv_offsets).first(ranks));
  if (!request.ok()) return request.status().WithContext("weight move (background)");
  round->request = std::move(request).value();
  in_flight_ = std::move(round);
  return Status::Ok();
}

Status AsyncExpertMove::Deliver() {
  const int me = comm_.rank();
  Round& round = *in_flight_;
  std::vector<int64_t> read(round.recv_offsets.begin(), round.recv_offsets.end() - 1);
  for (const SlotMove& m : round.moves) {
    if (m.dest_rank != me) continue;
    if (local_error_.ok()) {
      local_error_ = sink_(m, {round.recv_buffer.data() + read[m.source_rank], static_cast<size_t>(expert_bytes_)});
      if (local_error_.ok()) ++stats_.remote_copies;
    }
    read[m.source_rank] += expert_bytes_;
  }
  stats_.bytes_sent += round.send_offsets.back();
  stats_.bytes_received += round.recv_offsets.back();
  in_flight_.reset();
  if (finished()) stats_.seconds = SteadySeconds() - started_at_;
  return Status::Ok();
}

Result<bool> AsyncExpertMove::Poll() {
  if (in_flight_ != nullptr) {
    if (!in_flight_->request->Test()) return false;
    EPMOE_RETURN_IF_ERROR(Deliver());
  }
  if (!local_error_.ok()) return local_error_;
  return true;
}

Result<bool> AsyncExpertMove::StartNextRound() {
  EPMOE_CHECK_MSG(in_flight_ == nullptr, "AsyncExpertMove::StartNextRound with a round in flight");
  if (next_round_ >= rounds_.size()) {
    stats_.seconds = SteadySeconds() - started_at_;
    return false;
  }
  EPMOE_RETURN_IF_ERROR(Launch(next_round_++));
  return true;
}

bool AsyncExpertMove::finished() const { return in_flight_ == nullptr && next_round_ >= rounds_.size(); }

Result<MoveStats> MoveExperts(Communicator& comm, const MovePlan& plan, int64_t expert_bytes, int64_t max_buffer_bytes,
                              const SlotBytesSource& source, const SlotBytesSink& sink) {
  const auto start = std::chrono::steady_clock::now();
  const int ranks = comm.size();
  const int me = comm.rank();
  EPMOE_RETURN_IF_ERROR(CheckMoveArguments(comm, plan, expert_bytes, max_buffer_bytes));
  MoveStats stats;
  // A local failure (a source or sink refusing) is kept and returned at the end: this rank still
  // takes part in every round (sending zeros where its source failed), so the other ranks' exchanges
  // stay matched and nobody waits for a round this rank skipped.
  Status local_error;
  for (const SlotMove& move : plan.moves) {
    if (move.dest_rank != me || !move.local() || !local_error.ok()) continue;
    const auto bytes = source(move.layer, move.source_slot);
    local_error = CheckSpan(bytes, expert_bytes, move.layer, move.source_slot);
    if (local_error.ok()) local_error = sink(move, bytes);
    if (local_error.ok()) ++stats.local_copies;
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
    send_buffer.assign(send_offsets.back(), std::byte{0});
    recv_buffer.resize(recv_offsets.back());
    stats.peak_buffer_bytes = std::max<int64_t>(stats.peak_buffer_bytes, send_offsets.back() + recv_offsets.back());
    // Moves to one peer are packed (and unpacked) in plan order.
    std::vector<int64_t> cursor(send_offsets.begin(), send_offsets.end() - 1);
    for (const SlotMove* move : round) {
      if (move->source_rank != me) continue;
      if (local_error.ok()) {
        const auto bytes = source(move->layer, move->source_slot);
        local_error = CheckSpan(bytes, expert_bytes, move->layer, move->source_slot);
        if (local_error.ok()) std::memcpy(send_buffer.data() + cursor[move->dest_rank], bytes.data(), expert_bytes);
      }
      cursor[move->dest_rank] += expert_bytes;
    }
    const Status exchanged = comm.Alltoallv(send_buffer.data(), send_bytes, std::span(send_offsets).first(ranks),
                                            recv_buffer.data(), recv_bytes, std::span(recv_offsets).first(ranks));
    if (!exchanged.ok()) {
      if (exchanged.code() == StatusCode::kUnavailable) {
        Abandon(std::move(send_buffer));
        Abandon(std::move(recv_buffer));
      }
      return exchanged.WithContext("weight move");
    }
    std::vector<int64_t> read(recv_offsets.begin(), recv_offsets.end() - 1);
    for (const SlotMove* move : round) {
      if (move->dest_rank != me) continue;
      if (local_error.ok()) {
        local_error = sink(*move, {recv_buffer.data() + read[move->source_rank], static_cast<size_t>(expert_bytes)});
        if (local_error.ok()) ++stats.remote_copies;
      }
      read[move->source_rank] += expert_bytes;
    }
    stats.bytes_sent += send_offsets.back();
    stats.bytes_received += recv_offsets.back();
  }
  if (!local_error.ok()) return local_error;
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
