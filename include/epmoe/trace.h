// Routing traces: which experts each row picked, per step and MoE layer, read from any supported
// source and written in epmoe's own versioned binary format (or exported to CSV / JSON).
//
// Sources (LoadReadOptions::format; "auto" detects from the path and the first bytes):
//   epmoe             epmoe's binary trace (per-row picks with optional weights, or counts only);
//                     read streamed, so a trace larger than memory works
//   flame-csv         FLAME-MoE per-layer CSVs `layer_id,token_id,expert_0..expert_{E-1}` (gate score
//                     per expert, non-zero for the chosen ones): a folder of layerNN.csv (one step), a
//                     folder of posNN/ subfolders (one decode step each), or one layerNN.csv
//   flame-topk-csv    `[token,][seq,][pos,][step,][row,]layer,e0..e{k-1}[,w0..w{k-1}]`, one row per
//                     (token, layer); epmoe's own `topk-csv` export is this layout with step,row
//   jsonl             one JSON record per (token, layer): {"layer": L, "experts": [..],
//                     "gating_probs": [..], "token_idx": i, optional "step", a sequence key ("seq",
//                     "seq_id", "sequence_id", "request_id", "req_id", "problem_id", "sample_id",
//                     "conversation_id"; numbers or strings), "pos"};
//                     an optional record {"num_experts": E, "top_k": k, ...} gives the shape
//   expert-counts-csv `model,domain,selection,layer,expert,count` (OLMoE); each matching series is a step
//   sglang-json       SGLang-style per-pass records {"logical_count": [[..per expert..] per layer]}:
//                     one object, an array of them, one per line, or a 3-D [pass][layer][expert] array
//   counts-csv        `step,layer,expert,count` (epmoe's counts export)
// Layers are renumbered 0..L-1 in ascending order of the source's layer ids; the original ids are
// kept in TraceInfo::layer_ids (FLAME-MoE layers 2..9 become 0..7; OLMoE 0, 7, 15 become 0..2).
// Rows that do not parse, ids out of range, repeated experts in a row, non-finite weights,
// truncated or corrupted files are refused with the file, line (text) or byte offset (binary).
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/load.h"
#include "epmoe/router.h"
#include "epmoe/status.h"

namespace epmoe {

struct LoadReadOptions {
  std::string format = "auto";  // auto-detect, or: epmoe (binary), flame-csv, flame-topk-csv,
                                // jsonl, expert-counts-csv, sglang-json, counts-csv
  std::string phase = "auto";   // per-token sources: "decode" (steps of B rows) or "prefill"
                                // (chunks of C tokens); "auto" keeps the source's own steps
  int64_t batch = 0;            // B or C; 0 = the source's own grouping
  std::string filter;           // for multi-series count files, e.g. "model=olmoe,domain=arxiv,selection=topk"
  int num_experts = 0;          // 0: the source's own (header, columns), else largest id + 1
  std::string on_missing = "error";  // per-token sources, a token without a record for every layer:
                                     // "error" refuses the file, "drop-token" leaves the token out
                                     // (TraceInfo::dropped_tokens counts them)
};

// Reads any supported trace (a file, or a folder such as FLAME-MoE's decode_64seqs_pos1-10/ whose
// posNN subfolders are steps) as per-step, per-layer, per-expert pick counts.
//
// Steps from tokens (per-token sources; each token has a sequence and a position when the source
// says so: FLAME decode folders (row i = sequence i, posNN = position), `seq`/`pos` columns or
// fields, or a prefill folder named `<S>seqs_x<T>tok`; otherwise each step's row r is sequence r):
//   phase "decode", batch B: sequences in groups of B (ascending id); step p of a group holds
//     position p of each of its sequences (B concurrent rows, one token each). B = 0: one group.
//   phase "prefill", batch C: tokens in sequence-major order, cut into chunks of C tokens.
//     C = 0: one chunk per sequence.
Result<ExpertLoad> ReadExpertLoad(const std::string& path, const LoadReadOptions& options);

struct TraceInfo;
// The same, and *info says what the source held (format, original layer ids, series description).
Result<ExpertLoad> ReadExpertLoad(const std::string& path, const LoadReadOptions& options, TraceInfo* info);

// What a trace holds. A plain value.
struct TraceInfo {
  std::string format;            // the source format name (see above)
  int num_layers = 0;
  int num_experts = 0;
  int top_k = 0;                 // picks per row; 0 when unknown (count-only sources)
  bool has_picks = false;        // per-row picks (else per-expert counts only)
  bool has_weights = false;      // router weights with the picks
  int64_t num_steps = 0;
  std::vector<int> layer_ids;    // the source's id of each layer (num_layers values)
  std::string description;       // e.g. the series a count file's filter selected
  int64_t dropped_tokens = 0;    // tokens left out for a missing layer record (on_missing "drop-token")
};

// One step of a trace.
struct StepPicks {
  int64_t rows = 0;              // rows (tokens) in the step; 0 when unknown (count-only sources)
  std::vector<Picks> layers;     // per layer: rows x k picks (weights empty without weights);
                                 // empty for count-only sources
  std::vector<int64_t> counts;   // [layer][expert] picks per expert, num_layers * num_experts values
};

// Reads a trace one step at a time, from any supported source. The binary format with the source's
// own steps is streamed from disk (memory: one step); other sources and regrouped steps are
// imported into memory first (bounded: kMaxInMemoryPicks picks). Not thread-safe (one reader per
// thread).
class TraceReader {
 public:
  static constexpr int64_t kMaxInMemoryPicks = int64_t{1} << 26;
  static constexpr int64_t kMaxRowsPerStep = int64_t{1} << 40;  // bounds row arithmetic

  static Result<std::unique_ptr<TraceReader>> Open(const std::string& path, const LoadReadOptions& options);
  virtual ~TraceReader() = default;

  const TraceInfo& info() const { return info_; }
  int num_layers() const { return info_.num_layers; }
  int num_experts() const { return info_.num_experts; }
  int top_k() const { return info_.top_k; }
  bool has_picks() const { return info_.has_picks; }

  // Fills *step with the next step and returns true, or returns false after the last step.
  virtual Result<bool> Next(StepPicks* step) = 0;

 protected:
  TraceInfo info_;
};

// Writes epmoe's binary trace format, streamed: the header first, one record per step, then a
// trailer with the step and pick totals (the header's step count is filled in by Close).
// Layout (little-endian), version 1:
//   header  "EPMOETRC" u32 version u32 flags(1 = picks, 2 = weights) u32 layers u32 experts u32 top_k
//           u32 reserved(0) i64 steps, then i32 layer_ids[layers]
//   step    u32 "STEP" i64 rows, then per layer: picks: i32 ids[rows*k] (+ f32 weights[rows*k]);
//           counts only: i64 counts[experts]
//   trailer u32 "TEND" i64 steps i64 total_picks
// Not thread-safe.
class TraceWriter {
 public:
  static Result<std::unique_ptr<TraceWriter>> Create(const std::string& path, const TraceInfo& info);
  ~TraceWriter();
  // Checks the step against the header's shape (ids in range, distinct per row, finite weights,
  // counts matching rows * k) before writing it.
  Status Append(const StepPicks& step);
  Status Close();

 private:
  TraceWriter() = default;
  std::string path_;
  TraceInfo info_;
  std::ofstream out_;
  int64_t steps_ = 0;
  int64_t total_picks_ = 0;
  bool closed_ = false;
};

// Export formats of WriteTrace: "epmoe" (binary), "jsonl" (per-row records), "topk-csv"
// (`step,row,layer,e0..,w0..`), "counts-csv" (`step,layer,expert,count`), "sglang-json"
// (one {"logical_count": [[..]]} record per line, per step). Per-row formats need a trace with picks.
Status WriteTrace(TraceReader* reader, const std::string& path, const std::string& format);

// Fills step->counts from step->layers (per layer, picks per expert).
void CountStepPicks(int num_layers, int num_experts, StepPicks* step);

}  // namespace epmoe
