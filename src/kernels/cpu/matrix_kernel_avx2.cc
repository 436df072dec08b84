// The AVX2 matrix kernels (AVX2 + FMA: Zen 2 and 3, Intel CPUs without AVX-512, and AVX-512 CPUs
// that lack VNNI, BF16 or VBMI), on the weights of PackLayout::kChannelBlocked, the AVX-512
// kernels' layout: a block of 16 output channels is two 8-lane halves here, one output channel per
// 32-bit lane, so no horizontal sums are needed. Each step multiplies one 32-byte half of a weight
// vector (one input group of 8 channels) by the same input group of an activation row, broadcast:
//   fp32   fp32 activations, FMA.
//   bf16   fp32 activations; each bf16 pair becomes two fp32 vectors (a shift and a mask), two FMAs.
//   int8   activations quantized to int8 per row (scale max|x|/127). No VNNI: VPMADDUBSW multiplies
//          unsigned by signed bytes into saturating 16-bit pair sums, so the weight's magnitude is
//          the unsigned operand and its sign moves onto the activation (VPSIGNB): |w| <= 127 keeps
//          a pair sum within 2 x 127 x 127; VPMADDWD then sums the pairs into 32 bits.
//   nvfp4, mxfp4  the same int8 activations; VPSHUFB maps an E2M1 code to 2 * value + 12 (0..24,
//          unsigned: a pair sum stays within 2 x 24 x 127, and 16 inputs within 16 bits); the offset
//          is removed with -12 * (sum of the scale block's activations) per row; each scale block is
//          summed in 16 and then 32 bits, then scaled per lane by its channel's block scale (FMA).
// fp32, bf16 and int8 run an interleaved group chunk of input groups by chunk, in row tiles over as
// many of its blocks as 16 registers allow (RunDenseTiles); a 4-bit block is one stream of its own,
// read by tiles of up to 3 rows, the first from memory and the others from cache.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <iterator>

#include "kernels/cpu/exp_polynomial.h"
#include "kernels/cpu/streamed_stores.h"
#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

constexpr int64_t kLanes = 16;  // channels per block of kChannelBlocked: two 8-lane halves
// How far ahead the 4-bit tiles prefetch their block's stream into L2.
constexpr int64_t kPrefetchBytes = 4096;
// The dense tiles run an interleaved group's blocks chunk of kChunkGroups input groups by chunk
// (8 KB of the group: L1), for batches of up to kBatchRows rows, whose accumulators (kStateBlocks
// blocks per row) wait in memory between chunks. A tile over the whole group (one row) reads one
// stream and prefetches kStreamPrefetchSteps input groups (1 KB) ahead; a tile over part of the
// group prefetches its blocks' lines a chunk ahead.
constexpr int64_t kChunkGroups = 32, kBatchRows = 12, kStateBlocks = 4, kStreamPrefetchSteps = 4;
// A tile over a whole group whose Dot has kFarPrefetch prefetches each line a second time, this
// many times as far ahead (4 KB; DenseTile).
constexpr int64_t kFarPrefetchSteps = 4;

inline __m256i Load256(const uint8_t* at) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
}

inline void Prefetch(const uint8_t* at) {
  _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
}

// The 4-byte input group at `at`, broadcast to all 8 lanes.
inline __m256i BroadcastGroup(const uint8_t* at) {
  return _mm256_set1_epi32(LoadInt32(at));
}

// ---- int8 activations, shared by the int8 and 4-bit kernels ----

// Symmetric per-row quantization (cols a multiple of 8): returns the scale (1 for an all-zero row)
// and writes q, rounding to nearest even as the AVX-512 kernels do.
float QuantizeRowInt8(const float* x, int64_t cols, int8_t* q) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t c = 0; c < cols; c += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + c)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  const float max = *std::max_element(lanes, lanes + 8);
  const float scale = max > 0 ? max / 127.0f : 1.0f;
  const __m256 inverse = _mm256_set1_ps(1.0f / scale);
  for (int64_t c = 0; c < cols; c += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c), inverse));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + c), _mm_packs_epi16(words, words));
  }
  return scale;
}

// Sum of `count` int8 values (count a multiple of 16). VPSADBW sums 8 bytes at a time, taken
// unsigned (q + 128: the sign bit flipped).
int32_t SumInt8(const int8_t* q, int64_t count) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  __m128i eights = _mm_setzero_si128();
  for (int64_t c = 0; c < count; c += 16)
    eights = _mm_add_epi64(eights,
                           _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c)), flip),
                                        _mm_setzero_si128()));
  return static_cast<int32_t>(_mm_cvtsi128_si64(eights) + _mm_extract_epi64(eights, 1) - 128 * count);
}

// The 4-bit kernels' offset corrections: -12 x the sum of each `block` (16 or 32) values of q
// (cols a multiple of block), written as int32 from `out` on; 32 values at a time, by VPSADBW as in
// SumInt8 (summed block by block, nvfp4's row of 2,048 took longer than quantizing it).
void FourBitCorrections(const int8_t* q, int64_t cols, int block, uint8_t* out) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  int64_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    const __m256i eights = _mm256_sad_epu8(
        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c)), flip), _mm256_setzero_si256());
    // Each 16-byte sum in the low 32 bits of its 128-bit lane, then both together.
    const __m256i sixteens = _mm256_add_epi64(eights, _mm256_shuffle_epi32(eights, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m128i sums =
        _mm_sub_epi32(_mm_unpacklo_epi32(_mm256_castsi256_si128(sixteens), _mm256_extracti128_si256(sixteens, 1)),
                      _mm_set1_epi32(16 * 128));
    if (block == 32) {
      const int32_t correction = -12 * (_mm_cvtsi128_si32(sums) + _mm_extract_epi32(sums, 1));
      std::memcpy(out + c / 8, &correction, 4);
    } else {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c / 4), _mm_mullo_epi32(sums, _mm_set1_epi32(-12)));
    }
  }
  for (; c < cols; c += block) {
    const int32_t correction = -12 * SumInt8(q + c, block);
    std::memcpy(out + c / block * 4, &correction, 4);
  }
}

// ---- fp32, bf16, int8: tiles over the blocks of an interleaved group ----

// Where a tile reads and writes.
struct TileArgs {
  const PackedMatrix* weights;
  int64_t block;          // the tile's channel block
  const uint8_t* acts;    // first activation row of the tile
  int64_t act_stride;     // bytes between activation rows
  float* out;             // 4-bit: output of (first row, first channel of the block)
  int64_t out_stride;     // floats between output rows
  bool stream;            // 4-bit: the first row tile over the block, which prefetches it
  bool streamed_outputs;  // MatMul's OutputWrites::kStreamed (StoreOutput)
  bool prefetch_twice;    // dense: the call has one batch of rows (DenseTile)
};

// Writes 8 outputs at `to`: with `streamed`, a non-temporal store where they are an aligned half
// cache line (a tile writes both halves of a line one after the other; MatrixKernel::MatMul,
// OutputWrites::kStreamed).
inline void StoreOutput(float* to, __m256 v, bool streamed) {
  if (streamed && reinterpret_cast<uintptr_t>(to) % 32 == 0) {
    _mm256_stream_ps(to, v);
  } else {
    _mm256_storeu_ps(to, v);
  }
}

// What differs between fp32, bf16 and int8: how a 32-byte half of a weight vector is prepared once
// for all rows, how a row's input group is broadcast, the multiply-add, and how an accumulator
// becomes 8 outputs.
struct Fp32Dot {
  static constexpr int kValueBytes = 4, kMaxRows = 4;
  static constexpr bool kFarPrefetch = false;
  using Acc = __m256;
  using Weights = __m256;
  using Input = __m256;
  static Acc Zero() { return _mm256_setzero_ps(); }
  static Weights Prepare(__m256i w) { return _mm256_castsi256_ps(w); }
  static Input Broadcast(const uint8_t* row, int64_t g) { return _mm256_set1_ps(LoadFloat(row + 4 * g)); }
  static Acc MultiplyAdd(Acc acc, const Weights& w, const Input& x) { return _mm256_fmadd_ps(w, x, acc); }
  static __m256 Finish(const TileArgs&, const uint8_t*, int64_t, int, Acc acc) { return acc; }
};

// bf16 weights, fp32 activations: the pair (input 2g in the low half of each lane, 2g + 1 in the
// high half) becomes two fp32 vectors exactly.
struct Bf16Dot {
  static constexpr int kValueBytes = 2, kMaxRows = 4;
  static constexpr bool kFarPrefetch = false;
  using Acc = __m256;
  struct Weights {
    __m256 even, odd;
  };
  struct Input {
    __m256 even, odd;
  };
  static Acc Zero() { return _mm256_setzero_ps(); }
  static Weights Prepare(__m256i w) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
  }
  static Input Broadcast(const uint8_t* row, int64_t g) {
    return {_mm256_set1_ps(LoadFloat(row + 8 * g)), _mm256_set1_ps(LoadFloat(row + 8 * g + 4))};
  }
  static Acc MultiplyAdd(Acc acc, const Weights& w, const Input& x) {
    return _mm256_fmadd_ps(w.odd, x.odd, _mm256_fmadd_ps(w.even, x.even, acc));
  }
  static __m256 Finish(const TileArgs&, const uint8_t*, int64_t, int, Acc acc) { return acc; }
};

// int8 activation row: cols int8 values, padded to 32 bytes, then the fp32 scale.
struct Int8Dot {
  static constexpr int kValueBytes = 1, kMaxRows = 3;
  // Whole-group tiles prefetch each line a second time, kFarPrefetchSteps times as far ahead (in
  // calls of one batch of rows, DenseTile; at one row the int8 dot spends 6 instructions per 32
  // bytes, bf16 4, fp32 1). AVX2 forced on Zen 4, two threads, the skewed layer,
  // fraction of the read rate, medians of 7 - 11 alternations in one process: int8 T = 1 / 8 0.84
  // / 0.84 -> 0.90 - 0.92 / 0.90 in the slow memory state, 0.46 - 0.52 / 0.54 - 0.56 -> 0.57 -
  // 0.60 / 0.64 - 0.66 in the fast; the same made bf16 6 - 15% and fp32 10 - 23% slower in the
  // fast state (fp32 T = 1 0.92 - 0.97 -> 0.72 - 0.80).
  static constexpr bool kFarPrefetch = true;
  using Acc = __m256i;
  struct Weights {
    __m256i magnitude, sign;  // |w| and w (stored offset binary, w + 128)
  };
  using Input = __m256i;
  static Acc Zero() { return _mm256_setzero_si256(); }
  static Weights Prepare(__m256i stored) {
    const __m256i w = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));
    return {_mm256_abs_epi8(w), w};
  }
  static Input Broadcast(const uint8_t* row, int64_t g) { return BroadcastGroup(row + 4 * g); }
  static Acc MultiplyAdd(Acc acc, const Weights& w, const Input& x) {
    const __m256i pairs = _mm256_maddubs_epi16(w.magnitude, _mm256_sign_epi8(x, w.sign));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static __m256 Finish(const TileArgs& a, const uint8_t* row, int64_t block, int half, Acc acc) {
    const float act_scale = LoadFloat(row + RoundUp(a.weights->cols, 32));
    const __m256 weight_scales =
        _mm256_loadu_ps(reinterpret_cast<const float*>(a.weights->scales.data()) + block * kLanes + half * 8);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(weight_scales, _mm256_set1_ps(act_scale)));
  }
};

// R rows x B blocks of one interleaved group, over input groups [g_begin, g_end): the accumulators
// start from `state` and go back to it (RunDenseTiles zeroes and finishes them). Each tile
// prefetches its own blocks' lines into L2: over the whole group (one stream) a little ahead; over
// part of it a chunk ahead, so that the memory does not idle while the tiles over the group's other
// blocks run. The step is a lambda after the prefetches: written as one loop body (or with a branch
// on whether to prefetch), GCC 12 stored every accumulator to the stack on every step (fp32 at 4
// rows: 6 GB/s).
template <class Dot, int R, int B>
void DenseTile(const TileArgs& a, int64_t g_begin, int64_t g_end, typename Dot::Acc* state) {
  const PackedMatrix& m = *a.weights;
  const int64_t groups = m.cols * Dot::kValueBytes / 4;
  const InterleavedGroup group = InterleavedGroupOf(a.block, m.rows / kLanes);
  const uint8_t* w = m.values.data() + (group.first * groups + (a.block - group.first)) * 64;
  const int64_t stride = group.count * 64;  // between a block's vectors
  const int64_t ahead = (B == group.count ? kStreamPrefetchSteps : kChunkGroups) * stride;
  typename Dot::Acc acc[R][B][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j)
      for (int h = 0; h < 2; ++h) acc[r][j][h] = state[(r * kStateBlocks + j) * 2 + h];
  auto step = [&](int64_t g) __attribute__((always_inline)) {
    for (int j = 0; j < B; ++j) {
      const typename Dot::Weights half0 = Dot::Prepare(Load256(w + g * stride + 64 * j));
      const typename Dot::Weights half1 = Dot::Prepare(Load256(w + g * stride + 64 * j + 32));
      for (int r = 0; r < R; ++r) {
        const typename Dot::Input x = Dot::Broadcast(a.acts + r * a.act_stride, g);
        acc[r][j][0] = Dot::MultiplyAdd(acc[r][j][0], half0, x);
        acc[r][j][1] = Dot::MultiplyAdd(acc[r][j][1], half1, x);
      }
    }
  };
  // In a call of one batch of rows, each line a second time, farther ahead: a tile over part of the
  // group a chunk further, one over the whole group kFarPrefetchSteps times as far where
  // Dot::kFarPrefetch (0: not at all). AVX2 forced on Zen 4, two threads, fraction of
  // the read rate, medians of 7 alternations in one process: the second prefetch of the partial
  // tiles, every expert at 2 / 3 rows, fp32 0.65 - 0.70 -> 0.87 - 0.95 / 0.57 - 0.79 -> 0.77 -
  // 0.88, bf16 0.76 - 0.86 -> 0.84 - 0.94 / 0.68 - 0.87 -> 0.79 - 0.96, int8 0.61 - 0.82 -> 0.83 -
  // 0.95 / 0.59 - 0.90 -> 0.60 - 0.94; the skewed layer at T = 16 / 64, fp32 0.77 / 0.62 -> 0.92 -
  // 0.93 / 0.76 - 0.81 (fast memory state), bf16 0.88 / 0.81 -> 0.94 / 0.87 (slow), int8 T = 8 /
  // 16 / 64 +1 - 4% / +0 - 9% / +0 - 2%. Over more rows (T = 256 and 1024) it cost 1 - 3%: later
  // batches read the weights again from cache.
  int64_t far = 0;
  if (a.prefetch_twice) far = B < group.count ? 2 * ahead : Dot::kFarPrefetch ? kFarPrefetchSteps * ahead : 0;
  for (int64_t g = g_begin; g < g_end; ++g) {
    for (int j = 0; j < B; ++j) Prefetch(w + g * stride + ahead + 64 * j);
    if (far != 0)
      for (int j = 0; j < B; ++j) Prefetch(w + g * stride + far + 64 * j);
    step(g);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j)
      for (int h = 0; h < 2; ++h) state[(r * kStateBlocks + j) * 2 + h] = acc[r][j][h];
}

// ---- 4-bit (nvfp4, mxfp4) ----

// 4-bit activation row: FourBitCorrectionOffset and FourBitScaleOffset (kernels/kernel.h), as the
// AVX-512 kernels'.

template <WeightFormat kFormat>
struct FourBit {
  static constexpr int kScaleBlock = kFormat == WeightFormat::kNvfp4 ? 16 : 32;
  static constexpr int kMaxRows = 3;
  static int64_t ScaleOffset(int64_t cols) { return FourBitScaleOffset(cols, kScaleBlock); }
  // What LaneScales' values are multiplied by to give the block scales.
  static constexpr float kScaleFactor = kFormat == WeightFormat::kNvfp4 ? 0x1p120f : 1.0f;

  // kE2m1TwicePlus12 in both 16-byte lanes (VPSHUFB looks up within a lane).
  static __m256i Table() {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1TwicePlus12)));
  }

  // The 8 channels' scales of half `half` of one scale block (codes at `codes`) as fp32, as the
  // AVX-512 kernels decode them: nvfp4 E4M3 bits placed as fp32 (times 2^-120, kScaleFactor),
  // mxfp4 E8M0 as the fp32 exponent.
  static __m256 LaneScales(const uint8_t* codes) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, kFormat == WeightFormat::kNvfp4 ? 20 : 23));
  }

  template <int R>
  static void Tile(const TileArgs& a) {
    const PackedMatrix& m = *a.weights;
    const int64_t chunks = m.cols / 16, scale_blocks = m.cols / kScaleBlock;
    const uint8_t* w = m.values.data() + a.block * chunks * 128;
    const uint8_t* s = m.scales.data() + a.block * scale_blocks * kLanes;
    const __m256i table = Table(), low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < scale_blocks; ++sb) {
      const uint8_t* codes = w + sb * (kScaleBlock / 16) * 128;
      if (a.stream) {
        // Each line twice, the second time twice as far ahead, as the AVX-512 4-bit tiles do
        // (measured with AVX2 forced on Zen 4, two threads, the skewed layer, fraction
        // of the read rate, medians of 5 - 11 alternations in one process: nvfp4 T = 1 / 8 0.85 -
        // 0.90 / 0.89 - 0.91 -> 0.92 - 0.97 / 0.93 - 0.94 in the slow memory state and 0.54 ->
        // 0.66 at T = 1 in the fast; mxfp4 T = 1 / 8 0.52 - 0.54 / 0.57 - 0.58 -> 0.70 - 0.73 /
        // 0.69 - 0.70 fast, 0.82 - 0.89 -> 0.90 - 0.94 slow; T = 64 +1 - 6%).
        for (int64_t line = 0; line < kScaleBlock / 16 * 128; line += 64) {
          Prefetch(codes + kPrefetchBytes + line);
          Prefetch(codes + 2 * kPrefetchBytes + line);
        }
        if (sb % 4 == 0) Prefetch(s + (sb + kPrefetchBytes / (kScaleBlock * 8)) * kLanes);
      }
      for (int h = 0; h < 2; ++h) {
        __m256i sum[R];
        for (int r = 0; r < R; ++r)
          sum[r] = _mm256_set1_epi32(LoadInt32(a.acts + r * a.act_stride + FourBitCorrectionOffset(m.cols) + 4 * sb));
        for (int chunk = 0; chunk < kScaleBlock / 16; ++chunk) {
          // Input groups 0 and 1 of the chunk in the low and high nibbles of its first 64 bytes, 2
          // and 3 in the second; channels 8h..8h+7 in the h-th 32 bytes of each.
          const __m256i p0 = Load256(codes + chunk * 128 + 32 * h), p1 = Load256(codes + chunk * 128 + 64 + 32 * h);
          const __m256i v[4] = {_mm256_shuffle_epi8(table, _mm256_and_si256(p0, low_nibbles)),
                                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(p0, 4), low_nibbles)),
                                _mm256_shuffle_epi8(table, _mm256_and_si256(p1, low_nibbles)),
                                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(p1, 4), low_nibbles))};
          const int64_t c = (sb * (kScaleBlock / 16) + chunk) * 16;
          for (int r = 0; r < R; ++r) {
            const uint8_t* row = a.acts + r * a.act_stride + c;
            // 16 inputs in 16 bits: each pair sum is at most 2 x 24 x 127, four of them 24,384.
            __m256i pairs = _mm256_maddubs_epi16(v[0], BroadcastGroup(row));
            for (int i = 1; i < 4; ++i)
              pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[i], BroadcastGroup(row + 4 * i)));
            sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(pairs, ones));
          }
        }
        const __m256 scale = LaneScales(s + sb * kLanes + 8 * h);
        for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), scale, acc[r][h]);
      }
    }
    // The lookup table doubled the values: halve here, with the activation, tensor and lane scale
    // factors (acc first, small by kScaleFactor, so that factor * kScaleFactor cannot overflow).
    const float tensor = kFormat == WeightFormat::kNvfp4 ? m.tensor_scale : 1.0f;
    for (int r = 0; r < R; ++r) {
      const float act_scale = LoadFloat(a.acts + r * a.act_stride + ScaleOffset(m.cols));
      const __m256 factor = _mm256_set1_ps(0.5f * act_scale * tensor);
      for (int h = 0; h < 2; ++h)
        StoreOutput(a.out + r * a.out_stride + 8 * h,
                    _mm256_mul_ps(_mm256_mul_ps(acc[r][h], _mm256_set1_ps(kScaleFactor)), factor), a.streamed_outputs);
    }
  }
};

// Runs the 4-bit tiles for channel blocks [block_begin, block_end), every row, in row tiles of up
// to kMaxRows: a block's first row tile streams its weights, the others read them from cache.
template <int kMaxRows, class TileFn>
void RunFourBitTiles(TileArgs base, int64_t block_begin, int64_t block_end, int64_t rows, TileFn tile) {
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      TileArgs a = base;
      a.block = b;
      a.acts = base.acts + r * base.act_stride;
      a.out = base.out + r * base.out_stride + (b - block_begin) * kLanes;
      a.stream = r == 0;
      tile(a, static_cast<int>(std::min<int64_t>(kMaxRows, rows - r)));
    }
  }
}

// Runs the dense tiles for channel blocks [block_begin, block_end), every row: group by group, in
// batches of up to kBatchRows rows, chunk of input groups by chunk: row tiles of up to
// Dot::kMaxRows rows, each over as many of the group's blocks as its registers allow (1 row: 4, the
// whole group as one stream; 2 rows: 2; more: 1), their accumulators kept in `state` across chunks.
// The tiles over a chunk read it from L1 after the first has brought it in. (Tiles that each ran
// over a whole group, one after another, read it at half the speed of one stream, fp32 at 2 rows:
// 16 against 31 GB/s, one thread.)
template <class Dot>
void RunDenseTiles(const TileArgs& base, int64_t block_begin, int64_t block_end, int64_t rows) {
  using Fn = void (*)(const TileArgs&, int64_t, int64_t, typename Dot::Acc*);
  static constexpr Fn kTiles[4][4] = {
      {&DenseTile<Dot, 1, 1>, &DenseTile<Dot, 1, 2>, &DenseTile<Dot, 1, 3>, &DenseTile<Dot, 1, 4>},
      {&DenseTile<Dot, 2, 1>, &DenseTile<Dot, 2, 2>, nullptr, nullptr},
      {&DenseTile<Dot, 3, 1>, nullptr, nullptr, nullptr},
      {&DenseTile<Dot, 4, 1>, nullptr, nullptr, nullptr}};
  static_assert(Dot::kMaxRows <= 4 && kStateBlocks == kInterleavedBlocks);
  const int64_t groups = base.weights->cols * Dot::kValueBytes / 4;
  typename Dot::Acc state[kBatchRows * kStateBlocks * 2];
  for (int64_t b = block_begin; b < block_end;) {
    const InterleavedGroup group = InterleavedGroupOf(b, base.weights->rows / kLanes);
    const int64_t end = std::min(block_end, group.first + group.count);
    for (int64_t batch = 0; batch < rows; batch += kBatchRows) {
      const int64_t batch_rows = std::min(kBatchRows, rows - batch);
      for (typename Dot::Acc& acc : state) acc = Dot::Zero();
      for (int64_t g = 0; g < groups; g += kChunkGroups) {
        for (int64_t r = 0; r < batch_rows; r += Dot::kMaxRows) {
          const int tile_rows = static_cast<int>(std::min<int64_t>(Dot::kMaxRows, batch_rows - r));
          const int64_t max_blocks = tile_rows == 1 ? 4 : tile_rows == 2 ? 2 : 1;
          for (int64_t j = b; j < end; j += max_blocks) {
            TileArgs a = base;
            a.block = j;
            a.acts = base.acts + (batch + r) * base.act_stride;
            kTiles[tile_rows - 1][std::min(max_blocks, end - j) - 1](a, g, std::min(groups, g + kChunkGroups),
                                                                     &state[(r * kStateBlocks + (j - b)) * 2]);
          }
        }
      }
      for (int64_t r = 0; r < batch_rows; ++r) {
        const uint8_t* row = base.acts + (batch + r) * base.act_stride;
        for (int64_t j = b; j < end; ++j)
          for (int h = 0; h < 2; ++h)
            StoreOutput(base.out + (batch + r) * base.out_stride + (j - block_begin) * kLanes + 8 * h,
                        Dot::Finish(base, row, j, h, state[(r * kStateBlocks + (j - b)) * 2 + h]),
                        base.streamed_outputs);
      }
    }
    b = end;
  }
}

// exp(x) for x <= 0 (kernels/cpu/exp_polynomial.h); 2^n built in the exponent field (n >= -126
// above kExpMin, a normal number).
inline __m256 ExpNonPositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x));
  __m256 p = _mm256_set1_ps(kExpCoefficients[0]);
  for (size_t i = 1; i < std::size(kExpCoefficients); ++i)
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpCoefficients[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

class Avx2Kernel final : public MatrixKernel {
 public:
  explicit Avx2Kernel(WeightFormat format) : format_(format) {}
  Isa isa() const override { return Isa::kAvx2; }
  WeightFormat format() const override { return format_; }
  PackLayout layout() const override { return PackLayout::kChannelBlocked; }
  bool SupportsSize(int64_t size) const override { return size % kLanes == 0 && size % BlockSize(format_) == 0; }
  int64_t channel_block() const override { return kLanes; }
  int64_t channel_tile() const override { return kLanes * kInterleavedBlocks; }

  int64_t ActivationBytes(int64_t cols) const override {
    switch (format_) {
      case WeightFormat::kFp32:
      case WeightFormat::kBf16: return cols * static_cast<int64_t>(sizeof(float));
      case WeightFormat::kInt8: return RoundUp(cols, 32) + 32;
      case WeightFormat::kNvfp4:
      case WeightFormat::kMxfp4: return RoundUp(FourBitScaleOffset(cols, BlockSize(format_)) + 4, 32);
    }
    return 0;
  }

  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    if (format_ == WeightFormat::kFp32 || format_ == WeightFormat::kBf16) {
      std::memcpy(out, x, cols * sizeof(float));
      return;
    }
    int8_t* q = reinterpret_cast<int8_t*>(out);
    const float scale = QuantizeRowInt8(x, cols, q);
    if (format_ == WeightFormat::kInt8) {
      std::memcpy(out + RoundUp(cols, 32), &scale, 4);
      return;
    }
    const int block = BlockSize(format_);
    FourBitCorrections(q, cols, block, out + FourBitCorrectionOffset(cols));
    std::memcpy(out + FourBitScaleOffset(cols, block), &scale, 4);
  }

  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride, OutputWrites writes) const override {
    const bool streamed = writes == OutputWrites::kStreamed;
    const TileArgs base{&w, 0, acts, ActivationBytes(w.cols), out, out_stride, false, streamed, rows <= kBatchRows};
    const FenceStreamedStores fence{streamed};
    const int64_t block_begin = n_begin / kLanes, block_end = n_end / kLanes;
    switch (format_) {
      case WeightFormat::kFp32: return RunDenseTiles<Fp32Dot>(base, block_begin, block_end, rows);
      case WeightFormat::kBf16: return RunDenseTiles<Bf16Dot>(base, block_begin, block_end, rows);
      case WeightFormat::kInt8: return RunDenseTiles<Int8Dot>(base, block_begin, block_end, rows);
      case WeightFormat::kNvfp4: return RunFourBit<WeightFormat::kNvfp4>(base, block_begin, block_end, rows);
      case WeightFormat::kMxfp4: return RunFourBit<WeightFormat::kMxfp4>(base, block_begin, block_end, rows);
    }
  }

  // As ActivateAvx512 (matrix_kernel_avx512.cc), 8 values at a time.
  void Activate(const float* gate, const float* up, const float* gate_bias, const float* up_bias, int64_t count,
                const GatedActivation& activation, float* out) const override {
    const __m256 one = _mm256_set1_ps(1.0f), sign_bit = _mm256_set1_ps(-0.0f), alpha = _mm256_set1_ps(activation.alpha);
    const __m256 limit = _mm256_set1_ps(activation.limit), negative_limit = _mm256_set1_ps(-activation.limit);
    const __m256 up_offset = _mm256_set1_ps(activation.up_offset);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
      __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
      if (gate_bias != nullptr) g = _mm256_add_ps(g, _mm256_loadu_ps(gate_bias + i));
      if (up_bias != nullptr) u = _mm256_add_ps(u, _mm256_loadu_ps(up_bias + i));
      g = _mm256_min_ps(limit, g);
      u = _mm256_min_ps(limit, _mm256_max_ps(negative_limit, u));
      const __m256 a = _mm256_mul_ps(alpha, g);
      const __m256 e = ExpNonPositive(_mm256_or_ps(a, sign_bit));        // exp(-|a|)
      const __m256 inverse = _mm256_div_ps(one, _mm256_add_ps(one, e));  // sigmoid(|a|)
      const __m256 negative = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
      const __m256 sigmoid = _mm256_blendv_ps(inverse, _mm256_mul_ps(inverse, e), negative);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_add_ps(u, up_offset)));
    }
    // The last few, in scalar.
    MatrixKernel::Activate(gate + i, up + i, gate_bias != nullptr ? gate_bias + i : nullptr,
                           up_bias != nullptr ? up_bias + i : nullptr, count - i, activation, out + i);
  }

 private:
  template <WeightFormat kFormat>
  static void RunFourBit(const TileArgs& base, int64_t block_begin, int64_t block_end, int64_t rows) {
    using Ops = FourBit<kFormat>;
    RunFourBitTiles<Ops::kMaxRows>(base, block_begin, block_end, rows, [](const TileArgs& a, int tile_rows) {
      switch (tile_rows) {
        case 1: return Ops::template Tile<1>(a);
        case 2: return Ops::template Tile<2>(a);
        default: return Ops::template Tile<3>(a);
      }
    });
  }

  WeightFormat format_;
};

}  // namespace

std::unique_ptr<MatrixKernel> MakeAvx2Kernel(WeightFormat format) {
  return std::make_unique<Avx2Kernel>(format);
}

}  // namespace epmoe::kernels
