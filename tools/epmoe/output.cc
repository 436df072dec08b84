#include "output.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>

#include "epmoe/comm.h"

namespace epmoe::cli {

int ReportError(const Status& status) {
  std::fprintf(stderr, "epmoe: %s\n", status.message().c_str());
  return 1;
}

int ReportJobError(const Status& status, double comm_timeout_seconds) {
  if (status.code() == StatusCode::kUnavailable) {
    ReportError(status);
    AbortJob(1);
  }
  // Long enough for ranks refusing alike to meet, short against the timeout their peers wait.
  constexpr double kMostSeconds = 3;
  const double seconds = comm_timeout_seconds > 0 ? std::min(kMostSeconds, comm_timeout_seconds / 4) : kMostSeconds;
  const JobErrors job = GatherJobErrors(status, seconds);
  for (const JobErrors::Error& error : job.errors) {
    const bool everyone = job.every_rank_reported && error.ranks.size() == static_cast<size_t>(job.size);
    const std::string ranks =
        fmt::format("rank{} {}", error.ranks.size() == 1 ? "" : "s", fmt::join(error.ranks, ", "));
    // Messages of the communicator name their rank already ("rank 3: ...").
    const bool named = error.message.starts_with(ranks + ": ");
    if (everyone || named) {
      std::fprintf(stderr, "epmoe: %s\n", error.message.c_str());
    } else {
      std::fprintf(stderr, "epmoe: %s: %s\n", ranks.c_str(), error.message.c_str());
    }
  }
  if (!job.every_rank_reported) AbortJob(1);
  return 1;
}

Result<nlohmann::json> ReadRunReport(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("{}: cannot open the run report", path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  nlohmann::json report = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (report.is_discarded()) return IoError(fmt::format("{}: not JSON (write it with `epmoe run --format json`)", path));
  if (!report.is_object() || !report.contains("options") || !report["options"].is_array())
    return IoError(fmt::format("{}: no \"options\" array (not an `epmoe run --format json` report)", path));
  return report;
}

namespace {
CLI::Validator SignValidator(bool allow_zero) {
  return CLI::Validator(
      [allow_zero](std::string& input) -> std::string {
        double value = 0;
        try {
          size_t used = 0;
          value = std::stod(input, &used);
          if (used != input.size()) return "'" + input + "' is not a number";
        } catch (const std::exception&) {
          return "'" + input + "' is not a number";
        }
        if (allow_zero ? value < 0 : value <= 0)
          return input + (allow_zero ? " must not be negative" : " must be positive");
        return "";
      },
      allow_zero ? "NONNEGATIVE" : "POSITIVE");
}
}  // namespace

const CLI::Validator kNonNegative = SignValidator(true);
const CLI::Validator kPositive = SignValidator(false);

void AddFormatOption(CLI::App* command, std::string* format, const std::vector<std::string>& allowed) {
  command->add_option("--format", *format, "Output format")->check(CLI::IsMember(allowed))->capture_default_str();
}

void SetReportCallback(CLI::App* command, int* exit_code, const std::string* format,
                       std::function<Status(nlohmann::json*)> run,
                       std::function<void(const nlohmann::json&)> print_text) {
  command->callback([=] {
    nlohmann::json report;
    const Status status = run(&report);
    if (!status.ok()) {
      *exit_code = ReportError(status);
      return;
    }
    if (*format == "json") {
      std::printf("%s\n", report.dump(2).c_str());
    } else {
      print_text(report);
    }
    *exit_code = 0;
  });
}

namespace {
std::string Scaled(double value, const char* const* units, int count) {
  int unit = 0;
  while (std::fabs(value) >= 1000.0 && unit + 1 < count) {
    value /= 1000.0;
    ++unit;
  }
  return fmt::format("{:.{}f} {}", value, unit == 0 ? 0 : 2, units[unit]);
}
}  // namespace

std::string HumanCount(int64_t n) {
  static const char* const kUnits[] = {"", "K", "M", "G", "T"};
  return Scaled(static_cast<double>(n), kUnits, 5);
}

std::string HumanBytes(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KB", "MB", "GB", "TB"};
  return Scaled(static_cast<double>(bytes), kUnits, 5);
}

}  // namespace epmoe::cli
