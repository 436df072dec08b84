// The expert-kernel benchmark behind `epmoe bench kernels`: machine limits measured in the same
// run, then one MoE layer's routed experts (a model's shape, skewed routing) timed at several
// token counts for each weight format against the roofline bound
// max(bytes / bandwidth, operations / peak), and the decode experiment (time against bytes read
// and against picks over many small steps, split over ranks of whole experts, with a fitted line).
// RunKernelBench is a plain function; it uses the pool it is given and allocates the layer's
// weights (fp32 source plus one packed format at a time).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
  int decode_repetitions = 5;
  int64_t flush_bytes = int64_t{128} << 20;             // read before each timed run so weights come from DRAM
  int64_t bandwidth_buffer_bytes = int64_t{512} << 20;  // for MeasureMemoryBandwidth
};

// Medians of the limits measured at the start and again before each format.
struct MachineFigures {
  double read_gbps = 0;
  double fp32_gflops = 0;  // G operations/s, a multiply-add counts 2
  double bf16_gflops = 0;  // 0 when the instruction set has no such path
  double int8_gops = 0;
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
  // The run's medians (MachineFigures): bandwidth, and the peak of the kernel's arithmetic path.
  // Medians, not the figures measured next to the format: on a virtual machine one measurement
  // can land on faster memory (1.6x seen) and would misjudge that format alone.
  double read_gbps_used = 0;
  double peak_used = 0;
  double bandwidth_fraction = 0;  // gbps / read_gbps_used
  double operations = 0;          // 2 * picks * 3 * hidden * intermediate
  double gflops = 0;
  double bound_us = 0;           // max(bytes / read_gbps_used, operations / peak_used)
  bool memory_bound = false;     // which term of the bound is larger
  double roofline_fraction = 0;  // bound_us / us
  int repetitions = 0;
};

struct DecodeSample {
  int step = 0;
  int rank = 0;
  int64_t picks = 0;
  int64_t bytes = 0;
  double us = 0;
};

struct DecodeExperiment {
  WeightFormat format;
  std::vector<DecodeSample> samples;
  double fixed_us = 0;  // fitted time = fixed_us + us_per_gb * GB read
  double us_per_gb = 0;
  double correlation_bytes = 0;  // Pearson, time vs bytes read
  double correlation_picks = 0;  // Pearson, time vs picks
};

struct KernelBenchReport {
  int threads = 0;
  std::string isa;
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
