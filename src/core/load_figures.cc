#include "epmoe/load_figures.h"

#include <algorithm>
#include <numeric>

namespace epmoe {

double Balancedness(std::span<const double> per_rank) {
  if (per_rank.empty()) return 1;
  const double max = *std::max_element(per_rank.begin(), per_rank.end());
  if (max <= 0) return 1;
  return std::accumulate(per_rank.begin(), per_rank.end(), 0.0) / per_rank.size() / max;
}

double ProbabilityNoneHeld(int num_experts, double held, int top_k) {
  double p = 1.0;
  for (int i = 0; i < top_k; ++i) {
    const double numerator = num_experts - held - i;
    if (numerator <= 0) return 0.0;
    p *= numerator / (num_experts - i);
  }
  return p;
}

double ExpectedRanksPerRow(int num_experts, int top_k, int num_ranks) {
  const double held = static_cast<double>(num_experts) / num_ranks;
  return num_ranks * (1.0 - ProbabilityNoneHeld(num_experts, held, top_k));
}

}  // namespace epmoe
