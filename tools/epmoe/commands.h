// The subcommands of the `epmoe` program. Each Add*Command registers its subcommand (flags, help
// and callback) on the app; the callback runs the command and stores its exit code in *exit_code.
// This folder is the only place that parses command-line arguments.
#pragma once

#include <CLI/CLI.hpp>

namespace epmoe::cli {

void AddModelCommand(CLI::App& app, int* exit_code);
void AddLayerCommand(CLI::App& app, int* exit_code);
void AddBenchCommand(CLI::App& app, int* exit_code);  // `epmoe bench kernels`
void AddRunCommand(CLI::App& app, int* exit_code);
void AddBalanceCommand(CLI::App& app, int* exit_code);
void AddTraceCommand(CLI::App& app, int* exit_code);
void AddPlanCommand(CLI::App& app, int* exit_code);  // also `epmoe hardware`
void AddPlotBalanceCommand(CLI::App& app, int* exit_code);  // `epmoe plot-balance`
void AddCheckpointCommand(CLI::App& app, int* exit_code);   // `epmoe checkpoint show|write`

}  // namespace epmoe::cli
