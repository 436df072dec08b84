// The router's logits on AVX2 (logits_tile.h): 16 registers hold too few sums for a tile over a
// group's blocks, so a tile of R rows runs over one block (two 8-lane halves) and the call goes over
// the group's blocks in turn, the later ones finding the group's step lines in cache.
#include <immintrin.h>

#include <array>

#include "router/logits_tile.h"

namespace epmoe::router_internal {
namespace {

constexpr int64_t kPrefetchBytes = 4096;  // as the AVX-512 tiles (logits_avx512.cc)

template <int R, bool kBf16>
void BlockTile(const LogitsTile& t, int64_t block) {
  constexpr int kHalves = 2;
  __m256 sum[R][kHalves];
  float* sums = t.sums + block * kLanes;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kHalves; ++h)
      sum[r][h] = t.first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * t.sums_stride + 8 * h);
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = t.x + r * t.x_stride;
  const int64_t step = t.blocks * kStepBytes;
  const uint8_t* w = t.weights + block * kStepBytes;
  const int64_t full_steps = t.steps - (t.odd_tail ? 1 : 0);
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t s = 0; s < full_steps; ++s, w += step) {
    if (block == 0) {  // the first pass over the group's steps asks for all their lines
      for (int64_t line = 0; line < t.blocks; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + line * kStepBytes), _MM_HINT_T1);
    }
    if constexpr (kBf16) {
      __m256 even[kHalves], odd[kHalves];
      for (int h = 0; h < kHalves; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high_half));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 x_even = _mm256_set1_ps(x[r][2 * s]), x_odd = _mm256_set1_ps(x[r][2 * s + 1]);
        for (int h = 0; h < kHalves; ++h)
          sum[r][h] = _mm256_fmadd_ps(odd[h], x_odd, _mm256_fmadd_ps(even[h], x_even, sum[r][h]));
      }
    } else {
      __m256 weight[kHalves];
      for (int h = 0; h < kHalves; ++h) weight[h] = _mm256_loadu_ps(reinterpret_cast<const float*>(w + 32 * h));
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(x[r][s]);
        for (int h = 0; h < kHalves; ++h) sum[r][h] = _mm256_fmadd_ps(weight[h], xs, sum[r][h]);
      }
    }
  }
  if (t.odd_tail) {  // bf16 only: the last step's first input
    const int64_t s = full_steps;
    for (int h = 0; h < kHalves; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      for (int r = 0; r < R; ++r) sum[r][h] = _mm256_fmadd_ps(even, _mm256_set1_ps(x[r][2 * s]), sum[r][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kHalves; ++h) _mm256_storeu_ps(sums + r * t.sums_stride + 8 * h, sum[r][h]);
}

template <int R, bool kBf16>
void Tile(const LogitsTile& t) {
  for (int64_t b = 0; b < t.blocks; ++b) BlockTile<R, kBf16>(t, b);
}

using TileFn = void (*)(const LogitsTile&);
constexpr std::array<TileFn, kTileRows> kFp32Tiles = {&Tile<1, false>, &Tile<2, false>, &Tile<3, false>,
                                                      &Tile<4, false>};
constexpr std::array<TileFn, kTileRows> kBf16Tiles = {&Tile<1, true>, &Tile<2, true>, &Tile<3, true>, &Tile<4, true>};

}  // namespace

void LogitsTileAvx2(const LogitsTile& t) {
  (t.bf16 ? kBf16Tiles : kFp32Tiles)[t.rows - 1](t);
}

}  // namespace epmoe::router_internal
