// Count-only sources: OLMoE-style expert count CSVs, SGLang-style per-pass JSON records and epmoe's
// counts CSV export.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "epmoe/bounded_input.h"
#include "trace/imported.h"
#include "trace/text_input.h"

namespace epmoe::trace_internal {
namespace {

// Index of each named column in a header, or -1.
std::map<std::string, int> ColumnIndex(const std::vector<std::string>& header) {
  std::map<std::string, int> index;
  for (size_t c = 0; c < header.size(); ++c) index[header[c]] = static_cast<int>(c);
  return index;
}

Status CheckPickCapacity(const std::string& source, int64_t values) {
  if (values > TraceReader::kMaxInMemoryPicks)
    return OutOfRange(fmt::format("{}: more than {} values; too large to import", source,
                                  TraceReader::kMaxInMemoryPicks));
  return Status::Ok();
}

// Parses "key=value,key=value" into pairs.
Result<std::vector<std::pair<std::string, std::string>>> ParseFilter(const std::string& filter) {
  std::vector<std::pair<std::string, std::string>> pairs;
  if (filter.empty()) return pairs;
  for (std::string_view item : SplitCommas(filter)) {
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0)
      return InvalidArgument(fmt::format("filter '{}': '{}' is not key=value", filter, item));
    pairs.push_back({std::string(item.substr(0, eq)), std::string(item.substr(eq + 1))});
  }
  return pairs;
}

}  // namespace

Result<ImportedTrace> ImportExpertCountsCsv(std::istream& in, const std::string& source,
                                            const LoadReadOptions& options) {
  LineReader lines(in, source);
  std::string_view line;
  EPMOE_ASSIGN_OR_RETURN(bool has_header, lines.Next(&line));
  if (!has_header) return InvalidArgument(fmt::format("{}: empty file (expected a header)", source));
  const std::vector<std::string> header = SplitHeader(line);
  std::map<std::string, int> column = ColumnIndex(header);
  for (const char* name : {"layer", "expert", "count"})
    if (!column.count(name)) return lines.Error(fmt::format("the header has no '{}' column", name));
  const int layer_col = column["layer"], expert_col = column["expert"], count_col = column["count"];
  std::vector<int> series_cols;  // every other column names the series (model, domain, selection)
  for (size_t c = 0; c < header.size(); ++c)
    if (static_cast<int>(c) != layer_col && static_cast<int>(c) != expert_col && static_cast<int>(c) != count_col)
      series_cols.push_back(static_cast<int>(c));
  EPMOE_ASSIGN_OR_RETURN(auto filter, ParseFilter(options.filter));
  for (const auto& [key, value] : filter)
    if (!column.count(key) || key == "layer" || key == "expert" || key == "count")
      return InvalidArgument(fmt::format("filter '{}': {} is not a series column of {}", options.filter, key, source));
  const int model_col = column.count("model") ? column["model"] : -1;

  struct Series {
    std::vector<std::string> values;
    std::map<std::pair<int64_t, int64_t>, int64_t> counts;  // (layer id, expert) -> count
    std::map<int64_t, int64_t> layer_sums;
  };
  std::vector<Series> series;
  std::map<std::vector<std::string>, size_t> series_index;
  std::map<std::string, int64_t> max_expert_of_model;
  int64_t values = 0;
  std::vector<std::string_view> fields;
  while (true) {
    EPMOE_ASSIGN_OR_RETURN(bool more, lines.NextRecord(header.size(), &fields));
    if (!more) break;
    int64_t layer = 0, expert = 0, count = 0;
    if (!ParseInt64(fields[layer_col], &layer) || layer < 0 || layer > (1 << 20))
      return lines.Error(fmt::format("layer '{}' is not a layer id", fields[layer_col]));
    if (!ParseInt64(fields[expert_col], &expert) || expert < 0 || expert >= (1 << 20))
      return lines.Error(fmt::format("expert '{}' is not an expert id", fields[expert_col]));
    if (!ParseInt64(fields[count_col], &count) || count < 0)
      return lines.Error(fmt::format("count '{}' is not a non-negative integer", fields[count_col]));
    std::vector<std::string> key;
    for (int c : series_cols) key.emplace_back(fields[c]);
    const std::string model = model_col >= 0 ? std::string(fields[model_col]) : std::string();
    max_expert_of_model[model] = std::max(max_expert_of_model[model], expert);
    auto [it, inserted] = series_index.emplace(key, series.size());
    if (inserted) series.push_back({key, {}, {}});
    Series& s = series[it->second];
    if (!s.counts.emplace(std::make_pair(layer, expert), count).second)
      return lines.Error(fmt::format("a second count for layer {} expert {} of the same series", layer, expert));
    if (s.layer_sums[layer] > (int64_t{1} << 62) - count) return lines.Error("counts overflow");
    s.layer_sums[layer] += count;
    EPMOE_RETURN_IF_ERROR(CheckPickCapacity(source, ++values));
  }
  if (series.empty()) return InvalidArgument(fmt::format("{}: no rows after the header", source));

  auto series_name = [&](const Series& s) {
    std::string name;
    for (size_t i = 0; i < series_cols.size(); ++i)
      name += fmt::format("{}{}={}", i ? "," : "", header[series_cols[i]], s.values[i]);
    return name;
  };
  std::vector<const Series*> matched;
  for (const Series& s : series) {
    bool match = true;
    for (const auto& [key, value] : filter) {
      const auto pos = std::find(series_cols.begin(), series_cols.end(), column[key]) - series_cols.begin();
      match = match && s.values[pos] == value;
    }
    if (match) matched.push_back(&s);
  }
  if (matched.empty()) {
    std::string available;
    for (size_t i = 0; i < series.size() && i < 6; ++i) available += (i ? "; " : "") + series_name(series[i]);
    return InvalidArgument(fmt::format("{}: no series matches filter '{}' ({} series, e.g. {})", source,
                                       options.filter, series.size(), available));
  }
  std::string model;
  if (model_col >= 0) {
    const size_t pos = std::find(series_cols.begin(), series_cols.end(), model_col) - series_cols.begin();
    model = matched[0]->values[pos];
    for (const Series* s : matched)
      if (s->values[pos] != model)
        return InvalidArgument(fmt::format("{}: filter '{}' matches series of models {} and {}; add model=<name>",
                                           source, options.filter, model, s->values[pos]));
  }

  ImportedTrace trace;
  trace.info.format = "expert-counts-csv";
  std::set<int64_t> layer_ids;
  for (const Series* s : matched)
    for (const auto& [layer, sum] : s->layer_sums) layer_ids.insert(layer);
  for (int64_t id : layer_ids) trace.info.layer_ids.push_back(static_cast<int>(id));
  trace.info.num_layers = static_cast<int>(layer_ids.size());
  trace.info.num_experts = options.num_experts > 0 ? options.num_experts
                                                   : static_cast<int>(max_expert_of_model[model] + 1);
  // Rows and k: a top1 series counts each token once; a topk series is matched with the top1 series
  // of the same other fields, when the file has it, to recover tokens and k.
  const int selection_col = column.count("selection") ? column["selection"] : -1;
  const size_t selection_pos =
      std::find(series_cols.begin(), series_cols.end(), selection_col) - series_cols.begin();
  EPMOE_RETURN_IF_ERROR(CheckPickCapacity(
      source, static_cast<int64_t>(matched.size()) * trace.info.num_layers * trace.info.num_experts));
  std::vector<int> step_k;
  for (const Series* s : matched) {
    StepPicks step;
    step.counts.assign(static_cast<size_t>(trace.info.num_layers) * trace.info.num_experts, 0);
    for (const auto& [key, count] : s->counts) {
      const auto [layer, expert] = key;
      if (expert >= trace.info.num_experts)
        return InvalidArgument(fmt::format("{}: series {} has expert {}, but the trace has {} experts", source,
                                           series_name(*s), expert, trace.info.num_experts));
      const int l = static_cast<int>(std::distance(layer_ids.begin(), layer_ids.find(layer)));
      step.counts[static_cast<size_t>(l) * trace.info.num_experts + expert] = count;
    }
    const int64_t sum = s->layer_sums.begin()->second;
    int k = 0;
    if (selection_col >= 0) {
      if (s->values[selection_pos] == "top1") {
        k = 1;
        step.rows = sum;
      } else {
        std::vector<std::string> top1 = s->values;
        top1[selection_pos] = "top1";
        auto it = series_index.find(top1);
        const int64_t tokens = it == series_index.end() ? 0 : series[it->second].layer_sums.begin()->second;
        if (tokens > 0 && sum % tokens == 0 && sum / tokens <= 1024) {
          k = static_cast<int>(sum / tokens);
          step.rows = tokens;
        }
      }
    }
    step_k.push_back(k);
    trace.steps.push_back(std::move(step));
    trace.info.description += (trace.info.description.empty() ? "" : "; ") + series_name(*s);
  }
  // One model routes with one k: when the steps that tell k agree, the others' rows follow from it.
  std::set<int> known_k;
  for (int k : step_k)
    if (k > 0) known_k.insert(k);
  trace.info.top_k = known_k.size() == 1 ? *known_k.begin() : 0;
  for (size_t s = 0; s < trace.steps.size(); ++s) {
    StepPicks& step = trace.steps[s];
    const int64_t sum = matched[s]->layer_sums.begin()->second;
    if (trace.info.top_k == 0) step.rows = 0;
    else if (step_k[s] == 0) step.rows = sum % trace.info.top_k == 0 ? sum / trace.info.top_k : 0;
  }
  trace.info.num_steps = static_cast<int64_t>(trace.steps.size());
  EPMOE_RETURN_IF_ERROR(FinishImport(source, &trace));
  return trace;
}

Result<ImportedTrace> ImportCountsCsv(std::istream& in, const std::string& source, const LoadReadOptions& options) {
  LineReader lines(in, source);
  std::string_view line;
  EPMOE_ASSIGN_OR_RETURN(bool has_header, lines.Next(&line));
  if (!has_header) return InvalidArgument(fmt::format("{}: empty file (expected a header)", source));
  const std::vector<std::string> header = SplitHeader(line);
  std::map<std::string, int> column = ColumnIndex(header);
  for (const char* name : {"step", "layer", "expert", "count"})
    if (!column.count(name)) return lines.Error(fmt::format("the header has no '{}' column", name));
  const int rows_col = column.count("rows") ? column["rows"] : -1;
  const int k_col = column.count("top_k") ? column["top_k"] : -1;
  struct Entry {
    int64_t step, layer, expert, count;
  };
  std::vector<Entry> entries;
  std::map<int64_t, int64_t> rows_of_step;
  std::set<int64_t> layer_set;
  int64_t max_expert = -1, top_k = -1;
  std::vector<std::string_view> fields;
  while (true) {
    EPMOE_ASSIGN_OR_RETURN(bool more, lines.NextRecord(header.size(), &fields));
    if (!more) break;
    Entry e{};
    if (!ParseInt64(fields[column["step"]], &e.step) || e.step < 0) return lines.Error("bad step");
    if (!ParseInt64(fields[column["layer"]], &e.layer) || e.layer < 0 || e.layer > (1 << 20))
      return lines.Error("bad layer");
    if (!ParseInt64(fields[column["expert"]], &e.expert) || e.expert < 0 || e.expert >= (1 << 20))
      return lines.Error("bad expert");
    if (!ParseInt64(fields[column["count"]], &e.count) || e.count < 0) return lines.Error("bad count");
    if (rows_col >= 0) {
      int64_t rows = 0;
      if (!ParseInt64(fields[rows_col], &rows) || rows < 0) return lines.Error("bad rows");
      auto [it, inserted] = rows_of_step.emplace(e.step, rows);
      if (it->second != rows) return lines.Error(fmt::format("rows {} differs from {} earlier in step {}", rows,
                                                             it->second, e.step));
    }
    if (k_col >= 0) {
      int64_t k = 0;
      if (!ParseInt64(fields[k_col], &k) || k < 0 || k > 1024 || (top_k >= 0 && k != top_k))
        return lines.Error("bad or changing top_k");
      top_k = k;
    }
    max_expert = std::max(max_expert, e.expert);
    layer_set.insert(e.layer);
    entries.push_back(e);
    EPMOE_RETURN_IF_ERROR(CheckPickCapacity(source, static_cast<int64_t>(entries.size())));
  }
  if (entries.empty()) return InvalidArgument(fmt::format("{}: no rows after the header", source));
  ImportedTrace trace;
  trace.info.format = "counts-csv";
  for (int64_t id : layer_set) trace.info.layer_ids.push_back(static_cast<int>(id));
  trace.info.num_layers = static_cast<int>(layer_set.size());
  trace.info.num_experts = options.num_experts > 0 ? options.num_experts : static_cast<int>(max_expert + 1);
  trace.info.top_k = top_k > 0 ? static_cast<int>(top_k) : 0;
  std::map<int64_t, size_t> step_index;
  for (const Entry& e : entries) step_index.emplace(e.step, 0);
  const int64_t cells = static_cast<int64_t>(step_index.size()) * trace.info.num_layers * trace.info.num_experts;
  EPMOE_RETURN_IF_ERROR(CheckPickCapacity(source, cells));
  size_t next = 0;
  for (auto& [step, index] : step_index) {
    index = next++;
    StepPicks s;
    s.rows = rows_of_step.count(step) ? rows_of_step[step] : 0;
    s.counts.assign(static_cast<size_t>(trace.info.num_layers) * trace.info.num_experts, 0);
    trace.steps.push_back(std::move(s));
  }
  std::set<std::tuple<int64_t, int64_t, int64_t>> seen;
  for (const Entry& e : entries) {
    if (e.expert >= trace.info.num_experts)
      return InvalidArgument(fmt::format("{}: expert {} out of range for {} experts", source, e.expert,
                                         trace.info.num_experts));
    if (!seen.insert({e.step, e.layer, e.expert}).second)
      return InvalidArgument(fmt::format("{}: two counts for step {} layer {} expert {}", source, e.step, e.layer,
                                         e.expert));
    const int l = static_cast<int>(std::distance(layer_set.begin(), layer_set.find(e.layer)));
    trace.steps[step_index[e.step]].counts[static_cast<size_t>(l) * trace.info.num_experts + e.expert] = e.count;
  }
  trace.info.num_steps = static_cast<int64_t>(trace.steps.size());
  EPMOE_RETURN_IF_ERROR(FinishImport(source, &trace));
  return trace;
}

namespace {

// One pass's logical_count [layer][expert] into a step; shape-checked against *layers / *experts.
Status AddCountMatrix(const nlohmann::json& matrix, const std::string& where, int* layers, int* experts,
                      ImportedTrace* trace) {
  if (!matrix.is_array() || matrix.empty())
    return InvalidArgument(fmt::format("{}: logical_count is not a non-empty [layer][expert] array", where));
  StepPicks step;
  for (size_t l = 0; l < matrix.size(); ++l) {
    const nlohmann::json& row = matrix[l];
    if (!row.is_array() || row.empty())
      return InvalidArgument(fmt::format("{}: logical_count[{}] is not an array of counts", where, l));
    if (*experts == 0) *experts = static_cast<int>(row.size());
    if (static_cast<int>(row.size()) != *experts)
      return InvalidArgument(fmt::format("{}: logical_count[{}] has {} experts, expected {}", where, l, row.size(),
                                         *experts));
    for (size_t e = 0; e < row.size(); ++e) {
      const nlohmann::json& v = row[e];
      int64_t count = -1;
      if (v.is_number_integer()) count = v.get<int64_t>();
      else if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 9e18 &&
               v.get<double>() == static_cast<double>(static_cast<int64_t>(v.get<double>())))
        count = static_cast<int64_t>(v.get<double>());
      if (count < 0)
        return InvalidArgument(fmt::format("{}: logical_count[{}][{}] = {} is not a non-negative integer", where, l,
                                           e, v.dump()));
      step.counts.push_back(count);
    }
  }
  if (*layers == 0) *layers = static_cast<int>(matrix.size());
  if (static_cast<int>(matrix.size()) != *layers)
    return InvalidArgument(fmt::format("{}: logical_count has {} layers, expected {}", where, matrix.size(), *layers));
  EPMOE_RETURN_IF_ERROR(CheckPickCapacity(where, static_cast<int64_t>(trace->steps.size() + 1) * *layers * *experts));
  trace->steps.push_back(std::move(step));
  return Status::Ok();
}

// A record: {"logical_count": 2-D or 3-D array, optional "rows", "top_k"}; or a bare array.
Status AddRecord(const nlohmann::json& record, const std::string& where, int* layers, int* experts, int* top_k,
                 std::vector<int>* layer_ids, ImportedTrace* trace) {
  const nlohmann::json* counts = &record;
  int64_t rows = 0;
  if (record.is_object()) {
    auto it = record.find("logical_count");
    if (it == record.end()) return InvalidArgument(fmt::format("{}: record has no \"logical_count\"", where));
    counts = &*it;
    if (auto r = record.find("rows"); r != record.end()) {
      if (!r->is_number_unsigned()) return InvalidArgument(fmt::format("{}: \"rows\" is not a count", where));
      rows = r->get<int64_t>();
    }
    if (auto ids = record.find("layer_ids"); ids != record.end()) {
      std::vector<int> values;
      if (!ids->is_array()) return InvalidArgument(fmt::format("{}: \"layer_ids\" is not an array", where));
      for (const auto& id : *ids) {
        if (!id.is_number_unsigned() || id.get<int64_t>() > (1 << 20) ||
            (!values.empty() && id.get<int>() <= values.back()))
          return InvalidArgument(fmt::format("{}: \"layer_ids\" are not ascending layer ids", where));
        values.push_back(id.get<int>());
      }
      if (!layer_ids->empty() && *layer_ids != values)
        return InvalidArgument(fmt::format("{}: \"layer_ids\" differ from an earlier record's", where));
      *layer_ids = values;
    }
    if (auto k = record.find("top_k"); k != record.end()) {
      if (!k->is_number_unsigned() || k->get<int64_t>() > 1024)
        return InvalidArgument(fmt::format("{}: \"top_k\" is not a small count", where));
      if (*top_k >= 0 && *top_k != k->get<int>())
        return InvalidArgument(fmt::format("{}: top_k {} differs from {}", where, k->get<int>(), *top_k));
      *top_k = k->get<int>();
    }
  } else if (!record.is_array()) {
    return InvalidArgument(fmt::format("{}: expected an object with \"logical_count\" or an array", where));
  }
  const bool three_d = counts->is_array() && !counts->empty() && (*counts)[0].is_array() && !(*counts)[0].empty() &&
                       (*counts)[0][0].is_array();
  if (three_d) {
    for (size_t p = 0; p < counts->size(); ++p)
      EPMOE_RETURN_IF_ERROR(AddCountMatrix((*counts)[p], fmt::format("{} pass {}", where, p), layers, experts, trace));
  } else {
    EPMOE_RETURN_IF_ERROR(AddCountMatrix(*counts, where, layers, experts, trace));
    trace->steps.back().rows = rows;
  }
  return Status::Ok();
}

}  // namespace

Result<ImportedTrace> ImportSglangJson(std::istream& in, const std::string& source, const LoadReadOptions& options) {
  ImportedTrace trace;
  trace.info.format = "sglang-json";
  int layers = 0, experts = 0, top_k = -1;
  std::vector<int> layer_ids;  // optional "layer_ids" (epmoe's export); else 0..L-1
  // One JSON value per line (JSONL), or one JSON value over the whole file.
  std::stringstream whole;
  whole << in.rdbuf();
  const std::string text = whole.str();
  if (text.empty()) return InvalidArgument(fmt::format("{}: empty file", source));
  EPMOE_RETURN_IF_ERROR(CheckJsonDepth(text, source));
  nlohmann::json document = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!document.is_discarded()) {
    if (document.is_array() && !document.empty() && document[0].is_object()) {
      for (size_t i = 0; i < document.size(); ++i)
        EPMOE_RETURN_IF_ERROR(AddRecord(document[i], fmt::format("{} record {}", source, i), &layers, &experts,
                                        &top_k, &layer_ids, &trace));
    } else {
      EPMOE_RETURN_IF_ERROR(AddRecord(document, source, &layers, &experts, &top_k, &layer_ids, &trace));
    }
  } else {
    std::istringstream lines_in(text);
    LineReader lines(lines_in, source);
    std::string_view line;
    while (true) {
      EPMOE_ASSIGN_OR_RETURN(bool more, lines.Next(&line));
      if (!more) break;
      if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
      nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
      if (record.is_discarded()) return lines.Error("not valid JSON (expected one record per line)");
      EPMOE_RETURN_IF_ERROR(AddRecord(record, fmt::format("{}:{}", source, lines.line_number()), &layers, &experts,
                                      &top_k, &layer_ids, &trace));
    }
  }
  if (trace.steps.empty()) return InvalidArgument(fmt::format("{}: no records", source));
  trace.info.num_layers = layers;
  trace.info.num_experts = experts;
  if (options.num_experts > 0 && options.num_experts != experts)
    return InvalidArgument(fmt::format("{}: {} experts per layer, but {} were asked for", source, experts,
                                       options.num_experts));
  trace.info.top_k = std::max(top_k, 0);
  if (!layer_ids.empty() && static_cast<int>(layer_ids.size()) != layers)
    return InvalidArgument(fmt::format("{}: {} layer ids for {} layers", source, layer_ids.size(), layers));
  trace.info.layer_ids = layer_ids;
  for (int l = static_cast<int>(layer_ids.size()); l < layers; ++l) trace.info.layer_ids.push_back(l);
  trace.info.num_steps = static_cast<int64_t>(trace.steps.size());
  EPMOE_RETURN_IF_ERROR(FinishImport(source, &trace));
  return trace;
}

}  // namespace epmoe::trace_internal
