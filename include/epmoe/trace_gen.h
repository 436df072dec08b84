// Synthetic routing traces: deterministic generators of per-row picks (with router weights) for
// studying balance and dispatch without a model. Every step is a function of the options and the
// seed only, so runs and machines agree.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "epmoe/trace.h"

namespace epmoe {

struct TraceGenOptions {
  std::string distribution = "uniform";  // uniform | zipf | gaussian | round-robin
  int num_layers = 4;
  int num_experts = 64;
  int top_k = 8;
  int64_t steps = 16;
  int64_t batch = 64;            // rows per step
  uint64_t seed = 1;
  double zipf_exponent = 1.0;    // zipf: the r-th most popular expert has weight 1 / (r + 1)^s
  double temperature = 1.0;      // gaussian: popularity = softmax(N(0, 1) logits / temperature)
  int64_t drift_every = 0;       // > 0: the popular set changes every N steps (a new expert order)
  double correlation = 0.0;      // 0..1: chance that a row keeps each of its request's experts
  int64_t request_steps = 16;    // with correlation: mean steps a request stays in the batch
};

// Checks ranges (layers, experts, 1 <= k <= experts, steps, batch, exponent, temperature,
// correlation in [0, 1]) with a message naming the field.
Status ValidateTraceGenOptions(const TraceGenOptions& options);

// Generates the steps of a synthetic trace one at a time. Sampling without replacement follows the
// popularity (Gumbel top-k: k distinct experts, each draw proportional to popularity among those
// left); the router weights are the normalized perturbed popularities of the chosen experts, in
// descending order. Each layer has its own expert order (the hot experts differ per layer).
// Round robin: row r (counted over the whole trace), pick j -> expert (r*k + j) mod E, weight 1/k.
// Correlated requests: each of the `batch` slots holds a request with, per layer, its own k experts
// (drawn from the popularity when it starts); each step a row keeps each of them with probability
// `correlation` and draws the rest; a request ends after each step with probability 1/request_steps.
// Not thread-safe.
class TraceGenerator {
 public:
  static Result<std::unique_ptr<TraceGenerator>> Create(const TraceGenOptions& options);
  const TraceInfo& info() const { return info_; }
  // Fills *step with the next step and returns true, or false after the last one.
  bool Next(StepPicks* step);

 private:
  explicit TraceGenerator(const TraceGenOptions& options);
  void UpdatePopularity(int64_t epoch);
  void SampleRow(int layer, uint64_t* rng, const int32_t* keep, int keep_count, int32_t* experts, float* weights);

  TraceGenOptions options_;
  TraceInfo info_;
  int64_t step_ = 0;
  int64_t epoch_ = -1;
  std::vector<double> log_popularity_;    // [layer][expert]
  std::vector<int32_t> request_experts_;  // [slot][layer][k], correlated requests
  std::vector<uint8_t> request_active_;   // [slot]
  std::vector<double> score_;             // SampleRow's scratch: perturbed log popularity per expert
  std::vector<int32_t> candidates_;       // SampleRow's scratch: experts not kept
};

// Writes a generated trace in the binary format.
Status GenerateTraceFile(const TraceGenOptions& options, const std::string& path);

}  // namespace epmoe
