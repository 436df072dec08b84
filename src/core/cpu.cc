#include "epmoe/cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace epmoe {

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kReference: return "reference";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

std::vector<Isa> AllIsas() {
  return {Isa::kAvx512, Isa::kAvx2, Isa::kReference};
}

Result<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : AllIsas()) {
    if (name == IsaName(isa)) return isa;
  }
  return InvalidArgument(fmt::format("unknown instruction set '{}' (expected auto, avx512, avx2 or reference)", name));
}

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
    // __builtin_cpu_supports also checks that the OS saves the wide registers (XGETBV).
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    // F16C from CPUID leaf 1 (ECX bit 29): Clang's __builtin_cpu_supports does not know the name.
    // It needs AVX's register state, which the avx2 check includes.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    f.f16c = f.avx2 && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512vl = __builtin_cpu_supports("avx512vl");
    f.avx512dq = __builtin_cpu_supports("avx512dq");
    f.avx512vnni = __builtin_cpu_supports("avx512vnni");
    f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    f.avx512vbmi = __builtin_cpu_supports("avx512vbmi");
#endif
    return f;
  }();
  return features;
}

bool IsaSupportedBy(Isa isa, const CpuFeatures& f) {
  switch (isa) {
    case Isa::kReference: return true;
    case Isa::kAvx2: return f.avx2 && f.fma && f.f16c;
    case Isa::kAvx512:
      return IsaSupportedBy(Isa::kAvx2, f) && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni;
  }
  return false;
}

bool FormatSupportedBy(Isa isa, WeightFormat format, const CpuFeatures& f) {
  if (!IsaSupportedBy(isa, f)) return false;
  if (isa != Isa::kAvx512) return true;
  switch (format) {
    case WeightFormat::kBf16: return f.avx512bf16;  // VDPBF16PS
    case WeightFormat::kNvfp4:
    case WeightFormat::kMxfp4: return f.avx512vbmi;  // VPERMB
    default: return true;
  }
}

bool IsaSupported(Isa isa) {
  return IsaSupportedBy(isa, DetectCpuFeatures());
}

Isa BestSupportedIsa() {
  for (Isa isa : AllIsas()) {
    if (IsaSupported(isa)) return isa;
  }
  return Isa::kReference;
}

Isa IsaForFormat(WeightFormat format, Isa highest) {
  for (Isa isa : AllIsas()) {
    if (isa <= highest && FormatSupportedBy(isa, format, DetectCpuFeatures())) return isa;
  }
  return Isa::kReference;
}

Result<Isa> ResolveIsa(std::string_view requested) {
  Isa chosen = BestSupportedIsa();
  if (requested != "auto") {
    EPMOE_ASSIGN_OR_RETURN(chosen, ParseIsa(requested));
    if (!IsaSupported(chosen))
      return FailedPrecondition(fmt::format("this CPU cannot run the {} kernels (best available: {})", IsaName(chosen),
                                            IsaName(BestSupportedIsa())));
  }
  if (const char* env = std::getenv("EPMOE_ISA"); env != nullptr && *env != '\0') {
    auto cap = ParseIsa(env);
    if (!cap.ok()) return InvalidArgument(fmt::format("EPMOE_ISA: {}", cap.status().message()));
    chosen = std::min(chosen, *cap);
  }
  return chosen;
}

}  // namespace epmoe
