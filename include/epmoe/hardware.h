// Hardware profiles: what the planner needs to know about a machine to price each option.
//
// A profile describes one kind of node (GPUs, or a CPU server) and how nodes are linked; an EP group
// of G ranks spans ceil(G / gpus_per_node) such nodes. Profiles live in configs/hardware/<name>.json
// and are compiled into the binary (LoadHardware("b300x8")); a path to a .json file loads that file.
// Every number records its source in the profile's "sources" list. JSON layout (all fields required
// unless marked optional; units in the names):
//   name, description, sources[]          strings
//   gpus_per_node                         ranks that share the fast link domain (NVLink, one host)
//   ranks_share_device                    true on a CPU server: ranks on a node share one memory
//                                         system and its arithmetic (each gets 1/ranks of it)
//   nodes_share_device (optional)         true for a cluster emulated on one machine (a network
//                                         namespace per node, shaped links between them): the
//                                         ranks of every node share that machine, so with
//                                         ranks_share_device each of G ranks gets 1/G of it
//   cores (optional)                      threads the device runs at once (a CPU server: the
//                                         threads epmoe calibrate measured with); where a device's
//                                         ranks x two-batch-overlap lanes exceed it, the lanes
//                                         take turns on the cores (see plan.h, TBO)
//   memory: {capacity_gb, bandwidth_gbs, read_efficiency, copy_gbs (optional)}
//                                         per device; read_efficiency = share of the data-sheet
//                                         bandwidth an expert kernel reaches when reading weights;
//                                         copy_gbs = bytes the whole device copies per second
//                                         (memcpy far beyond the caches on every core: each byte
//                                         read once and written once), measured by epmoe
//                                         calibrate; priced where ranks_share_device (DWDP's
//                                         fetches are such copies); absent: half the read rate
//   row_codec_ns (optional)               ns one core takes per number to encode a row of fp32
//                                         into bf16 and to decode and add one back (a2a's pack and
//                                         unpack of every record and output on a CPU server),
//                                         measured by epmoe calibrate; absent: not priced (GPUs)
//   peak_tflops: {fp32, bf16, int8, fp8, fp4}   dense data-sheet peaks per arithmetic path
//   arithmetic_efficiency                 share of the peak a grouped expert kernel reaches
//   gemm_efficiency                       share of the peak a plain GEMM reaches (shared expert,
//                                         dense FFN layers: every row, one matrix, no routing)
//   kernel_fixed_us                       fixed cost of one layer's expert kernel (launch, tail)
//   intra_node, inter_node: {bandwidth_gbs, efficiency, latency_us}
//                                         per rank and direction; latency_us = fixed cost of one
//                                         collective step (launch + synchronization), not wire time;
//                                         exchange_latency_us (optional) = fixed cost of one
//                                         all-to-all step (a small alltoallv among the ranks, as
//                                         a2a's dispatch and combine are), when measured
//   partial_sums (optional)               "bf16" (default) or "fp32": the format of the runtime's
//                                         expert outputs per pick and of the partial sums the
//                                         all-gather options reduce-scatter: bf16 in GPU runtimes
//                                         (SGLang), fp32 in epmoe's CPU executors
//   kernel_lines (optional): [{format, fixed_us, us_per_gb, source, sliced_extra_us (optional)}]
//                                         a measured line "time = fixed + us_per_gb x GB read" for
//                                         experts stored in `format`; it replaces the bandwidth
//                                         term and the fixed cost for that format
// HardwareProfile is a plain value (thread-compatible).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/caches.h"
#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

// A link between ranks: per-rank bandwidth in one direction, its achieved share, a fixed cost.
struct LinkSpec {
  double bandwidth_gbs = 0;  // GB/s (10^9 bytes) per rank and direction, data sheet
  double efficiency = 0;     // share of bandwidth_gbs reached by collectives, (0, 1]
  double latency_us = 0;     // fixed cost of one collective step (>= 0)
  // Share of bandwidth_gbs reached by one-sided reads (DWDP's weight fetches), when measured
  // (`epmoe calibrate --links`); 0: as collectives.
  double one_sided_efficiency = 0;
  // Fixed cost of one all-to-all step (every rank sends a message to every other at once), when
  // measured (`epmoe calibrate --links`); 0: latency_us.
  double exchange_latency_us = 0;

  double exchange_step_us() const { return exchange_latency_us > 0 ? exchange_latency_us : latency_us; }
  double bytes_per_second() const { return bandwidth_gbs * 1e9 * efficiency; }
  double one_sided_bytes_per_second() const {
    return bandwidth_gbs * 1e9 * (one_sided_efficiency > 0 ? one_sided_efficiency : efficiency);
  }
};

// A measured expert-kernel line: time = fixed_us + us_per_gb x (GB of weights read).
struct KernelLine {
  WeightFormat format = WeightFormat::kNvfp4;
  double fixed_us = 0;
  double us_per_gb = 0;
  double sliced_extra_us = 0;  // extra fixed cost when the experts are sliced (optional, default 0)
  std::string source;
};

// Dense peaks per arithmetic path, in TFLOP/s (TOP/s for int8).
struct PeakTflops {
  double fp32 = 0, bf16 = 0, int8 = 0, fp8 = 0, fp4 = 0;
};

struct HardwareProfile {
  std::string name;
  std::string description;
  std::vector<std::string> sources;
  int gpus_per_node = 0;
  bool ranks_share_device = false;
  bool nodes_share_device = false;  // optional: every node of the EP group runs on one machine
  int cores = 0;                    // optional (0: not known): threads the device runs at once
  double memory_capacity_gb = 0;
  double memory_bandwidth_gbs = 0;
  double memory_read_efficiency = 0;
  double memory_copy_gbs = 0;  // optional (0: absent), see CopyBytesPerSecond
  double row_codec_ns = 0;     // optional (0: absent): ns per number and row encoded or decoded
  PeakTflops peak_tflops;
  double arithmetic_efficiency = 0;
  double gemm_efficiency = 0;
  double kernel_fixed_us = 0;
  int partial_sum_bytes = 2;  // bytes per number of pick outputs and partial sums: 2 (bf16) or 4 (fp32)
  LinkSpec intra_node;
  LinkSpec inter_node;
  std::vector<KernelLine> kernel_lines;

  // The measured line for experts stored in `format`, if the profile has one.
  std::optional<KernelLine> LineFor(WeightFormat format) const;
  // Bytes the whole device copies per second: memory.copy_gbs when measured, else half the read
  // rate (bandwidth x read_efficiency / 2: one read and one write per byte).
  double CopyBytesPerSecond() const;
  // Ranks of an EP group of `gpus` ranks that share one device's memory and arithmetic: 1 on GPUs,
  // the ranks of a node on a CPU server, all of them when the nodes share one machine.
  int RanksPerDevice(int gpus) const;
  // Whether `lanes` threads in each of the ranks sharing a device of an EP group of `gpus` ranks
  // outnumber its cores (never when the cores are not known).
  bool LanesOutnumberCores(int gpus, int lanes) const;
  // Peak of the arithmetic path that weights stored in `format` use: 4-bit formats fp4; 1-byte
  // weights the faster of int8 and fp8 (GPU checkpoints store 8-bit layers in FP8).
  double PeakTflopsFor(WeightFormat format) const;
};

// Checks every field (positive sizes, efficiencies in (0, 1], non-negative latencies); the message
// names `source` and the field, e.g. "configs/hardware/x.json: field 'memory.bandwidth_gbs' ...".
Status ValidateHardware(const HardwareProfile& profile, std::string_view source);

// Parses profile JSON; every required field must be present. `source` names the text in errors.
Result<HardwareProfile> ParseHardware(std::string_view json_text, std::string_view source);
// A built-in profile by name (see ListHardwareProfiles) or a .json file by path.
Result<HardwareProfile> LoadHardware(std::string_view name_or_path);
std::string HardwareToJson(const HardwareProfile& profile);
std::vector<std::string> ListHardwareProfiles();

class ThreadPool;

struct CopyBandwidthOptions {
  int64_t buffer_bytes = BytesBeyondCaches(int64_t{256} << 20);  // the copies go through DRAM
  int repetitions = 7;
};
// The device's copy rate for memory.copy_gbs, in GB/s of bytes copied (each read once and written
// once): every thread of the pool memcpys its share of one buffer into another, median over the
// repetitions after a warm-up. Refuses buffers under 1 MB or no repetitions; fails (OutOfRange) when
// the two buffers cannot be allocated.
Result<double> MeasureCopyBandwidth(ThreadPool& pool, const CopyBandwidthOptions& options = {});

struct RowCodecOptions {
  int64_t rows = 8192;  // 32 MB of fp32 rows: beyond the caches
  int64_t cols = 1024;
  int repetitions = 5;
};
// The device's row_codec_ns on one thread (a rank's, as epmoe run runs it): every row encoded into
// bf16 in a shuffled order (records are packed by destination), then decoded and added back into
// its fp32 row in that order; ns per number and operation, median over the repetitions after a
// warm-up. Refuses no rows or repetitions and a width bf16 rows cannot take.
Result<double> MeasureRowCodecNs(const RowCodecOptions& options = {});

}  // namespace epmoe
