// The machine's limits, measured by microbenchmarks: memory read bandwidth and the peak of each
// arithmetic path the expert kernels use. The roofline of `epmoe bench kernels` and the planner's
// measured hardware profile (`epmoe calibrate`) come from these. The measurements use the
// threads of the pool given; they are noisy when other processes run, so each returns the median
// of several repetitions. Thread-safe (the pool is used from one thread at a time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "epmoe/caches.h"
#include "epmoe/cpu.h"
#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

class ThreadPool;

enum class ArithmeticPath {
  kFp32Fma,   // fp32 fused multiply-add (AVX-512 or AVX2)
  kBf16Dot,   // bf16 pairs into fp32 (AVX-512 BF16: VDPBF16PS)
  kInt8Vnni,  // u8 x s8 quads into int32 (AVX-512 VNNI: VPDPBUSD)
  kInt8Madd,  // u8 x s8 pairs into 16 bits, then into int32 (AVX2: VPMADDUBSW, VPMADDWD, VPADDD)
  // VNNI with what a block-scaled format adds: each output's int32 sum of every 16 (nvfp4) or 32
  // (mxfp4) inputs converted to fp32 and multiplied by its block scale into an fp32 sum (VCVTDQ2PS,
  // VFMADD231PS). On CPUs where the FMA shares VPDPBUSD's ports (AMD Zen 4) this is the 4-bit
  // formats' real arithmetic ceiling; operations count only the dot's multiply-adds, as kInt8Vnni.
  kInt8VnniScale16,
  kInt8VnniScale32,
};
// "fp32_fma", "bf16_dot", "int8_vnni", "int8_madd", "int8_vnni_scale16", "int8_vnni_scale32"
const char* ArithmeticPathName(ArithmeticPath path);

// The arithmetic path the kernel of `format` runs on at instruction set `isa`: avx512 uses bf16 dot
// for bf16 and VNNI for int8 and the 4-bit formats; avx2 fp32 FMA for fp32 and bf16 (converted to
// fp32) and int8 multiply-adds for int8 and the 4-bit formats; reference fp32 FMA.
ArithmeticPath PathForFormat(WeightFormat format, Isa isa);
// The arithmetic `format` itself needs at `isa`, block scales included: on avx512 nvfp4 and mxfp4
// run kInt8VnniScale16 and kInt8VnniScale32; every other (format, isa) its PathForFormat.
ArithmeticPath BlockScaledPathForFormat(WeightFormat format, Isa isa);

// Reads `ranges` (any sizes) once with all threads of the pool, each range cut into pieces that the
// threads share out, with the widest loads `isa` has (lowered to what the CPU has), prefetching
// ahead as the kernels' streams do: GB/s (1e9 bytes per second). Where the ranges are a kernel's
// weights, this is the speed at which that memory can be read at that moment: the memory term of
// the kernel's roofline.
double MeasureReadRate(ThreadPool& pool, std::span<const std::span<const std::byte>> ranges, Isa isa = Isa::kAvx512);

// A buffer far larger than the caches that all threads of a pool read whole, each thread a
// disjoint part, with the widest loads an instruction set has. One read measures the memory's read
// bandwidth at that moment and leaves in the caches nothing of what ran before it, so a benchmark
// can read it before each timed run and judge the run against the bandwidth of that moment (on a
// shared or virtual machine the memory's speed changes by 1.6x within seconds).
class MemoryReadProbe {
 public:
  static constexpr int64_t kMinBytes = int64_t{64} << 20;  // twice the largest last-level cache seen
  // Allocates and touches `bytes` (rounded down to whole MB). Fails if they cannot be allocated or
  // are under kMinBytes (the reads would come from cache).
  static Result<MemoryReadProbe> Create(ThreadPool& pool, int64_t bytes, Isa isa = Isa::kAvx512);
  // Reads the buffer once; GB/s (1e9 bytes per second).
  double Read(ThreadPool& pool);

 private:
  struct Free {
    void operator()(uint8_t* memory) const;
  };
  MemoryReadProbe(std::unique_ptr<uint8_t, Free> buffer, int64_t bytes, Isa isa)
      : buffer_(std::move(buffer)), bytes_(bytes), isa_(isa) {}
  std::unique_ptr<uint8_t, Free> buffer_;
  int64_t bytes_;
  Isa isa_;
};

struct BandwidthOptions {
  int64_t buffer_bytes = BytesBeyondCaches(int64_t{512} << 20);  // so that reads come from DRAM
  int repetitions = 7;
};
// Read bandwidth in GB/s: a MemoryReadProbe of buffer_bytes, the median of `repetitions` reads.
Result<double> MeasureMemoryBandwidth(ThreadPool& pool, const BandwidthOptions& options = {}, Isa isa = Isa::kAvx512);

struct PeakOptions {
  double seconds_per_repetition = 0.05;
  int repetitions = 5;
};
// Peak arithmetic in G operations per second (a multiply-add is 2 operations): independent chains
// of the path's instruction in registers, on every thread until a common deadline
// (seconds_per_repetition), the sum of the threads' own rates; median over the repetitions. Fails
// when `isa` (lowered to what the CPU has) has no instruction for the path.
Result<double> MeasurePeak(ArithmeticPath path, ThreadPool& pool, const PeakOptions& options = {},
                           Isa isa = Isa::kAvx512);

}  // namespace epmoe
