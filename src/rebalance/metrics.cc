#include "epmoe/metrics.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "epmoe/atomic_file.h"

namespace epmoe {
namespace {

bool ValidName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

}  // namespace

Status MetricsFile::Declare(const std::string& name, const std::string& type, const std::string& help) {
  if (!ValidName(name)) return InvalidArgument(fmt::format("metrics: '{}' is not a valid metric name", name));
  if (type != "gauge" && type != "counter" && type != "summary")
    return InvalidArgument(fmt::format("metrics: '{}' has unknown type '{}'", name, type));
  Family& family = families_[name];
  family.type = type;
  family.help = help;
  return Status::Ok();
}

void MetricsFile::Set(const std::string& name, double value,
                      const std::vector<std::pair<std::string, std::string>>& labels) {
  auto it = families_.find(name);
  EPMOE_CHECK_MSG(it != families_.end(), "metric " + name + " was not declared");
  std::string key;
  for (const auto& [label, label_value] : labels) {
    EPMOE_CHECK_MSG(ValidName(label), "bad label name " + label);
    key += fmt::format("{}{}=\"{}\"", key.empty() ? "" : ",", label, EscapeLabelValue(label_value));
  }
  it->second.series[key] = value;
}

std::string MetricsFile::Render() const {
  std::string out;
  for (const auto& [name, family] : families_) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, family.help, name, family.type);
    for (const auto& [labels, value] : family.series) {
      out += labels.empty() ? fmt::format("{} {}\n", name, FormatValue(value))
                            : fmt::format("{}{{{}}} {}\n", name, labels, FormatValue(value));
    }
  }
  return out;
}

Status MetricsFile::Write() const {
  return WriteFileAtomically(path_, Render());
}

bool MetricsFile::WriteOrWarnOnce() {
  const Status status = Write();
  if (!status.ok() && !warned_) {
    warned_ = true;
    std::fprintf(stderr,
                 "epmoe: warning: %s (the metrics file is best effort: the run goes on, further failures "
                 "to write it are not reported)\n",
                 status.message().c_str());
  }
  return status.ok();
}

}  // namespace epmoe
