// Trace throughput: reading epmoe's binary format (streamed) against importing the same trace from
// its CSV and JSONL exports, and generating synthetic traces. Items are picks.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <string>

#include "epmoe/trace.h"
#include "epmoe/trace_gen.h"

namespace epmoe {
namespace {

TraceGenOptions BenchTrace() {
  TraceGenOptions o;
  o.distribution = "zipf";
  o.num_layers = 8;
  o.num_experts = 128;
  o.top_k = 8;
  o.steps = 32;
  o.batch = 256;  // 32 x 256 x 8 x 8 = 524,288 picks
  return o;
}
int64_t BenchPicks() {
  const TraceGenOptions o = BenchTrace();
  return o.steps * o.batch * o.num_layers * o.top_k;
}

// Writes the benchmark trace once per format; returns its path.
std::string TraceFile(const std::string& format) {
  const std::string dir = (std::filesystem::temp_directory_path() / "epmoe_trace_bench").string();
  const std::string binary = dir + "/trace.bin";
  const std::string path = format == "epmoe" ? binary : dir + "/trace." + format;
  if (std::filesystem::exists(path)) return path;
  std::filesystem::create_directories(dir);
  if (!std::filesystem::exists(binary) && !GenerateTraceFile(BenchTrace(), binary).ok()) std::abort();
  if (format != "epmoe") {
    auto reader = TraceReader::Open(binary, {});
    if (!reader.ok() || !WriteTrace(reader->get(), path, format).ok()) std::abort();
  }
  return path;
}

void ReadAll(benchmark::State& state, const std::string& format) {
  const std::string path = TraceFile(format);
  LoadReadOptions options;
  options.num_experts = 128;
  for (auto _ : state) {
    auto reader = TraceReader::Open(path, options);
    if (!reader.ok()) state.SkipWithError(reader.status().ToString().c_str());
    StepPicks step;
    int64_t rows = 0;
    while (true) {
      auto more = (*reader)->Next(&step);
      if (!more.ok() || !*more) break;
      rows += step.rows;
    }
    benchmark::DoNotOptimize(rows);
  }
  state.SetItemsProcessed(state.iterations() * BenchPicks());
}

void BM_ReadBinary(benchmark::State& state) { ReadAll(state, "epmoe"); }
void BM_ImportTopkCsv(benchmark::State& state) { ReadAll(state, "topk-csv"); }
void BM_ImportJsonl(benchmark::State& state) { ReadAll(state, "jsonl"); }

void BM_GenerateZipf(benchmark::State& state) {
  for (auto _ : state) {
    auto generator = TraceGenerator::Create(BenchTrace());
    StepPicks step;
    while ((*generator)->Next(&step)) benchmark::DoNotOptimize(step.counts.data());
  }
  state.SetItemsProcessed(state.iterations() * BenchPicks());
}

BENCHMARK(BM_ReadBinary)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ImportTopkCsv)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ImportJsonl)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GenerateZipf)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace epmoe
