#include "epmoe/expert_ffn.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "epmoe/cpu.h"
#include "epmoe/synthetic.h"
#include "kernels/expert_store.h"

namespace epmoe {

void ReferenceExpertFfn(const ExpertWeights& expert, const GatedActivation& activation, std::span<const float> row,
                        std::span<float> out) {
  const int64_t hidden = expert.hidden();
  const int64_t inter = expert.intermediate();
  const double limit = activation.limit;
  std::vector<double> act(inter);
  for (int64_t i = 0; i < inter; ++i) {
    double g = expert.gate_bias.empty() ? 0.0 : expert.gate_bias[i];
    double u = expert.up_bias.empty() ? 0.0 : expert.up_bias[i];
    for (int64_t c = 0; c < hidden; ++c) {
      g += static_cast<double>(expert.gate.at(i, c)) * row[c];
      u += static_cast<double>(expert.up.at(i, c)) * row[c];
    }
    g = std::min(g, limit);
    u = std::max(-limit, std::min(u, limit));
    act[i] = g / (1.0 + std::exp(-activation.alpha * g)) * (u + activation.up_offset);
  }
  for (int64_t h = 0; h < hidden; ++h) {
    double acc = expert.down_bias.empty() ? 0.0 : expert.down_bias[h];
    for (int64_t i = 0; i < inter; ++i) acc += static_cast<double>(expert.down.at(h, i)) * act[i];
    out[h] = static_cast<float>(acc);
  }
}

void FillSyntheticExpert(TensorKind gate, TensorKind up, TensorKind down, int64_t hidden, int64_t inter, int layer,
                         int index, uint64_t seed, int64_t begin, int64_t end, bool biased, ExpertWeights* out) {
  if (end < 0) end = inter;
  const int64_t width = end - begin;
  out->gate.Reshape(width, hidden);
  out->up.Reshape(width, hidden);
  out->down.Reshape(hidden, width);
  FillSynthetic(seed, {gate, layer, index, inter, hidden}, begin, width, 0, hidden, out->gate.data.data());
  FillSynthetic(seed, {up, layer, index, inter, hidden}, begin, width, 0, hidden, out->up.data.data());
  FillSynthetic(seed, {down, layer, index, hidden, inter}, 0, hidden, begin, width, out->down.data.data());
  out->gate_bias.resize(biased ? width : 0);
  out->up_bias.resize(biased ? width : 0);
  out->down_bias.resize(biased && begin == 0 ? hidden : 0);
  if (!biased) return;
  FillSynthetic(seed, {TensorKind::kExpertGateBias, layer, index, 1, inter}, 0, 1, begin, width, out->gate_bias.data());
  FillSynthetic(seed, {TensorKind::kExpertUpBias, layer, index, 1, inter}, 0, 1, begin, width, out->up_bias.data());
  if (begin == 0)
    FillSynthetic(seed, {TensorKind::kExpertDownBias, layer, index, 1, hidden}, 0, 1, 0, hidden, out->down_bias.data());
}

namespace {

Status CheckExpertShape(const ExpertWeights& x, int expert, int64_t hidden, int64_t inter) {
  if (x.gate.rows != inter || x.gate.cols != hidden || x.up.rows != inter || x.up.cols != hidden ||
      x.down.rows != hidden || x.down.cols != inter)
    return InvalidArgument(
        fmt::format("pack experts: expert {} has shapes gate {}x{}, up {}x{}, down {}x{}; expected "
                    "gate and up {}x{}, down {}x{}",
                    expert, x.gate.rows, x.gate.cols, x.up.rows, x.up.cols, x.down.rows, x.down.cols, inter, hidden,
                    hidden, inter));
  const std::pair<const std::vector<float>*, int64_t> biases[3] = {
      {&x.gate_bias, inter}, {&x.up_bias, inter}, {&x.down_bias, hidden}};
  for (int b = 0; b < 3; ++b) {
    static constexpr const char* kNames[3] = {"gate", "up", "down"};
    const std::vector<float>& bias = *biases[b].first;
    if (!bias.empty() && static_cast<int64_t>(bias.size()) != biases[b].second)
      return InvalidArgument(fmt::format("pack experts: expert {} has a {} bias of {} values; expected {} (or none)",
                                         expert, kNames[b], bias.size(), biases[b].second));
    for (size_t i = 0; i < bias.size(); ++i) {
      if (!std::isfinite(bias[i]))
        return InvalidArgument(
            fmt::format("pack experts: expert {} {} bias value {} is {}", expert, kNames[b], i, bias[i]));
    }
  }
  return Status::Ok();
}

Result<std::unique_ptr<ExpertStore>> Pack(int count, int64_t hidden, int64_t inter,
                                          const kernels::KernelExpertStore::Source& source,
                                          const PackOptions& options) {
  EPMOE_RETURN_IF_ERROR(CheckShape(options.format, inter, hidden));
  EPMOE_RETURN_IF_ERROR(CheckShape(options.format, hidden, inter));
  Result<Isa> isa = ResolveIsa(options.isa);
  if (!isa.ok()) return isa.status().WithContext("pack experts");
  EPMOE_ASSIGN_OR_RETURN(auto store, kernels::KernelExpertStore::Create(count, hidden, inter, source, options.format,
                                                                        options.activation, *isa, options.pool));
  return std::unique_ptr<ExpertStore>(std::move(store));
}

}  // namespace

Result<std::unique_ptr<ExpertStore>> PackExperts(std::span<const ExpertWeights* const> experts,
                                                 const PackOptions& options) {
  if (experts.empty()) return InvalidArgument("pack experts: no experts given");
  const int64_t hidden = experts[0]->hidden();
  const int64_t inter = experts[0]->intermediate();
  for (size_t e = 0; e < experts.size(); ++e)
    EPMOE_RETURN_IF_ERROR(CheckExpertShape(*experts[e], static_cast<int>(e), hidden, inter));
  return Pack(
      static_cast<int>(experts.size()), hidden, inter,
      [&](int e, ExpertWeights*) -> Result<const ExpertWeights*> { return experts[e]; }, options);
}

Result<std::unique_ptr<ExpertStore>> PackExperts(int count, int64_t hidden, int64_t intermediate,
                                                 const ExpertMaker& make, const PackOptions& options) {
  if (count <= 0) return InvalidArgument(fmt::format("pack experts: {} experts to make", count));
  if (hidden <= 0 || intermediate <= 0)
    return InvalidArgument(fmt::format("pack experts: shape hidden {} x intermediate {}", hidden, intermediate));
  auto made = [&](int e, ExpertWeights* scratch) -> Result<const ExpertWeights*> {
    const Status status = make(e, scratch);
    if (!status.ok()) return status.WithContext(fmt::format("pack experts: expert {}", e));
    EPMOE_RETURN_IF_ERROR(CheckExpertShape(*scratch, e, hidden, intermediate));
    return scratch;
  };
  return Pack(count, hidden, intermediate, made, options);
}

}  // namespace epmoe
