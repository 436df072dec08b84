#include "epmoe/cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
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

const CpuIdentity& DetectCpuIdentity() {
  static const CpuIdentity identity = [] {
    CpuIdentity cpu;
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return cpu;
    char vendor[12];
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    cpu.vendor.assign(vendor, 12);
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0) {
      const int base_family = static_cast<int>((eax >> 8) & 0xf), base_model = static_cast<int>((eax >> 4) & 0xf);
      // The extended fields count only for these families (Intel's and AMD's CPUID documentation).
      cpu.family = base_family == 0xf ? base_family + static_cast<int>((eax >> 20) & 0xff) : base_family;
      cpu.model = base_family == 0xf || base_family == 0x6 ? (static_cast<int>((eax >> 16) & 0xf) << 4) | base_model
                                                           : base_model;
      cpu.stepping = static_cast<int>(eax & 0xf);
    }
    if (static_cast<unsigned>(__get_cpuid_max(0x80000000, nullptr)) >= 0x80000004u) {
      char brand[48];
      for (unsigned leaf = 0; leaf < 3; ++leaf) {
        __get_cpuid(0x80000002 + leaf, &eax, &ebx, &ecx, &edx);
        const unsigned words[4] = {eax, ebx, ecx, edx};
        std::memcpy(brand + 16 * leaf, words, 16);
      }
      std::string name(brand, strnlen(brand, sizeof(brand)));
      const size_t first = name.find_first_not_of(' ');
      cpu.name = first == std::string::npos ? "" : name.substr(first, name.find_last_not_of(' ') - first + 1);
    }
#endif
    return cpu;
  }();
  return identity;
}

std::string CoreGeneration(const CpuIdentity& cpu) {
  if (cpu.vendor != "AuthenticAMD") return "";
  const int m = cpu.model;
  switch (cpu.family) {
    case 0x17: return m >= 0x30 ? "Zen 2" : "Zen or Zen+";
    case 0x19:
      // Zen 4: Genoa (0x10 - 0x1f), Raphael and Phoenix (0x60 - 0x7f), Bergamo and Siena (0xa0 - 0xaf);
      // the others Zen 3 (Milan 0x00 - 0x0f, the client parts).
      return (m >= 0x10 && m <= 0x1f) || (m >= 0x60 && m <= 0x7f) || (m >= 0xa0 && m <= 0xaf) ? "Zen 4" : "Zen 3";
    case 0x1a: return "Zen 5";
    default: return "";
  }
}

std::string DescribeCpu(const CpuIdentity& cpu) {
  if (cpu.vendor.empty()) return "unknown CPU";
  const std::string generation = CoreGeneration(cpu);
  return fmt::format("{} ({} family {:#x} model {:#x} stepping {}{}{})", cpu.name.empty() ? "unnamed CPU" : cpu.name,
                     cpu.vendor, cpu.family, cpu.model, cpu.stepping, generation.empty() ? "" : ", ", generation);
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
