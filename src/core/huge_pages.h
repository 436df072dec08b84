// Memory on 2 MiB pages for large buffers that are read again and again (expert weights, exchange
// buffers; not part of the public API). With 4 KiB pages every 4 KiB of a stream costs a TLB miss
// and a page walk (a nested one on a virtual machine) and ends the hardware prefetcher's stream;
// one thread streaming int8 expert weights read 24.6 - 24.9 GB/s on 4 KiB pages and 27.1 - 28.1 on
// 2 MiB ones (kernels_matmul_bench BM_MatMul/2/1, transparent huge pages madvise against always).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

namespace epmoe {

struct FreeHugePageMemory {
  void operator()(uint8_t* memory) const { std::free(memory); }
};
using HugePageMemory = std::unique_ptr<uint8_t, FreeHugePageMemory>;

constexpr int64_t kHugePageBytes = int64_t{2} << 20;

// What a buffer of `bytes` takes: from 1 MiB up, whole 2 MiB pages (the rounding costs at most half
// of what is asked for); below that, what is asked for.
int64_t HugePageBytes(int64_t bytes);

// HugePageBytes(bytes) of uninitialized memory; where that is whole 2 MiB pages, aligned to them and
// advised (madvise MADV_HUGEPAGE) to be backed by transparent huge pages. Advice only: where the
// kernel has no transparent huge pages the memory has ordinary pages. Null when it cannot be
// allocated.
HugePageMemory AllocateHugePageMemory(int64_t bytes);

}  // namespace epmoe
