// Small helpers shared by the commands: error reporting, report printing and human-readable numbers.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "epmoe/statistics.h"  // Median and Quantile, for the reports
#include "epmoe/status.h"

namespace epmoe::cli {

// Prints "epmoe: <message>" to stderr and returns the exit code for a failed command (1).
int ReportError(const Status& status);

// Reports a command that failed on this rank of an MPI job (or in one process) so that the user
// sees every rank's error once, with its rank, and the job ends: the failed ranks gather their
// errors (GatherJobErrors, bounded by a quarter of comm_timeout_seconds, at most 3 s; 0: no
// timeout); when every rank failed, rank 0 prints each distinct error once (naming the ranks
// unless all hit it) and 1 is returned; otherwise this rank prints its own error with its rank
// and ends the job (AbortJob), since its peers may wait for it. A peer that stopped answering
// (Unavailable, which names the ranks) is printed and ends the job at once.
int ReportJobError(const Status& status, double comm_timeout_seconds);

// Validators with one-line messages ("must not be negative", "must be positive").
extern const CLI::Validator kNonNegative;
extern const CLI::Validator kPositive;

// Adds `--format` with the given allowed values.
void AddFormatOption(CLI::App* command, std::string* format, const std::vector<std::string>& allowed);

// Sets a command's callback for the common shape of a report: run() fills a JSON report (or fails,
// and the error is reported); the report is printed as JSON when *format is "json", else by
// print_text. The exit code goes to *exit_code.
void SetReportCallback(CLI::App* command, int* exit_code, const std::string* format,
                       std::function<Status(nlohmann::json*)> run,
                       std::function<void(const nlohmann::json&)> print_text);

// An `epmoe run --format json` report read from `path`. Refuses, naming the path, a file that
// cannot be opened, is not JSON or has no "options" array.
Result<nlohmann::json> ReadRunReport(const std::string& path);

// 1234567 -> "1.23 M"; bytes -> "1.23 GB" (powers of 1,000, as the seeds quote sizes).
std::string HumanCount(int64_t n);
std::string HumanBytes(int64_t bytes);

}  // namespace epmoe::cli
