// libFuzzer target: ImportSglangJson (the sglang-json importer) on arbitrary bytes, then regrouping into
// decode steps and prefill chunks when it accepts them.
#include "trace_fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace epmoe;
  std::istringstream in = fuzz::StreamOf(data, size);
  LoadReadOptions options;
  auto trace = trace_internal::ImportSglangJson(in, "fuzz", options);
  fuzz::CheckImported(trace);
  if (trace.ok() && trace->info.has_picks) {
    fuzz::CheckImported(trace_internal::RegroupSteps(*trace, "decode", 3));
    fuzz::CheckImported(trace_internal::RegroupSteps(*trace, "prefill", 0));
  }
  return 0;
}
