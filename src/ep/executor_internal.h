// Helpers shared by the executors (not part of the public API).
#pragma once

#include <chrono>
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

// The source of routed and shared weights with the synthetic defaults filled in.
ExpertSource RoutedSource(const ModelConfig& model, const ExecutorOptions& options);
ExpertSource SharedSource(const ModelConfig& model, const ExecutorOptions& options);

// Packs the given weights into one store.
Result<std::unique_ptr<ExpertStore>> Pack(const std::vector<ExpertWeights>& experts, const PackOptions& options);

// The shared experts of every layer packed whole (a full copy on this rank); empty stores (null)
// when the model has none.
Result<std::vector<std::unique_ptr<ExpertStore>>> PackSharedCopies(const ModelConfig& model,
                                                                   const ExecutorOptions& options);

// out[r] += shared_s(rows[r]) for every shared expert s of the store, in order s = 0, 1, ...
// Returns the bytes of shared weights read (0 when there are no rows or no store).
int64_t AddSharedExperts(const ExpertStore* shared, const Matrix& rows, Matrix* out, ThreadPool& pool);

// Checks rows and picks given to Forward.
Status CheckForwardInput(const ModelConfig& model, int num_layers, int layer, const Matrix& rows, const Picks& picks);

// The placement to use: the given one (checked against the model and ranks) or the trivial one.
Result<PlacementPtr> ResolvePlacement(const ModelConfig& model, const ExecutorOptions& options, int num_ranks,
                                      int num_nodes);

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
