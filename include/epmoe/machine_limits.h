// The machine's limits, measured by microbenchmarks: memory read bandwidth and the peak of each
// arithmetic path the expert kernels use. The roofline of `epmoe bench kernels` and the planner's
// measured hardware profile (`epmoe calibrate`) come from these. The measurements use the
// threads of the pool given; they are noisy when other processes run, so each returns the median
// of several repetitions. Thread-safe (the pool is used from one thread at a time).
#pragma once

#include <cstdint>
#include <string_view>

#include "epmoe/cpu.h"
#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

class ThreadPool;

enum class ArithmeticPath {
  kFp32Fma,   // fp32 fused multiply-add (AVX-512 or AVX2)
  kBf16Dot,   // bf16 pairs into fp32 (AVX-512 BF16: VDPBF16PS)
  kInt8Vnni,  // u8 x s8 quads into int32 (AVX-512 VNNI: VPDPBUSD)
};
const char* ArithmeticPathName(ArithmeticPath path);  // "fp32_fma", "bf16_dot", "int8_vnni"

// The arithmetic path the kernel of `format` runs on at instruction set `isa` (reference and
// avx2 dequantize to fp32 and use fp32 FMA; avx512 uses bf16 dot for bf16 and VNNI for int8 and
// the 4-bit formats).
ArithmeticPath PathForFormat(WeightFormat format, Isa isa);

struct BandwidthOptions {
  int64_t buffer_bytes = int64_t{512} << 20;  // far larger than the caches, so reads come from DRAM
  int repetitions = 7;
};
// Read bandwidth in GB/s (1e9 bytes per second): all threads of the pool sum disjoint parts of the
// buffer with the widest loads `isa` has; median over the repetitions. Fails if the buffer cannot
// be allocated or is smaller than 64 MB.
Result<double> MeasureMemoryBandwidth(ThreadPool& pool, const BandwidthOptions& options = {}, Isa isa = Isa::kAvx512);

struct PeakOptions {
  double seconds_per_repetition = 0.05;
  int repetitions = 5;
};
// Peak arithmetic in G operations per second (a multiply-add is 2 operations): independent chains
// of the path's instruction on every thread, in registers; median over the repetitions. Fails when
// `isa` (lowered to what the CPU has) has no instruction for the path.
Result<double> MeasurePeak(ArithmeticPath path, ThreadPool& pool, const PeakOptions& options = {},
                           Isa isa = Isa::kAvx512);

}  // namespace epmoe
