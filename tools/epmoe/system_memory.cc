#include "system_memory.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "output.h"

namespace epmoe::cli {
namespace {

// Bytes of an estimate as an int64 (for HumanBytes and the all-gather), saturated.
int64_t Saturated(double bytes) {
  return bytes >= 9e18 ? int64_t{9'000'000'000'000'000'000} : static_cast<int64_t>(std::max(bytes, 0.0));
}

std::string Refusal(const MemoryEstimate& m, double budget, double max_memory_gb, const std::string& what,
                    const std::string& remedy) {
  std::vector<std::string> parts;
  const std::array<std::pair<const char*, double>, 4> named = {{{"packed weights", m.weights},
                                                                {"fp32 and reference weights", m.reference},
                                                                {"rows", m.rows},
                                                                {"exchange buffers", m.exchange}}};
  for (const auto& [name, bytes] : named)
    if (bytes > 0) parts.push_back(fmt::format("{} {}", name, HumanBytes(Saturated(bytes))));
  return fmt::format("{}: about {} of memory needed ({}), over the budget of {} ({}); {}, or raise --max-memory-gb",
                     what, HumanBytes(Saturated(m.total())), fmt::join(parts, ", "), HumanBytes(Saturated(budget)),
                     max_memory_gb > 0 ? "--max-memory-gb" : "80% of the memory available", remedy);
}

// This host's name hashed: ranks with the same one share its memory.
int64_t HostId() {
  std::array<char, 256> name{};
  gethostname(name.data(), name.size() - 1);
  return static_cast<int64_t>(std::hash<std::string>{}(name.data()) >> 1);
}

}  // namespace

int64_t AvailableMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t value_kb = 0;
  std::string unit;
  while (meminfo >> key >> value_kb >> unit) {
    if (key == "MemAvailable:") return value_kb * 1024;
  }
  return 8'000'000'000LL;
}

double MemoryBudgetBytes(double max_memory_gb) {
  return max_memory_gb > 0 ? max_memory_gb * 1e9 : 0.8 * static_cast<double>(AvailableMemoryBytes());
}

Status AdmitMemory(const MemoryEstimate& estimate, double max_memory_gb, const std::string& what,
                   const std::string& remedy) {
  const double budget = MemoryBudgetBytes(max_memory_gb);
  if (estimate.total() <= budget) return Status::Ok();
  return OutOfRange(Refusal(estimate, budget, max_memory_gb, what, remedy));
}

Status AdmitJobMemory(Communicator& comm, const MemoryEstimate& mine, double max_memory_gb, const std::string& remedy) {
  constexpr int kValues = 6;  // host, budget, weights, reference, rows, exchange
  const std::array<int64_t, kValues> send = {HostId(),
                                             Saturated(MemoryBudgetBytes(max_memory_gb)),
                                             Saturated(mine.weights),
                                             Saturated(mine.reference),
                                             Saturated(mine.rows),
                                             Saturated(mine.exchange)};
  std::vector<int64_t> all(static_cast<size_t>(kValues) * comm.size());
  EPMOE_RETURN_IF_ERROR(comm.AllgatherInt64(send, all));
  std::vector<bool> counted(comm.size(), false);
  for (int first = 0; first < comm.size(); ++first) {
    if (counted[first]) continue;
    MemoryEstimate machine;
    double budget = static_cast<double>(all[first * kValues + 1]);
    std::vector<int> ranks;
    for (int r = first; r < comm.size(); ++r) {
      const int64_t* v = &all[r * kValues];
      if (v[0] != all[first * kValues]) continue;
      counted[r] = true;
      ranks.push_back(r);
      budget = std::min(budget, static_cast<double>(v[1]));
      machine.weights += static_cast<double>(v[2]);
      machine.reference += static_cast<double>(v[3]);
      machine.rows += static_cast<double>(v[4]);
      machine.exchange += static_cast<double>(v[5]);
    }
    if (machine.total() <= budget) continue;
    const std::string what = comm.size() == 1 ? std::string("the run")
                                              : fmt::format("rank{} {} (on one machine, summed)",
                                                            ranks.size() == 1 ? "" : "s", fmt::join(ranks, ", "));
    return OutOfRange(Refusal(machine, budget, max_memory_gb, what, remedy));
  }
  return Status::Ok();
}

}  // namespace epmoe::cli
