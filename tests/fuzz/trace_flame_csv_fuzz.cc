// libFuzzer target: one FLAME-MoE layer CSV (ParseFlameLayerCsv) on arbitrary bytes.
#include "trace_fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace epmoe;
  std::istringstream in = fuzz::StreamOf(data, size);
  Picks picks;
  int experts = 0;
  Status status = trace_internal::ParseFlameLayerCsv(in, "fuzz", &picks, &experts);
  if (status.ok()) {
    if (experts < 1 || picks.rows < 1 || picks.k < 1 || !ValidatePicks(picks, experts).ok()) std::abort();
  } else if (status.message().empty()) {
    std::abort();
  }
  return 0;
}
