// Per-token sources with one record per (token, layer): top-k CSVs and JSONL routing logs.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "trace/imported.h"
#include "trace/text_input.h"

namespace epmoe::trace_internal {
namespace {

// Collects (token, layer) records and assembles them into steps of rows. Not thread-safe.
class TokenTableBuilder {
 public:
  explicit TokenTableBuilder(std::string source) : source_(std::move(source)) {}

  struct Record {
    int64_t step = 0;
    int64_t seq = 0;     // sequence id, or 0
    int64_t token = -1;  // token index within (step, seq); -1: the record's order in its layer
    int64_t pos = -1;    // position in the sequence, or -1 when unknown
    int64_t layer = 0;
    int64_t line = 0;
  };

  // Adds one record with its experts and (possibly empty) weights.
  Status Add(Record record, const std::vector<int64_t>& experts, const std::vector<double>& weights) {
    const std::string where = fmt::format("{}:{}", source_, record.line);
    if (experts.empty()) return InvalidArgument(fmt::format("{}: no experts", where));
    if (k_ == 0) {
      k_ = static_cast<int>(experts.size());
      has_weights_ = !weights.empty();
    }
    if (static_cast<int>(experts.size()) != k_)
      return InvalidArgument(
          fmt::format("{}: {} experts, earlier records have {} (top-k must be constant)", where, experts.size(), k_));
    if (weights.empty() == has_weights_ || (!weights.empty() && weights.size() != experts.size()))
      return InvalidArgument(fmt::format("{}: {} weights for {} experts{}", where, weights.size(), experts.size(),
                                         has_weights_ ? "" : " (earlier records have none)"));
    if (static_cast<int64_t>(experts_.size()) + k_ > TraceReader::kMaxInMemoryPicks)
      return OutOfRange(
          fmt::format("{}: more than {} picks; too large to import", where, TraceReader::kMaxInMemoryPicks));
    for (size_t j = 0; j < experts.size(); ++j) {
      if (experts[j] < 0 || experts[j] >= (1 << 20))
        return InvalidArgument(fmt::format("{}: expert id {} out of range", where, experts[j]));
      for (size_t i = 0; i < j; ++i)
        if (experts[i] == experts[j])
          return InvalidArgument(fmt::format("{}: expert {} picked twice", where, experts[j]));
      max_expert_ = std::max(max_expert_, experts[j]);
      experts_.push_back(static_cast<int32_t>(experts[j]));
      if (!weights.empty()) {
        float weight = 0;
        if (!ToWeight(weights[j], &weight))
          return InvalidArgument(
              fmt::format("{}: weight {} of expert {} is out of range", where, weights[j], experts[j]));
        weights_.push_back(weight);
      }
    }
    if (record.token < 0) record.token = next_token_[{record.step, record.layer}]++;
    records_.push_back(record);
    return Status::Ok();
  }

  Result<ImportedTrace> Build(const std::string& format, const LoadReadOptions& options, bool has_positions) {
    if (records_.empty()) return InvalidArgument(fmt::format("{}: no records", source_));
    ImportedTrace trace;
    trace.info.format = format;
    trace.info.has_picks = true;
    trace.info.has_weights = has_weights_;
    trace.info.top_k = k_;
    trace.info.num_experts = options.num_experts > 0 ? options.num_experts : static_cast<int>(max_expert_ + 1);
    if (max_expert_ >= trace.info.num_experts)
      return InvalidArgument(
          fmt::format("{}: expert id {} out of range for {} experts", source_, max_expert_, trace.info.num_experts));
    std::set<int64_t> layer_set;
    for (const Record& r : records_) layer_set.insert(r.layer);
    std::vector<int64_t> layers(layer_set.begin(), layer_set.end());
    for (int64_t id : layers) trace.info.layer_ids.push_back(static_cast<int>(id));
    trace.info.num_layers = static_cast<int>(layers.size());
    std::vector<size_t>& order = order_;
    order.resize(records_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const Record& x = records_[a];
      const Record& y = records_[b];
      return std::tie(x.step, x.seq, x.token, x.layer) < std::tie(y.step, y.seq, y.token, y.layer);
    });
    const int L = trace.info.num_layers;
    const bool drop = options.on_missing == "drop-token";
    if (!drop && options.on_missing != "error")
      return InvalidArgument(fmt::format("on-missing \"{}\": error or drop-token", options.on_missing));
    int64_t current_step = 0;
    for (size_t i = 0, end = 0; i < order.size(); i = end) {
      // The records of one token: [i, end), one per layer in ascending order when complete.
      const Record& first = records_[order[i]];
      end = i + 1;
      while (end < order.size() && SameToken(records_[order[end]], first)) ++end;
      bool complete = end - i == static_cast<size_t>(L);
      for (int l = 0; complete && l < L; ++l) complete = records_[order[i + l]].layer == layers[l];
      if (!complete) {
        if (drop) {
          ++trace.info.dropped_tokens;
          continue;
        }
        return InvalidArgument(
            fmt::format("{}: token {} of step {} (line {}) {} (--on-missing drop-token leaves such "
                        "tokens out)",
                        source_, first.token, first.step, first.line, WhatIsWrong(i, end, layers)));
      }
      if (trace.steps.empty() || first.step != current_step) {
        current_step = first.step;
        StepPicks step;
        step.layers.resize(L);
        for (Picks& p : step.layers) p.k = k_;
        trace.steps.push_back(std::move(step));
        trace.row_seq.emplace_back();
        trace.row_pos.emplace_back();
      }
      StepPicks& step = trace.steps.back();
      for (int l = 0; l < L; ++l) {
        const size_t index = order[i + l];
        Picks& picks = step.layers[l];
        picks.experts.insert(picks.experts.end(), experts_.begin() + index * k_, experts_.begin() + (index + 1) * k_);
        if (has_weights_)
          picks.weights.insert(picks.weights.end(), weights_.begin() + index * k_, weights_.begin() + (index + 1) * k_);
        ++picks.rows;
      }
      ++step.rows;
      trace.row_seq.back().push_back(first.seq);
      trace.row_pos.back().push_back(first.pos >= 0 ? first.pos : first.token);
    }
    trace.has_sequences = has_positions;
    if (!has_positions) {
      trace.row_seq.clear();
      trace.row_pos.clear();
    }
    if (trace.steps.empty())
      return InvalidArgument(
          fmt::format("{}: all {} tokens lack a layer's record", source_, trace.info.dropped_tokens));
    if (trace.info.dropped_tokens > 0)
      trace.info.description =
          fmt::format("dropped {} tokens without a record for every layer", trace.info.dropped_tokens);
    trace.info.num_steps = static_cast<int64_t>(trace.steps.size());
    EPMOE_RETURN_IF_ERROR(FinishImport(source_, &trace));
    return trace;
  }

 private:
  // For a token's records [begin, end) of `order_` that do not cover each layer once: which layer
  // lacks its record, or has two.
  std::string WhatIsWrong(size_t begin, size_t end, const std::vector<int64_t>& layers) const {
    std::map<int64_t, int> seen;
    for (size_t i = begin; i < end; ++i) ++seen[records_[order_[i]].layer];
    for (int64_t layer : layers)
      if (seen[layer] == 0) return fmt::format("has no record for layer {}", layer);
    for (const auto& [layer, count] : seen)
      if (count > 1)
        return fmt::format("has two records for layer {} (line {})", layer, records_[order_[end - 1]].line);
    return "has records that do not match the layers";
  }

  static bool SameToken(const Record& a, const Record& b) {
    return a.step == b.step && a.seq == b.seq && a.token == b.token;
  }

  std::string source_;
  std::vector<Record> records_;
  std::vector<size_t> order_;  // records_ by (step, seq, token, layer), set by Build
  std::vector<int32_t> experts_;
  std::vector<float> weights_;
  std::map<std::pair<int64_t, int64_t>, int64_t> next_token_;
  int k_ = 0;
  bool has_weights_ = false;
  int64_t max_expert_ = -1;
};

// Column index of "<prefix><j>" for j = 0.., stopping at the first missing one.
std::vector<int> NumberedColumns(const std::map<std::string, int>& column, const std::string& prefix) {
  std::vector<int> columns;
  for (int j = 0;; ++j) {
    auto it = column.find(prefix + std::to_string(j));
    if (it == column.end()) break;
    columns.push_back(it->second);
  }
  return columns;
}

}  // namespace

Result<ImportedTrace> ImportTopkCsv(std::istream& in, const std::string& source, const LoadReadOptions& options) {
  LineReader lines(in, source);
  std::string_view line;
  EPMOE_ASSIGN_OR_RETURN(bool has_header, lines.Next(&line));
  if (!has_header) return InvalidArgument(fmt::format("{}: empty file (expected a header)", source));
  const std::vector<std::string> header = SplitHeader(line);
  std::map<std::string, int> column;
  for (size_t c = 0; c < header.size(); ++c) column[std::string(header[c])] = static_cast<int>(c);
  if (!column.count("layer")) return lines.Error("the header has no 'layer' column");
  const std::vector<int> expert_cols = NumberedColumns(column, "e");
  const std::vector<int> weight_cols = NumberedColumns(column, "w");
  if (expert_cols.empty()) return lines.Error("the header has no e0, e1, .. columns");
  if (!weight_cols.empty() && weight_cols.size() != expert_cols.size())
    return lines.Error(fmt::format("{} expert columns but {} weight columns", expert_cols.size(), weight_cols.size()));
  auto optional = [&](const char* name) { return column.count(name) ? column[name] : -1; };
  const int step_col = optional("step"), seq_col = optional("seq"), pos_col = optional("pos");
  const int token_col = optional("token") >= 0 ? optional("token") : optional("row");
  const int layer_col = column["layer"];
  TokenTableBuilder builder(source);
  std::vector<int64_t> experts(expert_cols.size());
  std::vector<double> weights(weight_cols.size());
  std::vector<std::string_view> fields;
  while (true) {
    EPMOE_ASSIGN_OR_RETURN(bool more, lines.NextRecord(header.size(), &fields));
    if (!more) break;
    TokenTableBuilder::Record record;
    record.line = lines.line_number();
    auto read_id = [&](int col, int64_t* value) -> Status {
      if (col < 0) return Status::Ok();
      if (!ParseInt64(fields[col], value) || *value < 0 || *value > (int64_t{1} << 48))
        return lines.Error(fmt::format("column '{}': '{}' is not a non-negative integer", header[col], fields[col]));
      return Status::Ok();
    };
    EPMOE_RETURN_IF_ERROR(read_id(step_col, &record.step));
    EPMOE_RETURN_IF_ERROR(read_id(seq_col, &record.seq));
    EPMOE_RETURN_IF_ERROR(read_id(pos_col, &record.pos));
    EPMOE_RETURN_IF_ERROR(read_id(token_col, &record.token));
    EPMOE_RETURN_IF_ERROR(read_id(layer_col, &record.layer));
    if (record.layer > (1 << 20)) return lines.Error(fmt::format("layer {} out of range", record.layer));
    for (size_t j = 0; j < expert_cols.size(); ++j) {
      if (!ParseInt64(fields[expert_cols[j]], &experts[j]))
        return lines.Error(fmt::format("column 'e{}': '{}' is not an expert id", j, fields[expert_cols[j]]));
    }
    for (size_t j = 0; j < weight_cols.size(); ++j)
      if (!ParseDouble(fields[weight_cols[j]], &weights[j]))
        return lines.Error(fmt::format("column 'w{}': '{}' is not a finite number", j, fields[weight_cols[j]]));
    EPMOE_RETURN_IF_ERROR(builder.Add(record, experts, weights));
  }
  return builder.Build("flame-topk-csv", options, seq_col >= 0 && pos_col >= 0);
}

Result<ImportedTrace> ImportJsonl(std::istream& in, const std::string& source, const LoadReadOptions& options) {
  LineReader lines(in, source);
  std::string_view line;
  TokenTableBuilder builder(source);
  LoadReadOptions shaped = options;
  std::map<std::string, int64_t> request_ids;  // string request ids -> dense ids, in order of appearance
  bool has_seq = false, has_pos = false;
  int declared_k = 0;
  std::vector<int64_t> experts;
  std::vector<double> weights;
  while (true) {
    EPMOE_ASSIGN_OR_RETURN(bool more, lines.Next(&line));
    if (!more) break;
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !record.is_object()) return lines.Error("not a JSON object");
    if (!record.contains("experts")) {
      // A shape record: {"num_experts": E, "top_k": k, ...}.
      if (record.contains("num_experts")) {
        const auto& e = record["num_experts"];
        if (!e.is_number_unsigned() || e.get<int64_t>() < 1 || e.get<int64_t>() > (1 << 20))
          return lines.Error("\"num_experts\" is not a positive count");
        if (options.num_experts == 0) shaped.num_experts = e.get<int>();
        if (record.contains("top_k") && record["top_k"].is_number_unsigned() && record["top_k"].get<int64_t>() <= 1024)
          declared_k = record["top_k"].get<int>();
        continue;
      }
      return lines.Error("record has no \"experts\" array");
    }
    auto get_id = [&](const char* name, int64_t* value, bool* present) -> Status {
      auto it = record.find(name);
      if (it == record.end()) return Status::Ok();
      if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (int64_t{1} << 48))
        return lines.Error(fmt::format("\"{}\" is not a non-negative integer", name));
      *value = it->get<int64_t>();
      if (present) *present = true;
      return Status::Ok();
    };
    TokenTableBuilder::Record r;
    r.line = lines.line_number();
    bool has_layer = false;
    EPMOE_RETURN_IF_ERROR(get_id("layer", &r.layer, &has_layer));
    if (!has_layer) return lines.Error("record has no \"layer\"");
    if (r.layer > (1 << 20)) return lines.Error(fmt::format("layer {} out of range", r.layer));
    EPMOE_RETURN_IF_ERROR(get_id("step", &r.step, nullptr));
    EPMOE_RETURN_IF_ERROR(get_id("forward_pass", &r.step, nullptr));
    EPMOE_RETURN_IF_ERROR(get_id("token_idx", &r.token, nullptr));
    EPMOE_RETURN_IF_ERROR(get_id("row", &r.token, nullptr));
    EPMOE_RETURN_IF_ERROR(get_id("pos", &r.pos, &has_pos));
    EPMOE_RETURN_IF_ERROR(get_id("position", &r.pos, &has_pos));
    for (const char* name :
         {"seq", "seq_id", "sequence_id", "request_id", "req_id", "problem_id", "sample_id", "conversation_id"}) {
      auto it = record.find(name);
      if (it == record.end()) continue;
      if (it->is_string()) {
        r.seq = request_ids.emplace(it->get<std::string>(), static_cast<int64_t>(request_ids.size())).first->second;
      } else {
        EPMOE_RETURN_IF_ERROR(get_id(name, &r.seq, nullptr));
      }
      has_seq = true;
    }
    const auto& ids = record["experts"];
    if (!ids.is_array()) return lines.Error("\"experts\" is not an array");
    experts.clear();
    for (const auto& id : ids) {
      if (!id.is_number_integer()) return lines.Error(fmt::format("expert id {} is not an integer", id.dump()));
      experts.push_back(id.get<int64_t>());
    }
    weights.clear();
    for (const char* name : {"gating_probs", "weights", "topk_weights"}) {
      auto it = record.find(name);
      if (it == record.end()) continue;
      if (!it->is_array()) return lines.Error(fmt::format("\"{}\" is not an array", name));
      for (const auto& w : *it) {
        if (!w.is_number() || !std::isfinite(w.get<double>()))
          return lines.Error(fmt::format("\"{}\" holds {}, not a finite number", name, w.dump()));
        weights.push_back(w.get<double>());
      }
      break;
    }
    if (declared_k > 0 && static_cast<int>(experts.size()) != declared_k)
      return lines.Error(fmt::format("{} experts, but the shape record says top-{}", experts.size(), declared_k));
    EPMOE_RETURN_IF_ERROR(builder.Add(r, experts, weights));
  }
  return builder.Build("jsonl", shaped, has_seq && has_pos);
}

}  // namespace epmoe::trace_internal
