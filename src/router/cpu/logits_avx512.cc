// The router's logits on AVX-512 (logits_tile.h): a tile of R rows x B blocks keeps R x B vectors
// of 16 sums in registers; per step it loads B weight vectors (bf16: widened to two fp32 vectors,
// the low halves shifted up and the high halves masked) and broadcasts each row's input.
// GCC 12 reports its own AVX-512 intrinsics (_mm512_undefined_* in the broadcasts) as "used
// uninitialized" once inlined at -O3; the values are never read. Silence only that check.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <array>

#include "router/logits_tile.h"

namespace epmoe::router_internal {
namespace {

// Every weight line is asked into L2 this far ahead: a decode step reads each weight once, in
// streams too short for the hardware prefetcher to reach full speed.
constexpr int64_t kPrefetchBytes = 4096;

template <int R, int B, bool kBf16>
void Tile(const LogitsTile& t) {
  __m512 sum[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      sum[r][b] = t.first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.sums + r * t.sums_stride + b * kLanes);
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = t.x + r * t.x_stride;
  const uint8_t* w = t.weights;
  const int64_t full_steps = t.steps - (t.odd_tail ? 1 : 0);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t s = 0; s < full_steps; ++s, w += B * kStepBytes) {
    for (int b = 0; b < B; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + b * kStepBytes), _MM_HINT_T1);
    if constexpr (kBf16) {
      __m512 even[B], odd[B];
      for (int b = 0; b < B; ++b) {
        const __m512i v = _mm512_loadu_si512(w + b * kStepBytes);
        even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        odd[b] = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 x_even = _mm512_set1_ps(x[r][2 * s]), x_odd = _mm512_set1_ps(x[r][2 * s + 1]);
        for (int b = 0; b < B; ++b)
          sum[r][b] = _mm512_fmadd_ps(odd[b], x_odd, _mm512_fmadd_ps(even[b], x_even, sum[r][b]));
      }
    } else {
      __m512 weight[B];
      for (int b = 0; b < B; ++b) weight[b] = _mm512_loadu_ps(reinterpret_cast<const float*>(w + b * kStepBytes));
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(x[r][s]);
        for (int b = 0; b < B; ++b) sum[r][b] = _mm512_fmadd_ps(weight[b], xs, sum[r][b]);
      }
    }
  }
  if (t.odd_tail) {  // bf16 only: the last step's first input
    const int64_t s = full_steps;
    for (int b = 0; b < B; ++b) {
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + b * kStepBytes), 16));
      for (int r = 0; r < R; ++r) sum[r][b] = _mm512_fmadd_ps(even, _mm512_set1_ps(x[r][2 * s]), sum[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(t.sums + r * t.sums_stride + b * kLanes, sum[r][b]);
}

using TileFn = void (*)(const LogitsTile&);

template <bool kBf16, int... kIndex>
constexpr std::array<TileFn, sizeof...(kIndex)> MakeTiles(std::integer_sequence<int, kIndex...>) {
  return {&Tile<kIndex / kGroupBlocks + 1, kIndex % kGroupBlocks + 1, kBf16>...};
}

// [rows - 1][blocks - 1], flattened.
constexpr auto kFp32Tiles = MakeTiles<false>(std::make_integer_sequence<int, kTileRows * kGroupBlocks>{});
constexpr auto kBf16Tiles = MakeTiles<true>(std::make_integer_sequence<int, kTileRows * kGroupBlocks>{});

}  // namespace

void LogitsTileAvx512(const LogitsTile& t) {
  const int64_t index = (t.rows - 1) * kGroupBlocks + (t.blocks - 1);
  (t.bf16 ? kBf16Tiles : kFp32Tiles)[index](t);
}

}  // namespace epmoe::router_internal
