// Option 5, traveling weights (DWDP). Rank g owns experts [g*E/G, (g+1)*E/G) of every layer, packed
// once in the kernel's format; their packed bytes (values and every scale, ExpertStore::
// ExportExpert) sit in a one-sided window. Rows never move: every rank reads the experts it lacks
// from their owners, as packed bytes, straight into their slots of one half of a double buffer
// (ExpertStore::MutableExpertParts: each contiguous part of a slot is the target of one read), so
// the traffic is exactly the experts' stored bytes, each moved once: nothing is staged, imported or
// repacked. (On one node the window is shared memory and a read is the reader's memcpy: a staging
// area and an import copy doubled the copying, on the same cores and memory as the kernel.) While
// one half computes, the reads of the next piece fill the other half.
//
// The double buffer is bounded by ExecutorOptions::max_buffer_bytes: two stores of P experts each
// (2 P expert_bytes in all). When a layer's lacking experts do not fit in P, the layer is fetched in
// pieces of P experts, one piece ahead of use (the next layer's first piece is read while the
// current layer's last piece computes); when they fit, that is one piece per layer, read one layer
// ahead.
//
// Where the transport allows concurrent threads the reads run on a helper thread, overlapped with
// compute; otherwise the reads are started (MPI_Rget) before the compute and completed when the
// piece is needed. Each pick is computed by the same packed
// bytes and kernel as the single-process layer with the same weight format, and the sum runs in pick
// order, so results are bit-exact with MoeLayer.
#include <algorithm>
#include <functional>
#include <future>

#include <fmt/format.h>

#include "ep/executor_internal.h"
#include "epmoe/layer.h"
#include "epmoe/thread_pool.h"
#include "epmoe/weight_format.h"

namespace epmoe::ep_internal {
namespace {

class DwdpExecutor : public MoeExecutor {
 public:
  DwdpExecutor(Communicator& comm, const ModelConfig& model, const ExecutorOptions& options, ThreadPool& pool)
      : comm_(comm), model_(model), options_(options), pool_(pool) {}

  // The last resort when Close was not called (e.g. an error ended the run): bounded like Close.
  ~DwdpExecutor() override { (void)Close(); }

  Status Settle() override {
    // Complete keeps each half's layer and piece, so the next Forward still finds its read there.
    for (Buffer& b : buffers_) EPMOE_RETURN_IF_ERROR(Complete(b));
    return Status::Ok();
  }

  // Completes this rank's reads (the helper thread's too) and closes the window (Window::Close:
  // nobody frees it while a peer may still read from it; bounded, naming the ranks missing).
  Status Close() override {
    if (closed_) return Status::Ok();
    closed_ = true;
    Status status = Status::Ok();
    for (Buffer& b : buffers_) {
      const Status completed = Complete(b);
      if (status.ok()) status = completed;
    }
    if (window_ != nullptr) {
      const Status closed = window_->Close();
      if (status.ok()) status = closed;
    }
    return status;
  }

  Status Init() {
    const int me = comm_.rank(), g = comm_.size();
    own_begin_ = OwnerBegin(me);
    own_end_ = OwnerBegin(me + 1);
    const int owned = own_end_ - own_begin_;
    lacking_ = model_.num_experts - owned;
    const std::shared_ptr<const WeightSource> weights = Weights(model_, options_);
    owned_.resize(options_.num_layers);
    for (int layer = 0; layer < options_.num_layers && owned > 0; ++layer) {
      auto owned_expert = [&](int i, ExpertWeights* out) {
        return weights->ReadExpert(layer, own_begin_ + i, 0, -1, out);
      };
      EPMOE_ASSIGN_OR_RETURN(
          owned_[layer], PackExperts(owned, model_.hidden, model_.expert_intermediate, owned_expert, options_.pack));
    }
    // Bytes of one packed expert; every expert of every rank must have the same size and layout
    // (same format, shape and kernel), or the bytes read would not fit the importing store.
    expert_bytes_ = RoutedExpertBytes(model_, options_.pack.format);
    if (owned > 0) expert_bytes_ = owned_[0]->expert_bytes(0);
    const std::string kernel = owned > 0 ? owned_[0]->kernel_name() : std::string();
    const int64_t mine[2] = {owned > 0 ? expert_bytes_ : -1,
                             owned > 0 ? static_cast<int64_t>(std::hash<std::string>{}(kernel) >> 1) : -1};
    std::vector<int64_t> all(2 * g);
    EPMOE_RETURN_IF_ERROR(comm_.AllgatherInt64(mine, all));
    int reference = -1;
    for (int r = 0; r < g; ++r) {
      if (all[2 * r] < 0) continue;
      if (reference < 0) reference = r;
      if (all[2 * r] != all[2 * reference] || all[2 * r + 1] != all[2 * reference + 1])
        return FailedPrecondition(fmt::format("dwdp: rank {} packs experts into {} bytes ({}), rank {} into {} bytes; "
                                              "every rank must use the same weight format and kernel (--isa)",
                                              r, all[2 * r], r == me ? kernel : "another kernel", reference,
                                              all[2 * reference]));
    }
    if (reference >= 0) expert_bytes_ = all[2 * reference];

    // The window: this rank's packed experts of every layer, layer-major.
    EPMOE_ASSIGN_OR_RETURN(window_, comm_.AllocateWindow(static_cast<int64_t>(options_.num_layers) * owned * expert_bytes_));
    std::byte* base = static_cast<std::byte*>(window_->local());
    for (int layer = 0; layer < options_.num_layers && owned > 0; ++layer) {
      for (int i = 0; i < owned; ++i) {
        std::span<std::byte> at(base + (static_cast<int64_t>(layer) * owned + i) * expert_bytes_, expert_bytes_);
        EPMOE_RETURN_IF_ERROR(owned_[layer]->ExportExpert(i, at));
      }
    }
    EPMOE_RETURN_IF_ERROR(comm_.Barrier());  // every window is written before anyone reads

    if (lacking_ > 0) {
      piece_experts_ = static_cast<int>(std::min<int64_t>(lacking_, options_.max_buffer_bytes / (2 * expert_bytes_)));
      if (piece_experts_ < 1)
        return OutOfRange(fmt::format("dwdp: rank {}: one expert takes {} bytes and the double buffer needs two, over "
                                      "the buffer bound of {} bytes", me, expert_bytes_, options_.max_buffer_bytes));
      pieces_per_layer_ = (lacking_ + piece_experts_ - 1) / piece_experts_;
      // The halves are stores of piece_experts_ experts in the kernel's format, packed once from one
      // expert's weights (the reads overwrite each slot before it is used).
      EPMOE_ASSIGN_OR_RETURN(const ExpertWeights filler, weights->Expert(0, 0, 0, -1));
      const std::vector<const ExpertWeights*> fillers(piece_experts_, &filler);
      for (Buffer& b : buffers_) {
        EPMOE_ASSIGN_OR_RETURN(b.store, PackExperts(fillers, options_.pack));
        const int64_t kernel_hash = static_cast<int64_t>(std::hash<std::string>{}(b.store->kernel_name()) >> 1);
        if (b.store->expert_bytes(0) != expert_bytes_ || (reference >= 0 && kernel_hash != all[2 * reference + 1]))
          return FailedPrecondition(fmt::format("dwdp: rank {} packs experts into {} bytes ({}), the owners into {} "
                                                "bytes; every rank must use the same weight format and kernel (--isa)",
                                                me, b.store->expert_bytes(0), b.store->kernel_name(), expert_bytes_));
        // Where each slot's bytes live: the reads' targets (stable: the store never reallocates).
        b.slots.resize(piece_experts_);
        for (int i = 0; i < piece_experts_; ++i) {
          EPMOE_ASSIGN_OR_RETURN(b.slots[i], b.store->MutableExpertParts(i));
          int64_t bytes = 0;
          for (const auto& part : b.slots[i]) bytes += static_cast<int64_t>(part.size());
          EPMOE_CHECK(bytes == expert_bytes_);
        }
      }
    }
    EPMOE_ASSIGN_OR_RETURN(shared_, PackSharedCopies(model_, options_));
    EPMOE_ASSIGN_OR_RETURN(shared_gates_, SharedOutputGates(model_, options_));
    threaded_ = comm_.concurrent_threads();
    return Status::Ok();
  }

  EpOption option() const override { return EpOption::kDwdp; }
  std::string description() const override {
    return fmt::format("dwdp: packed {} experts read ahead, {} piece{} of up to {} experts per layer ({}), shared "
                       "expert copied", WeightFormatName(options_.pack.format), pieces_per_layer_,
                       pieces_per_layer_ == 1 ? "" : "s", piece_experts_, threaded_ ? "helper thread" : "nonblocking reads");
  }
  int64_t resident_weight_bytes() const override {
    int64_t bytes = (window_ ? window_->local_bytes() : 0) + BufferBytes();
    for (const auto* list : {&owned_, &shared_}) {
      for (const auto& store : *list) {
        if (store == nullptr) continue;
        for (int e = 0; e < store->num_experts(); ++e) bytes += store->expert_bytes(e);
      }
    }
    return bytes;
  }

  Status Forward(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) override {
    if (closed_) return FailedPrecondition(fmt::format("dwdp: rank {}: Forward after Close", comm_.rank()));
    EPMOE_RETURN_IF_ERROR(CheckForwardInput(model_, options_.num_layers, layer, rows, picks));
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k, e_count = model_.num_experts;
    const int64_t h = model_.hidden;
    StepStats st;
    Stopwatch watch;

    // Rows stay: data-parallel rows are this rank's; tensor-parallel rows are split as if they were.
    const bool tensor_parallel = options_.origin == RowOrigin::kTensorParallel;
    const int64_t first = tensor_parallel ? RowBegin(rows.rows, g, me) : 0;
    const int64_t n = tensor_parallel ? RowBegin(rows.rows, g, me + 1) - first : rows.rows;
    st.rows = n;
    // Lacking experts are numbered first (0..lacking-1, in expert order), owned ones after, so each
    // piece's rows and the owned store's rows are contiguous runs of the permuted rows.
    const int owned = own_end_ - own_begin_;
    Picks relabeled{n, k, std::vector<int32_t>(n * k), std::vector<float>(picks.weights.begin() + first * k,
                                                                          picks.weights.begin() + (first + n) * k)};
    for (int64_t i = 0; i < n * k; ++i) {
      const int32_t e = picks.experts[first * k + i];
      relabeled.experts[i] = e >= own_end_ ? e - owned : e >= own_begin_ ? lacking_ + (e - own_begin_) : e;
    }
    const Matrix mine = RowSlice(rows, first, n);
    const PermutedPicks permuted = PermuteByExpert(relabeled, e_count);
    const std::vector<int64_t>& offsets = permuted.offsets;
    Matrix gathered, expert_out(n * k, h);
    GatherPermutedRows(mine, permuted, k, &gathered);
    st.pack_us += watch.Lap();

    // Owned experts first: the first piece may still be arriving.
    if (owned_[layer] != nullptr && offsets[e_count] > offsets[lacking_]) {
      std::vector<int64_t> tail(offsets.begin() + lacking_, offsets.end());
      const int64_t base = tail[0];
      for (int64_t& t : tail) t -= base;
      owned_[layer]->Run(gathered.row(base), tail, expert_out.row(base), pool_);
    }
    for (int i = 0; i < owned; ++i) {
      if (offsets[lacking_ + i + 1] > offsets[lacking_ + i]) st.expert_bytes_read += owned_[layer]->expert_bytes(i);
    }
    st.experts_us += watch.Lap();

    std::vector<int64_t> piece_offsets(piece_experts_ + 1);
    for (int piece = 0; piece < pieces_per_layer_; ++piece) {
      // This piece: from the read started one piece ago, else read now.
      int current = -1;
      for (int b = 0; b < 2; ++b) {
        if (buffers_[b].layer == layer && buffers_[b].piece == piece) current = b;
      }
      if (current < 0) {
        for (Buffer& b : buffers_) EPMOE_RETURN_IF_ERROR(Complete(b));  // a read for another piece: unused
        current = 0;
        EPMOE_RETURN_IF_ERROR(StartFetch(layer, piece, buffers_[current]));
      }
      EPMOE_RETURN_IF_ERROR(Complete(buffers_[current]));
      std::vector<int64_t> none(g, 0), read_from(g, 0);
      for (int i = 0; i < PieceSize(piece); ++i)
        read_from[OwnerOf(LackingExpert(piece * piece_experts_ + i))] += expert_bytes_;
      AddExchangeBytes(comm_, none, read_from, &st);
      st.dispatch_us += watch.Lap();
      // The next piece (of this layer, or the next layer's first) into the other half.
      Buffer& other = buffers_[1 - current];
      EPMOE_RETURN_IF_ERROR(Complete(other));
      const bool last = piece + 1 == pieces_per_layer_;
      EPMOE_RETURN_IF_ERROR(
          StartFetch(last ? (layer + 1) % options_.num_layers : layer, last ? 0 : piece + 1, other));

      const int begin = piece * piece_experts_, count = PieceSize(piece);
      for (int i = 0; i <= piece_experts_; ++i) piece_offsets[i] = offsets[begin + std::min(i, count)] - offsets[begin];
      const ExpertStore& store = *buffers_[current].store;
      if (piece_offsets[piece_experts_] > 0)
        store.Run(gathered.row(offsets[begin]), piece_offsets, expert_out.row(offsets[begin]), pool_);
      for (int i = 0; i < count; ++i) {
        if (piece_offsets[i + 1] > piece_offsets[i]) st.expert_bytes_read += store.expert_bytes(i);
      }
      buffers_[current].layer = -1;  // used: the next reads may reuse this half
      st.experts_us += watch.Lap();
    }
    st.picks = n * k;
    Matrix my_out;
    CombinePermutedRows(expert_out, permuted, relabeled, &my_out);
    st.unpack_us += watch.Lap();
    st.expert_bytes_read += AddSharedExperts(shared_[layer].get(), shared_gates_[layer], mine, &my_out, pool_);
    st.shared_us += watch.Lap();

    if (tensor_parallel) {
      *out = Matrix(rows.rows, h);
      std::vector<int64_t> bytes(g);
      for (int r = 0; r < g; ++r) bytes[r] = (RowBegin(rows.rows, g, r + 1) - RowBegin(rows.rows, g, r)) * h * 4;
      const auto row_offsets = PrefixOffsets(bytes);
      EPMOE_RETURN_IF_ERROR(comm_.Allgatherv(my_out.data.data(), bytes[me], out->data.data(), bytes,
                                             std::span<const int64_t>(row_offsets.data(), g)));
      AddAllgatherBytes(comm_, bytes, &st);
      st.combine_us += watch.Lap();
    } else {
      *out = std::move(my_out);
    }
    st.peak_buffer_bytes = BufferBytes();
    st.rounds = pieces_per_layer_ > 0 ? pieces_per_layer_ : 1;
    if (stats != nullptr) *stats = st;
    return Status::Ok();
  }

 private:
  // One half of the double buffer: a store of piece_experts_ experts and which piece it holds or is
  // reading (layer -1: free).
  struct Buffer {
    int layer = -1;
    int piece = 0;
    bool pending = false;
    std::future<Status> fetch;  // threaded reads
    std::unique_ptr<ExpertStore> store;
    // Per slot, its contiguous parts in exported order (ExpertStore::MutableExpertParts).
    std::vector<std::vector<std::span<std::byte>>> slots;
  };

  int OwnerBegin(int rank) const {
    return static_cast<int>(static_cast<int64_t>(rank) * model_.num_experts / comm_.size());
  }
  // The expert of a lacking index: the experts of the ranks before and after this one.
  int LackingExpert(int lacking_index) const {
    return lacking_index < own_begin_ ? lacking_index : lacking_index + (own_end_ - own_begin_);
  }
  int OwnerOf(int expert) const {
    int owner = 0;
    while (OwnerBegin(owner + 1) <= expert) ++owner;
    return owner;
  }
  int PieceSize(int piece) const { return std::min(piece_experts_, lacking_ - piece * piece_experts_); }
  // The two stores.
  int64_t BufferBytes() const { return lacking_ > 0 ? 2 * static_cast<int64_t>(piece_experts_) * expert_bytes_ : 0; }

  // Starts the one-sided reads of a piece's experts straight into b's slots (threaded: and waits
  // for them on the helper thread).
  Status StartFetch(int layer, int piece, Buffer& b) {
    b.layer = layer;
    b.piece = piece;
    b.pending = true;
    auto issue = [this, layer, piece, &b]() -> Status {
      const int begin = piece * piece_experts_, count = PieceSize(piece);
      for (int i = 0; i < count; ++i) {
        const int e = LackingExpert(begin + i);
        const int owner = OwnerOf(e);
        const int64_t owner_experts = OwnerBegin(owner + 1) - OwnerBegin(owner);
        int64_t at = (static_cast<int64_t>(layer) * owner_experts + (e - OwnerBegin(owner))) * expert_bytes_;
        for (const std::span<std::byte>& part : b.slots[i]) {
          const int64_t bytes = static_cast<int64_t>(part.size());
          EPMOE_RETURN_IF_ERROR(window_->Get(owner, at, bytes, part.data()));
          at += bytes;
        }
      }
      return threaded_ ? window_->Flush() : Status::Ok();
    };
    if (threaded_) {
      b.fetch = std::async(std::launch::async, issue);
      return Status::Ok();
    }
    return issue();
  }

  // Waits for b's reads.
  Status Complete(Buffer& b) {
    if (!b.pending) return Status::Ok();
    b.pending = false;
    return threaded_ ? b.fetch.get() : window_->Flush();
  }

  Communicator& comm_;
  ModelConfig model_;
  ExecutorOptions options_;
  ThreadPool& pool_;
  int own_begin_ = 0, own_end_ = 0;
  int lacking_ = 0;               // experts of a layer this rank reads from others
  int piece_experts_ = 0;         // experts per piece (per half of the double buffer)
  int pieces_per_layer_ = 0;
  int64_t expert_bytes_ = 0;      // one packed expert, values and scales
  bool threaded_ = false;
  bool closed_ = false;
  std::unique_ptr<Window> window_;
  std::vector<std::unique_ptr<ExpertStore>> owned_;   // per layer; null when a rank owns none
  Buffer buffers_[2];
  std::vector<std::unique_ptr<ExpertStore>> shared_;  // per layer; null without shared experts
  // Per layer; empty without a shared output gate.
  std::vector<std::vector<float>> shared_gates_;
};

}  // namespace

Result<std::unique_ptr<MoeExecutor>> CreateDwdpExecutor(Communicator& comm, const ModelConfig& model,
                                                        const ExecutorOptions& options, ThreadPool& pool) {
  auto executor = std::make_unique<DwdpExecutor>(comm, model, options, pool);
  EPMOE_RETURN_IF_ERROR(executor->Init());
  return std::unique_ptr<MoeExecutor>(std::move(executor));
}

}  // namespace epmoe::ep_internal
