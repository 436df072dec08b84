// `epmoe bench kernels`: the expert kernels against the machine's measured limits (roofline), and
// the decode experiment. The work is RunKernelBench (epmoe/kernel_bench.h); this file parses flags
// and prints.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "epmoe/kernel_bench.h"
#include "epmoe/layer.h"
#include "epmoe/model.h"
#include "epmoe/thread_pool.h"
#include "output.h"
#include "system_memory.h"

namespace epmoe::cli {
namespace {

struct BenchKernelsOptions {
  std::string model = "qwen3-30b-a3b";
  std::vector<std::string> formats = {"fp32", "bf16", "int8", "nvfp4", "mxfp4"};
  std::vector<int64_t> tokens = {1, 8, 16, 64, 256, 1024, 8192};
  std::string isa = "auto";
  int threads = 0;
  int repetitions = 5;
  double seconds_per_point = 3.0;
  bool no_decode = false;
  int decode_steps = 32;
  int decode_ranks = 8;
  int decode_repetitions = KernelBenchOptions{}.decode_repetitions;
  double decode_seconds = KernelBenchOptions{}.decode_seconds;
  std::string decode_share = DecodeSharesName(false);
  double skew = 0.3;
  uint64_t seed = 1;
  double max_memory_gb = 0;
  std::string format = "text";
};

nlohmann::json ToJson(const KernelBenchReport& r, const ModelConfig& model) {
  nlohmann::json points = nlohmann::json::array();
  for (const auto& p : r.points) {
    points.push_back({{"format", WeightFormatName(p.format)},
                      {"kernel", p.kernel},
                      {"tokens", p.tokens},
                      {"picks", p.picks},
                      {"experts_touched", p.experts_touched},
                      {"max_rows_per_expert", p.max_rows_per_expert},
                      {"us", p.us},
                      {"bytes", p.bytes},
                      {"gbps", p.gbps},
                      {"read_gbps_used", p.read_gbps_used},
                      {"peak_used", p.peak_used},
                      {"bandwidth_fraction", p.bandwidth_fraction},
                      {"operations", p.operations},
                      {"gflops", p.gflops},
                      {"bound_us", p.bound_us},
                      {"bound", p.memory_bound ? "memory" : "arithmetic"},
                      {"roofline_fraction", p.roofline_fraction},
                      {"expert_bound_us", p.expert_bound_us},
                      {"expert_roofline_fraction", p.expert_roofline_fraction},
                      {"block_scaled_peak_used", p.block_scaled_peak_used},
                      {"block_scaled_bound_us", p.block_scaled_bound_us},
                      {"block_scaled_roofline_fraction", p.block_scaled_roofline_fraction},
                      {"repetitions", p.repetitions},
                      {"runs_with_stolen_time", p.runs_with_stolen_time}});
  }
  nlohmann::json decode = nlohmann::json::array();
  for (const auto& d : r.decode) {
    nlohmann::json samples = nlohmann::json::array();
    for (const auto& s : d.samples)
      samples.push_back({{"step", s.step},
                         {"rank", s.rank},
                         {"picks", s.picks},
                         {"bytes", s.bytes},
                         {"us", s.us},
                         {"read_gbps", s.read_gbps}});
    decode.push_back({{"format", WeightFormatName(d.format)},
                      {"shares", DecodeSharesName(d.contiguous_shares)},
                      {"points", d.samples.size()},
                      {"fixed_us", d.fixed_us},
                      {"us_per_gb", d.us_per_gb},
                      {"correlation_bytes", d.correlation_bytes},
                      {"correlation_picks", d.correlation_picks},
                      {"correlation_bytes_steady", d.correlation_bytes_steady},
                      {"median_read_gbps", d.median_read_gbps},
                      {"passes", d.passes},
                      {"runs_left_out", d.runs_left_out},
                      {"samples_off_speed", d.samples_off_speed},
                      {"samples", samples}});
  }
  return {{"cpu",
           {{"name", r.cpu.name},
            {"vendor", r.cpu.vendor},
            {"family", r.cpu.family},
            {"model", r.cpu.model},
            {"stepping", r.cpu.stepping},
            {"generation", CoreGeneration(r.cpu)}}},
          {"model", model.name},
          {"experts", model.num_experts},
          {"hidden", model.hidden},
          {"intermediate", model.expert_intermediate},
          {"top_k", model.top_k},
          {"threads", r.threads},
          {"isa", r.isa},
          {"probe_bytes", r.probe_bytes},
          {"last_level_cache_bytes", r.last_level_cache_bytes},
          {"limits",
           {{"read_gbps", r.limits.read_gbps},
            {"read_gbps_p05", r.limits.read_gbps_low},
            {"read_gbps_p95", r.limits.read_gbps_high},
            {"fp32_fma_gflops", r.limits.fp32_gflops},
            {"bf16_dot_gflops", r.limits.bf16_gflops},
            {"int8_vnni_gops", r.limits.int8_gops},
            {"int8_madd_gops", r.limits.int8_madd_gops},
            {"int8_vnni_scale16_gops", r.limits.int8_scale16_gops},
            {"int8_vnni_scale32_gops", r.limits.int8_scale32_gops}}},
          {"points", points},
          {"decode", decode}};
}

void PrintText(const KernelBenchReport& r, const ModelConfig& model) {
  std::printf("%s layer: %d experts of %dx%d, top-%d; %d threads, isa %s; %s\n", model.name.c_str(), model.num_experts,
              model.expert_intermediate, model.hidden, model.top_k, r.threads, r.isa.c_str(),
              DescribeCpu(r.cpu).c_str());
  std::printf(
      "limits: read %.1f GB/s (5th - 95th percentile %.1f - %.1f; a %s buffer; last-level caches %s); fp32 FMA %.0f, "
      "bf16 dot %.0f GFLOP/s; "
      "int8 VNNI %.0f (with the block scales of nvfp4 %.0f, of mxfp4 %.0f), int8 multiply-add (AVX2) %.0f GOP/s\n",
      r.limits.read_gbps, r.limits.read_gbps_low, r.limits.read_gbps_high, HumanBytes(r.probe_bytes).c_str(),
      r.last_level_cache_bytes > 0 ? HumanBytes(r.last_level_cache_bytes).c_str() : "not reported by the system",
      r.limits.fp32_gflops, r.limits.bf16_gflops, r.limits.int8_gops, r.limits.int8_scale16_gops,
      r.limits.int8_scale32_gops, r.limits.int8_madd_gops);
  std::printf(
      "limit: the read rate of the point's own weights, measured just before each of its runs (median); bw "
      "and roof: medians over the runs of each run against that read; roof/e: against the bound taken expert by "
      "expert, with the format's block scales in its arithmetic; roof/s: against the bound with those block scales\n");
  std::printf("%-14s %6s %7s %7s %11s %10s %7s %7s %6s %8s %10s %5s %6s %6s %6s\n", "kernel", "T", "picks", "touched",
              "us", "bytes", "GB/s", "limit", "bw", "GFLOP/s", "bound us", "by", "roof", "roof/e", "roof/s");
  for (const auto& p : r.points) {
    std::printf("%-14s %6lld %7lld %7d %11.1f %10s %7.1f %7.1f %6.2f %8.1f %10.1f %5s %6.2f %6.2f %6.2f\n",
                p.kernel.c_str(), static_cast<long long>(p.tokens), static_cast<long long>(p.picks), p.experts_touched,
                p.us, HumanBytes(p.bytes).c_str(), p.gbps, p.read_gbps_used, p.bandwidth_fraction, p.gflops, p.bound_us,
                p.memory_bound ? "mem" : "arith", p.roofline_fraction, p.expert_roofline_fraction,
                p.block_scaled_roofline_fraction);
  }
  std::string disturbed;
  for (const auto& p : r.points) {
    if (p.runs_with_stolen_time > 0)
      disturbed +=
          fmt::format("{}{} T={} ({})", disturbed.empty() ? "" : ", ", p.kernel, p.tokens, p.runs_with_stolen_time);
  }
  if (!disturbed.empty())
    std::printf("runs timed again because the host took CPU time from this machine during them: %s\n",
                disturbed.c_str());
  for (const auto& d : r.decode) {
    std::printf(
        "decode experiment %s (%s shares): %zu points, %d runs each, at %.1f GB/s of memory (%d runs at another speed "
        "left out, %d points never at it); time = %.1f us + %.1f us per GB read; correlation with bytes %.3f (%.3f "
        "with each run's time scaled by its weights' read rate), with picks %.3f\n",
        WeightFormatName(d.format), DecodeSharesName(d.contiguous_shares), d.samples.size(), d.passes,
        d.median_read_gbps, d.runs_left_out, d.samples_off_speed, d.fixed_us, d.us_per_gb, d.correlation_bytes,
        d.correlation_bytes_steady, d.correlation_picks);
  }
}

Status RunBenchKernels(const BenchKernelsOptions& o, KernelBenchReport* report, ModelConfig* model) {
  EPMOE_ASSIGN_OR_RETURN(*model, LoadModel(o.model));
  KernelBenchOptions options;
  options.formats.clear();
  for (const std::string& name : o.formats) {
    EPMOE_ASSIGN_OR_RETURN(WeightFormat f, ParseWeightFormat(name));
    options.formats.push_back(f);
  }
  options.tokens = o.tokens;
  options.hidden = model->hidden;
  options.intermediate = model->expert_intermediate;
  options.experts = model->num_experts;
  options.top_k = model->top_k;
  options.activation = ActivationOf(*model);
  options.expert_bias = model->expert_bias;
  options.isa = o.isa;
  options.repetitions = o.repetitions;
  options.seconds_per_point = o.seconds_per_point;
  options.decode = !o.no_decode;
  options.decode_steps = o.decode_steps;
  options.decode_ranks = o.decode_ranks;
  options.decode_repetitions = o.decode_repetitions;
  options.decode_seconds = o.decode_seconds;
  options.decode_contiguous_shares = o.decode_share == DecodeSharesName(true);
  options.skew_sigma = o.skew;
  options.seed = o.seed;
  options.max_memory_bytes = static_cast<int64_t>(MemoryBudgetBytes(o.max_memory_gb));
  ThreadPool pool(o.threads);
  EPMOE_ASSIGN_OR_RETURN(*report, RunKernelBench(options, pool, [](const std::string& line) {
    std::fprintf(stderr, "bench: %s\n", line.c_str());
  }));
  return Status::Ok();
}

}  // namespace

void AddBenchCommand(CLI::App& app, int* exit_code) {
  auto* bench = app.add_subcommand("bench", "Benchmarks of epmoe's parts on this machine");
  bench->require_subcommand(1);
  auto o = std::make_shared<BenchKernelsOptions>();
  auto* cmd = bench->add_subcommand(
      "kernels",
      "Expert kernels per weight format and token count against the measured roofline, and the decode "
      "experiment (time vs bytes read)");
  cmd->add_option("--model", o->model, "Model preset (or .json) giving the layer shape")->capture_default_str();
  cmd->add_option("--formats", o->formats, "Weight formats, comma separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--tokens", o->tokens, "Token counts T, comma separated")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--isa", o->isa, "Highest instruction set (auto, avx512, avx2, reference)")
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "reference"}))
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Worker threads (0: every core this process may use)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--reps", o->repetitions, "Timed runs per point (median)")->check(kPositive)->capture_default_str();
  cmd->add_option("--seconds-per-point", o->seconds_per_point, "Stop repeating a point after this long")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_flag("--no-decode", o->no_decode, "Skip the decode experiment");
  cmd->add_option("--decode-steps", o->decode_steps, "Decode steps (8 to 16 tokens each)")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--decode-ranks", o->decode_ranks, "Ranks of whole experts each decode step is replayed for")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--decode-reps", o->decode_repetitions, "Timed runs per decode sample (median), at least")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--decode-seconds", o->decode_seconds,
                  "Run more passes over the decode samples until each format's experiment has taken this long")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_option("--decode-share", o->decode_share,
                  "Which experts make a rank's share in the decode experiment: round-robin (expert e on rank e % "
                  "ranks) or contiguous (consecutive experts)")
      ->check(CLI::IsMember({DecodeSharesName(false), DecodeSharesName(true)}))
      ->capture_default_str();
  cmd->add_option("--skew", o->skew, "Routing skew: expert popularity ~ exp(skew * N(0,1))")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of weights, rows and routing")->capture_default_str();
  cmd->add_option("--max-memory-gb", o->max_memory_gb,
                  "Memory budget: formats that would need more are refused before anything runs (0: 80% of "
                  "available memory)")
      ->check(kNonNegative);
  AddFormatOption(cmd, &o->format, {"text", "json"});
  cmd->callback([o, exit_code] {
    KernelBenchReport report;
    ModelConfig model;
    const Status status = RunBenchKernels(*o, &report, &model);
    if (!status.ok()) {
      *exit_code = ReportError(status);
      return;
    }
    if (o->format == "json") {
      std::printf("%s\n", ToJson(report, model).dump(2).c_str());
    } else {
      PrintText(report, model);
    }
    *exit_code = 0;
  });
}

}  // namespace epmoe::cli
