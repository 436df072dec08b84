// `epmoe calibrate`: measures this machine into a hardware profile for the planner.
//   epmoe calibrate --out local.json                      memory bandwidth, copy rate, peak per
//                                                         arithmetic path and the expert kernel's
//                                                         fitted line
//   mpirun -np G epmoe calibrate --links --base local.json --out local.json
//                                                         MPI latency and bandwidth between ranks;
//                                                         across several nodes (or --ranks-per-node)
//                                                         the intra- and inter-node links apart
// The two parts run separately so that idle MPI ranks never compete with the kernel measurements
// for the cores. Machine measurements come from the kernels module (machine_limits, kernel_bench).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "commands.h"
#include "epmoe/atomic_file.h"
#include "epmoe/comm.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/hardware.h"
#include "epmoe/kernel_bench.h"
#include "epmoe/machine_limits.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"
#include "output.h"

namespace epmoe::cli {
namespace {

struct CalibrateFlags {
  std::string base = "local";
  std::string out;
  std::vector<std::string> formats = {"nvfp4", "bf16", "int8"};
  int threads = 0;
  bool links = false;
  int64_t prefill_tokens = 4096;
  int64_t max_link_bytes = int64_t{32} << 20;
  int ranks_per_node = 0;  // CommOptions::ranks_per_node: model nodes of this many ranks (0: real nodes)
  double link_gbit = 0;    // the shaped rate of a node's link (0: record the measured rate)
};

std::string Today() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d", std::gmtime(&now));
  return text;
}

// Writes the profile to `out`, opened before the measuring so that a path that cannot be written is
// refused at once, not after a minute of work; null prints it.
Status WriteProfile(const HardwareProfile& profile, AtomicFile* out) {
  EPMOE_RETURN_IF_ERROR(ValidateHardware(profile, out == nullptr ? "calibrated profile" : out->path()));
  const std::string text = HardwareToJson(profile) + "\n";
  if (out == nullptr) {
    std::printf("%s", text.c_str());
    return Status::Ok();
  }
  EPMOE_RETURN_IF_ERROR(out->Append(text));
  EPMOE_RETURN_IF_ERROR(out->Commit());
  std::fprintf(stderr, "epmoe calibrate: wrote %s\n", out->path().c_str());
  return Status::Ok();
}

Result<std::unique_ptr<AtomicFile>> OpenProfileOutput(const std::string& path) {
  if (path.empty()) return std::unique_ptr<AtomicFile>();
  return AtomicFile::Create(path);
}

// Memory bandwidth, peaks and one fitted kernel line per format, on this process's threads.
Status CalibrateMachine(const CalibrateFlags& f, HardwareProfile* p) {
  KernelBenchOptions options;
  options.formats.clear();
  for (const auto& name : f.formats) {
    EPMOE_ASSIGN_OR_RETURN(WeightFormat format, ParseWeightFormat(name));
    options.formats.push_back(format);
  }
  options.tokens = {f.prefill_tokens};
  ThreadPool pool(f.threads);
  auto progress = [](const std::string& line) { std::fprintf(stderr, "epmoe calibrate: %s\n", line.c_str()); };
  EPMOE_ASSIGN_OR_RETURN(KernelBenchReport report, RunKernelBench(options, pool, progress));
  EPMOE_ASSIGN_OR_RETURN(Isa isa, ResolveIsa("auto"));
  const MachineFigures& m = report.limits;
  p->memory_bandwidth_gbs = m.read_gbps;
  p->cores = report.threads;
  // Each format at the peak of the path its kernel runs on here: a CPU without BF16 runs bf16 weights
  // on fp32 FMA (converted), one without VNNI (or EPMOE_ISA=avx2) int8 and the 4-bit formats on
  // AVX2's multiply-adds. With VNNI the 4-bit formats' block scales are part of their path
  // (BlockScaledPathForFormat): on Zen 4 their FMAs share VPDPBUSD's ports, 0.8 of its peak for nvfp4.
  const double fp32 = m.fp32_gflops / 1e3;
  auto path_for = [&](WeightFormat format) { return BlockScaledPathForFormat(format, IsaForFormat(format, isa)); };
  auto peak_for = [&](WeightFormat format) {
    const double gops = m.peak(path_for(format));
    return gops > 0 ? gops / 1e3 : fp32;
  };
  const double bf16 = peak_for(WeightFormat::kBf16);
  p->peak_tflops = {fp32, bf16, peak_for(WeightFormat::kInt8), bf16, peak_for(WeightFormat::kNvfp4)};
  // Where ranks share this machine, DWDP's fetches are memcpys (shared-memory windows): price them at
  // the rate all cores copy at together.
  const CopyBandwidthOptions copy;  // a buffer 4 x the last-level caches, at least 256 MB
  EPMOE_ASSIGN_OR_RETURN(p->memory_copy_gbs, MeasureCopyBandwidth(pool, copy));
  progress(fmt::format("memory copy {:.1f} GB/s", p->memory_copy_gbs));
  EPMOE_ASSIGN_OR_RETURN(p->row_codec_ns, MeasureRowCodecNs());
  progress(fmt::format("row codec {:.2f} ns per number", p->row_codec_ns));
  // The peaks as priced, each with the path it was measured on (machine_limits).
  auto priced = [&](WeightFormat format) {
    return fmt::format("{:.0f} ({})", 1e3 * peak_for(format), ArithmeticPathName(path_for(format)));
  };
  p->sources.push_back(fmt::format(
      "epmoe calibrate {} ({} threads, {}): memory read {:.1f} GB/s; peaks in G operations/s fp32 {:.0f}, bf16 {}, "
      "int8 {}, 4-bit as nvfp4's kernel with its block scales {}; fp8 priced at the bf16 rate; copy_gbs "
      "{:.1f}: every thread memcpys its share of {} into another buffer as large (median of {}); cores {} (the "
      "threads); row_codec_ns {:.2f}: one thread encodes 8192 fp32 rows of 1024 into bf16 and decodes and adds "
      "them back, in a shuffled order",
      Today(), report.threads, report.isa, m.read_gbps, m.fp32_gflops, priced(WeightFormat::kBf16),
      priced(WeightFormat::kInt8), priced(WeightFormat::kNvfp4), p->memory_copy_gbs, HumanBytes(copy.buffer_bytes),
      copy.repetitions, p->cores, p->row_codec_ns));
  p->kernel_lines.clear();
  double read_efficiency = 0, arithmetic_efficiency = 0;
  int lines = 0, points = 0;
  for (const auto& d : report.decode) {
    if (d.us_per_gb <= 0) continue;
    p->kernel_lines.push_back(
        {d.format, std::max(0.0, d.fixed_us), d.us_per_gb, 0.0,
         fmt::format("epmoe calibrate {}: decode experiment, {} points, r(bytes) {:.3f}, r(picks) {:.3f}", Today(),
                     d.samples.size(), d.correlation_bytes, d.correlation_picks)});
    read_efficiency += (1e6 / d.us_per_gb) / m.read_gbps;  // GB/s the line reads at / measured bandwidth
    ++lines;
  }
  for (const auto& point : report.points) {
    // Against the point's peak with its format's block scales (the profile's one fp4 peak is
    // nvfp4's, which prices mxfp4 too).
    if (point.block_scaled_peak_used <= 0 || point.gflops <= 0) continue;
    arithmetic_efficiency += point.gflops / point.block_scaled_peak_used;
    ++points;
  }
  if (lines > 0) p->memory_read_efficiency = std::clamp(read_efficiency / lines, 0.05, 1.0);
  if (points > 0) p->arithmetic_efficiency = std::clamp(arithmetic_efficiency / points, 0.01, 1.0);
  if (!p->kernel_lines.empty()) p->kernel_fixed_us = p->kernel_lines.front().fixed_us;
  // The profile prices epmoe's own executors, which write each pick's output and sum partials in fp32.
  p->partial_sum_bytes = 4;
  p->sources.push_back(
      "partial_sums fp32: epmoe's CPU executors write each pick's output and reduce-scatter the partial sums in fp32 "
      "(src/ep)");
  p->sources.push_back(fmt::format(
      "read_efficiency {:.2f}: mean of the kernel lines' read rate over the measured bandwidth; arithmetic_efficiency "
      "{:.2f}: mean kernel G operations/s at {} tokens over the path's peak",
      p->memory_read_efficiency, p->arithmetic_efficiency, f.prefill_tokens));
  return Status::Ok();
}

// Median over `repetitions` of the slowest rank's time of `operation` (run by every rank after a
// barrier), in us; two more runs before them warm up.
template <class Operation>
Result<double> TimeSlowestRank(Communicator& comm, int repetitions, Operation operation) {
  std::vector<double> times;
  for (int rep = 0; rep < repetitions + 2; ++rep) {
    EPMOE_RETURN_IF_ERROR(comm.Barrier());
    const auto start = std::chrono::steady_clock::now();
    EPMOE_RETURN_IF_ERROR(operation());
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    EPMOE_ASSIGN_OR_RETURN(int64_t slowest, comm.AllreduceMax(ns));
    if (rep >= 2) times.push_back(slowest / 1e3);
  }
  return Median(times);
}

// One all-gather of `bytes` per rank, timed as TimeSlowestRank does.
Result<double> TimeAllgather(Communicator& comm, int64_t bytes, int repetitions) {
  const int g = comm.size();
  std::vector<uint8_t> send(bytes, 1), recv(bytes * g);
  const std::vector<int64_t> sizes(g, bytes);
  const std::vector<int64_t> offsets = PrefixOffsets(sizes);
  return TimeSlowestRank(comm, repetitions, [&] {
    return comm.Allgatherv(send.data(), bytes, recv.data(), sizes, std::span(offsets).first(g));
  });
}

// One all-to-all step: `bytes` from every rank to every other at once (as a2a's dispatch and
// combine exchange rows), timed as TimeSlowestRank does.
Result<double> TimeAlltoall(Communicator& comm, int64_t bytes, int repetitions) {
  const int g = comm.size();
  std::vector<uint8_t> send(bytes * g, 1), recv(bytes * g);
  const std::vector<int64_t> sizes(g, bytes);
  const std::vector<int64_t> offsets = PrefixOffsets(sizes);
  const auto at = std::span(offsets).first(g);
  return TimeSlowestRank(comm, repetitions,
                         [&] { return comm.Alltoallv(send.data(), sizes, at, recv.data(), sizes, at); });
}

// Reading `bytes` from the next rank's window (one-sided, as DWDP fetches experts), timed as
// TimeSlowestRank does.
Result<double> TimeWindowRead(Communicator& comm, int64_t bytes, int repetitions) {
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<Window> window, comm.AllocateWindow(bytes));
  std::memset(window->local(), 1, bytes);
  std::vector<uint8_t> into(bytes);
  const int peer = (comm.rank() + 1) % comm.size();
  Result<double> us = TimeSlowestRank(comm, repetitions, [&]() -> Status {
    EPMOE_RETURN_IF_ERROR(window->Get(peer, 0, bytes, into.data()));
    return window->Flush();
  });
  if (!us.ok()) return us;
  EPMOE_RETURN_IF_ERROR(comm.Barrier());  // no rank frees the window while another still reads it
  return us;
}

// What DWDP's fetches cost where the ranks share this machine, measured as DWDP runs: each rank
// runs the decode expert kernel (1 thread, 2 rows per expert) over 64 packed bf16 experts of
// 1024 x 512, alone and while a helper thread reads as many bytes from the next rank's window (a
// memcpy by the reader on one node, as DWDP reads the next layer's experts); both timed as
// TimeSlowestRank does. The reads' cost is what they add: the device's copy rate beside the
// kernel is ranks x bytes read / (together - alone). Sets the times and bytes for the profile's
// notes. (A kernel over 128 experts beside reads of 64 gave 9.6 - 12.4 GB/s in three runs, its
// kernel alone 40 - 49 ms against 2 x 12 ms for 64: less steady on this machine.)
Result<double> MeasureCopyUnderKernel(Communicator& comm, double* alone_us, double* together_us, int64_t* bytes_out) {
  constexpr int kExperts = 64, kReadExperts = 64;
  constexpr int64_t kHidden = 1024, kIntermediate = 512, kRowsPerExpert = 2;
  ExpertWeights expert;
  expert.gate = SyntheticMatrix(7, {TensorKind::kExpertGate, 0, 0, kIntermediate, kHidden});
  expert.up = SyntheticMatrix(7, {TensorKind::kExpertUp, 0, 0, kIntermediate, kHidden});
  expert.down = SyntheticMatrix(7, {TensorKind::kExpertDown, 0, 0, kHidden, kIntermediate});
  const std::vector<const ExpertWeights*> experts(kExperts, &expert);  // distinct packed copies
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<ExpertStore> store, PackExperts(experts, PackOptions{WeightFormat::kBf16}));
  const int64_t expert_bytes = store->expert_bytes(0);
  const int64_t bytes = kReadExperts * expert_bytes;
  const Matrix rows = SyntheticMatrix(8, {TensorKind::kRows, 0, 0, kExperts * kRowsPerExpert, kHidden});
  std::vector<int64_t> offsets(kExperts + 1);
  for (int e = 0; e <= kExperts; ++e) offsets[e] = e * kRowsPerExpert;
  std::vector<float> out(rows.data.size());
  ThreadPool pool(1);  // as `epmoe run`: one thread per rank
  auto kernel = [&]() -> Status {
    store->Run(rows.data.data(), offsets, out.data(), pool);
    return Status::Ok();
  };

  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<Window> window, comm.AllocateWindow(bytes));
  std::memset(window->local(), 1, bytes);
  std::vector<std::byte> into(bytes, std::byte{2});
  const int peer = (comm.rank() + 1) % comm.size();
  // Starts the reads of the peer's experts, one per expert as DWDP reads them.
  auto start_reads = [&]() -> Status {
    for (int e = 0; e < kReadExperts; ++e)
      EPMOE_RETURN_IF_ERROR(window->Get(peer, e * expert_bytes, expert_bytes, into.data() + e * expert_bytes));
    return Status::Ok();
  };
  EPMOE_ASSIGN_OR_RETURN(*alone_us, TimeSlowestRank(comm, 5, kernel));
  const bool threaded = comm.concurrent_threads();
  Result<double> together = TimeSlowestRank(comm, 5, [&]() -> Status {
    if (!threaded) {  // reads started before the kernel and completed after it, as DWDP does then
      EPMOE_RETURN_IF_ERROR(start_reads());
      EPMOE_RETURN_IF_ERROR(kernel());
      return window->Flush();
    }
    std::future<Status> reads = std::async(std::launch::async, [&]() -> Status {
      EPMOE_RETURN_IF_ERROR(start_reads());
      return window->Flush();
    });
    const Status ran = kernel();
    const Status got = reads.get();
    return ran.ok() ? got : ran;
  });
  EPMOE_RETURN_IF_ERROR(comm.Barrier());  // no rank frees the window while another still reads it
  if (!together.ok()) return together.status();
  *together_us = *together;
  *bytes_out = bytes;
  if (*together_us <= *alone_us)
    return Internal(
        fmt::format("calibrate: the kernel took {:.0f} us alone and {:.0f} us with {} MB of window reads "
                    "beside it; the reads added nothing measurable",
                    *alone_us, *together_us, bytes >> 20));
  return static_cast<double>(comm.size()) * bytes / ((*together_us - *alone_us) * 1e3);  // GB/s
}

// Bytes each rank sends every peer to time the fixed cost of an all-to-all step.
constexpr int64_t kExchangeProbeBytes = 64;

// Latency and per-rank bandwidth of collectives between the ranks of one communicator.
struct LinkMeasure {
  double latency_us = 0;     // a 64 B all-gather
  double bandwidth_gbs = 0;  // bytes each rank sends to its peers per second, median over sizes
  double one_sided_gbs = 0;  // reads of the next rank's window
};

// A small all-gather gives the fixed cost, large ones the bandwidth of the bytes each rank sends to
// its peers (unless `all_gather_bandwidth` is false: the caller measures it another way); one-sided
// reads (DWDP's fetches) of the next rank's window at the same sizes can run at another rate.
Result<LinkMeasure> MeasureLink(Communicator& comm, const CalibrateFlags& f, bool all_gather_bandwidth = true) {
  const int g = comm.size();
  LinkMeasure link;
  EPMOE_ASSIGN_OR_RETURN(link.latency_us, TimeAllgather(comm, 64, 50));
  if (all_gather_bandwidth) {
    std::vector<double> rates;
    for (int64_t bytes = int64_t{1} << 20; bytes <= f.max_link_bytes; bytes *= 4) {
      EPMOE_ASSIGN_OR_RETURN(double us, TimeAllgather(comm, bytes, 5));
      const double moved = static_cast<double>(bytes) * (g - 1);
      if (us > link.latency_us) rates.push_back(moved / ((us - link.latency_us) * 1e3));  // GB/s
    }
    if (rates.empty()) return Internal("calibrate: the large all-gathers were not slower than the small one");
    link.bandwidth_gbs = Median(rates);
  }
  std::vector<double> read_rates;
  for (int64_t bytes = int64_t{1} << 20; bytes <= f.max_link_bytes; bytes *= 4) {
    Result<double> us = TimeWindowRead(comm, bytes, 5);
    // Every rank is refused alike when MPI has no one-sided transport between them (Open MPI over
    // TCP): the link then has no one-sided figure, and the planner prices reads as collectives.
    if (us.status().code() == StatusCode::kFailedPrecondition) break;
    EPMOE_RETURN_IF_ERROR(us.status());
    read_rates.push_back(static_cast<double>(bytes) / (*us * 1e3));  // GB/s
  }
  link.one_sided_gbs = read_rates.empty() ? 0 : Median(read_rates);
  return link;
}

// `link` measured by the ranks of several communicators at once (every node, or every set of ranks
// with one local index), gathered to every rank: the slowest (highest latency, lowest rates) of
// the ranks that measured (`measured`), since the slowest rank sets a step's time. Nullopt when no
// rank measured.
Result<std::optional<LinkMeasure>> SlowestLink(Communicator& world, bool measured, const LinkMeasure& link) {
  const int g = world.size();
  const std::vector<double> mine = {measured ? 1.0 : 0.0, link.latency_us, link.bandwidth_gbs, link.one_sided_gbs};
  std::vector<double> all(4 * g);
  EPMOE_RETURN_IF_ERROR(world.AllgatherDouble(mine, all));
  std::optional<LinkMeasure> slowest;
  for (int r = 0; r < g; ++r) {
    if (all[4 * r] == 0) continue;
    const LinkMeasure m{all[4 * r + 1], all[4 * r + 2], all[4 * r + 3]};
    if (!slowest) {
      slowest = m;
      continue;
    }
    slowest->latency_us = std::max(slowest->latency_us, m.latency_us);
    slowest->bandwidth_gbs = std::min(slowest->bandwidth_gbs, m.bandwidth_gbs);
    slowest->one_sided_gbs = std::min(slowest->one_sided_gbs, m.one_sided_gbs);
  }
  return slowest;
}

// Passes over the sizes of InterNodeExchangeBandwidth: on ranks that share cores, one pass ran at
// 0.55 - 0.79 of a shaped 1 Gbit/s link and the next at another rate, while the median of four
// passes stayed within 0.67 - 0.71 over three runs.
constexpr int kInterNodePasses = 4;

// Per-rank bandwidth between nodes as a flat dispatch uses it: every rank sends `bytes` to every
// rank on the other nodes, all at once (one alltoallv over all ranks, no bytes inside a node), so
// a node's ranks share its link with as many flows as a step has. Median over kInterNodePasses
// passes over 1 MB..--max-link-bytes per peer of the bytes a rank sends / (the slowest rank's time
// - the step's fixed cost `exchange_us`), in GB/s. (All-gathers among the ranks of one local index,
// one flow per node pair, reached 0.55 of a 1 Gbit/s link shared by 2 ranks per node where this
// pattern and a2a's steps reached about 0.7 - 0.8.)
Result<double> InterNodeExchangeBandwidth(Communicator& comm, const CalibrateFlags& f, int largest_node,
                                          double exchange_us) {
  const int g = comm.size();
  const int my_node = comm.node_of(comm.rank());
  int remote_ranks = 0;
  for (int r = 0; r < g; ++r) remote_ranks += comm.node_of(r) != my_node;
  // Sized once for the largest size of the passes; every pass and size reuses them.
  int64_t largest = int64_t{1} << 20;
  while (largest * 4 <= f.max_link_bytes) largest *= 4;
  std::vector<uint8_t> send(largest * remote_ranks, 1), recv(largest * remote_ranks);
  std::vector<double> rates;
  for (int pass = 0; pass < kInterNodePasses; ++pass) {
    for (int64_t bytes = int64_t{1} << 20; bytes <= f.max_link_bytes; bytes *= 4) {
      std::vector<int64_t> sizes(g, 0);
      for (int r = 0; r < g; ++r)
        if (comm.node_of(r) != my_node) sizes[r] = bytes;
      const std::vector<int64_t> offsets = PrefixOffsets(sizes);
      const auto at = std::span(offsets).first(g);
      EPMOE_ASSIGN_OR_RETURN(double us, TimeSlowestRank(comm, 5, [&] {
                               return comm.Alltoallv(send.data(), sizes, at, recv.data(), sizes, at);
                             }));
      // With unequal nodes, the slowest rank's time over the fewest bytes a rank sends (a rank of
      // the largest node's) keeps the figure a lower bound.
      const double sent = static_cast<double>(bytes) * (g - largest_node);
      if (us > exchange_us) rates.push_back(sent / ((us - exchange_us) * 1e3));
    }
  }
  if (rates.empty()) return Internal("calibrate: the large exchanges between nodes were not slower than the small one");
  return Median(rates);
}

// This machine's identity (the kernel's boot id, else the host name) as a number: ranks with the
// same one run on one machine, as the nodes of a cluster emulated with network namespaces do.
int64_t MachineId() {
  std::string id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  if (!(boot >> id)) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    id = host;
  }
  return static_cast<int64_t>(std::hash<std::string>{}(id));
}

// The profile's link from a measurement: per rank and direction, its data-sheet bandwidth
// `nominal_gbs` (0: the measured rate itself) reached at the measured share.
Result<LinkSpec> LinkFrom(const LinkMeasure& m, double nominal_gbs, const char* which) {
  const double bandwidth = nominal_gbs > 0 ? nominal_gbs : m.bandwidth_gbs;
  if (m.bandwidth_gbs > bandwidth * 1.05)
    return InvalidArgument(fmt::format(
        "calibrate: the {} link measured {:.3f} GB/s per rank, above the {:.3f} GB/s --link-gbit gives each rank: "
        "these ranks do not talk over that link (--ranks-per-node models nodes on shared memory; give --link-gbit "
        "only on a cluster whose links are shaped to it)",
        which, m.bandwidth_gbs, bandwidth));
  return LinkSpec{bandwidth, std::min(1.0, m.bandwidth_gbs / bandwidth), m.latency_us, m.one_sided_gbs / bandwidth};
}

// The links between the ranks of this job. On one node: collectives among all ranks, and what
// DWDP's reads cost beside the kernel (the ranks' own copies). On several nodes: the intra-node
// link among the ranks of each node, then the inter-node link among the ranks of one local index
// on every node (all nodes at once, as a step uses them); the profile's gpus_per_node becomes the
// largest node, and nodes_share_device says whether every rank runs on this one machine.
Status CalibrateLinks(const CalibrateFlags& f, HardwareProfile* p, Communicator& comm) {
  const int g = comm.size();
  const int me = comm.rank();
  if (comm.num_nodes() == 1) {
    if (f.link_gbit > 0)
      return InvalidArgument(
          "--link-gbit gives the link between nodes, and these ranks are on one node (give "
          "--ranks-per-node, or run across nodes)");
    EPMOE_ASSIGN_OR_RETURN(const LinkMeasure link, MeasureLink(comm, f));
    p->intra_node = {link.bandwidth_gbs, 1.0, link.latency_us, link.one_sided_gbs / link.bandwidth_gbs};
    EPMOE_ASSIGN_OR_RETURN(p->intra_node.exchange_latency_us, TimeAlltoall(comm, kExchangeProbeBytes, 50));
    p->inter_node = p->intra_node;
    // On one node the reads are the ranks' own copies: what they cost beside the kernel.
    double alone_us = 0, together_us = 0;
    int64_t fetched = 0;
    EPMOE_ASSIGN_OR_RETURN(p->memory_copy_gbs, MeasureCopyUnderKernel(comm, &alone_us, &together_us, &fetched));
    std::erase_if(p->sources, [](const std::string& s) { return s.find("copy_gbs") == 0; });
    p->sources.push_back(fmt::format(
        "copy_gbs {:.1f} (epmoe calibrate --links {}, {} ranks): a decode kernel over 64 bf16 experts of 1024 x 512 "
        "per rank (1 thread, 2 rows each) took {:.1f} ms alone and {:.1f} ms with {} MB (as many experts) read from "
        "the next rank's window beside it; copy_gbs = ranks x bytes / the added time (replaces the machine part's "
        "memcpy figure)",
        p->memory_copy_gbs, Today(), g, alone_us / 1e3, together_us / 1e3, fetched >> 20));
    p->sources.push_back(fmt::format(
        "epmoe calibrate --links {} over {}: all-gather fixed cost {:.1f} us (64 B per rank), all-to-all step {:.1f} "
        "us "
        "(64 B to every peer; exchange_latency_us), {:.2f} GB/s per rank (median over 1 MB..{} MB per rank); "
        "one-sided window reads {:.2f} GB/s (one_sided_efficiency); inter_node = intra_node (one host)",
        Today(), comm.description(), link.latency_us, p->intra_node.exchange_latency_us, link.bandwidth_gbs,
        f.max_link_bytes >> 20, link.one_sided_gbs));
    return Status::Ok();
  }
  // Nodes, their sizes and this rank's index on its node.
  std::vector<int> ranks_on(comm.num_nodes(), 0);
  int local_index = 0;
  for (int r = 0; r < g; ++r) {
    if (r < me && comm.node_of(r) == comm.node_of(me)) ++local_index;
    ++ranks_on[comm.node_of(r)];
  }
  const int per_node = *std::max_element(ranks_on.begin(), ranks_on.end());
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> node, comm.Split(comm.node_of(me), me));
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> across, comm.Split(local_index, me));
  LinkMeasure intra, inter;
  if (node->size() > 1) {
    EPMOE_ASSIGN_OR_RETURN(intra, MeasureLink(*node, f));
  }
  EPMOE_ASSIGN_OR_RETURN(const std::optional<LinkMeasure> slowest_intra, SlowestLink(comm, node->size() > 1, intra));
  if (across->size() > 1) {
    EPMOE_ASSIGN_OR_RETURN(inter, MeasureLink(*across, f, /*all_gather_bandwidth=*/false));
  }
  EPMOE_ASSIGN_OR_RETURN(std::optional<LinkMeasure> slowest_inter, SlowestLink(comm, across->size() > 1, inter));
  EPMOE_CHECK(slowest_inter.has_value());  // several nodes: local index 0 is on every one
  // The all-to-all step's fixed cost: among each node's ranks (two-level's forwarding, the slowest
  // node's), and among all ranks at once (a flat dispatch or combine across the nodes).
  double node_exchange_us = 0;
  if (node->size() > 1) {
    EPMOE_ASSIGN_OR_RETURN(node_exchange_us, TimeAlltoall(*node, kExchangeProbeBytes, 50));
  }
  EPMOE_ASSIGN_OR_RETURN(const int64_t slowest_node_exchange_ns,
                         comm.AllreduceMax(static_cast<int64_t>(node_exchange_us * 1e3)));
  EPMOE_ASSIGN_OR_RETURN(const double world_exchange_us, TimeAlltoall(comm, kExchangeProbeBytes, 50));
  EPMOE_ASSIGN_OR_RETURN(slowest_inter->bandwidth_gbs,
                         InterNodeExchangeBandwidth(comm, f, per_node, world_exchange_us));
  // --link-gbit is the rate of a node's link, shared by the node's ranks sending at once.
  const double nominal_inter = f.link_gbit / 8 / per_node;
  EPMOE_ASSIGN_OR_RETURN(p->inter_node, LinkFrom(*slowest_inter, nominal_inter, "inter-node"));
  p->inter_node.exchange_latency_us = world_exchange_us;
  if (slowest_intra) {
    EPMOE_ASSIGN_OR_RETURN(p->intra_node, LinkFrom(*slowest_intra, 0, "intra-node"));
    p->intra_node.exchange_latency_us = slowest_node_exchange_ns / 1e3;
  }
  std::vector<int64_t> machines(g);
  EPMOE_RETURN_IF_ERROR(comm.AllgatherInt64(std::vector<int64_t>{MachineId()}, machines));
  p->nodes_share_device = std::all_of(machines.begin(), machines.end(), [&](int64_t m) { return m == machines[0]; });
  p->gpus_per_node = per_node;
  p->name = "local-cluster";
  p->description =
      fmt::format("{} nodes of up to {} ranks{}, measured by epmoe calibrate --links", comm.num_nodes(), per_node,
                  p->nodes_share_device ? " on this one machine (their ranks share its CPU and memory)" : "");
  auto described = [&](const LinkMeasure& m, const char* bandwidth_by) {
    return fmt::format(
        "fixed cost {:.1f} us (64 B all-gather), {:.3f} GB/s per rank ({}, median over 1 MB..{} MB per "
        "rank and peer), one-sided window reads {:.3f} GB/s",
        m.latency_us, m.bandwidth_gbs, bandwidth_by, f.max_link_bytes >> 20, m.one_sided_gbs);
  };
  p->sources.push_back(fmt::format(
      "epmoe calibrate --links {} over {}, the slowest rank of each: intra_node among the ranks of each node: {}; "
      "inter_node among the ranks of one local index on every node, all at once: {}; all-to-all step (64 B to "
      "every peer; exchange_latency_us) {:.1f} us among all ranks (inter_node){}{}",
      Today(), comm.description(),
      slowest_intra ? described(*slowest_intra, "all-gathers") : "not measured (one rank per node: kept)",
      described(*slowest_inter, "every rank sending to every rank of the other nodes at once, an alltoallv"),
      world_exchange_us,
      slowest_intra ? fmt::format(", {:.1f} us among each node's ranks (intra_node)", slowest_node_exchange_ns / 1e3)
                    : "",
      f.link_gbit > 0 ? fmt::format("; bandwidth_gbs {:.4f} = --link-gbit {} / 8 / {} ranks per node, efficiency the "
                                    "measured share of it",
                                    nominal_inter, f.link_gbit, per_node)
                      : ""));
  p->sources.push_back(
      fmt::format("gpus_per_node {}: the largest node of the calibration run; nodes_share_device {}: "
                  "{} (the kernel's boot id of every rank); copy_gbs kept (not measured across nodes)",
                  per_node, p->nodes_share_device ? "true" : "false",
                  p->nodes_share_device ? "every rank ran on this machine" : "the ranks ran on several machines"));
  return Status::Ok();
}

int RunCalibrate(const CalibrateFlags& f) {
  auto base = LoadHardware(f.base);
  if (!base.ok()) return ReportError(base.status());
  HardwareProfile profile = *base;
  profile.name = "local";
  if (!f.links) {
    profile.description =
        "This machine, measured by epmoe calibrate; ranks are MPI processes sharing the CPU and its memory";
    profile.ranks_share_device = true;
    // Keep only the base's notes on links; the machine figures (the copy rate too) are replaced.
    std::vector<std::string> kept;
    for (const auto& s : profile.sources)
      if ((s.find("--links") != std::string::npos && s.find("copy_gbs") != 0) || s.find("intra_node") == 0 ||
          s.find("inter_node") == 0)
        kept.push_back(s);
    profile.sources = kept;
    auto out = OpenProfileOutput(f.out);
    if (!out.ok()) return ReportError(out.status());
    if (Status s = CalibrateMachine(f, &profile); !s.ok()) return ReportError(s);
    if (Status s = WriteProfile(profile, out->get()); !s.ok()) return ReportError(s);
    return 0;
  }
  CommOptions comm_options;
  comm_options.ranks_per_node = f.ranks_per_node;
  auto comm = WorldCommunicator(comm_options);
  if (!comm.ok()) return ReportError(comm.status());
  if ((*comm)->size() < 2)
    return ReportError(
        InvalidArgument("calibrate --links needs at least 2 ranks: run it under mpirun -np 2 (or more)"));
  std::unique_ptr<AtomicFile> out;
  if ((*comm)->rank() == 0) {
    auto opened = OpenProfileOutput(f.out);
    if (!opened.ok()) AbortJob(ReportError(opened.status()));  // the other ranks would wait for rank 0
    out = std::move(*opened);
  }
  std::erase_if(profile.sources, [](const std::string& s) {
    return s.find("--links") != std::string::npos || s.find("intra_node") == 0 || s.find("inter_node") == 0;
  });
  if (Status s = CalibrateLinks(f, &profile, **comm); !s.ok()) return ReportJobError(s, CommOptions{}.timeout_seconds);
  if ((*comm)->rank() == 0) {
    // What was measured, as the machine part reports its figures.
    for (const auto& s : profile.sources)
      if (s.find("--links") != std::string::npos) std::fprintf(stderr, "epmoe calibrate: %s\n", s.c_str());
    if (Status s = WriteProfile(profile, out.get()); !s.ok()) return ReportError(s);
  }
  return 0;
}

}  // namespace

void AddCalibrateCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<CalibrateFlags>();
  auto* cmd = app.add_subcommand("calibrate", "Measure this machine into a hardware profile for `epmoe plan`");
  cmd->add_option("--base", f->base, "Profile to start from (name or .json path); fields not measured are kept")
      ->capture_default_str();
  cmd->add_option("--out", f->out, "Write the profile here (default: print it)");
  cmd->add_option("--formats", f->formats, "Weight formats whose kernel line to fit")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (0: every core this process may use)")
      ->check(kThreadCount)
      ->capture_default_str();
  cmd->add_option("--prefill-tokens", f->prefill_tokens, "Tokens of the arithmetic-bound point")
      ->check(CLI::Range(int64_t{64}, int64_t{1} << 16))
      ->capture_default_str();
  cmd->add_flag("--links", f->links, "Measure MPI latency and bandwidth between the ranks (run under mpirun)");
  cmd->add_option("--ranks-per-node", f->ranks_per_node,
                  "For --links: model nodes of this many consecutive ranks (0: the transport's nodes, e.g. hosts or "
                  "the namespaces of a cluster on one machine)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--link-gbit", f->link_gbit,
                  "For --links across nodes: the rate (Gbit/s) each node's link is shaped to, recorded as the "
                  "inter-node bandwidth (shared by the node's ranks) with the measured share as its efficiency")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-link-bytes", f->max_link_bytes, "Largest all-gather per rank for --links")
      ->check(CLI::Range(int64_t{1} << 20, int64_t{1} << 30))
      ->capture_default_str();
  cmd->callback([f, exit_code] { *exit_code = RunCalibrate(*f); });
}

}  // namespace epmoe::cli
