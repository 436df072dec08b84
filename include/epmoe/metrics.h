// MetricsFile: a Prometheus text-format (exposition format 0.0.4) file, rewritten atomically.
//
// A long run sets gauges and counters as it goes and calls Write() now and then; Write renders every
// metric into a temporary beside PATH and renames it over PATH (an AtomicFile), so a scraper (node_exporter's textfile
// collector, or a person with cat) never sees a half-written file. Names must match [a-zA-Z_:][a-zA-Z0-9_:]*; label
// values are escaped. Thread-compatible (one writer).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

class MetricsFile {
 public:
  explicit MetricsFile(std::string path) : path_(std::move(path)) {}

  // Declares a metric family (type: "gauge", "counter" or "summary") with its help text. Setting a
  // value of an undeclared family is a programming error (checked).
  Status Declare(const std::string& name, const std::string& type, const std::string& help);

  // Sets the value of one series: `labels` are (name, value) pairs, e.g. {{"quantile", "0.9"}}.
  void Set(const std::string& name, double value, const std::vector<std::pair<std::string, std::string>>& labels = {});

  // The whole file's text as Write would store it.
  std::string Render() const;
  // Writes the file through an AtomicFile; errors name the path.
  Status Write() const;
  // Write for a long run, where metrics are best effort: a failure (a full disk, another run
  // replacing the file, a path that stopped being writable) is printed once to stderr and the run
  // goes on; later failures are silent. Returns whether the file was written.
  bool WriteOrWarnOnce();

  const std::string& path() const { return path_; }

 private:
  struct Family {
    std::string type;
    std::string help;
    std::map<std::string, double> series;  // rendered label set -> value
  };
  std::string path_;
  std::map<std::string, Family> families_;
  bool warned_ = false;
};

}  // namespace epmoe
