// Derived quantities of a model preset: sizes, even-router coverage, copies per row, memory per rank;
// the phase names.
#include <algorithm>
#include <cmath>

#include "epmoe/enum_names.h"
#include "epmoe/plan.h"

namespace epmoe {

namespace {
constexpr EnumNames<PlanPhase, 2> kPlanPhases("phase",
                                              {{{PlanPhase::kDecode, "decode"}, {PlanPhase::kPrefill, "prefill"}}});
}  // namespace

const char* PlanPhaseName(PlanPhase phase) {
  return kPlanPhases.Name(phase);
}
Result<PlanPhase> ParsePlanPhase(std::string_view name) {
  return kPlanPhases.Parse(name);
}

int64_t WeightsPerExpert(const ModelConfig& m) { return 3LL * m.hidden * m.expert_intermediate; }
int64_t WeightsPerSharedExpert(const ModelConfig& m) {
  return 3LL * m.hidden * m.shared_intermediate * m.num_shared_experts;
}
int64_t WeightsPerDenseLayer(const ModelConfig& m) { return 3LL * m.hidden * m.dense_intermediate; }
int64_t FourBitBytes(int64_t weights) { return weights / 2; }

double EvenTouchedShare(const ModelConfig& m, int64_t tokens) {
  const double miss_one_row = 1.0 - static_cast<double>(m.top_k) / m.num_experts;
  return 1.0 - std::pow(miss_one_row, static_cast<double>(tokens));
}

double CopiesSentPerRow(const ModelConfig& m, int gpus) {
  return ExpectedRanksPerRow(m.num_experts, m.top_k, gpus) * (gpus - 1) / gpus;
}

int64_t PickRowBytes(const ModelConfig& m, WeightFormat experts, int output_bytes) {
  const int64_t d = m.hidden;
  int64_t input = 0;
  switch (experts) {
    case WeightFormat::kFp32: input = 4 * d; break;
    case WeightFormat::kBf16: input = 2 * d; break;
    case WeightFormat::kInt8: input = d; break;
    case WeightFormat::kNvfp4: input = d / 2 + d / 16; break;  // 4-bit values, a 1-byte scale per 16
    case WeightFormat::kMxfp4: input = d / 2 + (d + 31) / 32; break;
  }
  return input + 2LL * output_bytes * d;
}

int64_t AllToAllBytesPerToken(const ModelConfig& m, int bytes_per_number) {
  return 2LL * m.top_k * m.hidden * bytes_per_number;
}

ModelBytes ComputeModelBytes(const ModelConfig& m, const WeightFormats& formats) {
  ModelBytes b;
  b.expert = RoutedExpertBytes(m, formats.experts);
  b.routed_layer = b.expert * m.num_experts;
  b.shared_layer = m.num_shared_experts > 0
                       ? m.num_shared_experts * ExpertByteCount(formats.shared, m.hidden, m.shared_intermediate)
                       : 0;
  b.dense_layer = m.num_dense_layers > 0 ? ExpertByteCount(formats.dense, m.hidden, m.dense_intermediate) : 0;
  b.routed_model = b.routed_layer * m.num_moe_layers();
  return b;
}

int64_t DwdpBytesPerRankPerLayer(const ModelConfig& m, WeightFormat format, int gpus) {
  const int64_t layer = RoutedExpertBytes(m, format) * m.num_experts;
  return layer / gpus * (gpus - 1);
}

MemoryPerRank ComputeMemoryPerRank(const ModelConfig& m, const WeightFormats& formats, EpOption option, int gpus,
                                   SharedMode shared, SharedMode dense) {
  const ModelBytes b = ComputeModelBytes(m, formats);
  const int64_t moe_layers = m.num_moe_layers();
  MemoryPerRank mem;
  mem.routed = b.routed_layer / gpus * moe_layers;
  mem.shared = (SharedIsSliced(option, shared) ? b.shared_layer / gpus : b.shared_layer) * moe_layers;
  mem.dense = (SharedIsSliced(option, dense) ? b.dense_layer / gpus : b.dense_layer) * m.num_dense_layers;
  // DWDP starts its fetches two layers ahead: two buffers of the experts a rank lacks.
  if (option == EpOption::kDwdp) mem.fetch_buffers = 2 * DwdpBytesPerRankPerLayer(m, formats.experts, gpus);
  return mem;
}

}  // namespace epmoe
