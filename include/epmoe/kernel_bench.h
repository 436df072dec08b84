// The expert-kernel benchmark behind `epmoe bench kernels`: machine limits measured in the same
// run, then one MoE layer's routed experts (a model's shape, skewed routing) timed at several
// token counts for each weight format against the roofline bound
// max(bytes / bandwidth, operations / peak), and the decode experiment (time against bytes read
// and against picks over many small steps, split over ranks of whole experts, with a fitted line).
// RunKernelBench is a plain function; it uses the pool it is given and holds one format's packed
// experts at a time (made in fp32 one expert per thread at a time), with the rows of one point.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "epmoe/caches.h"
#include "epmoe/cpu.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/machine_limits.h"
#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

class ThreadPool;

struct KernelBenchOptions {
  std::vector<WeightFormat> formats = AllWeightFormats();
  std::vector<int64_t> tokens = {1, 8, 16, 64, 256, 1024, 8192};
  int hidden = 2048;  // the layer's shape (qwen3-30b-a3b by default)
  int intermediate = 768;
  int experts = 128;
  int top_k = 8;
  // The experts' activation, and biases on their projections: the model's (gpt-oss runs its own).
  GatedActivation activation;
  bool expert_bias = false;
  std::string isa = "auto";
  double skew_sigma = 0.3;  // expert popularity ~ exp(sigma * N(0,1)): max/mean load ~2 at large T
  uint64_t seed = 1;
  int repetitions = 5;             // timed runs per point (median), fewer when a point is slow
  double seconds_per_point = 3.0;  // stop repeating a point after this much time
  bool decode = true;              // run the decode experiment
  int decode_steps = 32;
  int decode_min_tokens = 8;
  int decode_max_tokens = 16;
  int decode_ranks = 8;
  // Which whole experts make a rank's share: expert e on rank e % decode_ranks (round-robin), or
  // with contiguous_shares on rank e / (experts / decode_ranks), 16 consecutive experts here (the
  // usual expert-parallel layout). Round-robin by default: on a Zen 5 VM a contiguous share lies
  // in one region of memory, and regions read 7 - 20% faster than one another in a pattern that
  // changed from process to process, so each rank's samples ran faster or slower than their bytes
  // said; round-robin shares spread every rank over all regions (the ranks' speeds 1.05 - 1.14 x
  // apart with contiguous shares, 1.01 - 1.03 x round-robin).
  bool decode_contiguous_shares = false;
  // Passes of the decode experiment over all of its samples, each a timed run of every sample (a
  // sample's time is the median of its runs): at least decode_repetitions, then more until the
  // experiment has taken decode_seconds. The shortest samples need the most runs: on a Zen 5 VM
  // whose memory's speed wandered between 28 and 56 GB/s from run to run, a 4-bit sample's runs
  // (0.3 - 0.7 ms) spread by 11 - 13% (their coefficient of variation), fp32's (4 - 6 ms) by 7%, and
  // r(bytes) of nvfp4 / mxfp4 / int8 went 0.895 / 0.932 / 0.935 with 9 runs a sample, 0.982 / 0.981
  // / 0.989 with 21, 0.987 / 0.987 / 0.991 with 32. A budget in seconds gives the short samples
  // those runs at the cost of their own length: in 30 s there 4-bit samples get about 24 runs,
  // fp32's about 10.
  int decode_repetitions = 9;
  double decode_seconds = 30;
  // The MemoryReadProbe read before each timed run and before each read of the run's weights: it
  // flushes the caches (so that both come from memory) and samples the machine's bandwidth: 128 MB,
  // or 4 x the last-level caches where they are larger than 32 MB.
  int64_t probe_bytes = BytesBeyondCaches(int64_t{128} << 20);
  // Refuse, before anything runs, the formats whose KernelBenchMemoryBytes exceeds this (0: no limit).
  int64_t max_memory_bytes = 0;
};

// About the most memory RunKernelBench holds while it runs `format` on `threads` threads: the
// format's packed experts, the experts being made in fp32, the rows, outputs and Run's scratch of the
// largest point, the decode experiment's rows and the probe buffer.
int64_t KernelBenchMemoryBytes(const KernelBenchOptions& options, WeightFormat format, int threads);

// The machine's limits over the run: the peaks are medians of measurements at the start and before
// each format, the read bandwidth the median of every MemoryReadProbe read (at the start and
// beside each timed run). The points are judged against their own weights' read rate instead.
struct MachineFigures {
  double read_gbps = 0;
  // The 5th and 95th percentiles of those reads: how far the memory's speed moved during the run (on
  // a shared virtual machine 31 - 35 GB/s in one state, 55 - 63 in another), which is what spreads
  // the decode experiment's samples.
  double read_gbps_low = 0, read_gbps_high = 0;
  double fp32_gflops = 0;  // G operations/s, a multiply-add counts 2
  double bf16_gflops = 0;  // 0 when the instruction set has no such path
  double int8_gops = 0;    // VNNI
  double int8_madd_gops = 0;  // AVX2 multiply-adds (the avx2 kernels' int8 and 4-bit path)
  double int8_scale16_gops = 0;  // VNNI with nvfp4's block scales (ArithmeticPath::kInt8VnniScale16)
  double int8_scale32_gops = 0;  // VNNI with mxfp4's block scales

  // The peak of `path` (the field above that holds it).
  const double& peak(ArithmeticPath path) const;
  double& peak(ArithmeticPath path);
};

struct KernelBenchPoint {
  WeightFormat format;
  std::string kernel;
  int64_t tokens = 0;
  int64_t picks = 0;
  int experts_touched = 0;
  int64_t max_rows_per_expert = 0;
  double us = 0;      // median time of the layer's routed experts
  int64_t bytes = 0;  // expert weight bytes read (touched experts, scales included)
  double gbps = 0;
  // The bandwidth the point is judged against: the rate at which its touched experts' bytes are
  // read by a plain read loop (MeasureReadRate) just before each timed run, median. On a shared
  // virtual machine how fast memory delivers differs by up to 1.6x between allocations and over
  // time; this keeps either from being taken for the kernel's speed. The peak: the run's median
  // for the kernel's arithmetic path (MachineFigures).
  double read_gbps_used = 0;
  double peak_used = 0;
  // The fractions are medians over the point's timed runs of each run against the read of its
  // weights just before it: (bytes / read rate) / time, and max(that, operations / peak) / time.
  double bandwidth_fraction = 0;
  double operations = 0;  // 2 * picks * 3 * hidden * intermediate
  double gflops = 0;
  double bound_us = 0;           // max(bytes / read_gbps_used, operations / peak_used)
  bool memory_bound = false;     // which term of the bound is larger
  double roofline_fraction = 0;  // about bound_us / us (see bandwidth_fraction)
  // The bound with the arithmetic the format itself needs (BlockScaledPathForFormat): for nvfp4
  // and mxfp4 on avx512 the block scales' multiply-adds, which share VPDPBUSD's ports, make the
  // arithmetic term larger (the same as bound_us for the other formats).
  double block_scaled_peak_used = 0;
  double block_scaled_bound_us = 0;
  double block_scaled_roofline_fraction = 0;  // about block_scaled_bound_us / us, as roofline_fraction
  // The bound taken expert by expert: the sum over touched experts of max(expert bytes / read rate,
  // expert operations / block_scaled_peak_used). A layer that runs its experts one after another,
  // all threads on one expert at a time (as ExpertStore::Run hands out its work), cannot beat it:
  // an expert with few rows waits for memory, one with many for arithmetic, and the whole layer's
  // bound lets the two overlap. Only a schedule that runs a memory-bound expert on one core beside
  // an arithmetic-bound one on another could beat it, and only where one core can read more than
  // its share of the bandwidth. Equal to block_scaled_bound_us where every touched expert is bound
  // by the same term; bound_us / expert_bound_us is the most of roofline_fraction such a layer can
  // reach with this format on this CPU.
  double expert_bound_us = 0;
  double expert_roofline_fraction = 0;        // about expert_bound_us / us, as roofline_fraction
  int repetitions = 0;                        // timed runs the figures are medians of
  // Timed runs during which the host took CPU time from this machine (steal time on a virtual
  // machine): left out of the figures, unless no run was free of it.
  int runs_with_stolen_time = 0;
};

struct DecodeSample {
  int step = 0;
  int rank = 0;
  int64_t picks = 0;
  int64_t bytes = 0;
  double us = 0;         // median of its runs at the experiment's memory speed
  double read_gbps = 0;  // its weights' read rate beside those runs (KernelBenchPoint::read_gbps_used)
};

// How far (a fraction) a decode run's read may lie from its experiment's memory speed.
inline constexpr double kDecodeSpeedTolerance = 0.15;

// How a decode experiment's ranks share the experts, as the bench prints it: "contiguous" or
// "round-robin" (KernelBenchOptions::decode_contiguous_shares).
inline const char* DecodeSharesName(bool contiguous) {
  return contiguous ? "contiguous" : "round-robin";
}

struct DecodeExperiment {
  WeightFormat format;
  bool contiguous_shares = false;  // KernelBenchOptions::decode_contiguous_shares
  std::vector<DecodeSample> samples;
  double fixed_us = 0;  // fitted time = fixed_us + us_per_gb * GB read
  double us_per_gb = 0;
  double correlation_bytes = 0;  // Pearson, time vs bytes read
  double correlation_picks = 0;  // Pearson, time vs picks
  // Pearson, bytes read vs each sample's time scaled by the memory's speed (the median over all of
  // its runs of each run's time x the read rate of its weights just before it): what is left once
  // the memory's own changes of speed between runs are taken out, and the differences between
  // regions of memory (on a Zen 5 VM one rank's experts read 7 - 20% faster than another's, in a
  // pattern that changed from process to process).
  double correlation_bytes_steady = 0;
  // The experiment's memory speed: the median of the largest band of the reads beside its runs, a
  // band being the reads within kDecodeSpeedTolerance of one of them (DensestBandMedian). A run
  // whose read lies more than kDecodeSpeedTolerance from it ran while the memory was in another
  // state (a shared virtual machine's memory changes between two speeds, 1.7 x apart here) and is
  // left out of the samples' times; samples short of runs at this speed are run again, up to twice
  // as many runs.
  double median_read_gbps = 0;
  int passes = 0;  // timed runs of every sample (before the runs at another speed are left out)
  int runs_left_out = 0;
  int samples_off_speed = 0;  // samples with no run at that speed: all of their runs count
};

struct KernelBenchReport {
  CpuIdentity cpu;  // what the figures were measured on
  int threads = 0;
  std::string isa;
  int64_t probe_bytes = 0;             // the options' probe_bytes
  // LastLevelCacheBytes(): what the probe has to be well over; 0 where the system does not say
  // (some virtual machines have no sysfs cache directory), and the probe is then its floor.
  int64_t last_level_cache_bytes = 0;
  MachineFigures limits;
  std::vector<KernelBenchPoint> points;
  std::vector<DecodeExperiment> decode;
};

// progress (optional) receives one line per stage, for a terminal.
Result<KernelBenchReport> RunKernelBench(const KernelBenchOptions& options, ThreadPool& pool,
                                         const std::function<void(const std::string&)>& progress = {});

// Least squares y = a + b x and Pearson correlations (0 for fewer than 2 points or no spread).
void FitLine(const std::vector<double>& x, const std::vector<double>& y, double* intercept, double* slope);
double Correlation(const std::vector<double>& x, const std::vector<double>& y);

}  // namespace epmoe
