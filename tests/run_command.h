// Running the epmoe program from a test, as a user would: the CLI tests share this.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace epmoe::testing {

struct CommandResult {
  int exit_code;
  std::string out;
};

// Runs `command` in a shell and collects its exit code and its output: stdout and stderr together,
// or stdout alone (stderr dropped) for output that must parse, e.g. JSON.
inline CommandResult RunCommand(const std::string& command, bool with_stderr = true) {
  FILE* pipe = popen((command + (with_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) out.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// The epmoe binary under test ($EPMOE_BINARY, set by ctest, or the one in the build folder).
inline std::string EpmoeBinary() {
  const char* binary = std::getenv("EPMOE_BINARY");
  return binary ? binary : EPMOE_BINARY_DIR "/epmoe";
}

// `epmoe ARGS`.
inline CommandResult Epmoe(const std::string& args) {
  return RunCommand(EpmoeBinary() + " " + args);
}

}  // namespace epmoe::testing
