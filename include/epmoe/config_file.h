// Configuration files (model presets, hardware profiles): JSON texts that are either compiled into
// the binary (configs/<kind>/*.json, see cmake/EmbedFiles.cmake) or read from a path.
// Plain functions; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

// (name, JSON text) of each built-in file of one kind.
using BuiltinConfigs = std::vector<std::pair<std::string_view, std::string_view>>;

struct ConfigText {
  std::string text;
  std::string source;  // what errors call it: the path, or configs/<folder>/<name>.json
};

// The text of a built-in file by name, or of a file by path (anything ending in .json or
// containing '/'). `kind` ("model preset") and `folder` ("models") word the errors; an unknown name
// lists the known ones.
Result<ConfigText> ReadConfig(std::string_view name_or_path, const BuiltinConfigs& builtin, std::string_view kind,
                              std::string_view folder);

// The built-in names, sorted.
std::vector<std::string> BuiltinConfigNames(const BuiltinConfigs& builtin);

}  // namespace epmoe
