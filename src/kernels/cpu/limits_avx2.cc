#include <immintrin.h>

#include "kernels/cpu/limits_kernels.h"

namespace epmoe::kernels {

uint64_t ReadSumAvx2(const uint8_t* data, int64_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < bytes; i += 128) {
    // 4 KB ahead into L2, as in ReadSumAvx512.
    _mm_prefetch(reinterpret_cast<const char*>(data + i + 4096), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(data + i + 4096 + 64), _MM_HINT_T1);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i + 96)));
  }
  const __m256i sum = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

int64_t ArithmeticLoopAvx2(ArithmeticPath path, int64_t iterations, float* sink) {
  constexpr int kChains = 12;
  if (path == ArithmeticPath::kInt8Madd) {
    __m256i acc[kChains];
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_epi32(j);
    const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    // In assembly: the products of constants would otherwise be computed once, outside the loop.
    for (int64_t i = 0; i < iterations; ++i) {
      for (int j = 0; j < kChains; ++j) {
        __m256i pairs;
        asm("vpmaddubsw %[b], %[a], %[t]\n\tvpmaddwd %[ones], %[t], %[t]\n\tvpaddd %[t], %[acc], %[acc]"
            : [acc] "+x"(acc[j]), [t] "=&x"(pairs)
            : [a] "x"(a), [b] "x"(b), [ones] "x"(ones));
      }
    }
    __m256i total = acc[0];
    for (int j = 1; j < kChains; ++j) total = _mm256_add_epi32(total, acc[j]);
    *sink += static_cast<float>(_mm256_extract_epi32(total, 0));
    return iterations * kChains * 32 * 2;
  }
  if (path != ArithmeticPath::kFp32Fma) return 0;
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(static_cast<float>(j));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  __m256 total = acc[0];
  for (int j = 1; j < kChains; ++j) total = _mm256_add_ps(total, acc[j]);
  *sink += _mm256_cvtss_f32(total);
  return iterations * kChains * 8 * 2;
}

}  // namespace epmoe::kernels
