// epmoe: the command-line program. See `epmoe --help` and docs/cli.md.
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"epmoe: expert-parallel Mixture-of-Experts runtime"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "epmoe 0.1");
  int exit_code = 0;
  epmoe::cli::AddModelCommand(app, &exit_code);
  epmoe::cli::AddLayerCommand(app, &exit_code);
  epmoe::cli::AddBenchCommand(app, &exit_code);
  epmoe::cli::AddRunCommand(app, &exit_code);
  epmoe::cli::AddBalanceCommand(app, &exit_code);
  epmoe::cli::AddTraceCommand(app, &exit_code);
  epmoe::cli::AddPlanCommand(app, &exit_code);
  epmoe::cli::AddPlotBalanceCommand(app, &exit_code);
  epmoe::cli::AddCheckpointCommand(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "epmoe: %s (see --help)\n", e.what());
    return 2;
  }
  // A report that did not reach its destination (`> /dev/full`, a closed pipe) is a failure.
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "epmoe: writing the output failed: %s\n", std::strerror(errno));
    return 1;
  }
  return exit_code;
}
