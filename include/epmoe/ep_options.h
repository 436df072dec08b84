// The vocabulary of expert-parallel runs, shared by the executors (executor.h) and the planner
// (plan.h): the five ways a row meets its experts, where rows start, where the shared expert runs
// (DESIGN.md, "The five ways a row meets its experts"). Free functions; thread-safe.
#pragma once

#include <string_view>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

// sliced, whole, hybrid: rows are all-gathered (options 1-3); a2a: traveling rows (option 4);
// dwdp: traveling weights (option 5).
enum class EpOption { kSliced, kWhole, kHybrid, kA2a, kDwdp };
const char* EpOptionName(EpOption option);  // "sliced", "whole", "hybrid", "a2a", "dwdp"
// Also accepts the option's number ("1".."5") and the planner's former names "rows" (a2a) and
// "weights" (dwdp).
Result<EpOption> ParseEpOption(std::string_view name);
std::vector<EpOption> AllEpOptions();
// 1..5, the option's number in DESIGN.md.
int EpOptionNumber(EpOption option);
// Options 1-3: every row visits every rank (all-gather, then reduce-scatter).
bool GathersRows(EpOption option);

// How a2a's dispatch learns what each rank receives (seed 003's --deepep-mode): normal all-gathers
// the row counts first and sizes buffers exactly (rounds under the buffer bound); low-latency
// sizes fixed buffers once from the most rows a rank may send and exchanges no counts (decode);
// auto picks low-latency when that bound is small, its buffers fit and two levels were not asked
// for (ResolveA2aMode, executor.h).
enum class A2aMode { kNormal, kLowLatency, kAuto };
const char* A2aModeName(A2aMode mode);                // "normal", "low-latency", "auto"
Result<A2aMode> ParseA2aMode(std::string_view name);  // also SGLang's "low_latency"
// Auto picks low-latency when a rank holds at most this many rows per step (the executor also
// needs its fixed buffers to fit max_buffer_bytes): measured, low-latency's dispatch + combine was
// faster up to 512 rows per rank and slower at 2,048 (docs/architecture.md, "The a2a exchange").
inline constexpr int64_t kAutoLowLatencyMaxRows = 512;

// What moves a2a's nonblocking exchanges on while a rank computes (Open MPI's TCP transport sends
// and receives a large message only when the progress engine runs): wait: only this rank's waits
// and polls on the exchange; poll: also the rank's own thread between chunks of its compute loops
// (ThreadPool::set_between_chunks); thread: a thread of the rank drives it all through the layer
// (needs MPI_THREAD_MULTIPLE).
enum class A2aProgress { kWait, kPoll, kThread };
const char* A2aProgressName(A2aProgress progress);  // "wait", "poll", "thread"
Result<A2aProgress> ParseA2aProgress(std::string_view name);

enum class RowOrigin { kDataParallel, kTensorParallel };
const char* RowOriginName(RowOrigin origin);
Result<RowOrigin> ParseRowOrigin(std::string_view name);  // also "dp", "tp"

// Where the shared expert (or a dense layer) runs: sliced over the ranks like the routed experts
// (sliced, whole and hybrid only) or a full copy on every rank applied to its own rows.
enum class SharedMode { kDefault, kSliced, kCopied };       // default: sliced for 1-3, copied for 4-5
const char* SharedModeName(SharedMode mode);                // "default", "sliced", "copied"
Result<SharedMode> ParseSharedMode(std::string_view name);  // also "auto" for default
// Whether `mode` slices under `option` (default: options 1-3 slice).
bool SharedIsSliced(EpOption option, SharedMode mode);

// How a2a rows cross between nodes: flat sends one record per (row, destination rank); two-level
// (DeepEP's normal mode) sends one per (row, destination node) to a gateway rank of that node,
// which forwards it inside the node; auto picks two-level when there are several nodes and some
// node holds more than one rank, flat otherwise. Low-latency mode is flat only (ResolveA2aLevels,
// executor.h, combines the two).
enum class A2aLevels { kAuto, kFlat, kTwoLevel };
const char* A2aLevelsName(A2aLevels levels);  // "auto", "flat", "two-level"
Result<A2aLevels> ParseA2aLevels(std::string_view name);
// Whether `levels` runs the two-level exchange on `num_ranks` ranks in `num_nodes` nodes.
bool UsesTwoLevels(A2aLevels levels, int num_ranks, int num_nodes);

}  // namespace epmoe
