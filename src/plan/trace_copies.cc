// Copies per row measured from a trace's per-row picks (not the share-of-picks estimate).
#include <algorithm>

#include <fmt/format.h>

#include "epmoe/plan.h"
#include "epmoe/trace.h"

namespace epmoe {

Result<std::vector<double>> TraceCopiesPerRow(TraceReader& reader, const std::vector<int>& gpus, int64_t max_rows) {
  if (!reader.has_picks()) return InvalidArgument("the trace has no per-row picks (counts only)");
  for (int g : gpus)
    if (g < 1 || g > reader.num_experts())
      return InvalidArgument(fmt::format("EP size {} is outside 1..{} (the trace's experts)", g, reader.num_experts()));
  const int experts = reader.num_experts();
  std::vector<double> copies(gpus.size(), 0.0);
  int64_t rows_seen = 0;
  std::vector<int> ranks;
  StepPicks step;
  while (rows_seen < max_rows) {
    EPMOE_ASSIGN_OR_RETURN(bool more, reader.Next(&step));
    if (!more) break;
    for (const Picks& picks : step.layers) {
      for (size_t i = 0; i < gpus.size(); ++i) {
        const int g = gpus[i];
        for (int64_t r = 0; r < picks.rows; ++r) {
          // Rows start data-parallel: row r of the step lives on rank r * G / rows.
          const int home = static_cast<int>(r * g / picks.rows);
          ranks.clear();
          for (int j = 0; j < picks.k; ++j) ranks.push_back(static_cast<int>(int64_t{picks.expert(r, j)} * g / experts));
          std::sort(ranks.begin(), ranks.end());
          ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
          copies[i] += static_cast<double>(ranks.size()) - (std::binary_search(ranks.begin(), ranks.end(), home) ? 1 : 0);
        }
      }
      rows_seen += picks.rows;
    }
  }
  if (rows_seen == 0) return InvalidArgument("the trace has no rows");
  for (auto& c : copies) c /= static_cast<double>(rows_seen);
  return copies;
}

}  // namespace epmoe
