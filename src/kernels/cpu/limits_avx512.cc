#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12 AVX-512 intrinsics, see matrix_kernel_avx512.cc
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/cpu/limits_kernels.h"

namespace epmoe::kernels {

uint64_t ReadSumAvx512(const uint8_t* data, int64_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < bytes; i += 256) {
    // Read 4 KB ahead into L2, as the kernels' streams read ahead too: the hardware prefetchers
    // alone leave bandwidth unused (a plain loop read 20 GB/s on one thread where the int8 kernel
    // streamed 25; with 1 - 8 KB ahead one thread reads alike, 30 - 33).
    for (int line = 0; line < 256; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(data + i + 4096 + line), _MM_HINT_T1);
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(data + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(data + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(data + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(data + i + 192));
  }
  const __m512i sum = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, sum);
  uint64_t total = 0;
  for (uint64_t v : lanes) total += v;
  return total;
}

int64_t ArithmeticLoopAvx512(ArithmeticPath path, int64_t iterations, float* sink) {
  constexpr int kChains = 12;  // enough independent chains to cover latency x throughput
  switch (path) {
    case ArithmeticPath::kInt8Madd: return ArithmeticLoopAvx2(path, iterations, sink);  // an AVX2 path
    case ArithmeticPath::kFp32Fma: {
      __m512 acc[kChains];
      for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
      const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
      for (int64_t i = 0; i < iterations; ++i)
        for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
      __m512 total = acc[0];
      for (int j = 1; j < kChains; ++j) total = _mm512_add_ps(total, acc[j]);
      *sink += _mm512_cvtss_f32(total);
      return iterations * kChains * 16 * 2;
    }
    case ArithmeticPath::kBf16Dot: {
      if (!DetectCpuFeatures().avx512bf16) return 0;  // AVX-512 without BF16 (Cascade and Ice Lake)
      __m512 acc[kChains];
      for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
      const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
      const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
      for (int64_t i = 0; i < iterations; ++i)
        for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
      __m512 total = acc[0];
      for (int j = 1; j < kChains; ++j) total = _mm512_add_ps(total, acc[j]);
      *sink += _mm512_cvtss_f32(total);
      return iterations * kChains * 32 * 2;
    }
    case ArithmeticPath::kInt8Vnni: {
      __m512i acc[kChains];
      for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_epi32(j);
      const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
      for (int64_t i = 0; i < iterations; ++i)
        for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
      __m512i total = acc[0];
      for (int j = 1; j < kChains; ++j) total = _mm512_add_epi32(total, acc[j]);
      *sink += static_cast<float>(_mm_cvtsi128_si32(_mm512_castsi512_si128(total)));
      return iterations * kChains * 64 * 2;
    }
    case ArithmeticPath::kInt8VnniScale16:
    case ArithmeticPath::kInt8VnniScale32: {
      // The 4-bit decode tile's shape: 8 (row, channel block) pairs, each a VPDPBUSD per 4 inputs
      // into an int32 sum, converted and scaled into its fp32 sum once per scale block. (The int32
      // sums run on rather than restart per block: the same instructions, with no copy.)
      constexpr int kPairs = 8;
      const int dots = path == ArithmeticPath::kInt8VnniScale16 ? 16 / 4 : 32 / 4;
      __m512i sum[kPairs];
      __m512 acc[kPairs];
      for (int j = 0; j < kPairs; ++j) {
        sum[j] = _mm512_set1_epi32(j);
        acc[j] = _mm512_setzero_ps();
      }
      const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
      const __m512 scale = _mm512_set1_ps(1e-9f);
      for (int64_t i = 0; i < iterations; ++i) {
        for (int d = 0; d < dots; ++d)
          for (int j = 0; j < kPairs; ++j) sum[j] = _mm512_dpbusd_epi32(sum[j], a, b);
        for (int j = 0; j < kPairs; ++j) acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[j]), scale, acc[j]);
      }
      __m512 total = acc[0];
      for (int j = 1; j < kPairs; ++j) total = _mm512_add_ps(total, acc[j]);
      *sink += _mm512_cvtss_f32(total);
      return iterations * kPairs * dots * 64 * 2;
    }
  }
  return 0;
}

}  // namespace epmoe::kernels
