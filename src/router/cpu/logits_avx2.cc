// The router's logits on AVX2 (logits_tile.h): 16 registers hold at most 8 vectors of sums, so a
// tile of R rows runs over B = 4 / R of the group's blocks (two 8-lane halves each) at a time, and
// the call goes over the group's blocks in such parts, the later parts finding the group's step
// lines in cache.
#include <immintrin.h>

#include <algorithm>
#include <array>

#include "router/logits_tile.h"

namespace epmoe::router_internal {
namespace {

constexpr int64_t kPrefetchBytes = 4096;  // as the AVX-512 tiles (logits_avx512.cc)

// Blocks [first_block, first_block + B) of the group.
template <int R, int B, bool kBf16>
void PartTile(const LogitsTile& t, int64_t first_block) {
  constexpr int kHalves = 2;
  __m256 sum[R][B][kHalves];
  float* sums = t.sums + first_block * kLanes;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < kHalves; ++h)
        sum[r][b][h] = t.first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * t.sums_stride + b * kLanes + 8 * h);
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = t.x + r * t.x_stride;
  const int64_t step = t.blocks * kStepBytes;
  const uint8_t* w = t.weights + first_block * kStepBytes;
  const int64_t full_steps = t.steps - (t.odd_tail ? 1 : 0);
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t s = 0; s < full_steps; ++s, w += step) {
    if (first_block == 0) {  // the first part asks for all of the steps' lines
      for (int64_t line = 0; line < t.blocks; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + line * kStepBytes), _MM_HINT_T1);
    }
    for (int b = 0; b < B; ++b) {
      const uint8_t* block = w + b * kStepBytes;
      if constexpr (kBf16) {
        __m256 even[kHalves], odd[kHalves];
        for (int h = 0; h < kHalves; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * h));
          even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high_half));
        }
        for (int r = 0; r < R; ++r) {
          const __m256 x_even = _mm256_set1_ps(x[r][2 * s]), x_odd = _mm256_set1_ps(x[r][2 * s + 1]);
          for (int h = 0; h < kHalves; ++h)
            sum[r][b][h] = _mm256_fmadd_ps(odd[h], x_odd, _mm256_fmadd_ps(even[h], x_even, sum[r][b][h]));
        }
      } else {
        __m256 weight[kHalves];
        for (int h = 0; h < kHalves; ++h) weight[h] = _mm256_loadu_ps(reinterpret_cast<const float*>(block + 32 * h));
        for (int r = 0; r < R; ++r) {
          const __m256 xs = _mm256_set1_ps(x[r][s]);
          for (int h = 0; h < kHalves; ++h) sum[r][b][h] = _mm256_fmadd_ps(weight[h], xs, sum[r][b][h]);
        }
      }
    }
  }
  if (t.odd_tail) {  // bf16 only: the last step's first input
    const int64_t s = full_steps;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < kHalves; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kStepBytes + 32 * h));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        for (int r = 0; r < R; ++r) sum[r][b][h] = _mm256_fmadd_ps(even, _mm256_set1_ps(x[r][2 * s]), sum[r][b][h]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < kHalves; ++h) _mm256_storeu_ps(sums + r * t.sums_stride + b * kLanes + 8 * h, sum[r][b][h]);
}

// The group's blocks in parts of up to 4 / R.
template <int R, bool kBf16>
void Tile(const LogitsTile& t) {
  constexpr int kPart = kGroupBlocks / R > 0 ? static_cast<int>(kGroupBlocks / R) : 1;
  for (int64_t b = 0; b < t.blocks; b += kPart) {
    switch (std::min<int64_t>(kPart, t.blocks - b)) {
      case 1: PartTile<R, 1, kBf16>(t, b); break;
      case 2:
        if constexpr (kPart >= 2) PartTile<R, 2, kBf16>(t, b);
        break;
      case 3:
        if constexpr (kPart >= 3) PartTile<R, 3, kBf16>(t, b);
        break;
      default:
        if constexpr (kPart >= 4) PartTile<R, 4, kBf16>(t, b);
        break;
    }
  }
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
