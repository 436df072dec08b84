// Option 5, traveling weights (DWDP). Rank g owns experts [g*E/G, (g+1)*E/G) of every layer, kept
// in fp32 in a one-sided window. Rows never move: before a layer runs, every rank reads the experts
// it lacks from their owners into one half of a double buffer; while layer l computes, the reads of
// the next layer fill the other half. Where the transport allows concurrent threads the reads, and
// packing the arrived experts into the kernel's format, run on a helper thread (overlapped with the
// layer's compute); otherwise the reads are started (MPI_Rget) before the layer computes and
// completed, then packed, when the next layer needs them. Owned experts were packed once. Each pick is computed exactly as the
// single-process layer computes it, so results are bit-exact with MoeLayer.
#include <algorithm>
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

  ~DwdpExecutor() override {
    for (Buffer& b : buffers_) {
      if (b.fetch.valid()) b.fetch.wait();
    }
    if (window_ != nullptr) {
      (void)window_->Flush();
      // Nobody frees the window while a peer may still read from it.
      (void)comm_.Barrier();
    }
  }

  Status Init() {
    const int me = comm_.rank();
    const int e_count = model_.num_experts;
    const int64_t hi = model_.hidden * static_cast<int64_t>(model_.expert_intermediate);
    expert_floats_ = 3 * hi;
    own_begin_ = OwnerBegin(me);
    own_end_ = OwnerBegin(me + 1);
    const int owned = own_end_ - own_begin_;
    EPMOE_ASSIGN_OR_RETURN(window_, comm_.AllocateWindow(options_.num_layers * owned * expert_floats_ * 4));
    float* base = static_cast<float*>(window_->local());
    const ExpertSource routed = RoutedSource(model_, options_);
    owned_.resize(options_.num_layers);
    for (int layer = 0; layer < options_.num_layers; ++layer) {
      std::vector<ExpertWeights> local;
      for (int e = own_begin_; e < own_end_; ++e) {
        ExpertWeights w = routed(layer, e, 0, model_.expert_intermediate);
        float* at = base + (static_cast<int64_t>(layer) * owned + (e - own_begin_)) * expert_floats_;
        std::copy(w.gate.data.begin(), w.gate.data.end(), at);
        std::copy(w.up.data.begin(), w.up.data.end(), at + hi);
        std::copy(w.down.data.begin(), w.down.data.end(), at + 2 * hi);
        local.push_back(std::move(w));
      }
      if (!local.empty()) {
        EPMOE_ASSIGN_OR_RETURN(owned_[layer], Pack(local, options_.pack));
      }
    }
    EPMOE_RETURN_IF_ERROR(comm_.Barrier());  // every window is written before anyone reads
    for (Buffer& b : buffers_) {
      b.experts.resize(e_count - owned);
      for (ExpertWeights& w : b.experts) {
        w.gate = Matrix(model_.expert_intermediate, model_.hidden);
        w.up = Matrix(model_.expert_intermediate, model_.hidden);
        w.down = Matrix(model_.hidden, model_.expert_intermediate);
      }
    }
    EPMOE_ASSIGN_OR_RETURN(shared_, PackSharedCopies(model_, options_));
    threaded_ = comm_.concurrent_windows();
    return Status::Ok();
  }

  EpOption option() const override { return EpOption::kDwdp; }
  std::string description() const override {
    return fmt::format("dwdp: fp32 weights read one layer ahead ({}), shared expert copied",
                       threaded_ ? "helper thread" : "nonblocking reads");
  }
  int64_t resident_weight_bytes() const override {
    int64_t bytes = window_ ? window_->local_bytes() : 0;
    for (const Buffer& b : buffers_) bytes += static_cast<int64_t>(b.experts.size()) * expert_floats_ * 4;
    for (const auto* list : {&owned_, &shared_}) {
      for (const auto& store : *list) {
        if (store == nullptr) continue;
        for (int e = 0; e < store->num_experts(); ++e) bytes += store->expert_bytes(e);
      }
    }
    return bytes;
  }

  Status Forward(int layer, const Matrix& rows, const Picks& picks, Matrix* out, StepStats* stats) override {
    EPMOE_RETURN_IF_ERROR(CheckForwardInput(model_, options_.num_layers, layer, rows, picks));
    const int g = comm_.size(), me = comm_.rank(), k = model_.top_k, e_count = model_.num_experts;
    const int64_t h = model_.hidden;
    StepStats st;
    Stopwatch watch;

    // This layer's experts: from the prefetch started by the previous Forward, else read now.
    int current = -1;
    for (int b = 0; b < 2; ++b) {
      if (buffers_[b].layer == layer) current = b;
    }
    if (current < 0) {
      current = buffers_[0].layer < 0 ? 0 : 1;
      if (buffers_[current].layer >= 0) EPMOE_RETURN_IF_ERROR(Complete(buffers_[current]));
      EPMOE_RETURN_IF_ERROR(StartFetch(layer, buffers_[current]));
    }
    EPMOE_RETURN_IF_ERROR(Complete(buffers_[current]));
    st.bytes_received += FetchBytes();
    st.dispatch_us += watch.Lap();
    // The next layer's experts, into the other half, while this layer computes.
    Buffer& other = buffers_[1 - current];
    if (other.layer >= 0) EPMOE_RETURN_IF_ERROR(Complete(other));
    EPMOE_RETURN_IF_ERROR(StartFetch((layer + 1) % options_.num_layers, other));
    const ExpertStore* fetched = buffers_[current].store.get();

    // Rows stay: data-parallel rows are this rank's; tensor-parallel rows are split as if they were.
    const bool tensor_parallel = options_.origin == RowOrigin::kTensorParallel;
    const int64_t first = tensor_parallel ? RowBegin(rows.rows, g, me) : 0;
    const int64_t n = tensor_parallel ? RowBegin(rows.rows, g, me + 1) - first : rows.rows;
    st.rows = n;
    // Fetched experts are numbered first (0..E-owned-1, in expert order), owned ones after, so
    // each store's rows are one contiguous run of the permuted rows.
    const int owned = own_end_ - own_begin_, lacking = e_count - owned;
    Picks relabeled{n, k, std::vector<int32_t>(n * k), std::vector<float>(picks.weights.begin() + first * k,
                                                                          picks.weights.begin() + (first + n) * k)};
    for (int64_t i = 0; i < n * k; ++i) {
      const int32_t e = picks.experts[first * k + i];
      relabeled.experts[i] = e >= own_end_ ? e - owned : e >= own_begin_ ? lacking + (e - own_begin_) : e;
    }
    Matrix mine(n, h);
    std::copy(rows.row(first), rows.row(first) + n * h, mine.data.begin());
    const PermutedPicks permuted = PermuteByExpert(relabeled, e_count);
    Matrix gathered, expert_out(n * k, h);
    GatherPermutedRows(mine, permuted, k, &gathered);
    st.pack_us += watch.Lap();
    const std::span<const int64_t> all(permuted.offsets);
    if (fetched != nullptr && permuted.offsets[lacking] > 0)
      fetched->Run(gathered.data.data(), all.subspan(0, lacking + 1), expert_out.data.data(), pool_);
    if (owned_[layer] != nullptr && permuted.offsets[e_count] > permuted.offsets[lacking]) {
      // The owned store's offsets start at zero: shift the tail of the offsets.
      std::vector<int64_t> tail(all.begin() + lacking, all.end());
      const int64_t base = tail[0];
      for (int64_t& t : tail) t -= base;
      owned_[layer]->Run(gathered.row(base), tail, expert_out.row(base), pool_);
    }
    for (int e = 0; e < e_count; ++e) {
      if (permuted.offsets[e + 1] == permuted.offsets[e]) continue;
      st.expert_bytes_read += e < lacking ? fetched->expert_bytes(e) : owned_[layer]->expert_bytes(e - lacking);
    }
    st.picks = n * k;
    st.experts_us += watch.Lap();
    Matrix my_out;
    CombinePermutedRows(expert_out, permuted, relabeled, &my_out);
    st.unpack_us += watch.Lap();
    st.expert_bytes_read += AddSharedExperts(shared_[layer].get(), mine, &my_out, pool_);
    st.shared_us += watch.Lap();
    buffers_[current].layer = -1;  // used: the next layers' reads may reuse this half
    buffers_[current].store.reset();

    if (tensor_parallel) {
      *out = Matrix(rows.rows, h);
      std::vector<int64_t> bytes(g);
      for (int r = 0; r < g; ++r) bytes[r] = (RowBegin(rows.rows, g, r + 1) - RowBegin(rows.rows, g, r)) * h * 4;
      const auto offsets = PrefixOffsets(bytes);
      EPMOE_RETURN_IF_ERROR(comm_.Allgatherv(my_out.data.data(), bytes[me], out->data.data(), bytes,
                                             std::span<const int64_t>(offsets.data(), g)));
      st.bytes_sent += bytes[me] * (g - 1);
      st.bytes_received += offsets[g] - bytes[me];
      st.combine_us += watch.Lap();
    } else {
      *out = std::move(my_out);
    }
    // Both halves: the fp32 experts as read and their packed copies.
    st.peak_buffer_bytes = 2 * static_cast<int64_t>(lacking) *
                           (expert_floats_ * 4 + ExpertByteCount(options_.pack.format, model_.hidden, model_.expert_intermediate));
    st.rounds = 1;
    if (stats != nullptr) *stats = st;
    return Status::Ok();
  }

 private:
  // One half of the double buffer: the lacking experts of `layer`, complete or being read, and
  // once complete, packed.
  struct Buffer {
    int layer = -1;
    bool pending = false;
    std::future<Status> fetch;  // threaded reads and packing
    std::vector<ExpertWeights> experts;
    std::unique_ptr<ExpertStore> store;  // null until complete (or when nothing is lacking)
  };

  int OwnerBegin(int rank) const {
    return static_cast<int>(static_cast<int64_t>(rank) * model_.num_experts / comm_.size());
  }
  int64_t FetchBytes() const { return static_cast<int64_t>(buffers_[0].experts.size()) * expert_floats_ * 4; }

  // Starts the one-sided reads of every lacking expert of `layer` into b.
  Status StartFetch(int layer, Buffer& b) {
    b.layer = layer;
    b.pending = true;
    auto issue = [this, layer, &b]() -> Status {
      const int g = comm_.size();
      const int64_t hi = expert_floats_ / 3;
      int index = 0;
      for (int owner = 0; owner < g; ++owner) {
        const int begin = OwnerBegin(owner), end = OwnerBegin(owner + 1);
        if (owner == comm_.rank()) continue;
        for (int e = begin; e < end; ++e, ++index) {
          const int64_t at = (static_cast<int64_t>(layer) * (end - begin) + (e - begin)) * expert_floats_ * 4;
          ExpertWeights& w = b.experts[index];
          EPMOE_RETURN_IF_ERROR(window_->Get(owner, at, hi * 4, w.gate.data.data()));
          EPMOE_RETURN_IF_ERROR(window_->Get(owner, at + hi * 4, hi * 4, w.up.data.data()));
          EPMOE_RETURN_IF_ERROR(window_->Get(owner, at + 2 * hi * 4, hi * 4, w.down.data.data()));
        }
      }
      if (!threaded_) return Status::Ok();
      EPMOE_RETURN_IF_ERROR(window_->Flush());
      return PackArrived(b);
    };
    if (threaded_) {
      b.fetch = std::async(std::launch::async, issue);
      return Status::Ok();
    }
    return issue();
  }

  // Waits for b's reads (and packing).
  Status Complete(Buffer& b) {
    if (!b.pending) return Status::Ok();
    b.pending = false;
    if (threaded_) return b.fetch.get();
    EPMOE_RETURN_IF_ERROR(window_->Flush());
    return PackArrived(b);
  }

  Status PackArrived(Buffer& b) {
    if (b.experts.empty()) return Status::Ok();
    EPMOE_ASSIGN_OR_RETURN(b.store, Pack(b.experts, options_.pack));
    return Status::Ok();
  }

  Communicator& comm_;
  ModelConfig model_;
  ExecutorOptions options_;
  ThreadPool& pool_;
  int64_t expert_floats_ = 0;
  int own_begin_ = 0, own_end_ = 0;
  bool threaded_ = false;
  std::unique_ptr<Window> window_;
  std::vector<std::unique_ptr<ExpertStore>> owned_;   // per layer; null when a rank owns none
  Buffer buffers_[2];
  std::vector<std::unique_ptr<ExpertStore>> shared_;  // per layer; null without shared experts
};

}  // namespace

Result<std::unique_ptr<MoeExecutor>> CreateDwdpExecutor(Communicator& comm, const ModelConfig& model,
                                                        const ExecutorOptions& options, ThreadPool& pool) {
  auto executor = std::make_unique<DwdpExecutor>(comm, model, options, pool);
  EPMOE_RETURN_IF_ERROR(executor->Init());
  return std::unique_ptr<MoeExecutor>(std::move(executor));
}

}  // namespace epmoe::ep_internal
