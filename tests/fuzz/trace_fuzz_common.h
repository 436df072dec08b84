// Shared by the trace readers' libFuzzer targets: runs an importer on the bytes and checks that an
// accepted trace is consistent (every step's counts match its shape). A crash, sanitizer report,
// leak or failed check is a finding; a refused input is not.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "epmoe/trace.h"
#include "trace/imported.h"

namespace epmoe::fuzz {

inline void CheckImported(const Result<trace_internal::ImportedTrace>& trace) {
  if (!trace.ok()) {
    if (trace.status().message().empty()) std::abort();  // every refusal says why
    return;
  }
  const TraceInfo& info = trace->info;
  for (const StepPicks& step : trace->steps) {
    if (step.counts.size() != static_cast<size_t>(info.num_layers) * info.num_experts) std::abort();
    if (info.has_picks) {
      if (static_cast<int>(step.layers.size()) != info.num_layers) std::abort();
      for (const Picks& picks : step.layers)
        if (picks.rows != step.rows || !ValidatePicks(picks.weights.empty() ? Picks{picks.rows, picks.k, picks.experts,
                                                                                     std::vector<float>(picks.experts.size(), 1.0f)}
                                                                               : picks,
                                                      info.num_experts)
                                             .ok())
          std::abort();
    }
  }
}

inline std::istringstream StreamOf(const uint8_t* data, size_t size) {
  return std::istringstream(std::string(reinterpret_cast<const char*>(data), size), std::ios::binary);
}

}  // namespace epmoe::fuzz
