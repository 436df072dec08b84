// TraceReader::Open (format detection, import, regrouping), ReadExpertLoad and import checks.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>

#include <fmt/format.h>

#include "trace/binary.h"
#include "trace/imported.h"

namespace epmoe {
namespace trace_internal {
namespace {

namespace fs = std::filesystem;

// Serves the steps of an imported trace from memory.
class MemoryTraceReader final : public TraceReader {
 public:
  explicit MemoryTraceReader(ImportedTrace trace) : trace_(std::move(trace)) { info_ = trace_.info; }
  Result<bool> Next(StepPicks* step) override {
    if (next_ >= trace_.steps.size()) return false;
    *step = std::move(trace_.steps[next_++]);
    return true;
  }

 private:
  ImportedTrace trace_;
  size_t next_ = 0;
};

const std::vector<std::string>& KnownFormats() {
  static const std::vector<std::string> formats = {"epmoe", "flame-csv", "flame-topk-csv", "jsonl",
                                                   "expert-counts-csv", "sglang-json", "counts-csv"};
  return formats;
}

// The format of a file from its first bytes (and its first line for CSVs).
Result<std::string> DetectFormat(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return std::string("flame-csv");
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("{}: cannot open", path));
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  if (HasTraceMagic(head.data(), head.size())) return std::string("epmoe");
  const size_t start = head.find_first_not_of(" \t\r\n");
  if (start == std::string::npos) return InvalidArgument(fmt::format("{}: empty file", path));
  if (head[start] == '{' || head[start] == '[') {
    if (head.find("logical_count") != std::string::npos) return std::string("sglang-json");
    return std::string("jsonl");
  }
  const std::string first_line = head.substr(0, head.find('\n'));
  auto has = [&](const char* name) {
    return (',' + first_line + ',').find(fmt::format(",{},", name)) != std::string::npos;
  };
  if (has("expert_0")) return std::string("flame-csv");
  if (has("e0")) return std::string("flame-topk-csv");
  if (has("step") && has("expert") && has("count")) return std::string("counts-csv");
  if (has("layer") && has("expert") && has("count")) return std::string("expert-counts-csv");
  std::string shown = first_line.substr(0, 80);  // printable, for the message
  for (char& c : shown)
    if (static_cast<unsigned char>(c) < 32 || static_cast<unsigned char>(c) > 126) c = '?';
  return InvalidArgument(fmt::format("{}: cannot tell the trace format from its first line '{}'; give one of {}",
                                     path, shown, fmt::join(KnownFormats(), ", ")));
}

}  // namespace

Status FinishImport(const std::string& source, ImportedTrace* trace) {
  TraceInfo& info = trace->info;
  if (info.num_layers <= 0 || info.num_experts <= 0 || info.num_experts > kMaxExperts || info.top_k < 0 ||
      info.top_k > kMaxTopK || static_cast<int>(info.layer_ids.size()) != info.num_layers)
    return InvalidArgument(fmt::format("{}: bad trace shape: {} layers, {} experts, top-{}", source, info.num_layers,
                                       info.num_experts, info.top_k));
  if (info.has_picks && info.top_k > info.num_experts)
    return InvalidArgument(fmt::format("{}: top-{} exceeds the {} experts", source, info.top_k, info.num_experts));
  info.num_steps = static_cast<int64_t>(trace->steps.size());
  if (info.num_steps * info.num_layers * info.num_experts > TraceReader::kMaxInMemoryPicks)
    return OutOfRange(fmt::format("{}: {} steps x {} layers x {} experts of counts exceed the in-memory bound of {}",
                                  source, info.num_steps, info.num_layers, info.num_experts,
                                  TraceReader::kMaxInMemoryPicks));
  for (size_t s = 0; s < trace->steps.size(); ++s) {
    StepPicks& step = trace->steps[s];
    if (step.rows < 0 || step.rows > TraceReader::kMaxRowsPerStep)
      return InvalidArgument(fmt::format("{}: step {} has {} rows", source, s, step.rows));
    if (info.has_picks) {
      if (static_cast<int>(step.layers.size()) != info.num_layers)
        return InvalidArgument(fmt::format("{}: step {} has {} layers, expected {}", source, s, step.layers.size(),
                                           info.num_layers));
      for (int l = 0; l < info.num_layers; ++l) {
        const Picks& picks = step.layers[l];
        if (picks.rows != step.rows || picks.k != info.top_k)
          return InvalidArgument(fmt::format("{}: step {} layer {}: {} rows of top-{}, expected {} of top-{}", source,
                                             s, info.layer_ids[l], picks.rows, picks.k, step.rows, info.top_k));
        if (!info.has_weights && !picks.weights.empty())
          return InvalidArgument(fmt::format("{}: step {} layer {} has weights, earlier steps do not", source, s,
                                             info.layer_ids[l]));
        Picks checked = picks;
        if (!info.has_weights) checked.weights.assign(checked.experts.size(), 1.0f);
        Status status = ValidatePicks(checked, info.num_experts);
        if (!status.ok())
          return status.WithContext(fmt::format("{}: step {} layer {}", source, s, info.layer_ids[l]));
      }
      CountStepPicks(info.num_layers, info.num_experts, &step);
    } else {
      step.layers.clear();
      if (step.counts.size() != static_cast<size_t>(info.num_layers) * info.num_experts)
        return InvalidArgument(fmt::format("{}: step {} holds {} counts, expected {}", source, s, step.counts.size(),
                                           static_cast<int64_t>(info.num_layers) * info.num_experts));
      // Every pick of a row is counted once in each layer, so all (non-empty) layers sum alike.
      int64_t first_sum = -1;
      for (int l = 0; l < info.num_layers; ++l) {
        int64_t sum = 0;
        for (int e = 0; e < info.num_experts; ++e) {
          const int64_t count = step.counts[static_cast<size_t>(l) * info.num_experts + e];
          if (count < 0 || sum > (int64_t{1} << 62) - count)
            return InvalidArgument(fmt::format("{}: step {} layer {}: bad count {}", source, s, info.layer_ids[l],
                                               count));
          sum += count;
        }
        if (sum == 0) continue;
        if (first_sum < 0) first_sum = sum;
        if (sum != first_sum)
          return InvalidArgument(fmt::format("{}: step {}: layer {} has {} picks, an earlier layer {}; counts do not "
                                             "add up", source, s, info.layer_ids[l], sum, first_sum));
        if (step.rows > 0 && info.top_k > 0 && sum != step.rows * info.top_k)
          return InvalidArgument(fmt::format("{}: step {} layer {}: {} picks, but {} rows x top-{} = {}", source, s,
                                             info.layer_ids[l], sum, step.rows, info.top_k, step.rows * info.top_k));
      }
    }
  }
  return Status::Ok();
}

Result<ImportedTrace> RegroupSteps(const ImportedTrace& trace, const std::string& phase, int64_t batch) {
  if (!trace.info.has_picks)
    return FailedPrecondition(fmt::format("phase '{}' needs per-row picks; {} holds counts only", phase,
                                          trace.info.format));
  if (batch < 0) return InvalidArgument(fmt::format("batch {} is negative", batch));
  struct Token {
    int64_t seq, pos, step, row;
  };
  std::vector<Token> tokens;
  for (size_t s = 0; s < trace.steps.size(); ++s)
    for (int64_t r = 0; r < trace.steps[s].rows; ++r)
      tokens.push_back(trace.has_sequences ? Token{trace.row_seq[s][r], trace.row_pos[s][r], static_cast<int64_t>(s), r}
                                           : Token{r, static_cast<int64_t>(s), static_cast<int64_t>(s), r});
  std::sort(tokens.begin(), tokens.end(), [](const Token& a, const Token& b) {
    return std::tie(a.seq, a.pos, a.step, a.row) < std::tie(b.seq, b.pos, b.step, b.row);
  });
  // Each new step is a list of tokens.
  std::vector<std::vector<const Token*>> groups;
  if (phase == "prefill") {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const bool new_chunk = batch > 0 ? (i % batch == 0) : (i == 0 || tokens[i].seq != tokens[i - 1].seq);
      if (new_chunk) groups.emplace_back();
      groups.back().push_back(&tokens[i]);
    }
  } else if (phase == "decode") {
    std::vector<size_t> seq_starts;  // index of each sequence's first token
    for (size_t i = 0; i < tokens.size(); ++i)
      if (i == 0 || tokens[i].seq != tokens[i - 1].seq) seq_starts.push_back(i);
    const size_t per_group = batch > 0 ? static_cast<size_t>(batch) : std::max<size_t>(seq_starts.size(), 1);
    for (size_t g = 0; g < seq_starts.size(); g += per_group) {
      const size_t end = g + per_group < seq_starts.size() ? seq_starts[g + per_group] : tokens.size();
      std::vector<const Token*> members;
      for (size_t i = seq_starts[g]; i < end; ++i) members.push_back(&tokens[i]);
      std::stable_sort(members.begin(), members.end(),
                       [](const Token* a, const Token* b) { return std::tie(a->pos, a->seq) < std::tie(b->pos, b->seq); });
      for (size_t i = 0; i < members.size(); ++i) {
        if (i == 0 || members[i]->pos != members[i - 1]->pos) groups.emplace_back();
        groups.back().push_back(members[i]);
      }
    }
  } else {
    return InvalidArgument(fmt::format("phase '{}': expected auto, decode or prefill", phase));
  }
  ImportedTrace out;
  out.info = trace.info;
  out.has_sequences = true;
  const int k = trace.info.top_k;
  for (const auto& group : groups) {
    StepPicks step;
    step.rows = static_cast<int64_t>(group.size());
    step.layers.resize(trace.info.num_layers);
    for (int l = 0; l < trace.info.num_layers; ++l) {
      Picks& picks = step.layers[l];
      picks.rows = step.rows;
      picks.k = k;
      for (const Token* t : group) {
        const Picks& from = trace.steps[t->step].layers[l];
        picks.experts.insert(picks.experts.end(), from.experts.begin() + t->row * k,
                             from.experts.begin() + (t->row + 1) * k);
        if (!from.weights.empty())
          picks.weights.insert(picks.weights.end(), from.weights.begin() + t->row * k,
                               from.weights.begin() + (t->row + 1) * k);
      }
    }
    out.row_seq.emplace_back();
    out.row_pos.emplace_back();
    for (const Token* t : group) {
      out.row_seq.back().push_back(t->seq);
      out.row_pos.back().push_back(t->pos);
    }
    out.steps.push_back(std::move(step));
  }
  EPMOE_RETURN_IF_ERROR(FinishImport(trace.info.format, &out));
  return out;
}

// Imports a whole source into memory.
Result<ImportedTrace> ImportTrace(const std::string& path, const std::string& format, const LoadReadOptions& options) {
  if (format == "flame-csv") return ImportFlameCsv(path, options);
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("{}: cannot open", path));
  if (format == "flame-topk-csv") return ImportTopkCsv(in, path, options);
  if (format == "jsonl") return ImportJsonl(in, path, options);
  if (format == "expert-counts-csv") return ImportExpertCountsCsv(in, path, options);
  if (format == "sglang-json") return ImportSglangJson(in, path, options);
  if (format == "counts-csv") return ImportCountsCsv(in, path, options);
  if (format == "epmoe") {
    // Read through the streamed reader, into memory (for regrouping).
    const int64_t size = static_cast<int64_t>(fs::file_size(path));
    EPMOE_ASSIGN_OR_RETURN(auto reader, OpenBinaryTrace(std::make_unique<std::ifstream>(std::move(in)), size, path));
    ImportedTrace trace;
    trace.info = reader->info();
    int64_t picks = 0;
    while (true) {
      StepPicks step;
      EPMOE_ASSIGN_OR_RETURN(bool more, reader->Next(&step));
      if (!more) break;
      picks += trace.info.has_picks ? step.rows * trace.info.top_k * trace.info.num_layers
                                    : static_cast<int64_t>(trace.info.num_layers) * trace.info.num_experts;
      if (picks > TraceReader::kMaxInMemoryPicks)
        return OutOfRange(fmt::format("{}: more than {} picks; too large to regroup in memory", path,
                                      TraceReader::kMaxInMemoryPicks));
      trace.steps.push_back(std::move(step));
    }
    return trace;
  }
  return InvalidArgument(fmt::format("unknown trace format '{}'; expected auto or one of {}", format,
                                     fmt::join(KnownFormats(), ", ")));
}

}  // namespace trace_internal

void CountStepPicks(int num_layers, int num_experts, StepPicks* step) {
  step->counts.assign(static_cast<size_t>(num_layers) * num_experts, 0);
  for (int l = 0; l < num_layers && l < static_cast<int>(step->layers.size()); ++l)
    for (int32_t e : step->layers[l].experts)
      if (e >= 0 && e < num_experts) ++step->counts[static_cast<size_t>(l) * num_experts + e];
}

Result<std::unique_ptr<TraceReader>> TraceReader::Open(const std::string& path, const LoadReadOptions& options) {
  using namespace trace_internal;
  std::string format = options.format;
  if (format == "auto") {
    EPMOE_ASSIGN_OR_RETURN(format, DetectFormat(path));
  }
  if (options.phase != "auto" && options.phase != "decode" && options.phase != "prefill")
    return InvalidArgument(fmt::format("phase '{}': expected auto, decode or prefill", options.phase));
  if (options.batch < 0) return InvalidArgument(fmt::format("batch {} is negative", options.batch));
  if (!options.filter.empty() && format != "expert-counts-csv")
    return InvalidArgument(fmt::format("filter '{}' applies to expert-counts-csv files; {} is {}", options.filter, path,
                                       format));
  if (options.phase == "auto" && options.batch != 0)
    return InvalidArgument(fmt::format("batch {} needs phase decode or prefill", options.batch));
  if (format == "epmoe" && options.phase == "auto") {
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) return NotFound(fmt::format("{}: {}", path, ec.message()));
    auto in = std::make_unique<std::ifstream>(path, std::ios::binary);
    if (!*in) return NotFound(fmt::format("{}: cannot open", path));
    return OpenBinaryTrace(std::move(in), static_cast<int64_t>(size), path);
  }
  EPMOE_ASSIGN_OR_RETURN(ImportedTrace trace, ImportTrace(path, format, options));
  if (options.phase != "auto") {
    EPMOE_ASSIGN_OR_RETURN(trace, RegroupSteps(trace, options.phase, options.batch));
  }
  return std::unique_ptr<TraceReader>(std::make_unique<MemoryTraceReader>(std::move(trace)));
}

Result<ExpertLoad> ReadExpertLoad(const std::string& path, const LoadReadOptions& options) {
  TraceInfo info;
  return ReadExpertLoad(path, options, &info);
}

Result<ExpertLoad> ReadExpertLoad(const std::string& path, const LoadReadOptions& options, TraceInfo* info_out) {
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<TraceReader> reader, TraceReader::Open(path, options));
  const TraceInfo& info = reader->info();
  ExpertLoad load(0, info.num_layers, info.num_experts, info.top_k);
  const size_t per_step = static_cast<size_t>(info.num_layers) * info.num_experts;
  while (true) {
    StepPicks step;
    EPMOE_ASSIGN_OR_RETURN(bool more, reader->Next(&step));
    if (!more) break;
    if (step.counts.size() != per_step)
      return Internal(fmt::format("{}: step {} holds {} counts, expected {}", path, load.num_steps, step.counts.size(),
                                  per_step));
    if (load.counts.size() + per_step > static_cast<size_t>(TraceReader::kMaxInMemoryPicks) * 4)
      return OutOfRange(fmt::format("{}: the load of {} steps exceeds the memory bound", path, load.num_steps));
    load.counts.insert(load.counts.end(), step.counts.begin(), step.counts.end());
    load.rows.push_back(step.rows);
    ++load.num_steps;
  }
  EPMOE_RETURN_IF_ERROR(ValidateExpertLoad(load, path));
  *info_out = info;
  info_out->num_steps = load.num_steps;
  return load;
}

}  // namespace epmoe
