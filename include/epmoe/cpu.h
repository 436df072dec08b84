// CPU feature detection and the choice of instruction set for the expert kernels and the router's
// logits (RouterWeights, router.h).
//
// Kernels exist for an ordered list of instruction sets, best first: avx512 (F, BW, VL, DQ and
// VNNI, as on Intel Cascade Lake and later and AMD Zen 4; its 4-bit kernels also need VBMI, its
// bf16 kernel BF16), avx2 (with FMA and F16C), and reference (plain C++, always available). The best
// one the CPU has is chosen once at run time, per weight format (Ice Lake runs bf16 on avx2 and the
// rest on avx512); the environment variable EPMOE_ISA (e.g. EPMOE_ISA=avx2) or an explicit request
// can force a lower one, never a higher one. All functions are thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

enum class Isa { kReference = 0, kAvx2 = 1, kAvx512 = 2 };

const char* IsaName(Isa isa);
// "reference", "avx2" or "avx512".
Result<Isa> ParseIsa(std::string_view name);
// Best first: avx512, avx2, reference.
std::vector<Isa> AllIsas();

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false, avx512vbmi = false;
};

// What this CPU (and OS) supports, detected once.
const CpuFeatures& DetectCpuFeatures();

// Which CPU this is, as CPUID reports it, so that a benchmark's figures say what they were measured
// on (a virtual machine may report only a generic name, e.g. "AMD EPYC", but keeps the family and
// model). Empty vendor and zeros off x86.
struct CpuIdentity {
  std::string vendor;  // "AuthenticAMD", "GenuineIntel"
  std::string name;    // the brand string, surrounding spaces removed
  int family = 0;      // display family and model: the base fields plus the extended ones
  int model = 0;
  int stepping = 0;
};

// Detected once.
const CpuIdentity& DetectCpuIdentity();

// The AMD core generation a family and model belong to ("Zen 4", "Zen 5"), or "" where not known
// (every other vendor: Intel's model numbers do not follow generations).
std::string CoreGeneration(const CpuIdentity& cpu);

// One line: "AMD EPYC (AuthenticAMD family 0x1a model 0x2 stepping 1, Zen 5)".
std::string DescribeCpu(const CpuIdentity& cpu);

// Whether a CPU with `features` can run the kernels of `isa` (at least one format's), and its kernel
// for weights of `format`.
bool IsaSupportedBy(Isa isa, const CpuFeatures& features);
bool FormatSupportedBy(Isa isa, WeightFormat format, const CpuFeatures& features);

// The same for this CPU.
bool IsaSupported(Isa isa);

// The best instruction set this CPU supports (ignores EPMOE_ISA).
Isa BestSupportedIsa();

// The instruction set whose kernel runs weights of `format` on this CPU when `highest` is asked for:
// the best one not above it that has a kernel for the format (Ice Lake asked for avx512 runs bf16 on
// avx2). A kernel may give way further for shapes it cannot run.
Isa IsaForFormat(WeightFormat format, Isa highest);

// Resolves a request: "auto" is the best supported one, lowered to EPMOE_ISA when that is set; a
// named set must be supported by the CPU and is also lowered to EPMOE_ISA when that is lower.
// Fails on unknown names (in the request or in EPMOE_ISA) and on sets the CPU lacks.
Result<Isa> ResolveIsa(std::string_view requested);

}  // namespace epmoe
