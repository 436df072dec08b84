// Synthetic trace generators (see trace_gen.h).
#include "epmoe/trace_gen.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

namespace epmoe {
namespace {

// splitmix64: a small counter-based generator; identical on every platform (unlike <random>'s
// distributions), which keeps generated traces reproducible.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
uint64_t Seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) { return Mix(Mix(Mix(seed ^ Mix(a)) ^ b) ^ c); }
// Uniform in (0, 1).
double NextUniform(uint64_t* state) {
  *state = Mix(*state);
  return (static_cast<double>(*state >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
double NextGumbel(uint64_t* state) { return -std::log(-std::log(NextUniform(state))); }
double NextGaussian(uint64_t* state) {
  const double u = NextUniform(state), v = NextUniform(state);
  return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
}

}  // namespace

Status ValidateTraceGenOptions(const TraceGenOptions& o) {
  const std::string& d = o.distribution;
  if (d != "uniform" && d != "zipf" && d != "gaussian" && d != "round-robin")
    return InvalidArgument(fmt::format("distribution '{}': expected uniform, zipf, gaussian or round-robin", d));
  if (o.num_layers < 1 || o.num_layers > (1 << 16)) return InvalidArgument(fmt::format("layers {} out of [1, 65536]", o.num_layers));
  if (o.num_experts < 1 || o.num_experts > (1 << 20))
    return InvalidArgument(fmt::format("experts {} out of [1, 1048576]", o.num_experts));
  if (o.top_k < 1 || o.top_k > o.num_experts || o.top_k > 1024)
    return InvalidArgument(fmt::format("top-k {} out of [1, min(experts {}, 1024)]", o.top_k, o.num_experts));
  if (o.steps < 0) return InvalidArgument(fmt::format("steps {} is negative", o.steps));
  if (o.batch < 1) return InvalidArgument(fmt::format("batch {} is not positive", o.batch));
  if (o.batch * o.top_k * o.num_layers > (int64_t{1} << 28))
    return OutOfRange(fmt::format("one step of {} rows x top-{} x {} layers exceeds 2^28 picks", o.batch, o.top_k,
                                  o.num_layers));
  if (!(o.zipf_exponent >= 0 && o.zipf_exponent <= 100))
    return InvalidArgument(fmt::format("zipf exponent {} out of [0, 100]", o.zipf_exponent));
  if (!(o.temperature > 0 && o.temperature <= 1e6))
    return InvalidArgument(fmt::format("temperature {} is not in (0, 1e6]", o.temperature));
  if (o.drift_every < 0) return InvalidArgument(fmt::format("drift-every {} is negative", o.drift_every));
  if (!(o.correlation >= 0 && o.correlation <= 1))
    return InvalidArgument(fmt::format("correlation {} out of [0, 1]", o.correlation));
  if (o.request_steps < 1) return InvalidArgument(fmt::format("request steps {} is not positive", o.request_steps));
  return Status::Ok();
}

TraceGenerator::TraceGenerator(const TraceGenOptions& options) : options_(options) {
  info_.format = "synthetic";
  info_.num_layers = options.num_layers;
  info_.num_experts = options.num_experts;
  info_.top_k = options.top_k;
  info_.has_picks = true;
  info_.has_weights = true;
  info_.num_steps = options.steps;
  info_.layer_ids.resize(options.num_layers);
  std::iota(info_.layer_ids.begin(), info_.layer_ids.end(), 0);
  info_.description = fmt::format("{} seed {}", options.distribution, options.seed);
  log_popularity_.assign(static_cast<size_t>(options.num_layers) * options.num_experts, 0.0);
  if (options.correlation > 0) {
    request_experts_.assign(static_cast<size_t>(options.batch) * options.num_layers * options.top_k, 0);
    request_active_.assign(static_cast<size_t>(options.batch), 0);
  }
}

Result<std::unique_ptr<TraceGenerator>> TraceGenerator::Create(const TraceGenOptions& options) {
  EPMOE_RETURN_IF_ERROR(ValidateTraceGenOptions(options));
  return std::unique_ptr<TraceGenerator>(new TraceGenerator(options));
}

void TraceGenerator::UpdatePopularity(int64_t epoch) {
  if (epoch == epoch_) return;
  epoch_ = epoch;
  const int E = options_.num_experts;
  std::vector<int> order(E);
  for (int l = 0; l < options_.num_layers; ++l) {
    uint64_t rng = Seed(options_.seed, 0x706f70, static_cast<uint64_t>(l), static_cast<uint64_t>(epoch));
    // A random expert order per layer and epoch (Fisher-Yates): order[r] is the r-th most popular.
    std::iota(order.begin(), order.end(), 0);
    for (int i = E - 1; i > 0; --i) {
      const int j = static_cast<int>(NextUniform(&rng) * (i + 1));
      std::swap(order[i], order[std::min(j, i)]);
    }
    double* log_p = &log_popularity_[static_cast<size_t>(l) * E];
    for (int r = 0; r < E; ++r) {
      double value = 0;
      if (options_.distribution == "zipf") value = -options_.zipf_exponent * std::log(r + 1.0);
      if (options_.distribution == "gaussian") value = NextGaussian(&rng) / options_.temperature;
      log_p[order[r]] = value;
    }
  }
}

void TraceGenerator::SampleRow(int layer, uint64_t* rng, const int32_t* keep, int keep_count, int32_t* experts,
                               float* weights) {
  const int E = options_.num_experts, k = options_.top_k;
  const double* log_p = &log_popularity_[static_cast<size_t>(layer) * E];
  std::vector<double>& score = score_;
  std::vector<int32_t>& candidates = candidates_;
  score.resize(E);
  candidates.clear();
  for (int e = 0; e < E; ++e) score[e] = log_p[e] + NextGumbel(rng);
  // Kept experts first, then the best-scored others (Gumbel top-k = sampling without replacement).
  int chosen = 0;
  for (int i = 0; i < keep_count; ++i) experts[chosen++] = keep[i];
  for (int e = 0; e < E; ++e)
    if (std::find(keep, keep + keep_count, e) == keep + keep_count) candidates.push_back(e);
  const int need = k - chosen;
  auto better = [&](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::partial_sort(candidates.begin(), candidates.begin() + need, candidates.end(), better);
  std::copy(candidates.begin(), candidates.begin() + need, experts + chosen);
  std::sort(experts, experts + k, better);
  double sum = 0;
  const double top = score[experts[0]];
  for (int j = 0; j < k; ++j) sum += std::exp(score[experts[j]] - top);
  for (int j = 0; j < k; ++j) weights[j] = static_cast<float>(std::exp(score[experts[j]] - top) / sum);
}

bool TraceGenerator::Next(StepPicks* step) {
  if (step_ >= options_.steps) return false;
  const int L = options_.num_layers, E = options_.num_experts, k = options_.top_k;
  const int64_t B = options_.batch;
  UpdatePopularity(options_.drift_every > 0 ? step_ / options_.drift_every : 0);
  step->rows = B;
  step->layers.assign(L, Picks{});
  std::vector<int32_t> keep(k);
  for (int l = 0; l < L; ++l) {
    Picks& picks = step->layers[l];
    picks.rows = B;
    picks.k = k;
    picks.experts.resize(static_cast<size_t>(B) * k);
    picks.weights.resize(static_cast<size_t>(B) * k);
    for (int64_t r = 0; r < B; ++r) {
      int32_t* experts = &picks.experts[r * k];
      float* weights = &picks.weights[r * k];
      if (options_.distribution == "round-robin") {
        const int64_t row = step_ * B + r;
        for (int j = 0; j < k; ++j) {
          experts[j] = static_cast<int32_t>((row * k + j) % E);
          weights[j] = 1.0f / static_cast<float>(k);
        }
        continue;
      }
      uint64_t rng = Seed(options_.seed, static_cast<uint64_t>(step_), static_cast<uint64_t>(l), static_cast<uint64_t>(r));
      int keep_count = 0;
      if (options_.correlation > 0 && request_active_[r]) {
        const int32_t* previous = &request_experts_[(static_cast<size_t>(r) * L + l) * k];
        for (int j = 0; j < k; ++j)
          if (NextUniform(&rng) < options_.correlation) keep[keep_count++] = previous[j];
      }
      SampleRow(l, &rng, keep.data(), keep_count, experts, weights);
      if (options_.correlation > 0)
        std::copy(experts, experts + k, &request_experts_[(static_cast<size_t>(r) * L + l) * k]);
    }
  }
  if (options_.correlation > 0) {
    // Requests end at random (geometric lengths, mean request_steps); the slot then starts a new one.
    for (int64_t r = 0; r < B; ++r) {
      uint64_t rng = Seed(options_.seed, static_cast<uint64_t>(step_), 0x656e64, static_cast<uint64_t>(r));
      request_active_[r] = NextUniform(&rng) >= 1.0 / static_cast<double>(options_.request_steps);
    }
  }
  CountStepPicks(L, E, step);
  ++step_;
  return true;
}

Status GenerateTraceFile(const TraceGenOptions& options, const std::string& path) {
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<TraceGenerator> generator, TraceGenerator::Create(options));
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<TraceWriter> writer, TraceWriter::Create(path, generator->info()));
  StepPicks step;
  while (generator->Next(&step)) EPMOE_RETURN_IF_ERROR(writer->Append(step));
  return writer->Close();
}

}  // namespace epmoe
