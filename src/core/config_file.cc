#include "epmoe/config_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "epmoe/bounded_input.h"

namespace epmoe {
namespace {

// Presets and profiles are a few KB; the bound refuses a device such as /dev/zero.
constexpr int64_t kMaxConfigBytes = 16 << 20;

bool LooksLikePath(std::string_view s) {
  return s.find('/') != std::string_view::npos || (s.size() > 5 && s.substr(s.size() - 5) == ".json");
}

}  // namespace

std::vector<std::string> BuiltinConfigNames(const BuiltinConfigs& builtin) {
  std::vector<std::string> names;
  for (const auto& [name, text] : builtin) names.emplace_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

Result<ConfigText> ReadConfig(std::string_view name_or_path, const BuiltinConfigs& builtin, std::string_view kind,
                              std::string_view folder) {
  if (LooksLikePath(name_or_path)) {
    std::string path(name_or_path);
    EPMOE_ASSIGN_OR_RETURN(std::string text, ReadFileText(path, kMaxConfigBytes, fmt::format("{} file", kind)));
    EPMOE_RETURN_IF_ERROR(CheckJsonDepth(text, path));
    return ConfigText{std::move(text), path};
  }
  for (const auto& [name, text] : builtin) {
    if (name == name_or_path) return ConfigText{std::string(text), fmt::format("configs/{}/{}.json", folder, name)};
  }
  std::string known;
  for (const auto& n : BuiltinConfigNames(builtin)) known += (known.empty() ? "" : ", ") + n;
  return NotFound(
      fmt::format("no {} named '{}' (known: {}; or give a path to a .json file)", kind, name_or_path, known));
}

}  // namespace epmoe
