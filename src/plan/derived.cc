// Derived quantities of a model preset: sizes, even-router coverage, copies per row, memory per rank.
#include <algorithm>
#include <cmath>

#include "epmoe/plan.h"

namespace epmoe {

const char* PlanOptionName(PlanOption option) {
  switch (option) {
    case PlanOption::kSliced: return "sliced";
    case PlanOption::kWholeAllRows: return "whole";
    case PlanOption::kHybrid: return "hybrid";
    case PlanOption::kTravelingRows: return "rows";
    case PlanOption::kTravelingWeights: return "weights";
  }
  return "unknown";
}

std::vector<PlanOption> AllPlanOptions() {
  return {PlanOption::kSliced, PlanOption::kWholeAllRows, PlanOption::kHybrid, PlanOption::kTravelingRows,
          PlanOption::kTravelingWeights};
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

double ProbabilityNoneHeld(int num_experts, double held, int top_k) {
  // C(E - h, k) / C(E, k) = prod_{i<k} (E - h - i) / (E - i), continued to non-integer h.
  double p = 1.0;
  for (int i = 0; i < top_k; ++i) {
    const double numerator = num_experts - held - i;
    if (numerator <= 0) return 0.0;
    p *= numerator / (num_experts - i);
  }
  return p;
}

double ExpectedRanksPerRow(const ModelConfig& m, int gpus) {
  const double held = static_cast<double>(m.num_experts) / gpus;
  return gpus * (1.0 - ProbabilityNoneHeld(m.num_experts, held, m.top_k));
}

double CopiesSentPerRow(const ModelConfig& m, int gpus) {
  const double held = static_cast<double>(m.num_experts) / gpus;
  return (gpus - 1) * (1.0 - ProbabilityNoneHeld(m.num_experts, held, m.top_k));
}

int64_t RowBytes(const ModelConfig& m, RowFormat format) {
  if (format == RowFormat::kBf16) return 2LL * m.hidden;
  return m.hidden / 2 + m.hidden / 16;  // 4-bit values + one 1-byte scale per 16 (NVFP4)
}

int64_t PickRowBytes(const ModelConfig& m, WeightFormat experts, int output_bytes) {
  const int64_t d = m.hidden;
  int64_t input = 0;
  switch (experts) {
    case WeightFormat::kFp32: input = 4 * d; break;
    case WeightFormat::kBf16: input = 2 * d; break;
    case WeightFormat::kInt8: input = d; break;
    case WeightFormat::kNvfp4: input = RowBytes(m, RowFormat::kFp4); break;  // an NVFP4 row, as rows travel
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

bool SharedIsSliced(PlanOption option, Sharing shared) {
  if (shared == Sharing::kAuto)
    return option == PlanOption::kSliced || option == PlanOption::kWholeAllRows || option == PlanOption::kHybrid;
  return shared == Sharing::kSliced;
}

MemoryPerRank ComputeMemoryPerRank(const ModelConfig& m, const WeightFormats& formats, PlanOption option, int gpus,
                                   Sharing shared, Sharing dense) {
  const ModelBytes b = ComputeModelBytes(m, formats);
  const int64_t moe_layers = m.num_moe_layers();
  MemoryPerRank mem;
  mem.routed = b.routed_layer / gpus * moe_layers;
  mem.shared = (SharedIsSliced(option, shared) ? b.shared_layer / gpus : b.shared_layer) * moe_layers;
  mem.dense = (SharedIsSliced(option, dense) ? b.dense_layer / gpus : b.dense_layer) * m.num_dense_layers;
  // DWDP starts its fetches two layers ahead: two buffers of the experts a rank lacks.
  if (option == PlanOption::kTravelingWeights) mem.fetch_buffers = 2 * DwdpBytesPerRankPerLayer(m, formats.experts, gpus);
  return mem;
}

}  // namespace epmoe
