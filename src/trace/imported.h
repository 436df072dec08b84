// Importers: each reads one source format fully into memory as an ImportedTrace (steps of picks or
// counts, plus each row's sequence and position when the source has them, used to regroup tokens
// into decode steps or prefill chunks). Internal to src/trace; stream-based where the format is a
// single file, so that the fuzz targets can drive them from memory.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "epmoe/trace.h"

namespace epmoe::trace_internal {

struct ImportedTrace {
  TraceInfo info;
  std::vector<StepPicks> steps;
  bool has_sequences = false;                 // row_seq / row_pos are filled
  std::vector<std::vector<int64_t>> row_seq;  // [step][row] sequence id
  std::vector<std::vector<int64_t>> row_pos;  // [step][row] position in its sequence
};

// FLAME-MoE per-layer gate-score CSVs: a layerNN.csv file, a folder of them, or a folder of
// posNN/ subfolders.
Result<ImportedTrace> ImportFlameCsv(const std::string& path, const LoadReadOptions& options);
// One FLAME-MoE layer file: per row, the non-zero scores become picks in descending score order
// (ties: lower id first). Sets *num_experts from the header's expert_* columns.
Status ParseFlameLayerCsv(std::istream& in, const std::string& source, Picks* picks, int* num_experts);

Result<ImportedTrace> ImportTopkCsv(std::istream& in, const std::string& source, const LoadReadOptions& options);
Result<ImportedTrace> ImportJsonl(std::istream& in, const std::string& source, const LoadReadOptions& options);
Result<ImportedTrace> ImportExpertCountsCsv(std::istream& in, const std::string& source,
                                            const LoadReadOptions& options);
Result<ImportedTrace> ImportSglangJson(std::istream& in, const std::string& source, const LoadReadOptions& options);
Result<ImportedTrace> ImportCountsCsv(std::istream& in, const std::string& source, const LoadReadOptions& options);

// Rebuilds the steps from the tokens: phase "decode" or "prefill" with batch B / C (see trace.h).
Result<ImportedTrace> RegroupSteps(const ImportedTrace& trace, const std::string& phase, int64_t batch);

// Checks every step against the info (shape, ids, repeats, weights) and fills the counts of steps
// with picks. `source` names the data in errors.
Status FinishImport(const std::string& source, ImportedTrace* trace);

}  // namespace epmoe::trace_internal
