// Memory the a2a executor keeps across steps for its exchanges (not part of the public API).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "core/huge_pages.h"
#include "epmoe/status.h"

namespace epmoe::ep_internal {

// Memory reused across steps, uninitialized: grows when a step needs more. A buffer of 1 MiB or
// more may be given whole 2 MiB pages (core/huge_pages.h): the exchanges move large blocks by a
// single copy that pins and copies the other rank's buffer page by page (process_vm_readv), and
// with 4 KiB pages the 0.5 MB output exchange of G = 2, T = 64 took twice as long as the copy of
// the same bytes between huge pages (0.105 against 0.048 ms as the last rank spends it). Whether
// to round up is the owner's call (it keeps the total within its buffer bound). Not thread-safe.
class ScratchBuffer {
 public:
  void Reserve(int64_t bytes, bool huge) {
    if (bytes <= capacity_) return;
    data_.reset();
    const int64_t allocated = huge ? HugePageBytes(bytes) : bytes;
    data_ = huge ? AllocateHugePageMemory(bytes)
                 : HugePageMemory(static_cast<uint8_t*>(std::malloc(static_cast<size_t>(bytes))));
    EPMOE_CHECK_MSG(data_ != nullptr, fmt::format("executor: cannot allocate a buffer of {} bytes", allocated));
    capacity_ = allocated;
    ++generation_;
  }
  // Frees the memory when it holds more than `bytes` (the next Reserve allocates what it needs).
  void ShrinkTo(int64_t bytes) {
    if (capacity_ <= bytes) return;
    data_.reset();
    capacity_ = 0;
    ++generation_;
  }
  // Changes whenever the memory is released or replaced (its contents are then lost).
  int64_t generation() const { return generation_; }
  int64_t capacity() const { return capacity_; }
  uint8_t* data() { return data_.get(); }
  float* floats() { return reinterpret_cast<float*>(data_.get()); }

 private:
  HugePageMemory data_;
  int64_t capacity_ = 0;
  int64_t generation_ = 0;
};

}  // namespace epmoe::ep_internal
