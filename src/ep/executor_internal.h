// Helpers shared by the executors (not part of the public API).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/matrix.h"
#include "epmoe/model.h"

namespace epmoe {

class ThreadPool;

namespace ep_internal {

class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  // Microseconds since construction or the last Lap, and restarts.
  double Lap() {
    const auto now = std::chrono::steady_clock::now();
    const double us = std::chrono::duration<double, std::micro>(now - start_).count();
    start_ = now;
    return us;
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// options.weights, or the synthetic weights of options.seed when it is null.
std::shared_ptr<const WeightSource> Weights(const ModelConfig& model, const ExecutorOptions& options);

// The shared experts of every layer packed whole (a full copy on this rank); empty stores (null)
// when the model has none.
Result<std::vector<std::unique_ptr<ExpertStore>>> PackSharedCopies(const ModelConfig& model,
                                                                   const ExecutorOptions& options);

// The shared output gate of every layer (MoeLayerWeights::shared_output_gate; empty ones when the
// model has none).
Result<std::vector<std::vector<float>>> SharedOutputGates(const ModelConfig& model, const ExecutorOptions& options);

// Checks rows and picks given to Forward.
Status CheckForwardInput(const ModelConfig& model, int num_layers, int layer, const Matrix& rows, const Picks& picks);

// The RebalanceTarget of an executor whose layers hold this rank's slots of the placement as one
// ExpertStore each (a2a, whole). Exports a slot when asked (kept until the next Install or
// DropStaged), keeps staged bytes aside, and on Install imports the staged slots of the switched
// layers (the Rebalancer then installs the placement in the LivePlacement, which the executor
// reads at its next step). Not thread-safe (between steps only).
class SlotStoresTarget final : public RebalanceTarget {
 public:
  SlotStoresTarget(int rank, const LivePlacement* live, std::vector<std::unique_ptr<ExpertStore>>* stores)
      : rank_(rank), live_(live), stores_(stores) {}
  int64_t expert_bytes() const override;
  std::span<const std::byte> slot_bytes(int layer, int slot) const override;
  Status Stage(int layer, int slot, std::span<const std::byte> bytes) override;
  Status Install(int layer_begin, int layer_end, PlacementPtr next) override;
  void DropStaged() override;

 private:
  // This rank's index of `slot`, or -1 when the slot is not on this rank or the layer is unknown.
  int LocalSlot(int layer, int slot) const;
  int rank_;
  const LivePlacement* live_;
  std::vector<std::unique_ptr<ExpertStore>>* stores_;
  mutable std::map<std::pair<int, int>, std::vector<std::byte>> exported_;
  std::map<std::pair<int, int>, std::vector<std::byte>> staged_;
};

// The exchange buffers A2aExecutor holds, in this order: returns, records sent and received,
// received rows decoded and in the kernel's input format, expert-ordered inputs and outputs,
// outputs going back; two levels only: records a gateway forwards and receives, forwarded
// records' outputs going back to their gateways and landing there.
inline constexpr int kA2aBuffers = 12;
// a2a low-latency: the bytes of one rank's message to a peer (a header of the sender's row count,
// then at most max_rows_per_rank records), and the fixed buffers sized from it for `ranks` ranks
// (none for two levels: low-latency is flat). The kernel's input format is bounded by fp32, as in
// normal mode's memory model.
int64_t LowLatencyMessageBytes(const ModelConfig& model, const ExecutorOptions& options);
std::array<int64_t, kA2aBuffers> LowLatencyBufferBytes(const ModelConfig& model, const ExecutorOptions& options,
                                                       int ranks);
int64_t LowLatencyBytes(const ModelConfig& model, const ExecutorOptions& options, int ranks);  // their sum

// Adds what one exchange moved to st: send_bytes[r] to and recv_bytes[r] from rank r (this rank's
// own entries do not count), and the part of it to or from ranks of other nodes.
void AddExchangeBytes(const Communicator& comm, std::span<const int64_t> send_bytes,
                      std::span<const int64_t> recv_bytes, StepStats* st);
// An all-gather: this rank's bytes[me] went to every other rank and bytes[r] came from rank r.
void AddAllgatherBytes(const Communicator& comm, std::span<const int64_t> bytes, StepStats* st);

// Makes rows travel: encode then decode (what a receiver sees).
void RoundTripRows(RowFormat format, const Matrix& rows, Matrix* out);

Result<std::unique_ptr<MoeExecutor>> CreateGatherExecutor(Communicator& comm, const ModelConfig& model,
                                                          const ExecutorOptions& options, ThreadPool& pool);
Result<std::unique_ptr<MoeExecutor>> CreateA2aExecutor(Communicator& comm, const ModelConfig& model,
                                                       const ExecutorOptions& options, ThreadPool& pool);
Result<std::unique_ptr<MoeExecutor>> CreateDwdpExecutor(Communicator& comm, const ModelConfig& model,
                                                        const ExecutorOptions& options, ThreadPool& pool);

}  // namespace ep_internal
}  // namespace epmoe
