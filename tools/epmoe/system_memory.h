// What the machine can give: used to refuse runs that would not fit before allocating.
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/comm.h"
#include "epmoe/layer.h"
#include "epmoe/status.h"

namespace epmoe::cli {

// MemAvailable from /proc/meminfo in bytes (or 8 GB when it cannot be read).
int64_t AvailableMemoryBytes();

// The memory a command may take: --max-memory-gb (GB of 1e9 bytes) when positive, else 80% of
// the memory available now.
double MemoryBudgetBytes(double max_memory_gb);

// Refuses (OutOfRange), before anything is allocated, an estimate over the budget of
// `max_memory_gb` (MemoryBudgetBytes), naming what takes the memory: `what` says whose memory it
// is ("4 layers of glm-5.3 in fp32"), `remedy` what to change ("use fewer --layers").
Status AdmitMemory(const MemoryEstimate& estimate, double max_memory_gb, const std::string& what,
                   const std::string& remedy);

// The same for an MPI job: every rank's estimate (`mine`) is summed over the ranks on each machine
// (host), against that machine's budget (the smallest of its ranks' MemoryBudgetBytes). Collective:
// every rank returns the same refusal, naming the ranks of the first machine that would not fit.
Status AdmitJobMemory(Communicator& comm, const MemoryEstimate& mine, double max_memory_gb, const std::string& remedy);

}  // namespace epmoe::cli
