// EnumNames: the one definition of a closed set of named values (an enum's names), from which its
// name, its parsing (with a message listing every name) and the list of its values follow.
// Defined as constants next to the enum's functions; immutable and thread-safe.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

template <typename Enum>
struct NamedValue {
  Enum value;
  const char* name;
};

template <typename Enum, std::size_t N>
class EnumNames {
 public:
  // `what` names the set in errors ("option", "recorder mode").
  constexpr EnumNames(const char* what, std::array<NamedValue<Enum>, N> values) : what_(what), values_(values) {}

  const char* Name(Enum value) const {
    for (const NamedValue<Enum>& v : values_)
      if (v.value == value) return v.name;
    return "?";
  }
  // Also accepts the aliases given (alias, value) pairs, e.g. "dp" for data-parallel.
  Result<Enum> Parse(std::string_view name,
                     std::initializer_list<std::pair<std::string_view, Enum>> aliases = {}) const {
    for (const NamedValue<Enum>& v : values_)
      if (name == v.name) return v.value;
    for (const auto& [alias, value] : aliases)
      if (name == alias) return value;
    return InvalidArgument(fmt::format("unknown {} '{}' ({})", what_, name, List()));
  }
  std::vector<Enum> All() const {
    std::vector<Enum> all;
    for (const NamedValue<Enum>& v : values_) all.push_back(v.value);
    return all;
  }
  // "a, b, c"
  std::string List() const {
    std::string list;
    for (const NamedValue<Enum>& v : values_) list += (list.empty() ? "" : ", ") + std::string(v.name);
    return list;
  }

 private:
  const char* what_;
  std::array<NamedValue<Enum>, N> values_;
};

}  // namespace epmoe
