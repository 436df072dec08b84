// Writes a small seed corpus for each trace fuzz target into <dir>/<target>/: a generated binary
// trace, and the first lines of the real trace excerpts (given as arguments: the folder tests/data).
// Usage: trace_fuzz_seeds OUT_DIR TRACES_DIR
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "epmoe/trace.h"
#include "epmoe/trace_gen.h"

namespace fs = std::filesystem;

// The first `lines` lines of a file; a missing file ends the program, so that a moved excerpt
// cannot leave a target without its seed.
static std::string Head(const fs::path& path, int lines) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "trace_fuzz_seeds: cannot read %s\n", path.string().c_str());
    std::exit(1);
  }
  std::string text, line;
  for (int i = 0; i < lines && std::getline(in, line); ++i) text += line + "\n";
  return text;
}

static void Write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: trace_fuzz_seeds OUT_DIR TRACES_DIR\n");
    return 2;
  }
  const fs::path out(argv[1]), traces(argv[2]);
  const fs::path flame = traces / "flame_moe_290m";
  epmoe::TraceGenOptions gen;
  gen.num_layers = 2;
  gen.num_experts = 8;
  gen.top_k = 2;
  gen.steps = 2;
  gen.batch = 2;
  fs::create_directories(out / "trace_binary_fuzz");
  if (!epmoe::GenerateTraceFile(gen, (out / "trace_binary_fuzz" / "picks.bin").string()).ok()) return 1;
  // A count-only binary trace: the same steps through the counts path.
  {
    auto generator = epmoe::TraceGenerator::Create(gen);
    epmoe::TraceInfo info = (*generator)->info();
    info.has_picks = info.has_weights = false;
    auto writer = epmoe::TraceWriter::Create((out / "trace_binary_fuzz" / "counts.bin").string(), info);
    epmoe::StepPicks step;
    while ((*generator)->Next(&step)) {
      step.layers.clear();
      if (!(*writer)->Append(step).ok()) return 1;
    }
    if (!(*writer)->Close().ok()) return 1;
  }
  Write(out / "trace_flame_csv_fuzz" / "layer.csv", Head(flame / "decode_32seqs_pos1-10" / "pos01" / "layer02.csv", 4));
  Write(out / "trace_topk_csv_fuzz" / "topk.csv", Head(flame / "prefill_4seqs_x64tok_topk_derived.csv", 6));
  Write(out / "trace_expert_counts_csv_fuzz" / "counts.csv",
        Head(traces / "olmoe_paper_expert_counts" / "expert_counts.csv", 20));
  Write(out / "trace_jsonl_fuzz" / "records.jsonl",
        "{\"num_experts\": 8, \"top_k\": 2}\n"
        "{\"layer\": 2, \"experts\": [3, 1], \"gating_probs\": [0.6, 0.4], \"token_idx\": 0, \"seq\": \"a\", \"pos\": 0}\n"
        "{\"layer\": 3, \"experts\": [0, 5], \"gating_probs\": [0.7, 0.3], \"token_idx\": 0, \"seq\": \"a\", \"pos\": 0}\n"
        "{\"layer\": 2, \"experts\": [4, 1], \"gating_probs\": [0.5, 0.5], \"token_idx\": 1, \"seq\": \"a\", \"pos\": 1}\n"
        "{\"layer\": 3, \"experts\": [2, 7], \"gating_probs\": [0.9, 0.1], \"token_idx\": 1, \"seq\": \"a\", \"pos\": 1}\n");
  Write(out / "trace_sglang_json_fuzz" / "passes.jsonl",
        "{\"logical_count\": [[1, 2, 0, 1], [0, 2, 2, 0]], \"rows\": 2, \"top_k\": 2}\n"
        "{\"logical_count\": [[[1, 1, 1, 1], [4, 0, 0, 0]]]}\n");
  Write(out / "trace_counts_csv_fuzz" / "counts.csv",
        "step,rows,top_k,layer,expert,count\n0,2,2,2,0,3\n0,2,2,2,1,1\n0,2,2,3,0,2\n0,2,2,3,1,2\n");
  return 0;
}
