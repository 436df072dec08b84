// FLAME-MoE per-layer gate-score CSVs (see trace.h for the layouts).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <regex>

#include "trace/imported.h"
#include "trace/text_input.h"

namespace epmoe::trace_internal {
namespace {

namespace fs = std::filesystem;

// The number in a name such as "layer02.csv" or "pos10", or -1 when it has none.
int64_t NumberAfterPrefix(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return -1;
  int64_t value = 0;
  size_t i = prefix.size();
  if (i >= name.size() || !std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
  for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])) && value < (int64_t{1} << 40); ++i)
    value = value * 10 + (name[i] - '0');
  return value;
}

struct LayerFile {
  int64_t layer_id;
  fs::path path;
};

// The layerNN.csv files of a folder, in ascending layer order.
Result<std::vector<LayerFile>> LayerFilesIn(const fs::path& folder) {
  std::vector<LayerFile> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    const int64_t id = NumberAfterPrefix(name, "layer");
    if (id >= 0 && entry.path().extension() == ".csv" && entry.is_regular_file()) files.push_back({id, entry.path()});
  }
  if (ec) return IoError(fmt::format("{}: cannot list the folder: {}", folder.string(), ec.message()));
  std::sort(files.begin(), files.end(), [](const LayerFile& a, const LayerFile& b) { return a.layer_id < b.layer_id; });
  for (size_t i = 1; i < files.size(); ++i)
    if (files[i].layer_id == files[i - 1].layer_id)
      return InvalidArgument(fmt::format("{}: two files for layer {}", folder.string(), files[i].layer_id));
  return files;
}

// One step: every layer file of a folder. All layers must have the same rows, experts and k.
Status ReadLayerFolder(const std::vector<LayerFile>& files, TraceInfo* info, StepPicks* step) {
  step->layers.assign(files.size(), Picks{});
  for (size_t l = 0; l < files.size(); ++l) {
    std::ifstream in(files[l].path, std::ios::binary);
    if (!in) return NotFound(fmt::format("{}: cannot open", files[l].path.string()));
    int experts = 0;
    EPMOE_RETURN_IF_ERROR(ParseFlameLayerCsv(in, files[l].path.string(), &step->layers[l], &experts));
    const Picks& picks = step->layers[l];
    if (info->num_experts == 0) {
      info->num_experts = experts;
      info->top_k = picks.k;
    }
    if (experts != info->num_experts || picks.k != info->top_k)
      return InvalidArgument(fmt::format("{}: {} experts and top-{}, but earlier layer files have {} and top-{}",
                                         files[l].path.string(), experts, picks.k, info->num_experts, info->top_k));
    if (l > 0 && picks.rows != step->layers[0].rows)
      return InvalidArgument(fmt::format("{}: {} rows, but {} has {}", files[l].path.string(), picks.rows,
                                         files[0].path.string(), step->layers[0].rows));
  }
  step->rows = files.empty() ? 0 : step->layers[0].rows;
  return Status::Ok();
}

}  // namespace

Status ParseFlameLayerCsv(std::istream& in, const std::string& source, Picks* picks, int* num_experts) {
  LineReader lines(in, source);
  std::string_view line;
  EPMOE_ASSIGN_OR_RETURN(bool has_header, lines.Next(&line));
  if (!has_header) return InvalidArgument(fmt::format("{}: empty file (expected a header)", source));
  // Header: layer_id,token_id,expert_0..expert_{E-1}; score columns are the expert_* ones, in order.
  const std::vector<std::string> header = SplitHeader(line);
  std::vector<int> column_expert(header.size(), -1);
  int experts = 0;
  for (size_t c = 0; c < header.size(); ++c) {
    const std::string name(header[c]);
    const int64_t id = NumberAfterPrefix(name, "expert_");
    if (id < 0) continue;
    if (id != experts || name.size() != 7 + std::to_string(id).size())
      return lines.Error(fmt::format("column {} is '{}', expected expert_{}", c + 1, name, experts));
    column_expert[c] = experts++;
  }
  if (experts == 0) return lines.Error("no expert_<id> columns in the header (not a FLAME-MoE layer CSV)");
  *num_experts = experts;
  picks->rows = 0;
  picks->k = 0;
  picks->experts.clear();
  picks->weights.clear();
  std::vector<std::pair<double, int>> chosen;
  std::vector<std::string_view> fields;
  while (true) {
    EPMOE_ASSIGN_OR_RETURN(bool more, lines.NextRecord(header.size(), &fields));
    if (!more) break;
    chosen.clear();
    for (size_t c = 0; c < fields.size(); ++c) {
      double value = 0;
      if (!ParseDouble(fields[c], &value))
        return lines.Error(fmt::format("column {} ('{}'): '{}' is not a finite number", c + 1, header[c], fields[c]));
      if (column_expert[c] < 0) continue;
      if (value < 0) return lines.Error(fmt::format("column {}: negative gate score {}", header[c], value));
      if (value > 0) chosen.push_back({value, column_expert[c]});
    }
    if (chosen.empty()) return lines.Error("no expert has a non-zero score");
    if (picks->rows == 0) picks->k = static_cast<int>(chosen.size());
    if (static_cast<int>(chosen.size()) != picks->k)
      return lines.Error(
          fmt::format("{} non-zero scores, earlier rows have {} (top-k must be constant)", chosen.size(), picks->k));
    if ((picks->rows + 1) * picks->k > TraceReader::kMaxInMemoryPicks)
      return OutOfRange(
          fmt::format("{}: more than {} picks; too large to import", source, TraceReader::kMaxInMemoryPicks));
    std::stable_sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (const auto& [score, expert] : chosen) {
      float weight = 0;
      if (!ToWeight(score, &weight))
        return lines.Error(fmt::format("gate score {} of expert {} is out of range", score, expert));
      picks->experts.push_back(expert);
      picks->weights.push_back(weight);
    }
    ++picks->rows;
  }
  if (picks->rows == 0) return InvalidArgument(fmt::format("{}: no rows after the header", source));
  return Status::Ok();
}

Result<ImportedTrace> ImportFlameCsv(const std::string& path, const LoadReadOptions& /*options*/) {
  ImportedTrace trace;
  trace.info.format = "flame-csv";
  trace.info.has_picks = true;
  trace.info.has_weights = true;
  std::error_code ec;
  const fs::path root(path);
  if (fs::is_regular_file(root, ec)) {
    int64_t id = NumberAfterPrefix(root.filename().string(), "layer");
    std::vector<LayerFile> files{{id < 0 ? 0 : id, root}};
    trace.steps.resize(1);
    EPMOE_RETURN_IF_ERROR(ReadLayerFolder(files, &trace.info, &trace.steps[0]));
    trace.info.layer_ids = {static_cast<int>(files[0].layer_id)};
  } else if (fs::is_directory(root, ec)) {
    EPMOE_ASSIGN_OR_RETURN(std::vector<LayerFile> files, LayerFilesIn(root));
    std::vector<std::pair<int64_t, fs::path>> step_folders;
    if (files.empty()) {
      for (const auto& entry : fs::directory_iterator(root, ec))
        if (entry.is_directory()) {
          const std::string name = entry.path().filename().string();
          size_t digits = name.find_first_of("0123456789");
          const int64_t number = digits == std::string::npos ? -1 : NumberAfterPrefix(name, name.substr(0, digits));
          step_folders.push_back({number, entry.path()});
        }
      if (ec) return IoError(fmt::format("{}: cannot list the folder: {}", path, ec.message()));
      if (step_folders.empty())
        return InvalidArgument(fmt::format("{}: no layerNN.csv files and no step subfolders (posNN/)", path));
      std::sort(step_folders.begin(), step_folders.end());
    }
    if (!files.empty()) {
      // One step: the whole folder. A name such as "prefill_32seqs_x64tok" says how rows form sequences.
      trace.steps.resize(1);
      EPMOE_RETURN_IF_ERROR(ReadLayerFolder(files, &trace.info, &trace.steps[0]));
      for (const LayerFile& f : files) trace.info.layer_ids.push_back(static_cast<int>(f.layer_id));
      std::smatch match;
      const std::string name =
          root.filename().empty() ? root.parent_path().filename().string() : root.filename().string();
      static const std::regex kSeqsTok("([0-9]+)seqs_x([0-9]+)tok");
      if (std::regex_search(name, match, kSeqsTok)) {
        const int64_t seqs = std::stoll(match[1].str()), tokens = std::stoll(match[2].str());
        if (seqs > 0 && tokens > 0 && seqs * tokens == trace.steps[0].rows) {
          trace.has_sequences = true;
          trace.row_seq.assign(1, std::vector<int64_t>(trace.steps[0].rows));
          trace.row_pos.assign(1, std::vector<int64_t>(trace.steps[0].rows));
          for (int64_t r = 0; r < trace.steps[0].rows; ++r) {
            trace.row_seq[0][r] = r / tokens;
            trace.row_pos[0][r] = r % tokens;
          }
        }
      }
    } else {
      // posNN/ subfolders: one decode step each; row i is sequence i at position NN.
      int64_t picks = 0;
      for (const auto& [number, folder] : step_folders) {
        EPMOE_ASSIGN_OR_RETURN(std::vector<LayerFile> step_files, LayerFilesIn(folder));
        if (step_files.empty()) return InvalidArgument(fmt::format("{}: no layerNN.csv files", folder.string()));
        std::vector<int> ids;
        for (const LayerFile& f : step_files) ids.push_back(static_cast<int>(f.layer_id));
        if (trace.steps.empty()) trace.info.layer_ids = ids;
        if (ids != trace.info.layer_ids)
          return InvalidArgument(fmt::format("{}: its layer files differ from those of {}", folder.string(),
                                             step_folders[0].second.string()));
        StepPicks step;
        EPMOE_RETURN_IF_ERROR(ReadLayerFolder(step_files, &trace.info, &step));
        picks += step.rows * trace.info.top_k * static_cast<int64_t>(ids.size());
        if (picks > TraceReader::kMaxInMemoryPicks)
          return OutOfRange(
              fmt::format("{}: more than {} picks; too large to import", path, TraceReader::kMaxInMemoryPicks));
        trace.row_seq.emplace_back(step.rows);
        std::iota(trace.row_seq.back().begin(), trace.row_seq.back().end(), 0);
        trace.row_pos.emplace_back(step.rows, number < 0 ? static_cast<int64_t>(trace.steps.size()) : number);
        trace.steps.push_back(std::move(step));
      }
      trace.has_sequences = true;
    }
  } else {
    return NotFound(fmt::format("{}: no such file or folder", path));
  }
  trace.info.num_layers = static_cast<int>(trace.info.layer_ids.size());
  trace.info.num_steps = static_cast<int64_t>(trace.steps.size());
  EPMOE_RETURN_IF_ERROR(FinishImport(path, &trace));
  return trace;
}

}  // namespace epmoe::trace_internal
