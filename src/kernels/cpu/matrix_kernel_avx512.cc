// The AVX-512 matrix kernels (needs F, BW, VL, DQ, VNNI, BF16 and VBMI; see epmoe/cpu.h).
//   fp32   fp32 activations, FMA.
//   bf16   activations rounded to bf16, VDPBF16PS (fp32 accumulation).
//   int8   activations quantized to int8 per row (scale max|x|/127); weights stored offset binary
//          (w + 128) so VPDPBUSD takes them as its unsigned operand; the offset is removed with
//          the row's precomputed -128 * sum(q). Integer accumulation over the whole row.
//   nvfp4, mxfp4  the same int8 activations, permuted to the kGrouped256 layout; E2M1 codes map
//          through a table (VPERMB) to 2 * value + 12 (0..24, unsigned); the offset is removed
//          with -12 * (sum of the lane's 16 activations), precomputed per row. Each 32-bit lane
//          holds one 16-input block, summed in int32 then scaled by its block scale in fp32.
// Every kernel tiles up to 4 activation rows x 4 (2 for 4-bit) weight rows in registers and walks
// the inputs once, so a weight row is read from memory once per call and from L1 for further row
// tiles.
// GCC 12 reports its own AVX-512 intrinsics (_mm512_undefined_* inside shuffles and extracts) as
// "used uninitialized" once inlined at -O3; the values are never read. Silence only that check.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

// Where a tile reads and writes.
struct TileArgs {
  const PackedMatrix* weights;
  int64_t channel;      // first weight row of the tile
  const uint8_t* acts;  // first activation row of the tile
  int64_t act_stride;   // bytes between activation rows
  float* out;           // result of (first row, first channel)
  int64_t out_stride;   // floats between output rows
  // 4-bit prefill only: the tile's weights already expanded (see FourBit::Unpack).
  const uint8_t* unpacked_values = nullptr;
  const float* unpacked_scales = nullptr;
};

using TileFn = void (*)(const TileArgs&);

template <template <int, int> class Tile, int kMaxRows, int kMaxChannels>
struct TileTable {
  template <int... I>
  static constexpr std::array<TileFn, sizeof...(I)> Make(std::integer_sequence<int, I...>) {
    return {&Tile<I / kMaxChannels + 1, I % kMaxChannels + 1>::Run...};
  }
  static constexpr std::array<TileFn, kMaxRows* kMaxChannels> kTable =
      Make(std::make_integer_sequence<int, kMaxRows * kMaxChannels>{});
};

// Walks [n_begin, n_end) in channel tiles and, inside each, all rows in row tiles.
template <template <int, int> class Tile, int kMaxRows, int kMaxChannels>
void RunTiles(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t act_stride,
              int64_t rows, float* out, int64_t out_stride) {
  for (int64_t n = n_begin; n < n_end; n += kMaxChannels) {
    const int channels = static_cast<int>(std::min<int64_t>(kMaxChannels, n_end - n));
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r));
      const TileArgs args{&w, n, acts + r * act_stride, act_stride, out + r * out_stride + (n - n_begin), out_stride};
      TileTable<Tile, kMaxRows, kMaxChannels>::kTable[(tile_rows - 1) * kMaxChannels + (channels - 1)](args);
    }
  }
}

// Horizontal sums.
float SumLanes(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  __m128 s = _mm512_castps512_ps128(v);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

int32_t SumLanes(__m512i v) {
  v = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  __m128i s = _mm512_castsi512_si128(v);
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Weight rows of a matrix are contiguous, so the tile after next starts 2 tiles past this one.
// Each tile prefetches that tile's weights at the pace it consumes its own: `bytes` (a multiple
// of 64) starting `offset` bytes into it. Short rows split into several
// streams over 4 KB pages defeat the hardware prefetchers; this keeps enough reads in flight.
inline void PrefetchNextTile(const uint8_t* next_tile, int64_t offset, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next_tile + offset + b), _MM_HINT_T0);
}

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// ---- fp32 ----

template <int R, int N>
struct Fp32Tile {
  static void Run(const TileArgs& a) {
    const int64_t cols = a.weights->cols;
    const float* w[N];
    for (int j = 0; j < N; ++j) w[j] = reinterpret_cast<const float*>(a.weights->row(a.channel + j));
    __m512 acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < N; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint8_t* next_tile = a.weights->row(a.channel) + 2 * N * a.weights->row_bytes;
    for (int64_t c = 0; c < cols; c += 16) {
      PrefetchNextTile(next_tile, 4 * c * N, 64 * N);
      __m512 wv[N];
      for (int j = 0; j < N; ++j) wv[j] = _mm512_loadu_ps(w[j] + c);
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_loadu_ps(reinterpret_cast<const float*>(a.acts + r * a.act_stride) + c);
        for (int j = 0; j < N; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], x, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < N; ++j) a.out[r * a.out_stride + j] = SumLanes(acc[r][j]);
  }
};

class Fp32Kernel final : public MatrixKernel {
 public:
  Isa isa() const override { return Isa::kAvx512; }
  WeightFormat format() const override { return WeightFormat::kFp32; }
  bool SupportsCols(int64_t cols) const override { return cols % 16 == 0; }
  int64_t ActivationBytes(int64_t cols) const override { return RoundUp(cols * 4, 64); }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    std::memcpy(out, x, cols * sizeof(float));
  }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride) const override {
    RunTiles<Fp32Tile, 4, 4>(w, n_begin, n_end, acts, ActivationBytes(w.cols), rows, out, out_stride);
  }
};

// ---- bf16 ----

template <int R, int N>
struct Bf16Tile {
  static void Run(const TileArgs& a) {
    const int64_t cols = a.weights->cols;
    const uint8_t* w[N];
    for (int j = 0; j < N; ++j) w[j] = a.weights->row(a.channel + j);
    __m512 acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < N; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint8_t* next_tile = w[0] + 2 * N * a.weights->row_bytes;
    for (int64_t c = 0; c < cols; c += 32) {
      PrefetchNextTile(next_tile, 2 * c * N, 64 * N);
      __m512i wv[N];
      for (int j = 0; j < N; ++j) wv[j] = _mm512_loadu_si512(w[j] + 2 * c);
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_loadu_si512(a.acts + r * a.act_stride + 2 * c);
        for (int j = 0; j < N; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)x, (__m512bh)wv[j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < N; ++j) a.out[r * a.out_stride + j] = SumLanes(acc[r][j]);
  }
};

class Bf16Kernel final : public MatrixKernel {
 public:
  Isa isa() const override { return Isa::kAvx512; }
  WeightFormat format() const override { return WeightFormat::kBf16; }
  bool SupportsCols(int64_t cols) const override { return cols % 32 == 0; }
  int64_t ActivationBytes(int64_t cols) const override { return RoundUp(cols * 2, 64); }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t bits = Bf16FromFloat(x[c]);
      std::memcpy(out + 2 * c, &bits, 2);
    }
  }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride) const override {
    RunTiles<Bf16Tile, 4, 4>(w, n_begin, n_end, acts, ActivationBytes(w.cols), rows, out, out_stride);
  }
};

// ---- int8 activations shared by the int8 and 4-bit kernels ----

// Symmetric per-row quantization: returns the scale (1 for an all-zero row) and writes q.
float QuantizeRowInt8(const float* x, int64_t cols, int8_t* q) {
  float amax = 0;
  for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(x[c]));
  const float scale = amax > 0 ? amax / 127.0f : 1.0f;
  const float inverse = 1.0f / scale;
  for (int64_t c = 0; c < cols; ++c)
    q[c] = static_cast<int8_t>(std::clamp(std::nearbyint(x[c] * inverse), -127.0f, 127.0f));
  return scale;
}

// int8 activation row: cols int8 values, padded to 64 bytes, then fp32 scale and int32 -128*sum(q).
template <int R, int N>
struct Int8Tile {
  static void Run(const TileArgs& a) {
    const int64_t cols = a.weights->cols;
    const uint8_t* w[N];
    for (int j = 0; j < N; ++j) w[j] = a.weights->row(a.channel + j);
    __m512i acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < N; ++j) acc[r][j] = _mm512_setzero_si512();
    const uint8_t* next_tile = w[0] + 2 * N * a.weights->row_bytes;
    for (int64_t c = 0; c < cols; c += 64) {
      PrefetchNextTile(next_tile, c * N, 64 * N);
      __m512i wv[N];
      for (int j = 0; j < N; ++j) wv[j] = _mm512_loadu_si512(w[j] + c);
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_loadu_si512(a.acts + r * a.act_stride + c);
        for (int j = 0; j < N; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wv[j], x);
      }
    }
    const int64_t tail = RoundUp(cols, 64);
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = a.acts + r * a.act_stride;
      float act_scale;
      int32_t correction;
      std::memcpy(&act_scale, row + tail, 4);
      std::memcpy(&correction, row + tail + 4, 4);
      for (int j = 0; j < N; ++j) {
        float weight_scale;
        std::memcpy(&weight_scale, a.weights->scales.data() + (a.channel + j) * 4, 4);
        const int32_t dot = SumLanes(acc[r][j]) + correction;
        a.out[r * a.out_stride + j] = static_cast<float>(dot) * (weight_scale * act_scale);
      }
    }
  }
};

class Int8Kernel final : public MatrixKernel {
 public:
  Isa isa() const override { return Isa::kAvx512; }
  WeightFormat format() const override { return WeightFormat::kInt8; }
  bool SupportsCols(int64_t cols) const override { return cols % 64 == 0; }
  int64_t ActivationBytes(int64_t cols) const override { return RoundUp(cols, 64) + 64; }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    int8_t* q = reinterpret_cast<int8_t*>(out);
    const float scale = QuantizeRowInt8(x, cols, q);
    int32_t sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += q[c];
    const int32_t correction = -128 * sum;
    std::memcpy(out + RoundUp(cols, 64), &scale, 4);
    std::memcpy(out + RoundUp(cols, 64) + 4, &correction, 4);
  }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride) const override {
    RunTiles<Int8Tile, 4, 4>(w, n_begin, n_end, acts, ActivationBytes(w.cols), rows, out, out_stride);
  }
};

// ---- 4-bit (nvfp4, mxfp4) ----

// 4-bit activation row (cols a multiple of 256): cols int8 values in kGrouped256 order, then
// cols/16 int32 lane corrections (-12 * sum of the lane's 16 values), then the fp32 scale.
int64_t FourBitCorrectionOffset(int64_t cols) {
  return cols;
}
int64_t FourBitScaleOffset(int64_t cols) {
  return cols + cols / 16 * 4;
}

// Lane scales of group g for one weight row: 16 fp32, lane i scaling inputs 16i .. 16i+15.
template <WeightFormat kFormat>
__m512 LaneScales(const uint8_t* row_scales, int64_t group) {
  if constexpr (kFormat == WeightFormat::kNvfp4) {
    // E4M3 (non-negative, never NaN here) -> fp32: place exponent and mantissa bits, then scale by
    // 2^(127 - 7) to rebias; subnormal codes come out right as fp32 subnormals times 2^120.
    const __m512i codes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_scales + group * 16)));
    const __m512 raw = _mm512_castsi512_ps(_mm512_slli_epi32(codes, 20));
    return _mm512_mul_ps(raw, _mm512_set1_ps(0x1p120f));
  } else {
    // E8M0 -> fp32: the code is the fp32 exponent field. One code covers lanes 2i and 2i+1.
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row_scales + group * 8));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(eight, eight));
    return _mm512_castsi512_ps(_mm512_slli_epi32(codes, 23));
  }
}

template <WeightFormat kFormat>
struct FourBit {
  // One group of 256 inputs of R rows against N channels' expanded values and block scales: per row
  // and channel 4 VPDPBUSD, a conversion and an FMA. Shared by the decode and prefill tiles.
  template <int R, int N>
  static inline __attribute__((always_inline)) void AccumulateGroup(const TileArgs& a, int64_t cols, int64_t g,
                                                                    const __m512i (&v)[N][4], const __m512 (&scale)[N],
                                                                    __m512 (&acc)[R][N]) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = a.acts + r * a.act_stride;
      const __m512i correction = _mm512_loadu_si512(x + FourBitCorrectionOffset(cols) + g * 64);
      const __m512i x0 = _mm512_loadu_si512(x + g * 256);
      const __m512i x1 = _mm512_loadu_si512(x + g * 256 + 64);
      const __m512i x2 = _mm512_loadu_si512(x + g * 256 + 128);
      const __m512i x3 = _mm512_loadu_si512(x + g * 256 + 192);
      for (int j = 0; j < N; ++j) {
        __m512i t = _mm512_dpbusd_epi32(correction, v[j][0], x0);
        t = _mm512_dpbusd_epi32(t, v[j][1], x1);
        t = _mm512_dpbusd_epi32(t, v[j][2], x2);
        t = _mm512_dpbusd_epi32(t, v[j][3], x3);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale[j], acc[r][j]);
      }
    }
  }

  // Writes an R x N tile. The lookup table doubled the values: halve here, with the activation and
  // tensor scales.
  template <int R, int N>
  static inline __attribute__((always_inline)) void StoreTile(const TileArgs& a, const PackedMatrix& m,
                                                              const __m512 (&acc)[R][N]) {
    const float tensor = kFormat == WeightFormat::kNvfp4 ? m.tensor_scale : 1.0f;
    for (int r = 0; r < R; ++r) {
      float act_scale;
      std::memcpy(&act_scale, a.acts + r * a.act_stride + FourBitScaleOffset(m.cols), 4);
      for (int j = 0; j < N; ++j) a.out[r * a.out_stride + j] = SumLanes(acc[r][j]) * (0.5f * act_scale * tensor);
    }
  }

  template <int R, int N>
  struct Tile {
    // VPERMB (AVX512_VBMI) looks codes up in a 64-entry table holding the 16 values 4 times, so
    // neither nibble needs masking: the index's bits 4-5 (the neighbouring nibble) are ignored.
    __attribute__((target("avx512vbmi"))) static void Run(const TileArgs& a) {
      const PackedMatrix& m = *a.weights;
      const int64_t cols = m.cols;
      const int64_t groups = cols / 256;
      const int64_t scales_per_row = cols / BlockSize(kFormat);
      // 2 * E2M1 value + 12 for codes 0..15 (8..15 negative), repeated in each 16 bytes.
      const __m512i table =
          _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
      const uint8_t* w[N];
      const uint8_t* s[N];
      for (int j = 0; j < N; ++j) {
        w[j] = m.row(a.channel + j);
        s[j] = m.scales.data() + (a.channel + j) * scales_per_row;
      }
      __m512 acc[R][N];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < N; ++j) acc[r][j] = _mm512_setzero_ps();
      const uint8_t* next_tile = w[0] + 2 * N * m.row_bytes;
      const uint8_t* next_scales = s[0] + 2 * N * scales_per_row;
      for (int64_t g = 0; g < groups; ++g) {
        PrefetchNextTile(next_tile, g * 128 * N, 128 * N);
        if (g % 4 == 0) PrefetchNextTile(next_scales, g * (256 / BlockSize(kFormat)) * N, 64);
        __m512i v[N][4];
        __m512 scale[N];
        for (int j = 0; j < N; ++j) {
          const __m512i p0 = _mm512_loadu_si512(w[j] + g * 128);
          const __m512i p1 = _mm512_loadu_si512(w[j] + g * 128 + 64);
          v[j][0] = _mm512_permutexvar_epi8(p0, table);
          v[j][1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(p0, 4), table);
          v[j][2] = _mm512_permutexvar_epi8(p1, table);
          v[j][3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(p1, 4), table);
          scale[j] = LaneScales<kFormat>(s[j], g);
        }
        AccumulateGroup<R, N>(a, cols, g, v, scale, acc);
      }
      StoreTile<R, N>(a, m, acc);
    }
  };

  // Prefill: expands `channels` weight rows starting at `channel` once into L1-sized buffers, as
  // unsigned values (4 vectors of 64 per group of 256 inputs) and fp32 lane scales (16 per group),
  // so that every row tile reuses them without unpacking again.
  __attribute__((target("avx512vbmi"))) static void Unpack(const PackedMatrix& m, int64_t channel, int channels,
                                                           uint8_t* values, float* scales) {
    const int64_t groups = m.cols / 256;
    const int64_t scales_per_row = m.cols / BlockSize(kFormat);
    const __m512i table =
        _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    for (int j = 0; j < channels; ++j) {
      const uint8_t* w = m.row(channel + j);
      const uint8_t* s = m.scales.data() + (channel + j) * scales_per_row;
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* target = values + (j * groups + g) * 256;
        const __m512i p0 = _mm512_loadu_si512(w + g * 128);
        const __m512i p1 = _mm512_loadu_si512(w + g * 128 + 64);
        _mm512_storeu_si512(target, _mm512_permutexvar_epi8(p0, table));
        _mm512_storeu_si512(target + 64, _mm512_permutexvar_epi8(_mm512_srli_epi16(p0, 4), table));
        _mm512_storeu_si512(target + 128, _mm512_permutexvar_epi8(p1, table));
        _mm512_storeu_si512(target + 192, _mm512_permutexvar_epi8(_mm512_srli_epi16(p1, 4), table));
        _mm512_storeu_ps(scales + (j * groups + g) * 16, LaneScales<kFormat>(s, g));
      }
    }
  }

  // Prefill tile over expanded weights: per group, the N channels' values and scales are loaded
  // into registers once for all R rows; per row, channel and group of 256 inputs there are 4
  // VPDPBUSD, a conversion and an FMA.
  template <int R, int N>
  struct UnpackedTile {
    static void Run(const TileArgs& a) {
      const PackedMatrix& m = *a.weights;
      const int64_t cols = m.cols;
      const int64_t groups = cols / 256;
      __m512 acc[R][N];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < N; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m512i v[N][4];
        __m512 scale[N];
        for (int j = 0; j < N; ++j) {
          const uint8_t* values = a.unpacked_values + (j * groups + g) * 256;
          for (int i = 0; i < 4; ++i) v[j][i] = _mm512_loadu_si512(values + 64 * i);
          scale[j] = _mm512_loadu_ps(a.unpacked_scales + (j * groups + g) * 16);
        }
        AccumulateGroup<R, N>(a, cols, g, v, scale, acc);
      }
      StoreTile<R, N>(a, m, acc);
    }
  };
};

template <WeightFormat kFormat>
class FourBitKernel final : public MatrixKernel {
 public:
  // Up to this many rows the weights are unpacked in registers as they stream by; more rows
  // amortize expanding them once per channel tile.
  static constexpr int64_t kStreamRows = 4;

  Isa isa() const override { return Isa::kAvx512; }
  WeightFormat format() const override { return kFormat; }
  PackLayout layout() const override { return PackLayout::kGrouped256; }
  bool SupportsCols(int64_t cols) const override { return cols % 256 == 0; }
  int64_t ActivationBytes(int64_t cols) const override { return FourBitScaleOffset(cols) + 64; }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    std::vector<int8_t> q(cols);
    const float scale = QuantizeRowInt8(x, cols, q.data());
    int8_t* permuted = reinterpret_cast<int8_t*>(out);
    for (int64_t g = 0; g < cols / 256; ++g) {
      for (int lane = 0; lane < 16; ++lane) {
        int32_t sum = 0;
        for (int k = 0; k < 16; ++k) {
          const int vector = k / 4, t = k % 4;
          const int8_t value = q[g * 256 + lane * 16 + k];
          permuted[g * 256 + vector * 64 + lane * 4 + t] = value;
          sum += value;
        }
        const int32_t correction = -12 * sum;
        std::memcpy(out + FourBitCorrectionOffset(cols) + (g * 16 + lane) * 4, &correction, 4);
      }
    }
    std::memcpy(out + FourBitScaleOffset(cols), &scale, 4);
  }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride) const override {
    const int64_t stride = ActivationBytes(w.cols);
    if (rows <= kStreamRows) {
      // Decode: unpack in registers while streaming the weights once.
      RunTiles<FourBit<kFormat>::template Tile, 4, 2>(w, n_begin, n_end, acts, stride, rows, out, out_stride);
      return;
    }
    // Prefill: expand kChannels weight rows once (L1), then run every row tile over them.
    constexpr int kChannels = 2, kRows = 4;
    std::vector<uint8_t> values(kChannels * w.cols);
    std::vector<float> scales(kChannels * (w.cols / 16));
    for (int64_t n = n_begin; n < n_end; n += kChannels) {
      const int channels = static_cast<int>(std::min<int64_t>(kChannels, n_end - n));
      FourBit<kFormat>::Unpack(w, n, channels, values.data(), scales.data());
      for (int64_t r = 0; r < rows; r += kRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kRows, rows - r));
        TileArgs args{
            &w,           n, acts + r * stride, stride, out + r * out_stride + (n - n_begin), out_stride, values.data(),
            scales.data()};
        TileTable<FourBit<kFormat>::template UnpackedTile, kRows, kChannels>::kTable[(tile_rows - 1) * kChannels +
                                                                                     (channels - 1)](args);
      }
    }
  }
};

}  // namespace

std::unique_ptr<MatrixKernel> MakeAvx512Kernel(WeightFormat format) {
  switch (format) {
    case WeightFormat::kFp32: return std::make_unique<Fp32Kernel>();
    case WeightFormat::kBf16: return std::make_unique<Bf16Kernel>();
    case WeightFormat::kInt8: return std::make_unique<Int8Kernel>();
    case WeightFormat::kNvfp4: return std::make_unique<FourBitKernel<WeightFormat::kNvfp4>>();
    case WeightFormat::kMxfp4: return std::make_unique<FourBitKernel<WeightFormat::kMxfp4>>();
  }
  return nullptr;
}

}  // namespace epmoe::kernels
