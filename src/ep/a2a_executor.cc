// Option 4, traveling rows. A row goes once to each rank holding one of its picks (the dispatch
// table of the placement chooses the copy), as a record: k local slot ids (-1: not for this rank),
// k router weights, the row in the dispatch format. The expert side runs its slots, multiplies each
// output by its router weight and sends one output per pick back in the combine format; the home
// rank sums a row's k outputs in pick order j = 0..k-1, as the single-process layer does. With
// partial sums the expert side adds up a row's picks it ran and sends one row back per rank.
// Counts are exchanged first (one all-gather of G values per rank, overlapped with packing) so
// receive buffers are sized exactly; when they would exceed the buffer bound the
// exchange runs in rounds (every rank sends a fixed share of each destination's rows per round, so
// both sides know every round's counts without another exchange).
// The step copies as little as it can: records are packed straight into the send buffer (a rank's
// own records are read from there and never pass through MPI), received rows are
// decoded straight into the expert-ordered input, weighted outputs are encoded straight into the
// return buffer (this rank's own straight into where they are summed), and returned outputs are
// summed where they landed. Buffers live across steps.
// Low-latency mode (ExecutorOptions::a2a_mode, for decode) exchanges no counts: buffers are sized
// once, at creation, for max_rows_per_rank rows per rank, and each rank sends every peer one
// message as soon as its records are packed: a header with the sender's row count this step, then
// its records for that peer; the receiver learns how many from the message's length. The messages
// travel through a CappedExchange made at creation, whose receives are posted ahead: re-armed as
// soon as the step's outputs are encoded (the last read of the records), before this rank waits
// for its outputs, so a peer's next records find their receive posted (measured faster than
// receives posted per exchange on one node: docs/performance.md, "Low-latency's transport").
// A step over the bound sends headers only, so every rank learns of it from the same
// messages and all fail that step alike. The combine is the same as normal mode's. Low-latency
// is flat only, as DeepEP's: it never forwards through a gateway (ResolveA2aLevels).
// Single-batch overlap (ExecutorOptions::single_batch_overlap) runs the shared expert once the
// dispatch is started, then (RunAsTheyLand, flat) this rank's own records and each rank's as they
// land (Request::WaitSomeReceived), in groups, while the rest is in flight; with two levels the
// direct records run while the forwarded ones travel (TwoLevelRound). A group runs early only with
// enough picks per slot to be worth reading the experts' weights again (kEarlyPicksPerSlot).
// ExecutorOptions::a2a_progress says what moves the exchanges on while the rank computes (its
// waits only, polls between its compute loops' chunks, or a thread: DriveProgress).
// Each exchange waits only for what this rank receives (Request::WaitReceived): a rank that arrives
// last need not wait for its peers to take its own records or outputs, which they do whenever
// they next poll; those sends are finished before their buffer is written again (next round or
// step, counted in that step's dispatch or combine).
//
// Two levels (DeepEP's normal mode, A2aLevels::kTwoLevel): a row whose picks lie on another node
// goes there once, as a node record (its slot ids are then global slots, rank * slots + local
// slot, for every rank of that node) to the node's gateway for the sender: the rank with the
// sender's index in its own node (modulo the node's size, so unequal nodes spread the load), as
// DeepEP pairs the GPUs of equal local index across nodes so that the network hop needs no
// forwarding on the sending side. The gateway forwards a per-rank record (local slot ids, as flat)
// to each rank of its node holding a pick, itself included; rows whose picks stay on the home
// node go straight to their ranks. The combine reverses it: each expert rank returns a forwarded
// record's outputs to the gateway, which sends the row's outputs of its node home unchanged, one
// per pick in pick order (with partial sums: the sum of the node's partial rows, one row per node),
// so the home rank lays out and sums its returns exactly as flat does, the gateway standing in for
// the ranks of its node. A round runs four exchanges: node and direct records, forwarded records
// (after one count exchange: what a gateway forwards depends on the picks it received), forwarded
// outputs back to the gateways, and direct and gateway outputs home. The expert side (RunBatches,
// EncodeOutputs) is the same for flat, two-level and low-latency.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "ep/executor_internal.h"
#include "ep/scratch_buffer.h"
#include "epmoe/dispatch.h"
#include "epmoe/thread_pool.h"

namespace epmoe::ep_internal {
namespace {

// Drives the progress of a layer's exchanges while it lives (A2aProgress): poll hooks a call to
// the transport between the chunks of the pool's loops (at most one per kPollPeriod), thread runs
// one on a thread of its own every kPollPeriod; wait does nothing (the exchange's own waits do).
class DriveProgress {
 public:
  static constexpr auto kPollPeriod = std::chrono::microseconds(50);

  DriveProgress(Communicator& comm, ThreadPool& pool, A2aProgress mode) : pool_(pool) {
    if (mode == A2aProgress::kPoll) {
      hooked_ = true;
      pool.set_between_chunks([&comm, last = std::chrono::steady_clock::time_point()]() mutable {
        const auto now = std::chrono::steady_clock::now();
        if (now - last < kPollPeriod) return;
        last = now;
        comm.Progress();
      });
    } else if (mode == A2aProgress::kThread) {
      thread_ = std::thread([this, &comm] {
        while (!stop_.load(std::memory_order_relaxed)) {
          comm.Progress();
          std::this_thread::sleep_for(kPollPeriod);
        }
      });
    }
  }
  ~DriveProgress() {
    if (hooked_) pool_.set_between_chunks(nullptr);
    stop_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
  }
  DriveProgress(const DriveProgress&) = delete;
  DriveProgress& operator=(const DriveProgress&) = delete;

 private:
  ThreadPool& pool_;
  bool hooked_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class A2aExecutor : public MoeExecutor {
 public:
  // This rank's weights of every layer: built by Init and shared with the executor's lanes.
  struct RankWeights {
    std::vector<std::unique_ptr<ExpertStore>> stores;  // per layer: this rank's slots
    std::vector<std::unique_ptr<ExpertStore>> shared;  // per layer; null without shared experts
    std::vector<std::vector<float>> shared_gates;      // per layer; empty without a shared output gate
  };

  A2aExecutor(Communicator& comm, const ModelConfig& model, const ExecutorOptions& options, ThreadPool& pool,
              std::shared_ptr<RankWeights> weights = std::make_shared<RankWeights>(),
              std::shared_ptr<LivePlacement> live = nullptr)
      : comm_(comm), model_(model), options_(options), pool_(pool), live_(std::move(live)),
        weights_(std::move(weights)), stores_(weights_->stores), shared_(weights_->shared),
        shared_gates_(weights_->shared_gates) {}

  Status Init() {
    const int me = comm_.rank();
    EPMOE_ASSIGN_OR_RETURN(live_, ResolveLivePlacement(model_, options_, comm_));
    const PlacementPtr placement = live_->placement();
    const Placement& p = *placement;
    const std::shared_ptr<const WeightSource> weights = Weights(model_, options_);
    stores_.resize(options_.num_layers);
    for (int layer = 0; layer < options_.num_layers; ++layer) {
      auto slot_expert = [&](int s, ExpertWeights* out) {
        return weights->ReadExpert(layer, p.phy2log(layer)[me * p.slots_per_rank() + s], 0, -1, out);
      };
      EPMOE_ASSIGN_OR_RETURN(stores_[layer], PackExperts(p.slots_per_rank(), model_.hidden, model_.expert_intermediate,
                                                         slot_expert, options_.pack));
    }
    EPMOE_ASSIGN_OR_RETURN(shared_, PackSharedCopies(model_, options_));
    EPMOE_ASSIGN_OR_RETURN(shared_gates_, SharedOutputGates(model_, options_));
    target_ = std::make_unique<SlotStoresTarget>(me, live_.get(), &stores_);
    return InitExchange();
  }

  // The exchange's mode and levels, the nodes' members (two levels) and, in low-latency mode, its
  // fixed buffers: every lane has its own, on its own communicator.
  Status InitExchange() {
    const int g = comm_.size();
    if (options_.a2a_progress == A2aProgress::kThread && !comm_.concurrent_threads())
      return FailedPrecondition(
          "a2a: --a2a-progress thread drives MPI from a second thread, which needs MPI_THREAD_MULTIPLE; this MPI "
          "was started without it (use wait or poll)");
    low_latency_ = ResolveA2aMode(model_, options_, g) == A2aMode::kLowLatency;
    two_level_ = ResolveA2aLevels(model_, options_, g, comm_.num_nodes()) == A2aLevels::kTwoLevel;
    node_members_.assign(comm_.num_nodes(), {});
    node_index_.resize(g);
    for (int r = 0; r < g; ++r) {
      std::vector<int>& members = node_members_[comm_.node_of(r)];
      node_index_[r] = static_cast<int>(members.size());
      members.push_back(r);
    }
    if (low_latency_) {
      // CheckExecutorShape has kept the fixed buffers within the bound.
      message_bytes_ = LowLatencyMessageBytes(model_, options_);
      const std::array<int64_t, kBuffers> needs = LowLatencyBufferBytes(model_, options_, comm_.size());
      fixed_buffer_bytes_ = Reserve(needs);
      items_cap_ = needs[5] / (int64_t{4} * model_.hidden);  // expert-ordered inputs: one per received pick
      EPMOE_ASSIGN_OR_RETURN(dispatch_exchange_, comm_.CreateCappedExchange(recv_.data(), message_bytes_));
    }
    return Status::Ok();
  }

  RebalanceTarget* rebalance_target() override { return target_.get(); }
  std::shared_ptr<LivePlacement> live_placement() override { return live_; }

  // A lane reads this executor's weights and live placement (so a rebalance of this executor moves
  // the lane's experts too) and keeps its own buffers and per-step state.
  Result<std::unique_ptr<MoeExecutor>> CreateLane(Communicator& comm, ThreadPool& pool) override {
    if (comm.size() != comm_.size() || comm.rank() != comm_.rank())
      return InvalidArgument(fmt::format("a2a lane: its communicator has rank {} of {}, the executor's rank {} of {}",
                                         comm.rank(), comm.size(), comm_.rank(), comm_.size()));
    auto lane = std::make_unique<A2aExecutor>(comm, model_, options_, pool, weights_, live_);
    EPMOE_RETURN_IF_ERROR(lane->InitExchange());
    return std::unique_ptr<MoeExecutor>(std::move(lane));
  }

  EpOption option() const override { return EpOption::kA2a; }
  std::string description() const override {
    const std::string mode =
        low_latency_ ? fmt::format("low-latency, buffers for {} rows per rank", options_.max_rows_per_rank) : "normal";
    return fmt::format("a2a ({}): {} rows out, {} outputs back ({}), {}, shared expert copied, progress: {}", mode,
                       RowFormatName(options_.dispatch_format), RowFormatName(options_.combine_format),
                       options_.combine_partial_sums ? "one per row and rank" : "one per pick",
                       two_level_ ? fmt::format("two-level over {} nodes", comm_.num_nodes()) : "flat",
                       A2aProgressName(options_.a2a_progress));
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
    const DriveProgress progress(comm_, pool_, options_.a2a_progress);
    if (options_.origin == RowOrigin::kDataParallel) return ForwardRows(layer, rows, picks, out, stats);
    // Tensor-parallel rows: each rank is home for its data-parallel share, then all outputs are
    // all-gathered.
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k;
    const int64_t h = model_.hidden, total = rows.rows;
    const int64_t first = RowBegin(total, g, me), count = RowBegin(total, g, me + 1) - first;
    const Matrix mine = RowSlice(rows, first, count);
    Picks my_picks{count, k, std::vector<int32_t>(picks.experts.begin() + first * k, picks.experts.begin() + (first + count) * k),
                   std::vector<float>(picks.weights.begin() + first * k, picks.weights.begin() + (first + count) * k)};
    Matrix my_out;
    StepStats st;
    EPMOE_RETURN_IF_ERROR(ForwardRows(layer, mine, my_picks, &my_out, &st));
    Stopwatch watch;
    *out = Matrix(total, h);
    std::vector<int64_t> bytes(g);
    for (int r = 0; r < g; ++r) bytes[r] = (RowBegin(total, g, r + 1) - RowBegin(total, g, r)) * h * 4;
    const auto offsets = PrefixOffsets(bytes);
    EPMOE_RETURN_IF_ERROR(comm_.Allgatherv(my_out.data.data(), bytes[me], out->data.data(), bytes,
                                           std::span<const int64_t>(offsets.data(), g)));
    st.combine_us += watch.Lap();
    AddAllgatherBytes(comm_, bytes, &st);
    if (stats != nullptr) *stats = st;
    return Status::Ok();
  }


 private:
  // The step's buffers: returns, records sent and received, received rows decoded and in the
  // kernel's input format, expert-ordered inputs (kernel format) and outputs (fp32), outputs going
  // back; two levels only: records forwarded and received from a gateway, outputs of forwarded
  // records going back to their gateways and landing there.
  static constexpr int kBuffers = kA2aBuffers;
  // Single-batch overlap runs the records at hand early only from this many picks per local slot
  // on average: at decode sizes (a few picks per slot) running them apart read the experts'
  // weights once per group and made the step slower (docs/performance.md, "Several nodes").
  static constexpr int64_t kEarlyPicksPerSlot = 4;
  static constexpr int64_t kHeaderBytes = 8;  // low-latency: the sender's row count, before its records

  // One block of records the expert side runs: `count` records from rank `source`.
  struct Batch {
    const uint8_t* records = nullptr;
    int64_t count = 0;
    int source = 0;
  };

  // Rows [first, first + count) of destination d's list in round `round` of `rounds`: both sides
  // split a pair's rows the same way, so no per-round counts travel.
  static int64_t RoundFirst(int64_t count, int64_t round, int64_t rounds) { return count * round / rounds; }
  static int64_t RoundShare(int64_t count, int64_t rounds) { return (count + rounds - 1) / rounds; }

  // Rows rank `from` sends to rank `to` this step (from the all-gathered count matrix): to its
  // first hop (with two levels: records for a gateway's whole node, or for a rank of its own node).
  int64_t Sent(int from, int to) const { return count_matrix_[static_cast<size_t>(from) * count_fields_ + to]; }
  // Two levels: rows of rank `from` whose picks include one on rank `to` (the flat count).
  int64_t Delivered(int from, int to) const {
    return count_matrix_[static_cast<size_t>(from) * count_fields_ + comm_.size() + to];
  }
  // Two levels: the bytes of the outputs coming back to `rank` this step.
  int64_t ReturnsBytes(int rank) const {
    return count_matrix_[static_cast<size_t>(rank) * count_fields_ + 2 * comm_.size()];
  }

  // Two levels: the rank of `node` that receives `home`'s node records for it.
  int Gateway(int home, int node) const {
    const std::vector<int>& members = node_members_[node];
    return members[node_index_[home] % members.size()];
  }
  // Where `home` sends its picks on rank `dest`: straight there inside its node, else the gateway.
  int FirstHop(int home, int dest) const {
    const int node = comm_.node_of(dest);
    return !two_level_ || node == comm_.node_of(home) ? dest : Gateway(home, node);
  }
  // Two levels: an upper bound of the records gateway `gw` forwards to rank `dest` of its node in
  // one of `rounds` rounds (each source's node records of a round, at most those with a pick on
  // dest); every rank computes it alike from the count matrix.
  int64_t ForwardedBound(int gw, int dest, int64_t rounds) const {
    const int node = comm_.node_of(gw);
    int64_t records = 0;
    for (int h = 0; h < comm_.size(); ++h) {
      if (comm_.node_of(h) != node && Gateway(h, node) == gw)
        records += std::min(RoundShare(Sent(h, gw), rounds), Delivered(h, dest));
    }
    return records;
  }
  // Two levels: the most outputs a gateway of a node of `ranks` ranks sends home per node record.
  int64_t GatewayReturnsPerRecord(int64_t ranks) const {
    return partial_ ? 1 : std::min<int64_t>(top_k_, slots_ * ranks);
  }

  // The bytes `rank` holds at once with `rounds` rounds (see ForwardHome's memory model); every
  // rank evaluates it for every rank from the count matrix, so all agree on the rounds.
  int64_t BytesHeld(int rank, int64_t rounds) const {
    if (two_level_) return BufferNeeds(rank, rounds).held;
    const int g = comm_.size();
    int64_t bytes = 0;
    for (int r = 0; r < g; ++r) {
      const int64_t out = Sent(rank, r), in = Sent(r, rank);
      bytes += out * (partial_ ? 1 : picks_per_row_) * return_bytes_;  // returns (an upper bound)
      // Received rows decoded and in the kernel's input format, then one input (kernel format,
      // bounded by fp32: the kernel may differ between ranks) and one fp32 output per pick.
      bytes += RoundShare(out, rounds) * record_bytes_ + RoundShare(in, rounds) * (picks_per_row_ + 1) * 2 * hidden_ * 4;
      if (r != rank) bytes += RoundShare(in, rounds) * (record_bytes_ + per_returned_row_);
    }
    return bytes;
  }

  // Two levels: the buffers `rank` needs with `rounds` rounds (bounds computed alike on every rank
  // from the count matrix; `held` is their sum).
  struct Needs {
    std::array<int64_t, kBuffers> bytes{};
    int64_t items = 0;  // picks run in a round
    int64_t held = 0;
  };
  Needs BufferNeeds(int rank, int64_t rounds) const {
    const int g = comm_.size(), node = comm_.node_of(rank);
    const std::vector<int>& members = node_members_[node];
    const int64_t returns = ReturnsBytes(rank);
    int64_t send = 0, recv = 0, back = 0, runs = 0;
    for (int r = 0; r < g; ++r) {
      const int64_t in = RoundShare(Sent(r, rank), rounds);
      const bool remote = comm_.node_of(r) != node;
      send += RoundShare(Sent(rank, r), rounds) * record_bytes_;
      if (r != rank) recv += in * record_bytes_;
      if (remote) {
        back += in * GatewayReturnsPerRecord(members.size()) * return_bytes_;  // gateway outputs home
      } else {
        runs += in;  // direct records
        if (r != rank) back += in * per_returned_row_;
      }
    }
    int64_t forwarded = 0, forwarded_in = 0;
    for (int d : members) forwarded += ForwardedBound(rank, d, rounds);
    for (int gw : members) {
      const int64_t in = ForwardedBound(gw, rank, rounds);
      runs += in;
      if (gw != rank) forwarded_in += in;
    }
    Needs n;
    n.items = runs * picks_per_row_;
    n.bytes = {returns,
               send,
               recv,
               runs * hidden_ * 4,
               runs * activation_bytes_,
               n.items * activation_bytes_,
               n.items * hidden_ * 4,
               back,
               forwarded * record_bytes_,
               forwarded_in * record_bytes_,
               forwarded_in * per_returned_row_,
               forwarded * per_returned_row_};
    // The kernel's input format is bounded by fp32 (the kernel may differ between ranks).
    n.held = returns + send + recv + back + runs * (picks_per_row_ + 1) * 2 * hidden_ * 4 +
             (forwarded + forwarded_in) * (record_bytes_ + per_returned_row_);
    return n;
  }

  // This step's buffer needs for `rounds` rounds; releases what is held beyond them first when
  // holding both would exceed the bound, then reserves. Returns the bytes held.
  int64_t ReserveBuffers(int64_t rounds) {
    if (two_level_) {
      const Needs needs = BufferNeeds(comm_.rank(), rounds);
      items_cap_ = needs.items;
      return Reserve(needs.bytes);
    }
    const int g = comm_.size(), me = comm_.rank();
    int64_t send_cap = 0, recv_cap = 0, items_cap = 0, back_cap = 0, received_cap = 0;
    for (int r = 0; r < g; ++r) {
      const int64_t in = RoundShare(recv_count_[r], rounds);
      send_cap += RoundShare(send_count_[r], rounds) * record_bytes_;
      items_cap += in * picks_per_row_;
      received_cap += in;
      if (r != me) {
        recv_cap += in * record_bytes_;
        back_cap += in * per_returned_row_;
      }
    }
    items_cap_ = items_cap;
    const int64_t needs[kBuffers] = {returns_bytes_,
                                     send_cap,
                                     recv_cap,
                                     received_cap * hidden_ * 4,
                                     received_cap * activation_bytes_,
                                     items_cap * activation_bytes_,
                                     items_cap * hidden_ * 4,
                                     back_cap,
                                     0,
                                     0,
                                     0,
                                     0};
    return Reserve(needs);
  }
  int64_t Reserve(std::span<const int64_t, kBuffers> needs) {
    ScratchBuffer* buffers[kBuffers] = {&returns_,      &send_,         &recv_,         &decoded_,
                                        &quantized_,    &work_in_,      &work_out_,     &back_send_,
                                        &forward_send_, &forward_recv_, &forward_back_, &forward_returns_};
    // Large buffers take whole huge pages (HugePageBytes) when, rounded up to them,
    // every buffer still fits the bound; otherwise exactly what they need.
    int64_t rounded = 0;
    for (int b = 0; b < kBuffers; ++b) rounded += std::max(buffers[b]->capacity(), HugePageBytes(needs[b]));
    const bool huge = rounded <= options_.max_buffer_bytes;
    int64_t held = 0;
    for (int b = 0; b < kBuffers; ++b)
      held += std::max(buffers[b]->capacity(), huge ? HugePageBytes(needs[b]) : needs[b]);
    for (int b = 0; b < kBuffers; ++b) {
      if (held > options_.max_buffer_bytes) buffers[b]->ShrinkTo(needs[b]);
    }
    held = 0;
    for (int b = 0; b < kBuffers; ++b) {
      buffers[b]->Reserve(needs[b], huge);
      held += buffers[b]->capacity();
    }
    return held;
  }

  // Packs round `round` of `rounds`: one record per (row, destination) straight into the send
  // buffer (this rank's own records too; they are read from there, never sent), and where each
  // destination's returns will land. Sets send_n_, send_bytes_, send_offsets_, back_recv_*.
  // header_bytes: room left before each destination's records (low-latency's header).
  void PackRound(int64_t round, int64_t rounds, const Matrix& rows, const Picks& picks, int64_t header_bytes = 0) {
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k;
    const int64_t h = hidden_;
    int64_t send_at = 0;
    std::vector<int32_t>& slot_ids = slot_ids_;
    for (int d = 0; d < g; ++d) {
      const int64_t first = RoundFirst(send_count_[d], round, rounds);
      const int64_t count = RoundFirst(send_count_[d], round + 1, rounds) - first;
      send_n_[d] = count;
      send_at += header_bytes;
      send_offsets_[d] = send_at;
      send_bytes_[d] = d == me ? 0 : count * record_bytes_;
      uint8_t* record = send_.data() + send_at;
      send_at += count * record_bytes_;
      const int64_t* row_list = send_rows_.data() + send_row_begin_[d] + first;
      for (int64_t i = 0; i < count; ++i, record += record_bytes_) {
        const int64_t r = row_list[i];
        for (int j = 0; j < k; ++j) slot_ids[j] = pick_rank_[r * k + j] == d ? pick_slot_[r * k + j] : -1;
        std::memcpy(record, slot_ids.data(), k * 4);
        std::memcpy(record + k * 4, picks.weights.data() + r * k, k * 4);
        EncodeRow(options_.dispatch_format, rows.row(r), h, record + k * 8);
      }
      const int64_t* return_at = send_return_at_.data() + send_row_begin_[d] + d;
      back_recv_offsets_[d] = region_[d] + return_at[first] * return_bytes_;
      back_recv_bytes_[d] = d == me ? 0 : (return_at[first + count] - return_at[first]) * return_bytes_;
    }
  }

  // This step's rows through the exchange of the mode chosen at creation.
  Status ForwardRows(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) {
    return low_latency_ ? ForwardLowLatency(layer, rows, picks, out, stats)
                        : ForwardHome(layer, rows, picks, out, stats);
  }

  // The step's row, record and return sizes (for `layer`'s kernel), and the layout of its rows:
  // where each pick goes (its first hop), each destination's rows, and where their returns will
  // land. Sets send_count_ (count_fields_ values: with two levels also the rows each rank finally
  // receives and the bytes of this rank's returns, all-gathered by ForwardHome).
  void Layout(int layer, const LivePlacement::Snapshot& snapshot, const Picks& picks) {
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k;
    const int64_t n = picks.rows;
    const Placement& p = *snapshot.placement;
    const DispatchTable& dispatch = snapshot.dispatch;
    const int slots = p.slots_per_rank();
    const ExpertStore& store = *stores_[layer];
    const RowFormat dispatch_format = options_.dispatch_format, combine_format = options_.combine_format;
    const bool partial = options_.combine_partial_sums;
    const int64_t h = model_.hidden;
    hidden_ = h;
    partial_ = partial;
    top_k_ = k;
    slots_ = slots;
    record_bytes_ = k * 8 + RowBytes(dispatch_format, h);
    return_bytes_ = RowBytes(combine_format, h);
    picks_per_row_ = std::min(k, slots);
    activation_bytes_ = store.activation_row_bytes();
    per_returned_row_ = (partial ? 1 : picks_per_row_) * return_bytes_;
    const int64_t return_bytes = return_bytes_;
    // Layout, pass 1: the destination (first hop) and slot id of every pick: the local slot on a
    // rank reached directly, the global slot when a gateway forwards it; rows and picks per
    // destination (a row counts once per destination it visits). With two levels also the rows
    // each rank finally receives.
    pick_rank_.resize(n * k);
    pick_slot_.resize(n * k);
    nth_.assign(model_.num_experts, 0);
    count_fields_ = two_level_ ? 2 * g + 1 : g;
    send_count_.assign(count_fields_, 0);
    std::vector<int64_t> picks_to(g, 0), last_row(g, -1), last_delivered(g, -1);
    const int my_node = comm_.node_of(me);
    for (int64_t r = 0; r < n; ++r) {
      for (int j = 0; j < k; ++j) {
        const int32_t e = picks.expert(r, j);
        const int32_t slot = dispatch.SlotFor(layer, e, nth_[e]++);
        const int rank = p.rank_of_slot(slot), dest = FirstHop(me, rank);
        pick_rank_[r * k + j] = dest;
        pick_slot_[r * k + j] = two_level_ && comm_.node_of(rank) != my_node ? slot : slot - rank * slots;
        ++picks_to[dest];
        if (last_row[dest] != r) {
          last_row[dest] = r;
          ++send_count_[dest];
        }
        if (two_level_ && last_delivered[rank] != r) {
          last_delivered[rank] = r;
          ++send_count_[g + rank];
        }
      }
    }
    // Pass 2: each destination's rows in row order, the returns they bring (prefix per row), and
    // where each pick's returned output will lie in the returns buffer.
    send_row_begin_ = PrefixOffsets(std::span<const int64_t>(send_count_.data(), g));
    region_.assign(g + 1, 0);  // returns of destination d: [region_[d], region_[d+1])
    for (int d = 0; d < g; ++d) region_[d + 1] = region_[d] + (partial ? send_count_[d] : picks_to[d]) * return_bytes;
    returns_bytes_ = region_[g];
    if (two_level_) send_count_[2 * g] = returns_bytes_;
    send_rows_.resize(send_row_begin_[g]);
    send_return_at_.resize(send_row_begin_[g] + g);  // per destination: count + 1 prefix values
    pick_return_.resize(n * k);
    std::vector<int64_t> cursor(send_row_begin_.begin(), send_row_begin_.end() - 1), returned(g, 0);
    std::fill(last_row.begin(), last_row.end(), -1);
    for (int64_t r = 0; r < n; ++r) {
      for (int j = 0; j < k; ++j) {
        const int d = pick_rank_[r * k + j];
        const bool first_visit = last_row[d] != r;
        if (first_visit) {
          last_row[d] = r;
          send_return_at_[cursor[d] + d] = returned[d];
          send_rows_[cursor[d]++] = r;
        }
        if (partial && !first_visit) {
          pick_return_[r * k + j] = -1;  // summed on the expert side into the row's first pick to d
          continue;
        }
        pick_return_[r * k + j] = region_[d] + returned[d] * return_bytes;
        ++returned[d];
      }
    }
    for (int d = 0; d < g; ++d) send_return_at_[send_row_begin_[d + 1] + d] = returned[d];
    slot_ids_.resize(k);
    send_n_.assign(g, 0);
    send_bytes_.assign(g, 0);
    send_offsets_.assign(g, 0);
    back_recv_bytes_.assign(g, 0);
    back_recv_offsets_.assign(g, 0);
    if (partial) partial_row_.resize(h);
  }

  // Memory model of one step (what max_buffer_bytes bounds), per rank:
  //   returns: every output coming back for this rank's rows, held for the whole step (one per
  //            pick, or one per row and destination with partial sums), so the home rank sums
  //            straight from where they landed, in pick order;
  //   per round: the records packed (this rank's own records among them: they are read where they
  //            were packed and never pass through MPI); the records received from other ranks;
  //            the expert-ordered input and output rows (at most min(k, slots) picks per record);
  //            the weighted outputs going back to other ranks (this rank's own go straight into
  //            returns); with two levels also the records a gateway forwards and receives from
  //            its node's gateways, the forwarded records' outputs going back to their gateways
  //            and landing there, and the gateway's outputs going home (bounded per round from
  //            the count matrix; the returns are all-gathered with it, so every rank knows every
  //            rank's need exactly).
  // Buffers are kept across steps and reused; when a step needs a different mix whose total would
  // exceed the bound, the oversized ones are released first, so what is held never exceeds it.
  // Buffers of 1 MiB or more are rounded up to whole 2 MiB pages when the rounded total fits.
  // The count matrix is all-gathered while the first round is packed (when this rank's own part
  // of a one-round step fits the bound), so the count exchange costs no extra wait.
  Status ForwardHome(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) {
    const int g = comm_.size(), me = comm_.rank();
    const int64_t n = rows.rows;
    // The placement and dispatch table of this step (a rebalance installs only between steps).
    const LivePlacement::SnapshotPtr snapshot = live_->current();
    StepStats st;
    st.rows = n;
    Stopwatch watch;
    EPMOE_RETURN_IF_ERROR(FinishPreviousSends(watch, st));
    Layout(layer, *snapshot, picks);
    if (two_level_) {  // the ranks this rank's rows reach, not the gateways they pass
      for (int rank = 0; rank < g; ++rank) st.row_copies += send_count_[g + rank];
    }

    // Counts: every rank's row counts to every rank, all-gathered (count_fields_ values per rank)
    // so that every rank computes every rank's need and all agree on the rounds without a second
    // exchange. While they travel, the records of a one-round step are packed when this rank's own
    // share fits.
    count_matrix_.assign(static_cast<size_t>(g) * count_fields_, 0);
    std::vector<int64_t> gather_bytes(g, count_fields_ * 8), gather_offsets(g);
    for (int r = 0; r < g; ++r) gather_offsets[r] = r * count_fields_ * 8;
    EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<Request> counting,
                           comm_.StartAllgatherv(send_count_.data(), count_fields_ * 8, count_matrix_.data(),
                                                 gather_bytes, gather_offsets));
    int64_t own_send = 0;
    for (int d = 0; d < g; ++d) own_send += send_count_[d] * record_bytes_;
    bool packed = false;
    int64_t packed_generation = 0;  // send_'s memory the records were packed into
    if (returns_bytes_ + own_send <= options_.max_buffer_bytes) {
      std::array<int64_t, kBuffers> needs{};
      needs[0] = returns_bytes_;
      needs[1] = own_send;
      Reserve(needs);
      PackRound(0, 1, rows, picks);
      packed = true;
      packed_generation = send_.generation();
    }
    st.pack_us += watch.Lap();
    EPMOE_RETURN_IF_ERROR(counting->Wait());
    st.dispatch_us += watch.Lap();

    recv_count_.assign(g, 0);
    for (int r = 0; r < g; ++r) recv_count_[r] = Sent(r, me);
    int64_t rounds = 1;
    for (int rank = 0; rank < g; ++rank) {
      int64_t max_count = 1;
      for (int r = 0; r < g; ++r) max_count = std::max({max_count, Sent(rank, r), Sent(r, rank)});
      if (BytesHeld(rank, max_count) > options_.max_buffer_bytes) {
        if (rank == me)
          return OutOfRange(fmt::format("a2a: rank {} needs {} bytes even with one row per peer and round ({} rounds), "
                                        "over the buffer bound of {} bytes", me, BytesHeld(me, max_count), max_count,
                                        options_.max_buffer_bytes));
        return OutOfRange(fmt::format("a2a: rank {} cannot fit one row per peer and round in the buffer bound of {} "
                                      "bytes", rank, options_.max_buffer_bytes));
      }
      int64_t lo = 1, hi = max_count;  // BytesHeld does not grow with more rounds
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (BytesHeld(rank, mid) <= options_.max_buffer_bytes) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      rounds = std::max(rounds, lo);
    }
    st.rounds = static_cast<int>(rounds);
    if (rounds > 1) packed = false;  // packed for one round: pack again, round by round
    st.peak_buffer_bytes = ReserveBuffers(rounds);
    // Reserving the whole step's buffers may have released and replaced send_ (to stay within the
    // bound): then the records are packed again.
    if (send_.generation() != packed_generation) packed = false;
    st.pack_us += watch.Lap();

    const ExpertStore& store = *stores_[layer];
    std::vector<int64_t> recv_bytes(g), recv_offsets(g), recv_n(g);
    std::vector<Batch> batches(g);
    for (int64_t round = 0; round < rounds; ++round) {
      if (round > 0) {  // the previous round's records are still being sent from send_
        EPMOE_RETURN_IF_ERROR(FinishSends(dispatch_sends_));
        st.dispatch_us += watch.Lap();
      }
      if (!packed) PackRound(round, rounds, rows, picks);
      packed = false;
      int64_t recv_at = 0;
      for (int s = 0; s < g; ++s) {
        recv_n[s] = RoundFirst(recv_count_[s], round + 1, rounds) - RoundFirst(recv_count_[s], round, rounds);
        recv_offsets[s] = recv_at;
        recv_bytes[s] = s == me ? 0 : recv_n[s] * record_bytes_;
        recv_at += recv_bytes[s];
      }
      if (!two_level_) {
        for (int d = 0; d < g; ++d) st.row_copies += send_n_[d];
      }
      st.pack_us += watch.Lap();
      // Only the records sent here are needed to go on; this rank's own go on their way meanwhile
      // (its peers take them whenever they poll) and are finished before send_ is written again.
      EPMOE_ASSIGN_OR_RETURN(dispatch_sends_, comm_.StartAlltoallv(send_.data(), send_bytes_, send_offsets_,
                                                                   recv_.data(), recv_bytes, recv_offsets));
      if (round == 0) ComputeSharedWhileInFlight(layer, rows, watch, st);
      AddExchangeBytes(comm_, send_bytes_, recv_bytes, &st);
      if (two_level_) {
        EPMOE_RETURN_IF_ERROR(dispatch_sends_->WaitReceived());
        st.dispatch_us += watch.Lap();
        EPMOE_RETURN_IF_ERROR(TwoLevelRound(store, recv_n, recv_offsets, &st, watch));
        continue;
      }
      // Every source's records (this rank's own read where they were packed).
      for (int s = 0; s < g; ++s)
        batches[s] = {s == me ? send_.data() + send_offsets_[me] : recv_.data() + recv_offsets[s], recv_n[s], s};
      EPMOE_RETURN_IF_ERROR(RunAsTheyLand(store, batches, nullptr, &st, watch));
      EPMOE_RETURN_IF_ERROR(SendOutputsHome(back_bytes_, back_at_, &st, watch));
    }
    return FinishStep(layer, rows, out, watch, st, stats);
  }

  // Low-latency mode (see the top of this file): one message to every peer into the buffers sized
  // at creation, no counts first; the combine as in normal mode.
  Status ForwardLowLatency(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) {
    const int g = comm_.size(), me = comm_.rank();
    const int64_t n = rows.rows, bound = options_.max_rows_per_rank;
    const LivePlacement::SnapshotPtr snapshot = live_->current();
    StepStats st;
    st.rows = n;
    st.rounds = 1;
    st.peak_buffer_bytes = fixed_buffer_bytes_;
    Stopwatch watch;
    EPMOE_RETURN_IF_ERROR(FinishPreviousSends(watch, st));
    // Each destination's message: the header, then (within the bound) its records.
    std::vector<int64_t> message_bytes(g, kHeaderBytes), message_offsets(g);
    if (n <= bound) {
      Layout(layer, *snapshot, picks);
      PackRound(0, 1, rows, picks, kHeaderBytes);
      for (int d = 0; d < g; ++d) {
        message_offsets[d] = send_offsets_[d] - kHeaderBytes;
        message_bytes[d] += send_bytes_[d];
        st.row_copies += send_n_[d];
      }
    } else {
      for (int d = 0; d < g; ++d) message_offsets[d] = d * kHeaderBytes;
    }
    message_bytes[me] = 0;  // this rank's own records are read where they were packed
    for (int d = 0; d < g; ++d) std::memcpy(send_.data() + message_offsets[d], &n, kHeaderBytes);
    st.pack_us += watch.Lap();
    received_bytes_.assign(g, 0);
    EPMOE_ASSIGN_OR_RETURN(dispatch_sends_,
                           dispatch_exchange_->Start(send_.data(), message_bytes, message_offsets, received_bytes_));
    ComputeSharedWhileInFlight(layer, rows, watch, st);

    // Each rank's records once its message has landed, its row count from the header: a rank over
    // the bound (it sent its header only) fails the step on every rank, once every header is in.
    std::vector<std::pair<int, int64_t>> over;  // (rank, rows)
    if (n > bound) over.emplace_back(me, n);
    std::vector<Batch> batches(g);
    if (n <= bound) batches[me] = {send_.data() + send_offsets_[me], send_n_[me], me};
    const auto landed = [&](int s) -> Status {
      if (received_bytes_[s] < kHeaderBytes)
        return Internal(fmt::format("a2a low-latency: rank {} received {} bytes from rank {}, less than its header", me,
                                    received_bytes_[s], s));
      int64_t home_rows = 0;
      std::memcpy(&home_rows, recv_.data() + s * message_bytes_, kHeaderBytes);
      if (home_rows > bound) over.emplace_back(s, home_rows);
      if (n > bound) return Status::Ok();  // nothing of this step runs here (nor was laid out)
      const int64_t record_bytes = received_bytes_[s] - kHeaderBytes;
      if (record_bytes % record_bytes_ != 0)
        return Internal(
            fmt::format("a2a low-latency: rank {} received {} bytes of records from rank {}, not whole "
                        "records of {} bytes",
                        me, record_bytes, s, record_bytes_));
      batches[s] = {recv_.data() + s * message_bytes_ + kHeaderBytes, record_bytes / record_bytes_, s};
      return Status::Ok();
    };
    if (n > bound) {  // this step fails: this rank only learns which other ranks are over too
      EPMOE_RETURN_IF_ERROR(dispatch_sends_->WaitReceived());
      for (int s = 0; s < g; ++s) {
        if (s != me) EPMOE_RETURN_IF_ERROR(landed(s));
      }
    } else {
      EPMOE_RETURN_IF_ERROR(RunAsTheyLand(*stores_[layer], batches, landed, &st, watch));
    }
    if (!over.empty()) {
      std::sort(over.begin(), over.end());
      std::vector<std::string> named;
      for (const auto& [rank, home_rows] : over) named.push_back(fmt::format("rank {} has {}", rank, home_rows));
      return OutOfRange(
          fmt::format("a2a low-latency: {} rows this step, over the {} rows per rank its buffers were "
                      "sized for (max_rows_per_rank; epmoe run: --tokens); use normal mode for larger "
                      "steps",
                      fmt::join(named, ", "), bound));
    }
    AddExchangeBytes(comm_, message_bytes, received_bytes_, &st);
    EPMOE_RETURN_IF_ERROR(SendOutputsHome(back_bytes_, back_at_, &st, watch));
    return FinishStep(layer, rows, out, watch, st, stats);
  }

  // The expert side of a flat round: runs every source's records (batch s: rank s's; this rank's
  // own are at hand) and encodes each source's weighted outputs, this rank's own straight into
  // returns_, the others' into back_send_ (back_bytes_[s] at back_at_[s], for SendOutputsHome).
  // landed(s), when given, is called once rank s's block of the dispatch in flight has landed and
  // fills batches[s]. With single-batch overlap the records run as they land, in groups (this
  // rank's own first, then whatever has landed by each wait), while the rest is in flight;
  // without it, once all have landed, in one group. Each row's outputs are the same either way:
  // the kernels compute a row alike whatever rows share its expert's call.
  Status RunAsTheyLand(const ExpertStore& store, std::span<Batch> batches, const std::function<Status(int)>& landed,
                       StepStats* st, Stopwatch& watch) {
    const int g = comm_.size(), me = comm_.rank();
    back_bytes_.assign(g, 0);
    back_at_.assign(g, 0);
    std::vector<char> done(g, 0);  // landed and taken into a group: this rank's own at once
    std::vector<int> group;        // landed, not run yet
    int64_t group_picks = 0;
    const auto take = [&](int s) -> Status {
      if (s != me && landed) EPMOE_RETURN_IF_ERROR(landed(s));
      done[s] = 1;
      group.push_back(s);
      if (options_.single_batch_overlap) group_picks += PicksHere(batches[s]);  // only overlap runs groups early
      return Status::Ok();
    };
    if (options_.single_batch_overlap) {
      EPMOE_RETURN_IF_ERROR(take(me));
      for (int s = 0; s < g; ++s) {  // blocks known to be empty travel as no message
        if (!landed && batches[s].count == 0 && !done[s]) EPMOE_RETURN_IF_ERROR(take(s));
      }
    } else {
      EPMOE_RETURN_IF_ERROR(dispatch_sends_->WaitReceived());
      st->dispatch_us += watch.Lap();
      for (int s = 0; s < g; ++s) EPMOE_RETURN_IF_ERROR(take(s));
    }
    bool combine_sends_done = false;
    int64_t at = 0;
    std::vector<Batch> run;
    for (;;) {
      const bool all_landed = std::find(done.begin(), done.end(), 0) == done.end();
      // Records run before the rest land only when they give the experts enough rows to be worth
      // reading their weights once more (a decode step's few rows wait for the rest).
      if (all_landed || group_picks >= kEarlyPicksPerSlot * slots_) {
        run.clear();
        for (int s : group) run.push_back(batches[s]);
        group.clear();
        group_picks = 0;
        st->pack_us += watch.Lap();
        EPMOE_RETURN_IF_ERROR(RunBatches(store, run, st, watch));
        if (!combine_sends_done) {  // the previous round's outputs may still be leaving back_send_
          EPMOE_RETURN_IF_ERROR(FinishCombineSends(st, watch));
          combine_sends_done = true;
        }
        for (size_t b = 0; b < run.size(); ++b) {
          const int s = run[b].source;
          back_at_[s] = at;
          back_bytes_[s] = s == me ? 0 : BatchOutputs(run, b) * return_bytes_;
          EncodeOutputs(run, b, s == me ? returns_.data() + back_recv_offsets_[me] : back_send_.data() + at);
          at += back_bytes_[s];
        }
        st->pack_us += watch.Lap();
      }
      if (all_landed) return Status::Ok();
      EPMOE_ASSIGN_OR_RETURN(const std::vector<int> arrived, dispatch_sends_->WaitSomeReceived());
      st->dispatch_us += watch.Lap();
      for (int s = 0; s < g; ++s) {  // none listed: every block has landed
        if (!done[s] && (arrived.empty() || std::find(arrived.begin(), arrived.end(), s) != arrived.end()))
          EPMOE_RETURN_IF_ERROR(take(s));
      }
    }
  }

  // Picks of a batch's records for this rank's slots.
  int64_t PicksHere(const Batch& batch) {
    int64_t picks = 0;
    for (int64_t i = 0; i < batch.count; ++i) {
      std::memcpy(slot_ids_.data(), batch.records + i * record_bytes_, top_k_ * 4);
      for (int j = 0; j < top_k_; ++j) picks += slot_ids_[j] >= 0;
    }
    return picks;
  }

  // Expert side of a round: groups the picks of the batches' records by local slot (counting
  // sort), decodes each record's row once into the kernel's input format (QuantizeRows) and copies
  // it to its picks' places in the expert-ordered input, then runs the slots (RunQuantized gives
  // what Run would on the decoded rows, bit for bit). Records are numbered q in batch order
  // (batch_first_); position_[q * k + j] is pick j's row in the expert-ordered output (-1: not here).
  Status RunBatches(const ExpertStore& store, std::span<const Batch> batches, StepStats* st, Stopwatch& watch) {
    const int k = top_k_, slots = slots_, me = comm_.rank();
    const int64_t h = hidden_;
    const size_t count = batches.size();
    batch_first_.assign(count + 1, 0);
    for (size_t b = 0; b < count; ++b) batch_first_[b + 1] = batch_first_[b] + batches[b].count;
    const int64_t received = batch_first_[count];
    slot_offsets_.assign(slots + 1, 0);
    for (const Batch& batch : batches) {
      for (int64_t i = 0; i < batch.count; ++i) {
        std::memcpy(slot_ids_.data(), batch.records + i * record_bytes_, k * 4);
        for (int j = 0; j < k; ++j) {
          const int32_t slot = slot_ids_[j];
          if (slot < -1 || slot >= slots)
            return Internal(fmt::format("a2a: rank {} received a pick for slot {} from rank {} (it holds {})", me, slot,
                                        batch.source, slots));
          if (slot >= 0) ++slot_offsets_[slot + 1];
        }
      }
    }
    for (int s = 0; s < slots; ++s) slot_offsets_[s + 1] += slot_offsets_[s];
    const int64_t items = slot_offsets_[slots];
    EPMOE_CHECK(items <= items_cap_);
    std::vector<int64_t> slot_cursor(slot_offsets_.begin(), slot_offsets_.end() - 1);
    position_.resize(received * k);
    float* const decoded = decoded_.floats();
    for (size_t b = 0; b < count; ++b) {
      for (int64_t i = 0; i < batches[b].count; ++i) {
        DecodeRow(options_.dispatch_format, batches[b].records + i * record_bytes_ + k * 8, h,
                  decoded + (batch_first_[b] + i) * h);
      }
    }
    const int64_t act = activation_bytes_;
    std::byte* const quantized = reinterpret_cast<std::byte*>(quantized_.data());
    std::byte* const work_in = reinterpret_cast<std::byte*>(work_in_.data());
    st->pack_us += watch.Lap();
    if (received > 0) store.QuantizeRows(decoded, received, quantized, pool_);
    st->experts_us += watch.Lap();  // the kernel's own first phase (Run would do it inside)
    for (size_t b = 0; b < count; ++b) {
      for (int64_t i = 0; i < batches[b].count; ++i) {
        const int64_t q = batch_first_[b] + i;
        std::memcpy(slot_ids_.data(), batches[b].records + i * record_bytes_, k * 4);
        for (int j = 0; j < k; ++j) {
          const int32_t slot = slot_ids_[j];
          position_[q * k + j] = slot < 0 ? -1 : slot_cursor[slot]++;
          if (slot >= 0) std::memcpy(work_in + position_[q * k + j] * act, quantized + q * act, act);
        }
      }
    }
    st->pack_us += watch.Lap();
    if (items > 0) store.RunQuantized(work_in, slot_offsets_, work_out_.floats(), pool_);
    for (int s = 0; s < slots; ++s) {
      if (slot_offsets_[s + 1] > slot_offsets_[s]) st->expert_bytes_read += store.expert_bytes(s);
    }
    st->picks += items;
    st->experts_us += watch.Lap();
    return Status::Ok();
  }

  // Outputs batch b sends back after RunBatches: one per pick run here, or (partial sums) one per
  // record.
  int64_t BatchOutputs(std::span<const Batch> batches, size_t b) const {
    if (partial_) return batches[b].count;
    int64_t outputs = 0;
    for (int64_t q = batch_first_[b] * top_k_; q < batch_first_[b + 1] * top_k_; ++q) outputs += position_[q] >= 0;
    return outputs;
  }

  // Encodes batch b's weighted outputs at `to`, in record order: one per pick in pick order, or
  // (partial sums) one per record with its picks here summed in pick order.
  void EncodeOutputs(std::span<const Batch> batches, size_t b, uint8_t* to) {
    const int k = top_k_;
    const int64_t h = hidden_, return_bytes = return_bytes_;
    const RowFormat combine_format = options_.combine_format;
    const float* const work_out = work_out_.floats();
    for (int64_t i = 0; i < batches[b].count; ++i) {
      const int64_t q = batch_first_[b] + i;
      const uint8_t* weights = batches[b].records + i * record_bytes_ + k * 4;
      if (partial_) {
        std::fill(partial_row_.begin(), partial_row_.end(), 0.0f);
        for (int j = 0; j < k; ++j) {
          const int64_t pos = position_[q * k + j];
          if (pos < 0) continue;
          float w;
          std::memcpy(&w, weights + j * 4, 4);
          const float* src = work_out + pos * h;
          for (int64_t c = 0; c < h; ++c) partial_row_[c] += w * src[c];
        }
        EncodeRow(combine_format, partial_row_.data(), h, to);
        to += return_bytes;
        continue;
      }
      for (int j = 0; j < k; ++j) {
        const int64_t pos = position_[q * k + j];
        if (pos < 0) continue;
        float w;
        std::memcpy(&w, weights + j * 4, 4);
        EncodeScaledRow(combine_format, w, work_out + pos * h, h, to);
        to += return_bytes;
      }
    }
  }

  // Two levels, one round once the node and direct records have landed (recv_n[s] records from rank
  // s at recv_offsets[s] of recv_): forwards the node records that came from other nodes, runs the
  // direct and forwarded records, returns the forwarded records' outputs to their gateways, then
  // sends the direct outputs and the gateway's outputs home.
  Status TwoLevelRound(const ExpertStore& store, std::span<const int64_t> recv_n, std::span<const int64_t> recv_offsets,
                       StepStats* st, Stopwatch& watch) {
    const int g = comm_.size(), me = comm_.rank(), node = comm_.node_of(me);
    const std::vector<int>& members = node_members_[node];
    const size_t m = members.size();
    std::vector<Batch> node_records;
    for (int s = 0; s < g; ++s) {
      if (comm_.node_of(s) != node) node_records.push_back({recv_.data() + recv_offsets[s], recv_n[s], s});
    }
    EPMOE_RETURN_IF_ERROR(PackForwarded(node_records));
    st->pack_us += watch.Lap();
    // What a gateway forwards depends on the picks it received: its counts travel first.
    std::vector<int64_t> forward_in(g, 0), send_bytes(g, 0), recv_bytes(g, 0), recv_at(g, 0);
    EPMOE_RETURN_IF_ERROR(comm_.ExchangeCounts(forward_n_, forward_in));
    int64_t at = 0;
    for (int s = 0; s < g; ++s) {
      if (s == me) continue;
      send_bytes[s] = forward_n_[s] * record_bytes_;
      recv_at[s] = at;
      recv_bytes[s] = forward_in[s] * record_bytes_;
      at += recv_bytes[s];
    }
    EPMOE_CHECK(at <= forward_recv_.capacity());
    EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<Request> forwarding,
                           comm_.StartAlltoallv(forward_send_.data(), send_bytes, forward_offsets_,
                                                forward_recv_.data(), recv_bytes, recv_at));
    AddExchangeBytes(comm_, send_bytes, recv_bytes, st);

    // Expert side: the direct records of each rank of this node, then the records each gateway of
    // this node forwarded (this rank's own read where they were packed). With single-batch overlap
    // the direct records run while the forwarded ones travel, when they hold enough picks to be
    // worth reading the experts' weights twice (as RunAsTheyLand's groups).
    std::vector<Batch> batches(2 * m);
    int64_t direct_picks = 0;
    for (size_t i = 0; i < m; ++i) {
      const int s = members[i];
      batches[i] = {s == me ? send_.data() + send_offsets_[me] : recv_.data() + recv_offsets[s], recv_n[s], s};
      batches[m + i] = {s == me ? forward_send_.data() + forward_offsets_[me] : forward_recv_.data() + recv_at[s],
                        forward_in[s], s};
      if (options_.single_batch_overlap) direct_picks += PicksHere(batches[i]);
    }
    // Home: direct outputs to the ranks of this node (batch first + i of `run`, the last records
    // run), gateway outputs to the ranks whose node records came here (one per pick of this node,
    // unchanged, or one summed row per record, packed by PackGatewayOutputs).
    std::vector<int64_t> home_bytes(g, 0), home_at(g, 0);
    const auto encode_direct = [&](std::span<const Batch> run, size_t first) -> Status {
      int64_t home = 0;
      for (int s = 0; s < g; ++s) {
        home_at[s] = home;
        home_bytes[s] = 0;
        if (comm_.node_of(s) != node) {
          home_bytes[s] = gateway_outputs_[s] * return_bytes_;
        } else if (s != me) {
          home_bytes[s] = BatchOutputs(run, first + node_index_[s]) * return_bytes_;
        }
        home += home_bytes[s];
      }
      EPMOE_CHECK(home <= back_send_.capacity());
      EPMOE_RETURN_IF_ERROR(FinishCombineSends(st, watch));
      for (size_t i = 0; i < m; ++i) {
        const int s = members[i];
        EncodeOutputs(run, first + i,
                      s == me ? returns_.data() + back_recv_offsets_[me] : back_send_.data() + home_at[s]);
      }
      st->pack_us += watch.Lap();
      return Status::Ok();
    };
    const std::span<const Batch> all(batches);
    const bool early = options_.single_batch_overlap && direct_picks >= kEarlyPicksPerSlot * slots_;
    if (early) {
      EPMOE_RETURN_IF_ERROR(RunBatches(store, all.first(m), st, watch));
      EPMOE_RETURN_IF_ERROR(encode_direct(all.first(m), 0));
    }
    EPMOE_RETURN_IF_ERROR(forwarding->Wait());
    st->dispatch_us += watch.Lap();
    // The forwarded records are batch forwarded_first + i of `forwarded_run`.
    const std::span<const Batch> forwarded_run = early ? all.subspan(m) : all;
    const size_t forwarded_first = early ? 0 : m;
    EPMOE_RETURN_IF_ERROR(RunBatches(store, forwarded_run, st, watch));

    // Forwarded records' outputs back to their gateways (this rank's own straight where they land).
    std::vector<int64_t> back_bytes(g, 0), back_at(g, 0), returned_bytes(g, 0);
    at = 0;
    for (size_t i = 0; i < m; ++i) {
      const int gw = members[i];
      back_at[gw] = at;
      if (gw != me) back_bytes[gw] = BatchOutputs(forwarded_run, forwarded_first + i) * return_bytes_;
      if (gw != me) returned_bytes[gw] = forward_outputs_[gw] * return_bytes_;
      at += back_bytes[gw];
    }
    EPMOE_CHECK(BatchOutputs(forwarded_run, forwarded_first + node_index_[me]) == forward_outputs_[me]);
    for (size_t i = 0; i < m; ++i) {
      const int gw = members[i];
      EncodeOutputs(
          forwarded_run, forwarded_first + i,
          gw == me ? forward_returns_.data() + forward_return_region_[me] : forward_back_.data() + back_at[gw]);
    }
    st->pack_us += watch.Lap();
    EPMOE_RETURN_IF_ERROR(comm_.Alltoallv(forward_back_.data(), back_bytes, back_at, forward_returns_.data(),
                                          returned_bytes, forward_return_region_));
    st->combine_us += watch.Lap();
    AddExchangeBytes(comm_, back_bytes, returned_bytes, st);

    if (!early) {
      EPMOE_RETURN_IF_ERROR(encode_direct(all, 0));
    }
    PackGatewayOutputs(node_records, home_at);
    st->pack_us += watch.Lap();
    return SendOutputsHome(home_bytes, home_at, st, watch);
  }

  // The round's last exchange: the outputs encoded in back_send_ (back_bytes[s] at back_at[s] for
  // rank s) go home into returns_, where this round's returns land (back_recv_*). Waits only for
  // what lands here; the sends finish before back_send_ is written again (FinishCombineSends).
  Status SendOutputsHome(std::span<const int64_t> back_bytes, std::span<const int64_t> back_at, StepStats* st,
                         Stopwatch& watch) {
    EPMOE_ASSIGN_OR_RETURN(combine_sends_, comm_.StartAlltoallv(back_send_.data(), back_bytes, back_at, returns_.data(),
                                                                back_recv_bytes_, back_recv_offsets_));
    // Low-latency: the received records are read until their outputs are encoded (just done), so
    // the next step's receives are posted now, before this rank waits for its outputs.
    if (low_latency_) EPMOE_RETURN_IF_ERROR(dispatch_exchange_->Rearm());
    EPMOE_RETURN_IF_ERROR(combine_sends_->WaitReceived());
    st->combine_us += watch.Lap();
    AddExchangeBytes(comm_, back_bytes, back_recv_bytes_, st);
    return Status::Ok();
  }

  // Gateway: checks the node records (every pick on a rank of this node), writes the per-rank
  // record forwarded to each rank holding one of a record's picks (itself included) into
  // forward_send_, grouped by destination in record order, and notes where each pick's output
  // will land in forward_returns_ (gateway_return_at_; with partial sums, the rank's one row at
  // its first pick). Sets forward_n_, forward_offsets_, forward_outputs_, forward_return_region_
  // and gateway_outputs_ (per rank).
  Status PackForwarded(std::span<const Batch> node_records) {
    const int g = comm_.size(), me = comm_.rank(), k = top_k_, slots = slots_, node = comm_.node_of(me);
    forward_n_.assign(g, 0);
    forward_outputs_.assign(g, 0);
    gateway_outputs_.assign(g, 0);
    int64_t total = 0;
    for (const Batch& batch : node_records) total += batch.count;
    gateway_return_at_.assign(total * k, -1);
    std::vector<int64_t> last(g, -1);
    int64_t q = 0;
    for (const Batch& batch : node_records) {
      for (int64_t i = 0; i < batch.count; ++i, ++q) {
        std::memcpy(slot_ids_.data(), batch.records + i * record_bytes_, k * 4);
        for (int j = 0; j < k; ++j) {
          const int32_t slot = slot_ids_[j];
          if (slot == -1) continue;
          if (slot < -1 || slot >= static_cast<int64_t>(g) * slots || comm_.node_of(slot / slots) != node)
            return Internal(
                fmt::format("a2a: rank {} (a gateway of node {}) received a pick for slot {} from rank {}, "
                            "not a slot of its node",
                            me, node, slot, batch.source));
          const int d = slot / slots;
          const bool first = last[d] != q;
          last[d] = q;
          forward_n_[d] += first;
          forward_outputs_[d] += partial_ ? first : 1;
          gateway_outputs_[batch.source] += partial_ ? 0 : 1;
        }
        gateway_outputs_[batch.source] += partial_ ? 1 : 0;
      }
    }
    forward_offsets_.assign(g, 0);
    forward_return_region_.assign(g, 0);
    int64_t records = 0, outputs = 0;
    for (int d = 0; d < g; ++d) {
      forward_offsets_[d] = records * record_bytes_;
      forward_return_region_[d] = outputs * return_bytes_;
      records += forward_n_[d];
      outputs += forward_outputs_[d];
    }
    EPMOE_CHECK(records * record_bytes_ <= forward_send_.capacity());
    EPMOE_CHECK(outputs * return_bytes_ <= forward_returns_.capacity());
    std::vector<int64_t> record_at(forward_offsets_), return_at(forward_return_region_);
    std::fill(last.begin(), last.end(), -1);
    std::vector<int32_t> local(k);
    q = 0;
    for (const Batch& batch : node_records) {
      for (int64_t i = 0; i < batch.count; ++i, ++q) {
        const uint8_t* record = batch.records + i * record_bytes_;
        std::memcpy(slot_ids_.data(), record, k * 4);
        for (int j = 0; j < k; ++j) {
          const int32_t slot = slot_ids_[j];
          if (slot < 0) continue;
          const int d = slot / slots;
          if (last[d] != q) {
            last[d] = q;
            for (int jj = 0; jj < k; ++jj)
              local[jj] = slot_ids_[jj] >= 0 && slot_ids_[jj] / slots == d ? slot_ids_[jj] - d * slots : -1;
            uint8_t* forwarded = forward_send_.data() + record_at[d];
            std::memcpy(forwarded, local.data(), k * 4);
            std::memcpy(forwarded + k * 4, record + k * 4, record_bytes_ - k * 4);  // weights and row, unchanged
            record_at[d] += record_bytes_;
          } else if (partial_) {
            continue;  // summed by rank d into the output of the record's first pick on it
          }
          gateway_return_at_[q * k + j] = return_at[d];
          return_at[d] += return_bytes_;
        }
      }
    }
    return Status::Ok();
  }

  // Gateway: the outputs of each node record, in record order, at back_send_ + at[source]: its
  // picks' outputs as they came back (one per pick in pick order), or with partial sums the sum of
  // the node's rows for it, in pick order of each rank's first pick.
  void PackGatewayOutputs(std::span<const Batch> node_records, std::span<const int64_t> at) {
    const int k = top_k_;
    const int64_t h = hidden_, return_bytes = return_bytes_;
    const uint8_t* const returned = forward_returns_.data();
    int64_t q = 0;
    for (const Batch& batch : node_records) {
      uint8_t* to = back_send_.data() + at[batch.source];
      for (int64_t i = 0; i < batch.count; ++i, ++q) {
        if (partial_) std::fill(partial_row_.begin(), partial_row_.end(), 0.0f);
        for (int j = 0; j < k; ++j) {
          const int64_t from = gateway_return_at_[q * k + j];
          if (from < 0) continue;
          if (partial_) {
            AddDecodedRow(options_.combine_format, returned + from, h, partial_row_.data());
          } else {
            std::memcpy(to, returned + from, return_bytes);
            to += return_bytes;
          }
        }
        if (partial_) {
          EncodeRow(options_.combine_format, partial_row_.data(), h, to);
          to += return_bytes;
        }
      }
    }
  }

  // The previous round's outputs may still be on their way from back_send_, about to be written.
  Status FinishCombineSends(StepStats* st, Stopwatch& watch) {
    if (combine_sends_ == nullptr) return Status::Ok();
    st->pack_us += watch.Lap();
    EPMOE_RETURN_IF_ERROR(FinishSends(combine_sends_));
    st->combine_us += watch.Lap();
    return Status::Ok();
  }

  // Sums each row's returned outputs, adds the shared experts and reports the step.
  Status FinishStep(int layer, const Matrix& rows, Matrix* out, Stopwatch& watch, StepStats& st, StepStats* stats) {
    const int k = model_.top_k;
    const int64_t h = hidden_, n = rows.rows;
    const RowFormat combine_format = options_.combine_format;
    const uint8_t* const returns = returns_.data();
    // Sum each row's outputs in pick order j = 0..k-1, exactly as CombinePermutedRows, straight
    // from where they landed.
    *out = Matrix(n, h);
    for (int64_t r = 0; r < n; ++r) {
      float* y = out->row(r);
      for (int j = 0; j < k; ++j) {
        const int64_t at = pick_return_[r * k + j];
        if (at >= 0) AddDecodedRow(combine_format, returns + at, h, y);
      }
    }
    st.unpack_us += watch.Lap();
    if (!options_.single_batch_overlap)
      ComputeSharedExperts(shared_[layer].get(), shared_gates_[layer], rows, &shared_outputs_, pool_);
    AddSharedOutputs(shared_outputs_, out, pool_);
    st.expert_bytes_read += shared_outputs_.bytes_read;
    st.shared_us += watch.Lap();
    if (stats != nullptr) *stats = st;
    return Status::Ok();
  }

  // Single-batch overlap: the shared expert runs on this rank's rows while the dispatch is in flight
  // (its outputs are added after the routed ones, as without overlap).
  void ComputeSharedWhileInFlight(int layer, const Matrix& rows, Stopwatch& watch, StepStats& st) {
    if (!options_.single_batch_overlap) return;
    st.dispatch_us += watch.Lap();
    ComputeSharedExperts(shared_[layer].get(), shared_gates_[layer], rows, &shared_outputs_, pool_);
    st.shared_us += watch.Lap();
  }

  // The previous step's records and outputs may still be on their way to their peers; their
  // buffers are about to be reused.
  Status FinishPreviousSends(Stopwatch& watch, StepStats& st) {
    EPMOE_RETURN_IF_ERROR(FinishSends(dispatch_sends_));
    st.dispatch_us += watch.Lap();
    EPMOE_RETURN_IF_ERROR(FinishSends(combine_sends_));
    st.combine_us += watch.Lap();
    return Status::Ok();
  }

  // Completes an exchange whose receiving side is done (its sends from a buffer about to be reused).
  static Status FinishSends(std::unique_ptr<Request>& exchange) {
    if (exchange == nullptr) return Status::Ok();
    Status status = exchange->Wait();
    exchange.reset();
    return status;
  }

  Communicator& comm_;
  ModelConfig model_;
  ExecutorOptions options_;
  ThreadPool& pool_;
  std::shared_ptr<LivePlacement> live_;                // the placement and this rank's dispatch table
  std::shared_ptr<RankWeights> weights_;               // shared with this executor's lanes
  std::vector<std::unique_ptr<ExpertStore>>& stores_;  // weights_->stores
  std::vector<std::unique_ptr<ExpertStore>>& shared_;  // weights_->shared
  std::vector<std::vector<float>>& shared_gates_;      // weights_->shared_gates
  std::unique_ptr<SlotStoresTarget> target_;           // live rebalancing of stores_ (null in a lane)

  // The exchange resolved at creation (InitExchange, in every lane).
  bool low_latency_ = false;                    // a2a_mode (ResolveA2aMode)
  bool two_level_ = false;                      // a2a_levels (ResolveA2aLevels; never with low-latency)
  std::vector<std::vector<int>> node_members_;  // per node: its ranks, ascending
  std::vector<int> node_index_;                 // per rank: its index in its node's members
  int64_t message_bytes_ = 0;                   // low-latency: the capacity of one peer's message
  int64_t fixed_buffer_bytes_ = 0;              // low-latency: the buffers held from creation on
  std::vector<int64_t> received_bytes_;         // low-latency: this step's message length from each rank

  // Per-step state, kept to reuse its memory (see ForwardHome).
  int64_t hidden_ = 0, record_bytes_ = 0, return_bytes_ = 0, returns_bytes_ = 0, per_returned_row_ = 0;
  int64_t picks_per_row_ = 0, items_cap_ = 0, activation_bytes_ = 0;
  int top_k_ = 0, slots_ = 0;
  int count_fields_ = 0;  // values per rank in count_matrix_: G, or 2G + 1 with two levels
  bool partial_ = false;
  std::vector<int32_t> pick_rank_, pick_slot_;     // per pick of this rank's rows
  std::vector<int64_t> pick_return_;               // per pick: byte offset of its output in returns_ (-1: none)
  std::vector<int64_t> nth_;                       // per expert: picks dealt so far this step
  std::vector<int64_t> send_count_, recv_count_;   // rows to / from each rank this step
  std::vector<int64_t> count_matrix_;              // rows rank s sends rank d, at s * count_fields_ + d
                                                   // (two levels: rows delivered to d at + G + d, returns at + 2G)
  std::vector<int64_t> send_row_begin_, send_rows_;  // rows per destination, in row order
  std::vector<int64_t> send_return_at_;            // per destination: returns before each of its rows
  std::vector<int64_t> region_;                    // per destination: where its returns start
  std::vector<int64_t> send_n_, send_bytes_, send_offsets_;     // this round's records per destination
  std::vector<int64_t> back_recv_bytes_, back_recv_offsets_;    // this round's returns per destination
  std::vector<int64_t> back_bytes_, back_at_;      // this round's outputs going back, per source (RunAsTheyLand)
  std::vector<int64_t> position_;                  // per received pick: its row in the expert-ordered input
  std::vector<int64_t> batch_first_, slot_offsets_;  // per batch: its first record; per slot: its first row
  // Two levels, per rank of this node: records forwarded there and where they start in
  // forward_send_, their outputs and where those land in forward_returns_; per source rank of
  // another node: the outputs its node records bring home. Per pick of a node record received:
  // where its output lands in forward_returns_ (-1: none, or summed into another with partial sums).
  std::vector<int64_t> forward_n_, forward_offsets_, forward_outputs_, forward_return_region_, gateway_outputs_;
  std::vector<int64_t> gateway_return_at_;
  std::vector<int32_t> slot_ids_;
  std::vector<float> partial_row_;
  ScratchBuffer returns_, send_, recv_, decoded_, quantized_, work_in_, work_out_, back_send_;
  ScratchBuffer forward_send_, forward_recv_, forward_back_, forward_returns_;
  SharedOutputs shared_outputs_;  // this step's shared expert outputs
  // Low-latency's dispatch into recv_, its receives posted ahead (declared after the buffers:
  // destroyed, and so its receives cancelled, before them).
  std::unique_ptr<CappedExchange> dispatch_exchange_;
  // The last row and output exchanges, received but maybe still sending from send_ and back_send_
  // (declared after the buffers and the exchange: destroyed, and so completed, before them).
  std::unique_ptr<Request> dispatch_sends_, combine_sends_;
};

}  // namespace

Result<std::unique_ptr<MoeExecutor>> CreateA2aExecutor(Communicator& comm, const ModelConfig& model,
                                                       const ExecutorOptions& options, ThreadPool& pool) {
  auto executor = std::make_unique<A2aExecutor>(comm, model, options, pool);
  EPMOE_RETURN_IF_ERROR(executor->Init());
  return std::unique_ptr<MoeExecutor>(std::move(executor));
}

}  // namespace epmoe::ep_internal
