#include "epmoe/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <random>

#include "epmoe/enum_names.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

// Orders expert (or group) ids by descending score, lower id first among equals.
struct ByScoreThenId {
  const float* score;
  bool operator()(int a, int b) const {
    if (score[a] != score[b]) return score[a] > score[b];
    return a < b;
  }
};

// The k best ids of `score` (length n) among those allowed, best first.
void TopK(const float* score, int n, int k, const std::vector<char>* allowed, std::vector<int>& ids) {
  ids.clear();
  for (int e = 0; e < n; ++e) {
    if (allowed == nullptr || (*allowed)[e]) ids.push_back(e);
  }
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), ByScoreThenId{score});
  ids.resize(k);
}

}  // namespace

namespace {
constexpr EnumNames<RoutingMode, 4> kRoutingModes("routing", {{{RoutingMode::kScores, "scores"},
                                                               {RoutingMode::kRoundRobin, "round_robin"},
                                                               {RoutingMode::kUniform, "uniform"},
                                                               {RoutingMode::kReplay, "replay"}}});
}  // namespace

const char* RoutingModeName(RoutingMode mode) {
  return kRoutingModes.Name(mode);
}
Result<RoutingMode> ParseRoutingMode(std::string_view name) {
  return kRoutingModes.Parse(name);
}

Status ValidatePicks(const Picks& picks, int num_experts) {
  if (picks.rows < 0 || picks.k <= 0)
    return InvalidArgument(fmt::format("picks: bad shape rows={} k={}", picks.rows, picks.k));
  const size_t n = static_cast<size_t>(picks.rows) * picks.k;
  if (picks.experts.size() != n || picks.weights.size() != n)
    return InvalidArgument(fmt::format("picks: expected {} experts and weights, got {} and {}", n, picks.experts.size(),
                                       picks.weights.size()));
  if (picks.k > num_experts)
    return InvalidArgument(fmt::format("picks: k = {} exceeds the {} experts", picks.k, num_experts));
  for (int64_t r = 0; r < picks.rows; ++r) {
    for (int j = 0; j < picks.k; ++j) {
      const int32_t e = picks.expert(r, j);
      if (e < 0 || e >= num_experts)
        return InvalidArgument(
            fmt::format("picks: row {} pick {} names expert {}, outside [0, {})", r, j, e, num_experts));
      if (!std::isfinite(picks.weight(r, j)))
        return InvalidArgument(fmt::format("picks: row {} pick {} has a non-finite weight", r, j));
      for (int i = 0; i < j; ++i) {
        if (picks.expert(r, i) == e) return InvalidArgument(fmt::format("picks: row {} picks expert {} twice", r, e));
      }
    }
  }
  return Status::Ok();
}

std::vector<int64_t> CountPicks(const Picks& picks, int num_experts) {
  std::vector<int64_t> counts(num_experts, 0);
  for (int32_t e : picks.experts) ++counts[e];
  return counts;
}

Router::Router(const ModelConfig& model) : model_(model) {}

Status Router::RouteLogits(const Matrix& logits, std::span<const float> bias, Picks* picks, ThreadPool* pool) const {
  const int n = model_.num_experts;
  const int k = model_.top_k;
  if (logits.cols != n)
    return InvalidArgument(fmt::format("router: logits have {} columns, the model has {} experts", logits.cols, n));
  const bool use_bias = model_.scoring == Scoring::kSigmoid && model_.correction_bias;
  if (use_bias && static_cast<int>(bias.size()) != n)
    return InvalidArgument(fmt::format("router: correction bias has {} values, expected {}", bias.size(), n));
  if (!use_bias && !bias.empty())
    return InvalidArgument("router: a correction bias was given but the model does not use one");
  for (float b : bias) {
    if (!std::isfinite(b)) return InvalidArgument("router: correction bias holds a non-finite value");
  }

  picks->rows = logits.rows;
  picks->k = k;
  picks->experts.assign(logits.rows * k, 0);
  picks->weights.assign(logits.rows * k, 0.0f);

  // Rows are routed independently, in chunks on the pool's threads (softmax and top-k over 512
  // experts take about 5 us a row); a chunk stops at its first row with a non-finite score, and the
  // lowest such row is reported.
  constexpr int64_t kChunkRows = 16;
  std::atomic<int64_t> first_bad_row{logits.rows};
  ParallelFor(pool, logits.rows, kChunkRows, [&](int64_t begin, int64_t end) {
    const int groups = model_.num_expert_groups;
    const int per_group = n / groups;
    std::vector<float> prob(n), choose(n), group_score(groups);
    std::vector<int> ids, group_ids;
    std::vector<char> allowed(n);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = logits.row(r);
      if (FirstNonFinite({x, static_cast<size_t>(n)}) >= 0) {
        int64_t seen = first_bad_row.load();
        while (r < seen && !first_bad_row.compare_exchange_weak(seen, r)) {
        }
        return;
      }

      switch (model_.scoring) {
        case Scoring::kSoftmax: {
          const float max = *std::max_element(x, x + n);
          double sum = 0;
          for (int e = 0; e < n; ++e) sum += prob[e] = std::exp(x[e] - max);
          for (int e = 0; e < n; ++e) prob[e] = static_cast<float>(prob[e] / sum);
          choose = prob;
          break;
        }
        case Scoring::kSoftmaxTopk:
          std::copy(x, x + n, prob.begin());
          choose = prob;
          break;
        case Scoring::kSigmoid:
          for (int e = 0; e < n; ++e) {
            prob[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(x[e]))));
            choose[e] = use_bias ? prob[e] + bias[e] : prob[e];
          }
          break;
      }

      const std::vector<char>* mask = nullptr;
      if (groups > 1) {
        for (int g = 0; g < groups; ++g) {
          TopK(choose.data() + g * per_group, per_group, model_.group_rank_experts, nullptr, ids);
          group_score[g] = 0;
          for (int id : ids) group_score[g] += choose[g * per_group + id];
        }
        TopK(group_score.data(), groups, model_.topk_groups, nullptr, group_ids);
        std::fill(allowed.begin(), allowed.end(), 0);
        for (int g : group_ids) std::fill(allowed.begin() + g * per_group, allowed.begin() + (g + 1) * per_group, 1);
        mask = &allowed;
      }
      TopK(choose.data(), n, k, mask, ids);

      int32_t* out_ids = &picks->experts[r * k];
      float* out_w = &picks->weights[r * k];
      double sum = 0;
      if (model_.scoring == Scoring::kSoftmaxTopk) {
        const float max = x[ids[0]];
        for (int j = 0; j < k; ++j) sum += std::exp(static_cast<double>(x[ids[j]]) - max);
        for (int j = 0; j < k; ++j) {
          out_ids[j] = ids[j];
          out_w[j] = static_cast<float>(std::exp(static_cast<double>(x[ids[j]]) - max) / sum * model_.routed_scaling);
        }
        continue;
      }
      for (int j = 0; j < k; ++j) sum += prob[ids[j]];
      const double scale = (model_.renormalize ? 1.0 / sum : 1.0) * model_.routed_scaling;
      for (int j = 0; j < k; ++j) {
        out_ids[j] = ids[j];
        out_w[j] = static_cast<float>(prob[ids[j]] * scale);
      }
    }
  });
  if (const int64_t r = first_bad_row.load(); r < logits.rows) {
    const int64_t bad = FirstNonFinite({logits.row(r), static_cast<size_t>(n)});
    return InvalidArgument(fmt::format("router: score of row {} for expert {} is {}", r, bad, logits.at(r, bad)));
  }
  return Status::Ok();
}

Status Router::Route(const Matrix& rows, const RouterWeights& weights, std::span<const float> bias, Picks* picks,
                     ThreadPool* pool) const {
  if (rows.cols != model_.hidden)
    return InvalidArgument(
        fmt::format("router: rows have {} columns, the model's hidden size is {}", rows.cols, model_.hidden));
  if (weights.experts() != model_.num_experts || weights.hidden() != model_.hidden)
    return InvalidArgument(fmt::format("router: weight is {}x{}, expected {}x{}", weights.experts(), weights.hidden(),
                                       model_.num_experts, model_.hidden));
  const int64_t bad = FirstNonFinite(rows.data);
  if (bad >= 0)
    return InvalidArgument(
        fmt::format("router: row {} column {} is {}", bad / rows.cols, bad % rows.cols, rows.data[bad]));
  Matrix logits;
  weights.Logits(rows, &logits, pool);
  if (!model_.router_bias) return RouteLogits(logits, bias, picks, pool);
  if (static_cast<int>(bias.size()) != model_.num_experts)
    return InvalidArgument(
        fmt::format("router: the router's bias has {} values, expected {}", bias.size(), model_.num_experts));
  for (int64_t r = 0; r < logits.rows; ++r) {
    float* x = logits.row(r);
    for (int e = 0; e < model_.num_experts; ++e) x[e] += bias[e];
  }
  return RouteLogits(logits, {}, picks, pool);
}

Picks RoundRobinPicks(const ModelConfig& model, int64_t rows, int64_t first_row) {
  Picks picks;
  picks.rows = rows;
  picks.k = model.top_k;
  picks.experts.resize(rows * model.top_k);
  picks.weights.assign(rows * model.top_k, static_cast<float>(model.routed_scaling / model.top_k));
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < model.top_k; ++j) {
      picks.experts[r * model.top_k + j] =
          static_cast<int32_t>(((first_row + r) * model.top_k + j) % model.num_experts);
    }
  }
  return picks;
}

Picks UniformPicks(const ModelConfig& model, int64_t rows, uint64_t seed, int64_t first_row) {
  Picks picks;
  picks.rows = rows;
  picks.k = model.top_k;
  picks.experts.resize(rows * model.top_k);
  picks.weights.resize(rows * model.top_k);
  std::vector<int32_t> pool(model.num_experts);
  for (int64_t r = 0; r < rows; ++r) {
    // One generator per global row: ranks that hold different rows of a batch agree with one process.
    std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(first_row + r));
    std::iota(pool.begin(), pool.end(), 0);
    double sum = 0;
    for (int j = 0; j < model.top_k; ++j) {
      const int64_t pick = j + static_cast<int64_t>(rng() % static_cast<uint64_t>(model.num_experts - j));
      std::swap(pool[j], pool[pick]);
      picks.experts[r * model.top_k + j] = pool[j];
      const double w = 0.05 + static_cast<double>(rng() >> 11) * 0x1.0p-53;
      picks.weights[r * model.top_k + j] = static_cast<float>(w);
      sum += w;
    }
    for (int j = 0; j < model.top_k; ++j) {
      float& w = picks.weights[r * model.top_k + j];
      w = static_cast<float>(w / sum * model.routed_scaling);
    }
  }
  return picks;
}

}  // namespace epmoe
