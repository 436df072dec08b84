#include "epmoe/kernel_bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <memory>
#include <random>
#include <utility>

#include "epmoe/cpu.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/machine_limits.h"
#include "epmoe/statistics.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

constexpr ArithmeticPath kArithmeticPaths[] = {ArithmeticPath::kFp32Fma,         ArithmeticPath::kBf16Dot,
                                               ArithmeticPath::kInt8Vnni,        ArithmeticPath::kInt8Madd,
                                               ArithmeticPath::kInt8VnniScale16, ArithmeticPath::kInt8VnniScale32};

// Skewed top-k routing: expert e has log-popularity sigma * z_e (z_e ~ N(0,1), fixed per seed);
// each row takes the k experts with the largest log-popularity + Gumbel noise, which samples k
// distinct experts with probabilities proportional to popularity (Gumbel top-k).
class SkewedRouter {
 public:
  SkewedRouter(int experts, int k, double sigma, uint64_t seed) : k_(k), log_popularity_(experts) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (double& v : log_popularity_) v = sigma * normal(rng);
  }

  // Picks per expert for `tokens` rows.
  std::vector<int64_t> Counts(int64_t tokens, uint64_t seed) const {
    const int experts = static_cast<int>(log_popularity_.size());
    std::vector<int64_t> counts(experts, 0);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> uniform(1e-12, 1.0);
    std::vector<std::pair<double, int>> keys(experts);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int e = 0; e < experts; ++e) keys[e] = {log_popularity_[e] - std::log(-std::log(uniform(rng))), e};
      std::partial_sort(keys.begin(), keys.begin() + k_, keys.end(), std::greater<>());
      for (int j = 0; j < k_; ++j) ++counts[keys[j].second];
    }
    return counts;
  }

 private:
  int k_;
  std::vector<double> log_popularity_;
};

std::vector<int64_t> OffsetsOf(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

// CPU time the host has taken from this machine's processors since boot, in ms (steal time, the
// "cpu" line of /proc/stat: a virtual machine's processors waiting while the host runs something
// else); 0 where the kernel does not count it.
double StolenMilliseconds() {
  std::FILE* stat = std::fopen("/proc/stat", "r");
  if (stat == nullptr) return 0;
  long long user, nice, system, idle, iowait, irq, softirq, steal = 0;
  const int fields = std::fscanf(stat, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &user, &nice, &system, &idle,
                                 &iowait, &irq, &softirq, &steal);
  std::fclose(stat);
  const long ticks_per_second = sysconf(_SC_CLK_TCK);
  return fields == 8 && ticks_per_second > 0 ? 1e3 * static_cast<double>(steal) / ticks_per_second : 0;
}

double TimeRun(const ExpertStore& store, const Matrix& rows, const std::vector<int64_t>& offsets, Matrix* out,
               ThreadPool& pool) {
  const auto start = std::chrono::steady_clock::now();
  store.Run(rows.data.data(), offsets, out->data.data(), pool);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}

Matrix RandomRows(int64_t count, int hidden, uint64_t seed, ThreadPool& pool) {
  Matrix rows(count, hidden);
  SyntheticTensor t{TensorKind::kRows, 0, static_cast<int>(seed % 100000), count, hidden};
  pool.ParallelFor(count, 256, [&](int64_t begin, int64_t end) {
    FillSynthetic(seed, t, begin, end - begin, 0, hidden, rows.row(begin));
  });
  // Synthetic values are scaled for weights (1/sqrt(fan_in)); rows are of order one.
  const float scale = std::sqrt(static_cast<float>(hidden));
  for (float& v : rows.data) v *= scale;
  return rows;
}

}  // namespace

const double& MachineFigures::peak(ArithmeticPath path) const {
  switch (path) {
    case ArithmeticPath::kFp32Fma: return fp32_gflops;
    case ArithmeticPath::kBf16Dot: return bf16_gflops;
    case ArithmeticPath::kInt8Vnni: return int8_gops;
    case ArithmeticPath::kInt8Madd: return int8_madd_gops;
    case ArithmeticPath::kInt8VnniScale16: return int8_scale16_gops;
    case ArithmeticPath::kInt8VnniScale32: return int8_scale32_gops;
  }
  return fp32_gflops;
}

double& MachineFigures::peak(ArithmeticPath path) {
  return const_cast<double&>(std::as_const(*this).peak(path));
}

void FitLine(const std::vector<double>& x, const std::vector<double>& y, double* intercept, double* slope) {
  const size_t n = std::min(x.size(), y.size());
  *intercept = 0;
  *slope = 0;
  if (n < 2) return;
  double mx = 0, my = 0;
  for (size_t i = 0; i < n; ++i) mx += x[i], my += y[i];
  mx /= n;
  my /= n;
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < n; ++i) sxy += (x[i] - mx) * (y[i] - my), sxx += (x[i] - mx) * (x[i] - mx);
  *slope = sxx > 0 ? sxy / sxx : 0;
  *intercept = my - *slope * mx;
}

double Correlation(const std::vector<double>& x, const std::vector<double>& y) {
  const size_t n = std::min(x.size(), y.size());
  if (n < 2) return 0;
  double mx = 0, my = 0;
  for (size_t i = 0; i < n; ++i) mx += x[i], my += y[i];
  mx /= n;
  my /= n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < n; ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0;
}

int64_t KernelBenchMemoryBytes(const KernelBenchOptions& o, WeightFormat format, int threads) {
  const int64_t hidden = o.hidden, intermediate = o.intermediate;
  const int64_t biases = o.expert_bias ? (2 * intermediate + hidden) * static_cast<int64_t>(sizeof(float)) : 0;
  const int64_t packed = o.experts * (ExpertByteCount(format, hidden, intermediate) + biases);
  // Each thread's expert in fp32 and its quantized copy before packing (at most as large).
  const int64_t making = std::max(1, threads) * 2 * ExpertByteCount(WeightFormat::kFp32, hidden, intermediate);
  const int64_t tokens = o.tokens.empty() ? 0 : *std::max_element(o.tokens.begin(), o.tokens.end());
  // Per pick: its row and output (fp32), Run's copy of the row in the kernel's format (at most
  // fp32) and its intermediate row in fp32 and in the kernel's format.
  const int64_t point = tokens * o.top_k * (3 * 4 * hidden + 2 * 4 * intermediate);
  const int64_t decode = o.decode ? int64_t{o.decode_steps} * o.decode_max_tokens * o.top_k * 4 * hidden : 0;
  return packed + making + point + decode + o.probe_bytes;
}

Result<KernelBenchReport> RunKernelBench(const KernelBenchOptions& o, ThreadPool& pool,
                                         const std::function<void(const std::string&)>& progress) {
  auto say = [&](const std::string& line) {
    if (progress) progress(line);
  };
  if (o.experts <= 0 || o.top_k <= 0 || o.top_k > o.experts || o.hidden <= 0 || o.intermediate <= 0)
    return InvalidArgument(fmt::format("bench: shape experts={} top_k={} hidden={} intermediate={} is not valid",
                                       o.experts, o.top_k, o.hidden, o.intermediate));
  if (o.decode && (o.decode_ranks <= 0 || o.experts % o.decode_ranks != 0))
    return InvalidArgument(
        fmt::format("bench: {} experts do not split into {} ranks of whole experts", o.experts, o.decode_ranks));
  if (o.decode && (o.decode_min_tokens <= 0 || o.decode_max_tokens < o.decode_min_tokens))
    return InvalidArgument(
        fmt::format("bench: decode tokens {}..{} is not a range", o.decode_min_tokens, o.decode_max_tokens));
  // At most a day: a budget is a measurement's length, and one far beyond that is a mistake.
  if (o.decode && !(o.decode_seconds >= 0 && o.decode_seconds <= 86400))
    return InvalidArgument(fmt::format("bench: decode seconds {} out of 0..86400", o.decode_seconds));
  for (int64_t t : o.tokens) {
    if (t <= 0 || t > (int64_t{1} << 20))
      return InvalidArgument(fmt::format("bench: token count {} out of 1..2^20", t));
  }
  EPMOE_ASSIGN_OR_RETURN(Isa isa, ResolveIsa(o.isa));
  if (o.max_memory_bytes > 0) {
    std::string over, fit;
    for (WeightFormat format : o.formats) {
      const int64_t bytes = KernelBenchMemoryBytes(o, format, pool.size());
      if (bytes > o.max_memory_bytes) {
        over += fmt::format("{}{:.1f} GB in {}", over.empty() ? "" : ", ", bytes / 1e9, WeightFormatName(format));
      } else {
        fit += fmt::format("{}{}", fit.empty() ? "" : ",", WeightFormatName(format));
      }
    }
    if (!over.empty())
      return OutOfRange(fmt::format(
          "bench: a layer of {} experts of {}x{} needs about {} (the weights, the largest point's rows and scratch), "
          "over the memory budget of {:.1f} GB; {}, fewer or smaller --tokens, or a larger budget",
          o.experts, o.intermediate, o.hidden, over, o.max_memory_bytes / 1e9,
          fit.empty() ? "no format fits" : "formats that fit: --formats " + fit));
  }

  KernelBenchReport report;
  report.threads = pool.size();
  report.isa = IsaName(isa);
  report.cpu = DetectCpuIdentity();
  report.probe_bytes = o.probe_bytes;
  report.last_level_cache_bytes = LastLevelCacheBytes();
  say("measuring memory read bandwidth and arithmetic peaks");
  // The limits are the machine's (its best instruction set), whichever kernel runs; a path the
  // machine lacks has peak 0 and drops out of the bound.
  const Isa machine = BestSupportedIsa();
  auto peak_or_zero = [&](ArithmeticPath path, const PeakOptions& options) {
    Result<double> peak = MeasurePeak(path, pool, options, machine);
    return peak.ok() ? *peak : 0.0;
  };
  EPMOE_ASSIGN_OR_RETURN(MemoryReadProbe probe, MemoryReadProbe::Create(pool, o.probe_bytes, machine));
  std::vector<double> bandwidths;  // every probe read of the run
  for (int rep = 0; rep < 7; ++rep) bandwidths.push_back(probe.Read(pool));
  // Every measurement of each path's peak (indexed by the path), their median at the end.
  std::vector<double> peaks[std::size(kArithmeticPaths)];
  for (ArithmeticPath path : kArithmeticPaths) peaks[static_cast<int>(path)].push_back(peak_or_zero(path, {}));
  // The arithmetic path of each point's kernel, and the one with its format's block scales.
  std::vector<ArithmeticPath> point_paths, point_block_scaled_paths;
  // Each point's touched experts: (bytes, picks), for its expert-by-expert bound.
  std::vector<std::vector<std::pair<double, double>>> point_experts;
  // Each point's timed runs: time (us) and the read rate of its weights just before (GB/s).
  std::vector<std::vector<std::pair<double, double>>> point_runs;

  // Each format packs the synthetic experts as they are made, one per thread at a time, so that the
  // whole layer never exists in fp32 (DeepSeek-V3's 256 experts: 45 GB).
  const ExpertMaker make_expert = [&o](int e, ExpertWeights* w) {
    FillSyntheticExpert(TensorKind::kExpertGate, TensorKind::kExpertUp, TensorKind::kExpertDown, o.hidden,
                        o.intermediate, 0, e, o.seed, 0, -1, o.expert_bias, w);
    return Status::Ok();
  };

  const SkewedRouter router(o.experts, o.top_k, o.skew_sigma, o.seed);
  const double operations_per_pick = 2.0 * 3.0 * o.hidden * static_cast<double>(o.intermediate);
  // The stored bytes of the experts that `counts` gives rows: what a run reads. (Through
  // MutableExpertParts, only read.)
  auto touched_bytes = [](ExpertStore& store, const std::vector<int64_t>& counts) {
    std::vector<std::span<const std::byte>> ranges;
    for (int e = 0; e < store.num_experts(); ++e) {
      if (counts[e] == 0) continue;
      const Result<std::vector<std::span<std::byte>>> parts = store.MutableExpertParts(e);
      for (const std::span<std::byte> part : *parts) ranges.emplace_back(part);
    }
    return ranges;
  };
  // The read rate of `weights`, after a probe read (which flushes the caches). A read during which
  // the host took CPU time from this machine is read again (up to three times, each after another
  // probe read); if none was free of it, the fastest counts.
  auto read_weights = [&](std::span<const std::span<const std::byte>> weights) {
    double fastest = 0;
    for (int attempt = 0; attempt < 3; ++attempt) {
      bandwidths.push_back(probe.Read(pool));
      const double stolen_before = StolenMilliseconds();
      const double gbps = MeasureReadRate(pool, weights, machine);
      if (StolenMilliseconds() == stolen_before) return gbps;
      fastest = std::max(fastest, gbps);
    }
    return fastest;
  };
  // One timed run of the layer, judged against the read rate of its own weights at that moment
  // (which `read_gbps` receives): how fast memory delivers changes over time on a virtual machine
  // (two threads read 31 - 35 GB/s in one state and 55 - 63 in another, for minutes at a time), so
  // neither the probe nor a measurement a minute away can stand for it. Each timed read follows a
  // probe read, which flushes the caches.
  // `stolen_ms` (when given) receives the CPU time the host took from this machine during the run.
  auto timed_run = [&](const ExpertStore& store, std::span<const std::span<const std::byte>> weights,
                       const Matrix& rows, const std::vector<int64_t>& offsets, Matrix* out,
                       std::vector<double>* read_gbps, double* stolen_ms = nullptr) {
    read_gbps->push_back(read_weights(weights));
    bandwidths.push_back(probe.Read(pool));
    const double stolen_before = StolenMilliseconds();
    const double us = TimeRun(store, rows, offsets, out, pool);
    if (stolen_ms != nullptr) *stolen_ms = StolenMilliseconds() - stolen_before;
    // A run does the read's reads and more, so a run well faster than the read says the read was
    // disturbed (whole points judged at 1.5 - 1.7 of their bound, reads of 19 - 23 GB/s between
    // runs at 32 - 35): read again, after another probe read, and keep the faster of the two.
    constexpr double kDisagreement = 1.1;
    double bytes = 0;
    for (const std::span<const std::byte> part : weights) bytes += static_cast<double>(part.size());
    if (bytes / (us * 1e3) > kDisagreement * read_gbps->back())
      read_gbps->back() = std::max(read_gbps->back(), read_weights(weights));
    return us;
  };

  for (WeightFormat format : o.formats) {
    say(fmt::format("packing {} experts of {}x{} in {}", o.experts, o.intermediate, o.hidden,
                    WeightFormatName(format)));
    PackOptions pack{format, IsaName(isa), &pool, o.activation};
    EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<ExpertStore> store,
                           PackExperts(o.experts, o.hidden, o.intermediate, make_expert, pack));
    // The kernel may have given way to a lower instruction set for this shape: its arithmetic
    // path is the one of the instruction set that runs (kernel_name is "<format>/<isa>").
    const std::string kernel = store->kernel_name();
    const Result<Isa> kernel_isa = ParseIsa(kernel.substr(kernel.find('/') + 1));
    const Isa runs_on = kernel_isa.ok() ? *kernel_isa : isa;
    const ArithmeticPath path = PathForFormat(format, runs_on);
    const ArithmeticPath block_scaled_path = BlockScaledPathForFormat(format, runs_on);
    // The peaks drift when other processes share the machine: measure the kernel's again next to
    // each format; every point is judged against the median of all measurements (see the end).
    peaks[static_cast<int>(path)].push_back(peak_or_zero(path, {0.05, 3}));
    if (block_scaled_path != path)
      peaks[static_cast<int>(block_scaled_path)].push_back(peak_or_zero(block_scaled_path, {0.05, 3}));

    for (int64_t tokens : o.tokens) {
      const std::vector<int64_t> counts = router.Counts(tokens, o.seed * 7919 + tokens);
      const std::vector<int64_t> offsets = OffsetsOf(counts);
      const Matrix rows = RandomRows(offsets.back(), o.hidden, o.seed + tokens, pool);
      Matrix out(rows.rows, rows.cols);
      KernelBenchPoint p;
      p.format = format;
      p.kernel = store->kernel_name();
      p.tokens = tokens;
      p.picks = offsets.back();
      point_experts.emplace_back();
      for (int e = 0; e < o.experts; ++e) {
        if (counts[e] == 0) continue;
        ++p.experts_touched;
        p.bytes += store->expert_bytes(e);
        p.max_rows_per_expert = std::max(p.max_rows_per_expert, counts[e]);
        point_experts.back().emplace_back(store->expert_bytes(e), static_cast<double>(counts[e]));
      }
      const std::vector<std::span<const std::byte>> weights = touched_bytes(*store, counts);
      // One untimed run first: Run's scratch grows to a point's rows on its first run, and on a
      // virtual machine the first touch of a page can cost much (about 10 us a 4 KB page: fp32
      // T = 8192's 0.9 GB of scratch made its one timed run 4 x its bound). The time of a layer is
      // that of its steady state.
      store->Run(rows.data.data(), offsets, out.data.data(), pool);
      // A run during which the host took CPU time from this machine is timed again (up to three
      // times the runs asked for): on a shared virtual machine the host's other work stalls both
      // threads at once (phases twice as long, with 40 - 80 ms of steal time in each, none in the
      // normal ones), which is not the kernel's time. Only if every run was disturbed
      // are (as many as were asked for of) those runs kept.
      std::vector<double> times, read_gbps, disturbed_times, disturbed_reads;
      double spent = 0;
      const int wanted = std::max(1, o.repetitions);
      for (int attempt = 0; attempt < 3 * wanted && static_cast<int>(times.size()) < wanted; ++attempt) {
        std::vector<double> read;
        double stolen_ms = 0;
        const double us = timed_run(*store, weights, rows, offsets, &out, &read, &stolen_ms);
        (stolen_ms > 0 ? disturbed_times : times).push_back(us);
        (stolen_ms > 0 ? disturbed_reads : read_gbps).push_back(read.back());
        spent += us * 1e-6;
        if (spent > o.seconds_per_point) break;
      }
      p.runs_with_stolen_time = static_cast<int>(disturbed_times.size());
      if (times.empty()) {
        const size_t kept = std::min<size_t>(disturbed_times.size(), wanted);
        times.assign(disturbed_times.begin(), disturbed_times.begin() + kept);
        read_gbps.assign(disturbed_reads.begin(), disturbed_reads.begin() + kept);
      }
      p.repetitions = static_cast<int>(times.size());
      p.us = Median(times);
      p.read_gbps_used = Median(read_gbps);
      point_runs.emplace_back();
      for (size_t i = 0; i < times.size(); ++i) point_runs.back().emplace_back(times[i], read_gbps[i]);
      p.gbps = p.bytes / (p.us * 1e-6) / 1e9;
      p.operations = operations_per_pick * static_cast<double>(p.picks);
      p.gflops = p.operations / (p.us * 1e-6) / 1e9;
      point_paths.push_back(path);
      point_block_scaled_paths.push_back(block_scaled_path);
      say(fmt::format("{} T={}: {:.1f} us, {:.1f} GB/s, {:.0f} G op/s", p.kernel, tokens, p.us, p.gbps, p.gflops));
      report.points.push_back(p);
    }

    if (o.decode) {
      DecodeExperiment d;
      d.format = format;
      d.contiguous_shares = o.decode_contiguous_shares;
      std::mt19937_64 rng(o.seed * 31 + 5);
      std::uniform_int_distribution<int> token_count(o.decode_min_tokens, o.decode_max_tokens);
      const int per_rank = o.experts / o.decode_ranks;
      // Every sample first, then its repetitions in passes over all of them: a sample's runs are
      // spread over the whole experiment, so that a change in the memory's speed or a disturbance
      // from outside falls on one run of many samples (which each one's median leaves out, or
      // which all of them share) instead of on every run of a few (which the correlation would
      // take for the samples' own cost).
      struct Pending {
        DecodeSample sample;
        std::vector<int64_t> offsets;
        std::vector<std::span<const std::byte>> weights;  // the touched experts' bytes
        Matrix rows;  // one rank's share of a step's picks: all samples hold each step's rows once (at most 32 MB)
        std::vector<double> times, read_gbps;
      };
      std::vector<Pending> pending;
      for (int step = 0; step < o.decode_steps; ++step) {
        const int tokens = token_count(rng);
        const std::vector<int64_t> counts = router.Counts(tokens, o.seed * 104729 + step);
        for (int rank = 0; rank < o.decode_ranks; ++rank) {
          // This rank's whole experts keep their picks; the others get none (and are not read).
          std::vector<int64_t> local(o.experts, 0);
          DecodeSample s;
          s.step = step;
          s.rank = rank;
          for (int e = 0; e < o.experts; ++e) {
            const int owner = o.decode_contiguous_shares ? e / per_rank : e % o.decode_ranks;
            if (owner != rank) continue;
            local[e] = counts[e];
            s.picks += counts[e];
            if (counts[e] > 0) s.bytes += store->expert_bytes(e);
          }
          if (s.picks == 0) continue;
          pending.push_back({s,
                             OffsetsOf(local),
                             touched_bytes(*store, local),
                             RandomRows(s.picks, o.hidden, o.seed + step * 131 + rank, pool),
                             {},
                             {}});
        }
      }
      auto run_pass = [&](auto&& wanted) {
        for (Pending& p : pending) {
          if (!wanted(p)) continue;
          Matrix out(p.rows.rows, p.rows.cols);
          p.times.push_back(timed_run(*store, p.weights, p.rows, p.offsets, &out, &p.read_gbps));
        }
      };
      const auto started = std::chrono::steady_clock::now();
      auto seconds_spent = [&] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      };
      const int min_passes = std::max(1, o.decode_repetitions);
      int passes = 0;
      while (passes < min_passes || seconds_spent() < o.decode_seconds) {
        run_pass([](const Pending&) { return true; });
        ++passes;
      }
      d.passes = passes;
      // The experiment is taken at one speed of the memory: that of its runs' commonest state, the
      // median of the largest band of their reads, a band being the reads within
      // kDecodeSpeedTolerance of one of them (the median of all of them falls between two states
      // visited about equally: one run here had 128 of 256 samples with no run within 15% of it).
      // A run whose read lies further from it ran while the memory was in another state (on a
      // shared virtual machine 31 - 35 GB/s in one, 55 - 63 in the other, changing within a run of
      // the bench), which would spread the samples by the memory's speed instead of their bytes.
      // Such runs are left out (and counted); samples left with fewer than half their runs get
      // more, in further passes, up to as many again.
      std::vector<double> all_reads;
      for (const Pending& p : pending) all_reads.insert(all_reads.end(), p.read_gbps.begin(), p.read_gbps.end());
      const double speed = DensestBandMedian(all_reads, kDecodeSpeedTolerance);
      auto at_speed = [&](double gbps) { return std::abs(gbps / speed - 1) <= kDecodeSpeedTolerance; };
      auto runs_at_speed = [&](const Pending& p) {
        return static_cast<int>(std::count_if(p.read_gbps.begin(), p.read_gbps.end(), at_speed));
      };
      for (int rep = 0; rep < passes; ++rep) run_pass([&](const Pending& p) { return 2 * runs_at_speed(p) < passes; });
      std::vector<double> scaled_us;  // per sample, see below
      for (Pending& p : pending) {
        std::vector<double> times, reads;
        for (size_t i = 0; i < p.times.size(); ++i) {
          if (!at_speed(p.read_gbps[i])) continue;
          times.push_back(p.times[i]);
          reads.push_back(p.read_gbps[i]);
        }
        d.runs_left_out += static_cast<int>(p.times.size() - times.size());
        if (times.empty()) {  // never at the experiment's speed: all of its runs count
          ++d.samples_off_speed;
          times = p.times;
          reads = p.read_gbps;
        }
        p.sample.us = Median(times);
        p.sample.read_gbps = Median(reads);
        d.samples.push_back(p.sample);
        // Run by run, time x the read rate just before it: the time the run would have taken at
        // 1 GB/s of memory, which the memory's changes of speed between runs leave alone.
        std::vector<double> scaled;
        for (size_t i = 0; i < p.times.size(); ++i) scaled.push_back(p.times[i] * p.read_gbps[i]);
        scaled_us.push_back(Median(scaled));
      }
      std::vector<double> gb, picks, us;
      for (const auto& s : d.samples) {
        gb.push_back(s.bytes / 1e9);
        picks.push_back(static_cast<double>(s.picks));
        us.push_back(s.us);
      }
      FitLine(gb, us, &d.fixed_us, &d.us_per_gb);
      d.correlation_bytes = Correlation(gb, us);
      d.correlation_picks = Correlation(picks, us);
      d.median_read_gbps = speed;
      d.correlation_bytes_steady = Correlation(gb, scaled_us);  // (the scale factor does not change r)
      say(fmt::format(
          "{} decode experiment ({} shares): {} points, {} runs each, at {:.1f} GB/s ({} runs at another speed "
          "left out), {:.1f} us + {:.1f} us/GB, r(bytes) {:.3f} ({:.3f} scaled by the read rate), r(picks) {:.3f}",
          WeightFormatName(format), DecodeSharesName(d.contiguous_shares), d.samples.size(), d.passes,
          d.median_read_gbps, d.runs_left_out, d.fixed_us, d.us_per_gb, d.correlation_bytes, d.correlation_bytes_steady,
          d.correlation_picks));
      report.decode.push_back(std::move(d));
    }
  }
  report.limits.read_gbps = Median(bandwidths);
  report.limits.read_gbps_low = Quantile(bandwidths, 0.05);
  report.limits.read_gbps_high = Quantile(bandwidths, 0.95);
  for (ArithmeticPath path : kArithmeticPaths) report.limits.peak(path) = Median(peaks[static_cast<int>(path)]);
  for (size_t i = 0; i < report.points.size(); ++i) {
    KernelBenchPoint& p = report.points[i];
    p.peak_used = report.limits.peak(point_paths[i]);
    p.block_scaled_peak_used = report.limits.peak(point_block_scaled_paths[i]);
    auto arithmetic_us = [](double operations, double peak) { return peak > 0 ? operations / (peak * 1e9) * 1e6 : 0; };
    auto memory_us = [&](double bytes, double read_gbps) { return bytes / (read_gbps * 1e9) * 1e6; };
    auto bound_us = [&](double read_gbps, double peak) {
      return std::max(memory_us(p.bytes, read_gbps), arithmetic_us(p.operations, peak));
    };
    auto expert_bound_us = [&](double read_gbps) {
      double sum = 0;
      for (const auto& [bytes, picks] : point_experts[i])
        sum +=
            std::max(memory_us(bytes, read_gbps), arithmetic_us(picks * operations_per_pick, p.block_scaled_peak_used));
      return sum;
    };
    p.bound_us = bound_us(p.read_gbps_used, p.peak_used);
    p.memory_bound = memory_us(p.bytes, p.read_gbps_used) >= arithmetic_us(p.operations, p.peak_used);
    p.expert_bound_us = expert_bound_us(p.read_gbps_used);
    p.block_scaled_bound_us = bound_us(p.read_gbps_used, p.block_scaled_peak_used);
    // Each run against the read just before it, then the median: the memory can change speed
    // between two runs of a point (and back), which medians of times and of reads taken apart
    // would pair across runs.
    std::vector<double> bandwidth_fractions, roofline_fractions, expert_roofline_fractions,
        block_scaled_roofline_fractions;
    for (const auto& [us, read_gbps] : point_runs[i]) {
      bandwidth_fractions.push_back(memory_us(p.bytes, read_gbps) / us);
      roofline_fractions.push_back(bound_us(read_gbps, p.peak_used) / us);
      expert_roofline_fractions.push_back(expert_bound_us(read_gbps) / us);
      block_scaled_roofline_fractions.push_back(bound_us(read_gbps, p.block_scaled_peak_used) / us);
    }
    p.bandwidth_fraction = Median(bandwidth_fractions);
    p.roofline_fraction = Median(roofline_fractions);
    p.expert_roofline_fraction = Median(expert_roofline_fractions);
    p.block_scaled_roofline_fraction = Median(block_scaled_roofline_fractions);
  }
  return report;
}

}  // namespace epmoe
