// Option 4, traveling rows. A row goes once to each rank holding one of its picks (the dispatch
// table of the placement chooses the copy), as a record: k local slot ids (-1: not for this rank),
// k router weights, the row in the dispatch format. The expert side runs its slots, multiplies each
// output by its router weight and sends one output per pick back in the combine format; the home
// rank sums a row's k outputs in pick order j = 0..k-1, as the single-process layer does. With
// partial sums the expert side adds up a row's picks it ran and sends one row back per rank.
// Counts are exchanged first (one all-gather of the count matrix) so receive buffers are sized
// exactly; when they would exceed the buffer bound the exchange runs in rounds (every rank sends a
// fixed share of each destination's rows per round, so both sides know every round's counts
// without another exchange).
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "ep/executor_internal.h"
#include "epmoe/dispatch.h"
#include "epmoe/thread_pool.h"

namespace epmoe::ep_internal {
namespace {

class A2aExecutor : public MoeExecutor {
 public:
  A2aExecutor(Communicator& comm, const ModelConfig& model, const ExecutorOptions& options, ThreadPool& pool)
      : comm_(comm), model_(model), options_(options), pool_(pool) {}

  Status Init() {
    const int me = comm_.rank();
    EPMOE_ASSIGN_OR_RETURN(placement_, ResolvePlacement(model_, options_, comm_.size(), comm_.num_nodes()));
    const Placement& p = *placement_;
    const ExpertSource routed = RoutedSource(model_, options_);
    stores_.resize(options_.num_layers);
    for (int layer = 0; layer < options_.num_layers; ++layer) {
      std::vector<ExpertWeights> local;
      for (int s = 0; s < p.slots_per_rank(); ++s)
        local.push_back(routed(layer, p.phy2log(layer)[me * p.slots_per_rank() + s], 0, model_.expert_intermediate));
      EPMOE_ASSIGN_OR_RETURN(stores_[layer], Pack(local, options_.pack));
    }
    EPMOE_ASSIGN_OR_RETURN(DispatchTable table, DispatchTable::Build(p, me, options_.dispatch_seed));
    dispatch_ = std::make_unique<DispatchTable>(std::move(table));
    EPMOE_ASSIGN_OR_RETURN(shared_, PackSharedCopies(model_, options_));
    target_ = std::make_unique<SlotStoresTarget>(me, &placement_, &stores_, [this](PlacementPtr next) -> Status {
      EPMOE_ASSIGN_OR_RETURN(DispatchTable table, DispatchTable::Build(*next, comm_.rank(), options_.dispatch_seed));
      dispatch_ = std::make_unique<DispatchTable>(std::move(table));
      placement_ = std::move(next);
      return Status::Ok();
    });
    return Status::Ok();
  }

  RebalanceTarget* rebalance_target() override { return target_.get(); }

  EpOption option() const override { return EpOption::kA2a; }
  std::string description() const override {
    return fmt::format("a2a: {} rows out, {} outputs back ({}), shared expert copied",
                       RowFormatName(options_.dispatch_format), RowFormatName(options_.combine_format),
                       options_.combine_partial_sums ? "one per row and rank" : "one per pick");
  }
  int64_t resident_weight_bytes() const override {
    int64_t bytes = 0;
    for (const auto* list : {&stores_, &shared_}) {
      for (const auto& store : *list) {
        if (store == nullptr) continue;
        for (int e = 0; e < store->num_experts(); ++e) bytes += store->expert_bytes(e);
      }
    }
    return bytes;
  }

  Status Forward(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) override {
    EPMOE_RETURN_IF_ERROR(CheckForwardInput(model_, options_.num_layers, layer, rows, picks));
    if (options_.origin == RowOrigin::kDataParallel) return ForwardHome(layer, rows, picks, out, stats);
    // Tensor-parallel rows: each rank is home for its data-parallel share, then all outputs are
    // all-gathered.
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k;
    const int64_t h = model_.hidden, total = rows.rows;
    const int64_t first = RowBegin(total, g, me), count = RowBegin(total, g, me + 1) - first;
    Matrix mine(count, h);
    std::copy(rows.row(first), rows.row(first) + count * h, mine.data.begin());
    Picks my_picks{count, k, std::vector<int32_t>(picks.experts.begin() + first * k, picks.experts.begin() + (first + count) * k),
                   std::vector<float>(picks.weights.begin() + first * k, picks.weights.begin() + (first + count) * k)};
    Matrix my_out;
    StepStats st;
    EPMOE_RETURN_IF_ERROR(ForwardHome(layer, mine, my_picks, &my_out, &st));
    Stopwatch watch;
    *out = Matrix(total, h);
    std::vector<int64_t> bytes(g);
    for (int r = 0; r < g; ++r) bytes[r] = (RowBegin(total, g, r + 1) - RowBegin(total, g, r)) * h * 4;
    const auto offsets = PrefixOffsets(bytes);
    EPMOE_RETURN_IF_ERROR(comm_.Allgatherv(my_out.data.data(), bytes[me], out->data.data(), bytes,
                                           std::span<const int64_t>(offsets.data(), g)));
    st.combine_us += watch.Lap();
    st.bytes_sent += bytes[me] * (g - 1);
    st.bytes_received += offsets[g] - bytes[me];
    if (stats != nullptr) *stats = st;
    return Status::Ok();
  }

 private:
  Status ForwardHome(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) {
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k;
    const int64_t h = model_.hidden, n = rows.rows;
    const Placement& p = *placement_;
    const int slots = p.slots_per_rank();
    const ExpertStore& store = *stores_[layer];
    const int64_t row_bytes = RowBytes(options_.dispatch_format, h);
    const int64_t record_bytes = k * 8 + row_bytes;
    const int64_t return_bytes = RowBytes(options_.combine_format, h);
    StepStats st;
    st.rows = n;
    Stopwatch watch;

    // Layout: destination and slot of every pick; the rows each destination gets, in row order.
    std::vector<int32_t> pick_rank(n * k), pick_slot(n * k);
    std::vector<std::vector<int64_t>> send_rows(g);
    std::vector<int64_t> seen(g, -1), nth(model_.num_experts, 0);
    for (int64_t r = 0; r < n; ++r) {
      for (int j = 0; j < k; ++j) {
        const int32_t e = picks.expert(r, j);
        const int32_t slot = dispatch_->SlotFor(layer, e, nth[e]++);
        const int dest = p.rank_of_slot(slot);
        pick_rank[r * k + j] = dest;
        pick_slot[r * k + j] = slot - dest * slots;
        if (seen[dest] != r) {
          seen[dest] = r;
          send_rows[dest].push_back(r);
        }
      }
    }
    // One all-gather gives every rank the whole count matrix (and every rank's rows), so receive
    // buffers are sized exactly and every rank computes the same number of rounds without a
    // further exchange.
    std::vector<int64_t> mine(g + 1), matrix(static_cast<size_t>(g) * (g + 1));
    for (int d = 0; d < g; ++d) mine[d] = static_cast<int64_t>(send_rows[d].size());
    mine[g] = n;
    st.pack_us += watch.Lap();
    EPMOE_RETURN_IF_ERROR(comm_.AllgatherInt64(mine, matrix));
    st.dispatch_us += watch.Lap();
    auto sent = [&](int from, int to) { return matrix[static_cast<size_t>(from) * (g + 1) + to]; };
    std::vector<int64_t> send_count(g), recv_count(g);
    for (int r = 0; r < g; ++r) {
      send_count[r] = sent(me, r);
      recv_count[r] = sent(r, me);
    }

    // Rounds under the buffer bound: the fewest that fit the rank needing the most.
    const int64_t picks_per_row = std::min(k, slots);
    const bool partial = options_.combine_partial_sums;
    const int64_t returns_per_row = partial ? 1 : picks_per_row;
    const int64_t per_recv_row = record_bytes + picks_per_row * 2 * h * 4 + returns_per_row * return_bytes + h * 4;
    const int64_t per_send_row = record_bytes + returns_per_row * return_bytes;
    // Bytes rank `rank` holds at once with `rounds` rounds; its returned outputs (one per pick of
    // its own rows) stay until the sum.
    auto round_bytes = [&](int rank, int64_t rounds) {
      int64_t bytes = sent(rank, g) * (partial ? h * 4 : k * return_bytes);
      for (int r = 0; r < g; ++r) {
        bytes += (sent(r, rank) + rounds - 1) / rounds * per_recv_row;
        bytes += (sent(rank, r) + rounds - 1) / rounds * per_send_row;
      }
      return bytes;
    };
    int64_t max_count = 1;
    for (int64_t v = 0; v < g; ++v)
      for (int r = 0; r < g; ++r) max_count = std::max(max_count, sent(static_cast<int>(v), r));
    int64_t rounds = 1;
    for (int rank = 0; rank < g; ++rank) {
      // The fewest rounds that fit this rank (round_bytes does not grow with more rounds).
      int64_t lo = 1, hi = max_count;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (round_bytes(rank, mid) <= options_.max_buffer_bytes) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      if (round_bytes(rank, lo) > options_.max_buffer_bytes)
        return OutOfRange(fmt::format("a2a: rank {} needs {} bytes even with one row per peer and round ({} rounds), "
                                      "over the buffer bound of {} bytes", rank, round_bytes(rank, lo), lo,
                                      options_.max_buffer_bytes));
      rounds = std::max(rounds, lo);
    }
    st.rounds = static_cast<int>(rounds);

    // Per-pick mode keeps every pick's returned output until the ordered sum; partial-sum mode adds
    // each returned row into the output as it arrives.
    std::vector<uint8_t> returned(partial ? 0 : n * k * return_bytes);
    *out = Matrix(n, h);
    std::vector<float> value(h);
    std::vector<uint8_t> send, recv, back_send, back_recv;
    Matrix recv_rows, work_in, work_out;
    std::vector<float> weighted(h);
    for (int64_t round = 0; round < rounds; ++round) {
      // This round's rows per destination and per source.
      std::vector<int64_t> send_first(g), send_n(g), recv_n(g), send_bytes(g), recv_bytes(g);
      for (int r = 0; r < g; ++r) {
        send_first[r] = send_count[r] * round / rounds;
        send_n[r] = send_count[r] * (round + 1) / rounds - send_first[r];
        recv_n[r] = recv_count[r] * (round + 1) / rounds - recv_count[r] * round / rounds;
        send_bytes[r] = send_n[r] * record_bytes;
        recv_bytes[r] = recv_n[r] * record_bytes;
      }
      const auto send_offsets = PrefixOffsets(send_bytes);
      const auto recv_offsets = PrefixOffsets(recv_bytes);
      send.resize(send_offsets[g]);
      recv.resize(recv_offsets[g]);
      for (int d = 0; d < g; ++d) {
        for (int64_t i = 0; i < send_n[d]; ++i) {
          const int64_t r = send_rows[d][send_first[d] + i];
          uint8_t* record = send.data() + send_offsets[d] + i * record_bytes;
          for (int j = 0; j < k; ++j) {
            const int32_t slot = pick_rank[r * k + j] == d ? pick_slot[r * k + j] : -1;
            std::memcpy(record + j * 4, &slot, 4);
          }
          std::memcpy(record + k * 4, picks.weights.data() + r * k, k * 4);
          EncodeRow(options_.dispatch_format, rows.row(r), h, record + k * 8);
        }
      }
      st.pack_us += watch.Lap();
      EPMOE_RETURN_IF_ERROR(comm_.Alltoallv(send.data(), send_bytes, std::span<const int64_t>(send_offsets.data(), g),
                                            recv.data(), recv_bytes, std::span<const int64_t>(recv_offsets.data(), g)));
      st.dispatch_us += watch.Lap();
      st.bytes_sent += send_offsets[g] - send_bytes[me];
      st.bytes_received += recv_offsets[g] - recv_bytes[me];
      st.row_copies += send_offsets[g] / record_bytes;

      // Expert side: decode the received rows and group their picks by local slot.
      const int64_t received = recv_offsets[g] / record_bytes;
      recv_rows = Matrix(received, h);
      std::vector<int32_t> item_slot(received * k);
      std::vector<float> item_weight(received * k);
      std::vector<int64_t> offsets(slots + 1, 0);
      for (int64_t q = 0; q < received; ++q) {
        const uint8_t* record = recv.data() + q * record_bytes;
        std::memcpy(item_slot.data() + q * k, record, k * 4);
        std::memcpy(item_weight.data() + q * k, record + k * 4, k * 4);
        for (int j = 0; j < k; ++j) {
          const int32_t slot = item_slot[q * k + j];
          if (slot < -1 || slot >= slots)
            return Internal(fmt::format("a2a: rank {} received a pick for slot {} (it holds {})", me, slot, slots));
          if (slot >= 0) ++offsets[slot + 1];
        }
        DecodeRow(options_.dispatch_format, record + k * 8, h, recv_rows.row(q));
      }
      for (int s = 0; s < slots; ++s) offsets[s + 1] += offsets[s];
      const int64_t items = offsets[slots];
      std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1), position(received * k, -1);
      work_in = Matrix(items, h);
      for (int64_t q = 0; q < received; ++q) {
        for (int j = 0; j < k; ++j) {
          const int32_t slot = item_slot[q * k + j];
          if (slot < 0) continue;
          position[q * k + j] = cursor[slot]++;
          std::copy(recv_rows.row(q), recv_rows.row(q) + h, work_in.row(position[q * k + j]));
        }
      }
      st.pack_us += watch.Lap();
      work_out = Matrix(items, h);
      if (items > 0) store.Run(work_in.data.data(), offsets, work_out.data.data(), pool_);
      for (int s = 0; s < slots; ++s) {
        if (offsets[s + 1] > offsets[s]) st.expert_bytes_read += store.expert_bytes(s);
      }
      st.picks += items;
      st.experts_us += watch.Lap();

      // Weighted outputs back in (received row, pick) order per source: one per pick, or (partial
      // sums) one per received row, its picks here summed in pick order.
      std::vector<int64_t> back_send_bytes(g), back_recv_bytes(g);
      int64_t q = 0;
      for (int s = 0; s < g; ++s) {
        int64_t count = 0;
        for (int64_t i = 0; i < recv_n[s]; ++i, ++q)
          for (int j = 0; j < k; ++j) count += item_slot[q * k + j] >= 0;
        back_send_bytes[s] = (partial ? recv_n[s] : count) * return_bytes;
      }
      for (int d = 0; d < g; ++d) {
        int64_t count = 0;
        for (int64_t i = 0; i < send_n[d]; ++i) {
          const int64_t r = send_rows[d][send_first[d] + i];
          for (int j = 0; j < k; ++j) count += pick_rank[r * k + j] == d;
        }
        back_recv_bytes[d] = (partial ? send_n[d] : count) * return_bytes;
      }
      const auto back_send_offsets = PrefixOffsets(back_send_bytes);
      const auto back_recv_offsets = PrefixOffsets(back_recv_bytes);
      back_send.resize(back_send_offsets[g]);
      back_recv.resize(back_recv_offsets[g]);
      int64_t out_at = 0;
      for (int64_t i = 0; i < received; ++i) {
        if (partial) std::fill(weighted.begin(), weighted.end(), 0.0f);
        for (int j = 0; j < k; ++j) {
          const int64_t pos = position[i * k + j];
          if (pos < 0) continue;
          const float w = item_weight[i * k + j];
          const float* src = work_out.row(pos);
          if (partial) {
            for (int64_t c = 0; c < h; ++c) weighted[c] += w * src[c];
            continue;
          }
          for (int64_t c = 0; c < h; ++c) weighted[c] = w * src[c];
          EncodeRow(options_.combine_format, weighted.data(), h, back_send.data() + out_at);
          out_at += return_bytes;
        }
        if (partial) {
          EncodeRow(options_.combine_format, weighted.data(), h, back_send.data() + out_at);
          out_at += return_bytes;
        }
      }
      st.peak_buffer_bytes = std::max<int64_t>(
          st.peak_buffer_bytes,
          static_cast<int64_t>(returned.size() + send.size() + recv.size() + back_send.size() + back_recv.size()) +
              static_cast<int64_t>((partial ? out->data.size() : 0) + recv_rows.data.size() + work_in.data.size() +
                                   work_out.data.size()) * 4);
      st.pack_us += watch.Lap();
      EPMOE_RETURN_IF_ERROR(comm_.Alltoallv(back_send.data(), back_send_bytes,
                                            std::span<const int64_t>(back_send_offsets.data(), g), back_recv.data(),
                                            back_recv_bytes, std::span<const int64_t>(back_recv_offsets.data(), g)));
      st.combine_us += watch.Lap();
      st.bytes_sent += back_send_offsets[g] - back_send_bytes[me];
      st.bytes_received += back_recv_offsets[g] - back_recv_bytes[me];

      // Each pick's output to its place, returned[r*k + j]; or each partial sum into its row.
      for (int d = 0; d < g; ++d) {
        const uint8_t* src = back_recv.data() + back_recv_offsets[d];
        for (int64_t i = 0; i < send_n[d]; ++i) {
          const int64_t r = send_rows[d][send_first[d] + i];
          if (partial) {
            DecodeRow(options_.combine_format, src, h, value.data());
            float* y = out->row(r);
            for (int64_t c = 0; c < h; ++c) y[c] += value[c];
            src += return_bytes;
            continue;
          }
          for (int j = 0; j < k; ++j) {
            if (pick_rank[r * k + j] != d) continue;
            std::memcpy(returned.data() + (r * k + j) * return_bytes, src, return_bytes);
            src += return_bytes;
          }
        }
      }
      st.unpack_us += watch.Lap();
    }

    // Sum each row's k outputs in pick order, exactly as CombinePermutedRows.
    for (int64_t r = 0; r < n && !partial; ++r) {
      float* y = out->row(r);
      for (int j = 0; j < k; ++j) {
        DecodeRow(options_.combine_format, returned.data() + (r * k + j) * return_bytes, h, value.data());
        for (int64_t c = 0; c < h; ++c) y[c] += value[c];
      }
    }
    st.unpack_us += watch.Lap();
    st.expert_bytes_read += AddSharedExperts(shared_[layer].get(), rows, out, pool_);
    st.shared_us += watch.Lap();
    if (stats != nullptr) *stats = st;
    return Status::Ok();
  }

  Communicator& comm_;
  ModelConfig model_;
  ExecutorOptions options_;
  ThreadPool& pool_;
  PlacementPtr placement_;
  std::vector<std::unique_ptr<ExpertStore>> stores_;   // per layer: this rank's slots
  std::unique_ptr<DispatchTable> dispatch_;            // this rank's picks -> slots
  std::unique_ptr<SlotStoresTarget> target_;           // live rebalancing of stores_ and placement_
  std::vector<std::unique_ptr<ExpertStore>> shared_;   // per layer; null without shared experts
};

}  // namespace

Result<std::unique_ptr<MoeExecutor>> CreateA2aExecutor(Communicator& comm, const ModelConfig& model,
                                                       const ExecutorOptions& options, ThreadPool& pool) {
  auto executor = std::make_unique<A2aExecutor>(comm, model, options, pool);
  EPMOE_RETURN_IF_ERROR(executor->Init());
  return std::unique_ptr<MoeExecutor>(std::move(executor));
}

}  // namespace epmoe::ep_internal
