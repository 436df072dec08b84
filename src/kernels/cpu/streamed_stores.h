// What the vector kernels share for MatMul's OutputWrites::kStreamed (kernels/kernel.h).
#pragma once

#include <xmmintrin.h>

namespace epmoe::kernels {

// Makes a MatMul's non-temporal stores, which are weakly ordered, visible before whatever its
// thread does next (such as telling the pool it is done, after which other threads read them).
struct FenceStreamedStores {
  bool streamed;
  ~FenceStreamedStores() {
    if (streamed) _mm_sfence();
  }
};

}  // namespace epmoe::kernels
