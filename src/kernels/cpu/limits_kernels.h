// Internal: the loops the machine-limit microbenchmarks time, one set per instruction set.
#pragma once

#include <cstdint>

#include "epmoe/machine_limits.h"

namespace epmoe::kernels {

// Sums `bytes` (a multiple of 256) of `data` as 64-bit words; the result only defeats dead-code
// elimination.
uint64_t ReadSumReference(const uint8_t* data, int64_t bytes);
uint64_t ReadSumAvx2(const uint8_t* data, int64_t bytes);
uint64_t ReadSumAvx512(const uint8_t* data, int64_t bytes);

// Runs `iterations` rounds of independent chains of the path's instruction; returns the
// operations done (2 per multiply-add), or 0 when this instruction set (or this CPU: AVX-512 without
// BF16) has no such instruction.
int64_t ArithmeticLoopAvx2(ArithmeticPath path, int64_t iterations, float* sink);
int64_t ArithmeticLoopAvx512(ArithmeticPath path, int64_t iterations, float* sink);

}  // namespace epmoe::kernels
