// libFuzzer target: the streamed binary trace reader on arbitrary bytes.
#include <memory>

#include "trace/binary.h"
#include "trace_fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace epmoe;
  auto reader = trace_internal::OpenBinaryTrace(
      std::make_unique<std::istringstream>(std::string(reinterpret_cast<const char*>(data), size), std::ios::binary),
      static_cast<int64_t>(size), "fuzz");
  if (!reader.ok()) return 0;
  const TraceInfo info = (*reader)->info();
  StepPicks step;
  while (true) {
    auto more = (*reader)->Next(&step);
    if (!more.ok() || !*more) break;
    if (step.counts.size() != static_cast<size_t>(info.num_layers) * info.num_experts) std::abort();
    if (info.has_picks)
      for (const Picks& picks : step.layers)
        for (int32_t e : picks.experts)
          if (e < 0 || e >= info.num_experts) std::abort();
  }
  return 0;
}
