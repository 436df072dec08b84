// Options 1-3 (sliced, whole, hybrid): every rank sees every row (all-gather, or tensor-parallel
// rows that are already everywhere), computes the picks of the experts or slices it holds into a
// partial output, and a reduce-scatter (all-reduce for tensor-parallel rows) sums the partials.
// The three options differ only in what a rank holds: hybrid with m ranks per expert; whole is
// m = 1 (placed by the Placement), sliced is m = G.
#include <algorithm>
#include <cstddef>
#include <cstring>

#include <fmt/format.h>

#include "ep/executor_internal.h"
#include "epmoe/dispatch.h"
#include "epmoe/thread_pool.h"

namespace epmoe::ep_internal {
namespace {

// Resizes a buffer kept across steps. It grows only when it must and then to exactly `size` (a
// plain resize may double it), so what stays held is each buffer's largest step, which the rounds
// keep within the bound.
template <typename Vector>
void Fit(size_t size, Vector* v) {
  v->reserve(size);
  v->resize(size);
}

// Makes m a rows x cols matrix in the storage it already has (Fit); zero: every value 0, else the
// values are left as they were and the caller overwrites them.
void Reshape(int64_t rows, int64_t cols, bool zero, Matrix* m) {
  m->rows = rows;
  m->cols = cols;
  Fit(static_cast<size_t>(rows * cols), &m->data);
  if (zero) std::fill(m->data.begin(), m->data.end(), 0.0f);
}

class GatherExecutor : public MoeExecutor {
 public:
  GatherExecutor(Communicator& comm, const ModelConfig& model, const ExecutorOptions& options, ThreadPool& pool)
      : comm_(comm), model_(model), options_(options), pool_(pool) {}

  Status Init() {
    const int g = comm_.size(), me = comm_.rank();
    slices_ = options_.option == EpOption::kWhole ? 1 : options_.option == EpOption::kSliced ? g : options_.tp_in_ep;
    const int groups = g / slices_, group = me / slices_, slice = me % slices_;
    const int64_t width = model_.expert_intermediate / slices_;
    const std::shared_ptr<const WeightSource> weights = Weights(model_, options_);
    const int e_count = model_.num_experts;
    stores_.resize(options_.num_layers);
    local_of_.resize(options_.num_layers);
    PlacementPtr placement;
    if (options_.option == EpOption::kWhole) {
      EPMOE_ASSIGN_OR_RETURN(live_, ResolveLivePlacement(model_, options_, comm_));
      placement = live_->placement();
    }
    for (int layer = 0; layer < options_.num_layers; ++layer) {
      // Sliced and hybrid: local_of_[layer][e]: the store index holding e's slice here, or -1.
      std::vector<int32_t>& local_of = local_of_[layer];
      local_of.assign(e_count, -1);
      if (options_.option == EpOption::kWhole) {
        const Placement& p = *placement;
        const int first = me * p.slots_per_rank();
        auto slot_expert = [&](int s, ExpertWeights* out) {
          return weights->ReadExpert(layer, p.phy2log(layer)[first + s], 0, -1, out);
        };
        if (p.slots_per_rank() > 0) {
          EPMOE_ASSIGN_OR_RETURN(stores_[layer], PackExperts(p.slots_per_rank(), model_.hidden,
                                                             model_.expert_intermediate, slot_expert, options_.pack));
        }
      } else {
        const int begin = static_cast<int>(static_cast<int64_t>(group) * e_count / groups);
        const int end = static_cast<int>(static_cast<int64_t>(group + 1) * e_count / groups);
        for (int e = begin; e < end; ++e) local_of[e] = e - begin;
        auto expert_slice = [&](int i, ExpertWeights* out) {
          return weights->ReadExpert(layer, begin + i, slice * width, (slice + 1) * width, out);
        };
        if (end > begin) {
          EPMOE_ASSIGN_OR_RETURN(stores_[layer],
                                 PackExperts(end - begin, model_.hidden, width, expert_slice, options_.pack));
        }
      }
    }
    // Shared expert: sliced over all G ranks, or a full copy applied to the home rows.
    shared_copied_ = options_.shared == SharedMode::kCopied;
    if (shared_copied_) {
      EPMOE_ASSIGN_OR_RETURN(shared_, PackSharedCopies(model_, options_));
    } else if (model_.num_shared_experts > 0) {
      const std::shared_ptr<const WeightSource> source = Weights(model_, options_);
      const int64_t w = model_.shared_intermediate / g;
      shared_.resize(options_.num_layers);
      for (int layer = 0; layer < options_.num_layers; ++layer) {
        auto shared_slice = [&](int s, ExpertWeights* out) {
          return source->ReadSharedExpert(layer, s, me * w, (me + 1) * w, out);
        };
        EPMOE_ASSIGN_OR_RETURN(shared_[layer],
                               PackExperts(model_.num_shared_experts, model_.hidden, w, shared_slice, options_.pack));
      }
    } else {
      shared_.resize(options_.num_layers);
    }
    EPMOE_ASSIGN_OR_RETURN(shared_gates_, SharedOutputGates(model_, options_));
    if (options_.option == EpOption::kWhole) {
      target_ = std::make_unique<SlotStoresTarget>(me, live_.get(), &stores_);
    }
    return Status::Ok();
  }

  RebalanceTarget* rebalance_target() override { return target_.get(); }
  std::shared_ptr<LivePlacement> live_placement() override { return live_; }
  EpOption option() const override { return options_.option; }
  std::string description() const override {
    std::string what = EpOptionName(options_.option);
    if (options_.option == EpOption::kHybrid) what += fmt::format(" (m = {})", slices_);
    return fmt::format("{}: {} rows all-gathered, shared expert {}", what, RowFormatName(options_.dispatch_format),
                       shared_copied_ ? "copied" : "sliced");
  }
  int64_t resident_weight_bytes() const override {
    int64_t bytes = 0;
    for (const auto& store : stores_) {
      if (store == nullptr) continue;
      for (int e = 0; e < store->num_experts(); ++e) bytes += store->expert_bytes(e);
    }
    for (const auto& store : shared_) {
      if (store == nullptr) continue;
      for (int e = 0; e < store->num_experts(); ++e) bytes += store->expert_bytes(e);
    }
    return bytes;
  }

  Status Forward(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) override {
    EPMOE_RETURN_IF_ERROR(CheckForwardInput(model_, options_.num_layers, layer, rows, picks));
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k;
    const int64_t h = model_.hidden;
    const bool tensor_parallel = options_.origin == RowOrigin::kTensorParallel;
    StepStats st;
    Stopwatch watch;

    // Rows per rank, and the global first row of each rank's rows.
    std::vector<int64_t> counts(g);
    if (tensor_parallel) {
      for (int r = 0; r < g; ++r) counts[r] = RowBegin(rows.rows, g, r + 1) - RowBegin(rows.rows, g, r);
    } else {
      const int64_t mine = rows.rows;
      EPMOE_RETURN_IF_ERROR(comm_.AllgatherInt64(std::span<const int64_t>(&mine, 1), counts));
    }
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    st.rows = tensor_parallel ? RowBegin(total, g, me + 1) - RowBegin(total, g, me) : rows.rows;

    // Rounds: every buffer of a round is at most the bound.
    const int64_t record_bytes = k * 8 + RowBytes(options_.dispatch_format, h);
    const ExpertStore* store = stores_[layer].get();
    const int64_t local_picks_per_row = std::min<int64_t>(k, store ? store->num_experts() : 0);
    const int64_t act = store ? store->activation_row_bytes() : 0;  // a row in the kernel's input format
    // Per row: its record sent and received, its fp32 row and partial sum, its kernel-format copy,
    // and per local pick a kernel-format row in and an fp32 output.
    const int64_t per_row = 2 * record_bytes + 2 * h * 4 + act + local_picks_per_row * (act + h * 4);
    int64_t max_count = 0;
    for (int64_t c : counts) max_count = std::max(max_count, c);
    auto round_rows = [&](int64_t rounds) {
      int64_t sum = 0;
      for (int64_t c : counts) sum += (c + rounds - 1) / rounds;
      return sum;
    };
    int64_t rounds = std::max<int64_t>(1, (total * per_row + options_.max_buffer_bytes - 1) / options_.max_buffer_bytes);
    rounds = std::min(rounds, std::max<int64_t>(1, max_count));
    while (rounds < max_count && round_rows(rounds) * per_row > options_.max_buffer_bytes) ++rounds;
    if (round_rows(rounds) * per_row > options_.max_buffer_bytes)
      return OutOfRange(fmt::format("{}: rank {}: one row from each of {} ranks needs {} bytes, over the buffer bound of "
                                    "{} bytes", EpOptionName(options_.option), me, g, round_rows(rounds) * per_row,
                                    options_.max_buffer_bytes));
    st.rounds = static_cast<int>(rounds);
    st.pack_us += watch.Lap();

    // Whole: the placement of this step, and every home rank's dispatch table for it (a row's
    // picks go to the copies its home rank would choose), rebuilt when a rebalance installed one.
    LivePlacement::SnapshotPtr snapshot;
    if (live_) {
      snapshot = live_->current();
      if (tables_generation_ != snapshot->generation || tables_.empty()) {
        std::vector<DispatchTable> tables;
        for (int home = 0; home < g; ++home) {
          EPMOE_ASSIGN_OR_RETURN(DispatchTable table,
                                 DispatchTable::Build(*snapshot->placement, home, live_->dispatch_seed()));
          tables.push_back(std::move(table));
        }
        tables_ = std::move(tables);
        tables_generation_ = snapshot->generation;
      }
    }
    *out = Matrix(rows.rows, h);
    std::vector<int64_t> nth(live_ ? static_cast<size_t>(g) * model_.num_experts : 0, 0);
    std::vector<int64_t> chunk(g), chunk_first(g);
    // Buffers kept across layers and steps, resized in place (grow-only, and bounded like the
    // rounds above): fresh ones cost a page fault per 4 KB on first touch every layer (at T = 64 and
    // G = 2 a sliced rank's pick outputs are 2 MB).
    std::vector<uint8_t>& send = scratch_.send;
    std::vector<uint8_t>& recv = scratch_.recv;
    Matrix& gathered_rows = scratch_.gathered_rows;
    Matrix& partial = scratch_.partial;
    std::vector<std::byte>& quantized = scratch_.quantized;
    std::vector<std::byte>& work_in = scratch_.work_in;
    Matrix& work_out = scratch_.work_out;
    std::vector<int32_t> gathered_experts;
    std::vector<float> gathered_weights;
    std::vector<int32_t> gathered_home;
    for (int64_t round = 0; round < rounds; ++round) {
      for (int r = 0; r < g; ++r) {
        chunk_first[r] = counts[r] * round / rounds;
        chunk[r] = counts[r] * (round + 1) / rounds - chunk_first[r];
      }
      const int64_t round_total = [&] {
        int64_t s = 0;
        for (int64_t c : chunk) s += c;
        return s;
      }();
      Reshape(round_total, h, /*zero=*/false, &gathered_rows);  // every row decoded below
      gathered_experts.resize(round_total * k);
      gathered_weights.resize(round_total * k);
      gathered_home.resize(round_total);
      int64_t at = 0;
      for (int r = 0; r < g; ++r)
        for (int64_t i = 0; i < chunk[r]; ++i) gathered_home[at++] = r;
      int64_t buffer_bytes = 0;
      if (tensor_parallel) {
        // Every rank has every row: no exchange, but rows pass the same codec as gathered ones.
        std::vector<uint8_t> encoded(RowBytes(options_.dispatch_format, h));
        int64_t row_at = 0;
        for (int r = 0; r < g; ++r) {
          const int64_t first = RowBegin(total, g, r) + chunk_first[r];
          for (int64_t i = 0; i < chunk[r]; ++i, ++row_at) {
            EncodeRow(options_.dispatch_format, rows.row(first + i), h, encoded.data());
            DecodeRow(options_.dispatch_format, encoded.data(), h, gathered_rows.row(row_at));
            for (int j = 0; j < k; ++j) {
              gathered_experts[row_at * k + j] = picks.expert(first + i, j);
              gathered_weights[row_at * k + j] = picks.weight(first + i, j);
            }
          }
        }
        st.pack_us += watch.Lap();
      } else {
        std::vector<int64_t> bytes(g);
        for (int r = 0; r < g; ++r) bytes[r] = chunk[r] * record_bytes;
        const auto offsets = PrefixOffsets(bytes);
        Fit(static_cast<size_t>(bytes[me]), &send);
        Fit(static_cast<size_t>(offsets[g]), &recv);
        buffer_bytes += static_cast<int64_t>(send.size() + recv.size());
        for (int64_t i = 0; i < chunk[me]; ++i) {
          const int64_t row = chunk_first[me] + i;
          uint8_t* record = send.data() + i * record_bytes;
          std::memcpy(record, picks.experts.data() + row * k, k * 4);
          std::memcpy(record + k * 4, picks.weights.data() + row * k, k * 4);
          EncodeRow(options_.dispatch_format, rows.row(row), h, record + k * 8);
        }
        st.pack_us += watch.Lap();
        EPMOE_RETURN_IF_ERROR(comm_.Allgatherv(send.data(), bytes[me], recv.data(), bytes,
                                               std::span<const int64_t>(offsets.data(), g)));
        st.dispatch_us += watch.Lap();
        AddAllgatherBytes(comm_, bytes, &st);
        st.row_copies += chunk[me] * g;
        for (int64_t q = 0; q < round_total; ++q) {
          const uint8_t* record = recv.data() + q * record_bytes;
          std::memcpy(gathered_experts.data() + q * k, record, k * 4);
          std::memcpy(gathered_weights.data() + q * k, record + k * 4, k * 4);
          DecodeRow(options_.dispatch_format, record + k * 8, h, gathered_rows.row(q));
        }
        // Picks from other ranks are checked like local ones: a bad peer must not index out of range.
        for (int32_t e : gathered_experts) {
          if (e < 0 || e >= model_.num_experts)
            return Internal(fmt::format("rank {}: received a pick of expert {} (of {})", me, e, model_.num_experts));
        }
        st.pack_us += watch.Lap();
      }

      // Picks of this rank's experts, grouped by local expert (stable: row order, then pick order).
      Reshape(round_total, h, /*zero=*/true, &partial);  // summed into
      const std::vector<int32_t>& local_of = local_of_[layer];
      const int local_count = store ? store->num_experts() : 0;
      std::vector<int64_t> offsets(local_count + 1, 0);
      std::vector<int32_t> item_local(round_total * k, -1);
      for (int64_t q = 0; q < round_total; ++q) {
        for (int j = 0; j < k; ++j) {
          const int32_t e = gathered_experts[q * k + j];
          int32_t li = local_of[e];
          if (live_) {
            // Whole experts: the copy the home rank's table deals this pick to (its nth pick of e
            // this step: rounds and rows come in the home rank's order).
            const int home = gathered_home[q];
            const int32_t slot = tables_[home].SlotFor(layer, e, nth[static_cast<size_t>(home) * model_.num_experts + e]++);
            const Placement& p = *snapshot->placement;
            li = p.rank_of_slot(slot) == me ? slot - me * p.slots_per_rank() : -1;
          }
          item_local[q * k + j] = li;
          if (li >= 0) ++offsets[li + 1];
        }
      }
      for (int e = 0; e < local_count; ++e) offsets[e + 1] += offsets[e];
      const int64_t items = offsets[local_count];
      std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
      std::vector<int64_t> position(round_total * k, -1);
      // Each gathered row with a pick here is put in the kernel's input format once (QuantizeRows);
      // its picks then take copies of those smaller rows, and RunQuantized gives what Run would on
      // the fp32 rows, bit for bit.
      Fit(static_cast<size_t>(round_total * act), &quantized);
      Fit(static_cast<size_t>(items * act), &work_in);
      st.pack_us += watch.Lap();
      if (items > 0) store->QuantizeRows(gathered_rows.data.data(), round_total, quantized.data(), pool_);
      st.experts_us += watch.Lap();  // the kernel's own first phase (Run would do it inside)
      for (int64_t q = 0; q < round_total; ++q) {
        for (int j = 0; j < k; ++j) {
          const int32_t li = item_local[q * k + j];
          if (li < 0) continue;
          const int64_t p = cursor[li]++;
          position[q * k + j] = p;
          std::memcpy(work_in.data() + p * act, quantized.data() + q * act, act);
        }
      }
      st.pack_us += watch.Lap();
      Reshape(items, h, /*zero=*/false, &work_out);  // RunQuantized writes every pick's output
      if (items > 0) store->RunQuantized(work_in.data(), offsets, work_out.data.data(), pool_);
      for (int e = 0; e < local_count; ++e) {
        if (offsets[e + 1] > offsets[e]) st.expert_bytes_read += store->expert_bytes(e);
      }
      st.picks += items;
      st.experts_us += watch.Lap();
      for (int64_t q = 0; q < round_total; ++q) {
        float* y = partial.row(q);
        for (int j = 0; j < k; ++j) {
          const int64_t p = position[q * k + j];
          if (p < 0) continue;
          const float w = gathered_weights[q * k + j];
          const float* src = work_out.row(p);
          for (int64_t c = 0; c < h; ++c) y[c] += w * src[c];
        }
      }
      st.unpack_us += watch.Lap();
      if (!shared_copied_) {
        st.expert_bytes_read +=
            AddSharedExperts(shared_[layer].get(), shared_gates_[layer], gathered_rows, &partial, pool_);
        st.shared_us += watch.Lap();
      }
      buffer_bytes += static_cast<int64_t>(gathered_rows.data.size() + partial.data.size() + work_out.data.size()) * 4 +
                      static_cast<int64_t>(quantized.size() + work_in.size());

      // Sum the partials: each rank gets its own rows (or, tensor-parallel, all of them).
      if (tensor_parallel) {
        EPMOE_RETURN_IF_ERROR(comm_.Allreduce(partial.data.data(), round_total * h));
        // As a ring all-reduce moves them, counted as an even share to and from every other rank.
        const int64_t moved = 2 * (g - 1) * round_total * h * 4 / g;
        std::vector<int64_t> share(g, g > 1 ? moved / (g - 1) : 0);
        AddExchangeBytes(comm_, share, share, &st);
        int64_t row_at = 0;
        for (int r = 0; r < g; ++r) {
          const int64_t first = RowBegin(total, g, r) + chunk_first[r];
          std::copy(partial.row(row_at), partial.row(row_at) + chunk[r] * h, out->row(first));
          row_at += chunk[r];
        }
      } else {
        std::vector<int64_t> floats(g);
        for (int r = 0; r < g; ++r) floats[r] = chunk[r] * h;
        EPMOE_RETURN_IF_ERROR(comm_.ReduceScatter(partial.data.data(), out->row(chunk_first[me]), floats));
        // Each rank's chunk of the partial sums goes to it; this rank's comes from every other.
        std::vector<int64_t> sent(g), received(g, chunk[me] * h * 4);
        for (int r = 0; r < g; ++r) sent[r] = chunk[r] * h * 4;
        AddExchangeBytes(comm_, sent, received, &st);
      }
      st.combine_us += watch.Lap();
      st.peak_buffer_bytes = std::max(st.peak_buffer_bytes, buffer_bytes);
    }
    if (shared_copied_) {
      st.expert_bytes_read += AddSharedExperts(shared_[layer].get(), shared_gates_[layer], rows, out, pool_);
      st.shared_us += watch.Lap();
    }
    if (stats != nullptr) *stats = st;
    return Status::Ok();
  }

 private:
  Communicator& comm_;
  ModelConfig model_;
  ExecutorOptions options_;
  ThreadPool& pool_;
  int slices_ = 1;
  std::shared_ptr<LivePlacement> live_;               // whole: the placement
  std::vector<std::unique_ptr<ExpertStore>> stores_;  // per layer; null when a rank holds no expert
  std::vector<DispatchTable> tables_;                 // whole: every rank's dispatch table of
  int64_t tables_generation_ = -1;                    // this generation of the live placement
  std::vector<std::vector<int32_t>> local_of_;  // sliced, hybrid
  bool shared_copied_ = false;
  std::vector<std::unique_ptr<ExpertStore>> shared_;  // per layer; null without shared experts
  // Per layer; empty without a shared output gate.
  std::vector<std::vector<float>> shared_gates_;
  std::unique_ptr<SlotStoresTarget> target_;          // whole: live rebalancing of stores_
  struct Scratch {
    std::vector<uint8_t> send, recv;
    Matrix gathered_rows, partial, work_out;
    std::vector<std::byte> quantized, work_in;  // gathered rows, then pick rows, in the kernel's input format
  } scratch_;  // Forward's buffers (see there)
};

}  // namespace

Result<std::unique_ptr<MoeExecutor>> CreateGatherExecutor(Communicator& comm, const ModelConfig& model,
                                                          const ExecutorOptions& options, ThreadPool& pool) {
  auto executor = std::make_unique<GatherExecutor>(comm, model, options, pool);
  EPMOE_RETURN_IF_ERROR(executor->Init());
  return std::unique_ptr<MoeExecutor>(std::move(executor));
}

}  // namespace epmoe::ep_internal
