// WriteTrace: a trace from any reader into the binary format or a CSV / JSON export.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "epmoe/trace.h"

namespace epmoe {

Status WriteTrace(TraceReader* reader, const std::string& path, const std::string& format) {
  const TraceInfo& info = reader->info();
  const bool per_row = format == "jsonl" || format == "topk-csv";
  if (format != "epmoe" && format != "counts-csv" && format != "sglang-json" && !per_row)
    return InvalidArgument(fmt::format("unknown export format '{}'; expected epmoe, jsonl, topk-csv, counts-csv or "
                                       "sglang-json", format));
  if (per_row && !info.has_picks)
    return FailedPrecondition(fmt::format("{} needs per-row picks; the {} trace holds counts only", format,
                                          info.format));
  if (format == "epmoe") {
    EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<TraceWriter> writer, TraceWriter::Create(path, info));
    while (true) {
      StepPicks step;
      EPMOE_ASSIGN_OR_RETURN(bool more, reader->Next(&step));
      if (!more) break;
      EPMOE_RETURN_IF_ERROR(writer->Append(step));
    }
    return writer->Close();
  }
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> out, AtomicFile::Create(path));
  const int L = info.num_layers, E = info.num_experts, k = info.top_k;
  std::string text;
  if (format == "jsonl") {
    text = nlohmann::json{{"num_experts", E}, {"top_k", k}, {"layer_ids", info.layer_ids}, {"source", info.format}}
               .dump() + "\n";
  } else if (format == "topk-csv") {
    text = "step,row,layer";
    for (int j = 0; j < k; ++j) text += fmt::format(",e{}", j);
    if (info.has_weights)
      for (int j = 0; j < k; ++j) text += fmt::format(",w{}", j);
    text += "\n";
  } else if (format == "counts-csv") {
    text = "step,rows,top_k,layer,expert,count\n";
  }
  for (int64_t s = 0;; ++s) {
    StepPicks step;
    EPMOE_ASSIGN_OR_RETURN(bool more, reader->Next(&step));
    if (!more) break;
    if (format == "sglang-json") {
      nlohmann::json counts = nlohmann::json::array();
      for (int l = 0; l < L; ++l)
        counts.push_back(std::vector<int64_t>(step.counts.begin() + static_cast<size_t>(l) * E,
                                              step.counts.begin() + static_cast<size_t>(l + 1) * E));
      nlohmann::json record{{"step", s},
                            {"rows", step.rows},
                            {"top_k", k},
                            {"layer_ids", info.layer_ids},
                            {"logical_count", std::move(counts)}};
      text += record.dump() + "\n";
    } else if (format == "counts-csv") {
      for (int l = 0; l < L; ++l)
        for (int e = 0; e < E; ++e)
          text += fmt::format("{},{},{},{},{},{}\n", s, step.rows, k, info.layer_ids[l], e,
                              step.counts[static_cast<size_t>(l) * E + e]);
    } else {
      for (int64_t r = 0; r < step.rows; ++r)
        for (int l = 0; l < L; ++l) {
          const Picks& picks = step.layers[l];
          if (format == "jsonl") {
            nlohmann::json record{{"step", s}, {"row", r}, {"layer", info.layer_ids[l]},
                                  {"experts", std::vector<int32_t>(picks.experts.begin() + r * k,
                                                                   picks.experts.begin() + (r + 1) * k)}};
            if (info.has_weights)
              record["gating_probs"] =
                  std::vector<float>(picks.weights.begin() + r * k, picks.weights.begin() + (r + 1) * k);
            text += record.dump() + "\n";
          } else {
            text += fmt::format("{},{},{}", s, r, info.layer_ids[l]);
            for (int j = 0; j < k; ++j) text += fmt::format(",{}", picks.expert(r, j));
            if (info.has_weights)
              for (int j = 0; j < k; ++j) text += fmt::format(",{}", picks.weight(r, j));
            text += "\n";
          }
        }
    }
    if (text.size() > (size_t{1} << 20)) {
      EPMOE_RETURN_IF_ERROR(out->Append(text));
      text.clear();
    }
  }
  EPMOE_RETURN_IF_ERROR(out->Append(text));
  return out->Commit();
}

}  // namespace epmoe
