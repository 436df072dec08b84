// The AVX-512 matrix kernels (needs F, BW, VL, DQ, VNNI, BF16 and VBMI; see epmoe/cpu.h), on weights
// in PackLayout::kChannelBlocked: 16 output channels per block, one per 32-bit lane, so a lane
// accumulates one output and no horizontal sums are needed. Each step multiplies one 64-byte
// weight vector (one input group of 16 channels) by the same input group of an activation row,
// broadcast to every lane:
//   fp32   fp32 activations, FMA.
//   bf16   activations rounded to bf16, VDPBF16PS.
//   int8   activations quantized to int8 per row (scale max|x|/127); weights stored offset binary
//          (w + 128, VPDPBUSD's unsigned operand); the offset is removed with -128 * sum(q) per row.
//   nvfp4, mxfp4  the same int8 activations; VPERMB maps an E2M1 code to 2 * value + 12 (0..24,
//          unsigned); the offset is removed with -12 * (sum of the scale block's activations) per
//          row; each scale block (16 or 32 inputs) is summed in int32, then scaled per lane by its
//          channel's block scale in fp32 (an FMA; mxfp4 prefill: VSCALEFPS by the scale's exponent
//          and an add, off the VPDPBUSD pipes).
// A register tile of R rows x B channel blocks takes B weight loads and R broadcasts for R x B
// multiply-adds. Decode (few rows) streams every weight vector from memory once: fp32, bf16 and
// int8 tiles span one interleaved group of 4 blocks, one sequential stream; the 4-bit tiles read
// their blocks as parallel streams. Prefill runs taller tiles over weights that stay in L2 (4-bit
// weights are expanded to int8 once per panel of channels, by the panel's first row tile as it
// streams them, then shared by the other row tiles).
// GCC 12 reports its own AVX-512 intrinsics (_mm512_undefined_* inside shuffles and extracts) as
// "used uninitialized" once inlined at -O3; the values are never read. Silence only that check.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cpu/exp_polynomial.h"
#include "kernels/cpu/streamed_stores.h"
#include "kernels/kernel.h"

namespace epmoe::kernels {
namespace {

constexpr int64_t kLanes = 16;  // output channels per block
// Rows up to which MatMul streams the weights once with short tiles; more rows run taller tiles.
constexpr int64_t kStreamRows = 4;
// How far ahead of its loads a 4-bit streaming tile prefetches each weight stream into L2. One
// thread alone needs 4 KB (1 KB into L1 read 16 GB/s, 4 KB into L2 24). Two threads, each near the
// most one core reads (30 - 36 GB/s, which the memory's fast state asks of both: 55 - 63 GB/s
// together), need more: the layer in the fast state, medians of alternated runs, nvfp4 T = 1 / 8 /
// 16: 2 KB 0.60 / 0.66 / 0.65 of the bound, 4 KB 0.72 - 0.73 / 0.79 - 0.81 / 0.74 - 0.80, 8 KB 0.74
// - 0.80 / 0.79 - 0.86 / 0.78 - 0.84, 12 and 16 KB 0.70 - 0.80; in the slow state all level.
constexpr int64_t kPrefetchBytes = 8192;

// The 4-byte input group at `at`, broadcast to all 16 lanes.
inline __m512i BroadcastGroup(const uint8_t* at) {
  int32_t group;
  std::memcpy(&group, at, 4);
  return _mm512_set1_epi32(group);
}

// The 4-bit streaming tiles prefetch each stream twice: kPrefetchBytes ahead into L2 and this far
// ahead into L1 (one thread from memory, 1 / 2 / 4 rows, medians of 4 alternated runs: nvfp4 +8 /
// +18 / +6%, mxfp4 +14 / +7 / +8% against the L2 prefetch alone; 256 B or 1 KB ahead: less). A
// single prefetch into L1 4 KB ahead was slower than into L2 (nvfp4 1 row 19 against 23 GB/s).
constexpr int64_t kFourBitL1PrefetchBytes = 512;

// How far ahead the dense streaming tiles (one stream of interleaved blocks) prefetch into L2, and
// in tiles of up to how many rows: taller tiles read faster with the hardware prefetchers alone.
// Two threads, every expert with the same rows, the memory's fast state (60 - 66 GB/s; the slow
// state level within 2%), fraction of the read rate measured just before each run, medians of 5
// runs of the variants alternated in one process, int8 at 1 / 2 / 3 / 4 / 5 / 6 rows:
//   1 KB ahead at every height                     0.86 / 0.83 / 0.78 / 0.72 / 0.69 / 0.66
//   2 KB ahead                                      0.90 / 0.83 / 0.79 / 0.71 / 0.60 / 0.46
//   none                                            0.86 / 0.83 / 0.82 / 0.77 / 0.73 / 0.69
// (4 - 16 KB, in other runs, slower at 1 - 5 rows). fp32 and bf16 at 4 - 6 rows gain as int8 (fp32
// 6 rows 0.74 -> 0.83). Why a prefetch that is neither just ahead nor far ahead slows a tile with
// this much arithmetic per line is not known (no hardware counters in this VM). The 4-bit tiles,
// which read their blocks as separate streams, were 18 - 36% slower at 4 - 8 rows with the
// hardware prefetchers alone.
constexpr int64_t kDensePrefetchBytes = 2048, kDensePrefetchMaxRows = 2;

// Where a 4-bit streaming tile prefetches: `ahead` bytes past its current position in the first of
// the B contiguous blocks (each `block_bytes`) that start at `tile`; block j's stream prefetches
// that address + j * block_bytes. Past the end of its block, stream j prefetches the start of block
// j of the next tile, so every stream of the next tile starts warm (prefetching past the end of the
// matrix is harmless: a prefetch never faults). Taken once per step for all B streams: computed per
// stream, GCC kept the comparison as a branch per prefetch (one thread over cached weights, 1 - 3
// rows: nvfp4 2%, mxfp4 3 - 4% faster; the layer from memory level).
inline const uint8_t* StreamAhead(const uint8_t* tile, int blocks, int64_t block_bytes, int64_t ahead) {
  return tile + ahead + (ahead >= block_bytes ? (blocks - 1) * block_bytes : 0);
}

// Always inlined: as a plain inline function, GCC 12 counted it as a call and compiled the dense
// tiles' loops differently (a third as many prefetch instructions in the object).
inline __attribute__((always_inline)) void PrefetchL2(const uint8_t* at) {
  _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
}

// acc + the lane-wise sums of 4 products of unsigned w and signed x bytes (VPDPBUSD). Written in
// assembly because GCC 12 copies the intrinsic's accumulator before and after every instruction,
// which with a tile's 24 accumulators spills them to the stack on every iteration (half speed).
inline __m512i DotAdd(__m512i acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

// Where a tile reads and writes.
struct TileArgs {
  const PackedMatrix* weights;
  int64_t block;          // first channel block of the tile
  const uint8_t* acts;    // first activation row of the tile
  int64_t act_stride;     // bytes between activation rows
  float* out;             // output of (first row, first channel of the tile)
  int64_t out_stride;     // floats between output rows
  bool streamed_outputs;  // MatMul's OutputWrites::kStreamed (StoreOutput)
  // 4-bit prefill: the panel's weights expanded to int8 in the kChannelBlocked arrangement, and
  // their block scale factors as fp32 (FourBit::LaneFactors), starting at channel block
  // `panel_block`.
  uint8_t* expanded = nullptr;
  float* expanded_scales = nullptr;
  int64_t panel_block = 0;
  // 4-bit prefill: cache lines for the tile to prefetch into L2, spread over its scale blocks (the
  // next panel's weights, so that the row tile that expands it does not wait for memory).
  const uint8_t* prefetch = nullptr;
  int64_t prefetch_lines = 0;
};

using TileFn = void (*)(const TileArgs&);

// Writes 16 outputs at `to`: with `streamed`, a non-temporal store where they are a whole aligned
// cache line (MatrixKernel::MatMul, OutputWrites::kStreamed).
inline void StoreOutput(float* to, __m512 v, bool streamed) {
  if (streamed && reinterpret_cast<uintptr_t>(to) % 64 == 0) {
    _mm512_stream_ps(to, v);
  } else {
    _mm512_storeu_ps(to, v);
  }
}

// The shortest row tile RunTiles makes for `fewest_rows` to `most_rows` rows in tiles of up to
// `max_rows`. (From max_rows x (max_rows - 1) rows on, every tile has at least max_rows - 1 rows,
// which a count below that already gives.)
constexpr int ShortestRowTile(int fewest_rows, int most_rows, int max_rows) {
  int shortest = max_rows;
  for (int rows = fewest_rows; rows <= std::min(most_rows, fewest_rows + max_rows * max_rows); ++rows)
    shortest = std::min(shortest, rows / ((rows + max_rows - 1) / max_rows));
  return shortest;
}

// The tiles of kShortest to kMaxRows rows and 1 to kMaxBlocks blocks, by (rows - kShortest) x
// kMaxBlocks + blocks - 1: only the heights a call can use are compiled.
template <template <int, int> class Tile, int kShortest, int kMaxRows, int kMaxBlocks>
struct TileTable {
  static constexpr int kHeights = kMaxRows - kShortest + 1;
  template <int... I>
  static constexpr std::array<TileFn, sizeof...(I)> Make(std::integer_sequence<int, I...>) {
    return {&Tile<kShortest + I / kMaxBlocks, I % kMaxBlocks + 1>::Run...};
  }
  static constexpr std::array<TileFn, kHeights* kMaxBlocks> kTable =
      Make(std::make_integer_sequence<int, kHeights * kMaxBlocks>{});
};

// Runs channel blocks [block_begin, block_end) for `rows` (none, or kFewestRows to kMostRows) rows
// in tiles of up to kMaxRows x kMaxBlocks: a column of row tiles per group of blocks, so each
// group's weights are read from memory by the first row tile and from cache by the others. `base`
// points at block_begin, row 0; its prefetch lines are shared out among the tiles in order.
template <template <int, int> class Tile, int kFewestRows, int kMaxRows, int kMaxBlocks,
          int kMostRows = std::numeric_limits<int>::max()>
void RunTiles(const TileArgs& base, int64_t block_begin, int64_t block_end, int64_t rows) {
  constexpr int kShortest = ShortestRowTile(kFewestRows, kMostRows, kMaxRows);
  EPMOE_CHECK(rows == 0 || (rows >= kFewestRows && rows <= kMostRows));
  // Row tiles of even height, the first rows % row_tiles one row taller (8 rows: 4 + 4, not 6 + 2;
  // 43 rows in tiles of up to 8: 8 + 5 x 7, not 5 x 8 + 3), so that no tile is much shorter than
  // the others (kernels_matmul_bench BM_MatMulCached, int8 at 8 rows: 392 -> 428 GOP/s; the VNNI
  // peak of one core is 468).
  const int64_t row_tiles = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t tiles = (block_end - block_begin + kMaxBlocks - 1) / kMaxBlocks * row_tiles;
  const int64_t lines_per_tile = tiles > 0 ? (base.prefetch_lines + tiles - 1) / tiles : 0;
  int64_t prefetched = 0;
  // One copy of `base` for all tiles, its fields then set one by one: a fresh copy per tile was
  // written field by field and read back as whole vectors, which waited for the writes to complete
  // (a failed store forward, ~3% of the skewed T = 256 nvfp4 layer's time, one thread).
  TileArgs a = base;
  for (int64_t b = block_begin; b < block_end; b += kMaxBlocks) {
    const int blocks = static_cast<int>(std::min<int64_t>(kMaxBlocks, block_end - b));
    int64_t r = 0;
    for (int64_t t = 0; t < row_tiles; ++t) {
      const int tile_rows = static_cast<int>(rows / row_tiles + (t < rows % row_tiles ? 1 : 0));
      a.block = b;
      a.acts = base.acts + r * base.act_stride;
      a.out = base.out + r * base.out_stride + (b - block_begin) * kLanes;
      a.prefetch = base.prefetch + prefetched * 64;
      a.prefetch_lines = std::min(lines_per_tile, base.prefetch_lines - prefetched);
      prefetched += a.prefetch_lines;
      TileTable<Tile, kShortest, kMaxRows, kMaxBlocks>::kTable[(tile_rows - kShortest) * kMaxBlocks + (blocks - 1)](a);
      r += tile_rows;
    }
  }
}

// ---- int8 activations, shared by the int8 and 4-bit kernels ----

// Symmetric per-row quantization: returns the scale (1 for an all-zero row) and writes q (cols a
// multiple of 16).
float QuantizeRowInt8(const float* x, int64_t cols, int8_t* q) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + c)));
  const float max = _mm512_reduce_max_ps(amax);
  const float scale = max > 0 ? max / 127.0f : 1.0f;
  const __m512 inverse = _mm512_set1_ps(1.0f / scale);
  for (int64_t c = 0; c < cols; c += 16) {
    // Round to nearest even, as std::nearbyint; |x| / scale <= 127 so no clamping is needed beyond
    // the saturating narrowing.
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c), _mm512_cvtsepi32_epi8(v));
  }
  return scale;
}

// Sum of `count` int8 values (count a multiple of 16). VPSADBW sums 8 bytes at a time, taken
// unsigned (q + 128: the sign bit flipped).
int32_t SumInt8(const int8_t* q, int64_t count) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i eights = _mm512_setzero_si512();
  int64_t c = 0;
  for (; c + 64 <= count; c += 64)
    eights = _mm512_add_epi64(
        eights, _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(q + c), flip), _mm512_setzero_si512()));
  int64_t sum = _mm512_reduce_add_epi64(eights);
  for (; c < count; c += 16) {
    const __m128i tail = _mm_sad_epu8(
        _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c)), _mm512_castsi512_si128(flip)),
        _mm_setzero_si128());
    sum += _mm_cvtsi128_si64(tail) + _mm_extract_epi64(tail, 1);
  }
  return static_cast<int32_t>(sum - 128 * count);
}

// The 4-bit kernels' offset corrections: -12 x the sum of each `block` (16 or 32) values of q
// (cols a multiple of block), written as int32 from `out` on. VPSADBW sums 8 bytes at a time, taken
// unsigned, as SumInt8; the 16-byte sums are then gathered four to a vector.
// Summed block by block (a widening, an add and a horizontal reduction each), nvfp4's row of 2,048
// took as long as quantizing it (BM_QuantizeActivations: 418 ns a row against int8's 193).
void FourBitCorrections(const int8_t* q, int64_t cols, int block, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m128i offset = _mm_set1_epi32(16 * 128), factor = _mm_set1_epi32(-12);
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    const __m512i eights = _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(q + c), flip), _mm512_setzero_si512());
    // Each 16-byte sum in the low 32 bits of its 128-bit lane, then the four lanes' sums together.
    const __m512i sixteens = _mm512_add_epi64(eights, _mm512_shuffle_epi32(eights, _MM_PERM_BADC));
    __m128i sums = _mm_sub_epi32(_mm512_castsi512_si128(_mm512_maskz_compress_epi32(0x1111, sixteens)), offset);
    if (block == 32) {
      sums = _mm_hadd_epi32(sums, sums);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c / 8), _mm_mullo_epi32(sums, factor));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c / 4), _mm_mullo_epi32(sums, factor));
    }
  }
  for (; c < cols; c += block) {
    const int32_t correction = -12 * SumInt8(q + c, block);
    std::memcpy(out + c / block * 4, &correction, 4);
  }
}

// ---- fp32, bf16 and int8: one tile over all input groups ----

// What differs between the three: the multiply-add and how an accumulator becomes 16 outputs.
struct Fp32Dot {
  using Acc = __m512;
  static constexpr int kValueBytes = 4;
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc MultiplyAdd(Acc acc, __m512i w, __m512i x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
  }
  static __m512 Finish(const TileArgs&, const uint8_t*, int, Acc acc) { return acc; }
};

struct Bf16Dot {
  using Acc = __m512;
  static constexpr int kValueBytes = 2;
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc MultiplyAdd(Acc acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  static __m512 Finish(const TileArgs&, const uint8_t*, int, Acc acc) { return acc; }
};

// int8 activation row: cols int8 values, padded to 64 bytes, then the fp32 scale and the int32
// -128 * sum(q).
struct Int8Dot {
  using Acc = __m512i;
  static constexpr int kValueBytes = 1;
  static Acc Zero() { return _mm512_setzero_si512(); }
  static Acc MultiplyAdd(Acc acc, __m512i w, __m512i x) { return DotAdd(acc, w, x); }
  static __m512 Finish(const TileArgs& a, const uint8_t* row, int block, Acc acc) {
    const int64_t tail = RoundUp(a.weights->cols, 64);
    const __m512i dot = _mm512_add_epi32(acc, _mm512_set1_epi32(LoadInt32(row + tail + 4)));
    const __m512 weight_scales =
        _mm512_loadu_ps(reinterpret_cast<const float*>(a.weights->scales.data()) + (a.block + block) * kLanes);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(weight_scales, _mm512_set1_ps(LoadFloat(row + tail))));
  }
};

// The weight vectors of a tile's B channel blocks: block j's vector of input group g at
// first[j] + g * stride[j] (the stride is the size of the block's interleaved group: a tile may
// span two groups, and a matrix's last group may be short).
template <int B>
struct BlockVectors {
  const uint8_t* first[B];
  int64_t stride[B];
  // The tile covers exactly one interleaved group (the usual case): block j's vector of group g at
  // first[0] + (g * B + j) * 64, one contiguous run of bytes per range of input groups.
  bool whole_group = true;

  // `groups`: the matrix's input groups.
  BlockVectors(const TileArgs& a, int64_t groups) {
    const PackedMatrix& m = *a.weights;
    const int64_t blocks = m.rows / kLanes;
    for (int j = 0; j < B; ++j) {
      const InterleavedGroup group = InterleavedGroupOf(a.block + j, blocks);
      first[j] = m.values.data() + (group.first * groups + (a.block + j - group.first)) * 64;
      stride[j] = group.count * 64;
      whole_group = whole_group && stride[j] == B * 64 && first[j] == first[0] + j * 64;
    }
  }
};

template <class Dot, bool kStream, int R, int B>
struct DenseTile {
  using Acc = typename Dot::Acc;

  // acc += the products of input groups [g_begin, g_end) of the tile's blocks with R rows from
  // `acts`; meanwhile prefetches `lines` cache lines from `prefetch` into L2, spread over them.
  static void Accumulate(const BlockVectors<B>& v, const uint8_t* acts, int64_t act_stride, int64_t g_begin,
                         int64_t g_end, const uint8_t* prefetch, int64_t lines, Acc (&acc)[R][B]) {
    // Block j's vector of group g at address(j, g). Always inlined: GCC 12 made this a call of its
    // own for some tiles, which then kept the sums and weight vectors in memory (fp32, 1 row over
    // cached weights: 1.5 x the time).
    auto run = [&](auto address) __attribute__((always_inline)) {
      for (int64_t g = g_begin; g < g_end; ++g) {
        for (int64_t line = g - g_begin; line < lines; line += g_end - g_begin) PrefetchL2(prefetch + line * 64);
        __m512i wv[B];
        for (int j = 0; j < B; ++j) {
          const uint8_t* at = address(j, g);
          // A group is one stream, which runs on into the next group.
          if constexpr (kStream && R <= kDensePrefetchMaxRows) PrefetchL2(at + kDensePrefetchBytes);
          wv[j] = _mm512_loadu_si512(at);
          // Held in a register: without this GCC 12 loaded the vector again for every row of some
          // tiles (3 rows x 4 blocks: 12 loads for 12 multiply-adds; BM_MatMulCached, int8 at 3
          // rows: 324 -> 423 GOP/s).
          asm("" : "+v"(wv[j]));
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x = BroadcastGroup(acts + r * act_stride + 4 * g);
          for (int j = 0; j < B; ++j) acc[r][j] = Dot::MultiplyAdd(acc[r][j], wv[j], x);
        }
      }
    };
    // A whole group is addressed from one pointer with fixed offsets, which the cached tiles run
    // faster (192 rows: 0.95 - 0.96 of the time of per-block strides).
    if (v.whole_group) {
      run([&](int j, int64_t g) { return v.first[0] + (g * B + j) * 64; });
    } else {
      run([&](int j, int64_t g) { return v.first[j] + g * v.stride[j]; });
    }
  }

  // Accumulate as a call of its own on a local copy of the sums, which GCC then keeps in registers
  // through the loop: inlined into DensePairTile, or summing into `sums` itself, it kept them in
  // memory (2.5 - 3 x the time).
  [[gnu::noinline]] static void AccumulateApart(const BlockVectors<B>& v, const uint8_t* acts, int64_t act_stride,
                                                int64_t g_begin, int64_t g_end, const uint8_t* prefetch, int64_t lines,
                                                Acc (&sums)[R][B]) {
    Acc acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < B; ++j) acc[r][j] = sums[r][j];
    Accumulate(v, acts, act_stride, g_begin, g_end, prefetch, lines, acc);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < B; ++j) sums[r][j] = acc[r][j];
  }

  static void Zero(Acc (&acc)[R][B]) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < B; ++j) acc[r][j] = Dot::Zero();
  }

  // The R x B outputs at `out` (row r at out + r * a.out_stride) from the finished sums.
  static void Store(const TileArgs& a, const uint8_t* acts, float* out, const Acc (&acc)[R][B]) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = acts + r * a.act_stride;
      for (int j = 0; j < B; ++j)
        StoreOutput(out + r * a.out_stride + j * kLanes, Dot::Finish(a, row, j, acc[r][j]), a.streamed_outputs);
    }
  }

  // The tile over all input groups; its prefetch lines (the next group's weights,
  // DenseKernel::MatMul) spread over them.
  static void Run(const TileArgs& a) {
    const int64_t groups = a.weights->cols * Dot::kValueBytes / 4;
    const BlockVectors<B> v(a, groups);
    Acc acc[R][B];
    Zero(acc);
    Accumulate(v, a.acts, a.act_stride, 0, groups, a.prefetch, a.prefetch_lines, acc);
    Store(a, a.acts, a.out, acc);
  }
};

// Input groups per chunk of DenseChunkedTile: 16 KB of a whole group's weights, which stay in L1
// while its row tiles take it in turn.
constexpr int64_t kDenseChunkGroups = 64;

// One row tile's sums (an array member, so that a tuple can hold the row tiles' sums).
template <class Dot, int R, int B>
struct RowTileSums {
  typename Dot::Acc acc[R][B];
};

// Row tiles of Rs... rows over the same blocks (7 - 18 rows: more than one tile holds), taken
// chunk by chunk of input groups: each chunk's weights are read from memory by the first and from
// L1 by the others, while all of them prefetch the next chunk into L2, so the weights stream on
// while any of them computes. Run one after the other over the whole group, as they were, the
// memory waited while the others computed.
template <class Dot, int B, int... Rs>
struct DenseChunkedTile {
  static void Run(const TileArgs& a) { Run(a, std::make_index_sequence<sizeof...(Rs)>()); }

 private:
  template <size_t... I>
  static void Run(const TileArgs& a, std::index_sequence<I...>) {
    constexpr int kTiles = sizeof...(Rs);
    constexpr int kHeights[kTiles] = {Rs...};
    int64_t first_row[kTiles] = {};
    for (int t = 1; t < kTiles; ++t) first_row[t] = first_row[t - 1] + kHeights[t - 1];
    const int64_t groups = a.weights->cols * Dot::kValueBytes / 4;
    const BlockVectors<B> v(a, groups);
    std::tuple<RowTileSums<Dot, Rs, B>...> sums;
    (DenseTile<Dot, false, Rs, B>::Zero(std::get<I>(sums).acc), ...);
    for (int64_t g0 = 0; g0 < groups; g0 += kDenseChunkGroups) {
      const int64_t g1 = std::min(groups, g0 + kDenseChunkGroups);
      // The next chunk (after the last, the next group's first), contiguous in a whole group, its
      // lines shared out among the row tiles.
      const uint8_t* next = v.first[0] + g1 * B * 64;
      const int64_t lines = v.whole_group ? kDenseChunkGroups * B : 0;
      (DenseTile<Dot, false, Rs, B>::AccumulateApart(
           v, a.acts + first_row[I] * a.act_stride, a.act_stride, g0, g1, next + lines * I / kTiles * 64,
           lines * (I + 1) / kTiles - lines * I / kTiles, std::get<I>(sums).acc),
       ...);
    }
    (DenseTile<Dot, false, Rs, B>::Store(a, a.acts + first_row[I] * a.act_stride, a.out + first_row[I] * a.out_stride,
                                         std::get<I>(sums).acc),
     ...);
  }
};

template <class Dot>
struct DenseTiles {
  template <int R, int B>
  using Stream = DenseTile<Dot, true, R, B>;
  template <int R, int B>
  using Cached = DenseTile<Dot, false, R, B>;
  // R rows as two row tiles, the first one row taller when R is odd.
  template <int R, int B>
  using Pair = DenseChunkedTile<Dot, B, (R + 1) / 2, R / 2>;
  // R rows as three row tiles, the first ones one row taller where R is not a multiple of 3.
  template <int R, int B>
  using Triple = DenseChunkedTile<Dot, B, (R + 2) / 3, (R + 1) / 3, R / 3>;
};

// ---- the gated activation (SwiGLU) ----

// exp(x) for x <= 0 (kernels/cpu/exp_polynomial.h); 2^n by VSCALEFPS.
inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpCoefficients[0]);
  for (size_t i = 1; i < std::size(kExpCoefficients); ++i)
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpCoefficients[i]));
  return _mm512_scalef_ps(p, n);
}

// GatedActivation over whole vectors of 16 only: returns how many values it did. The sigmoid comes
// from exp(-|a|), a = alpha * g, so that nothing overflows. The clamps take the limit as their
// first operand: MINPS / MAXPS return the second when either is NaN, so a NaN passes through.
int64_t ActivateAvx512(const float* gate, const float* up, const float* gate_bias, const float* up_bias, int64_t count,
                       const GatedActivation& activation, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f), alpha = _mm512_set1_ps(activation.alpha);
  const __m512 limit = _mm512_set1_ps(activation.limit), negative_limit = _mm512_set1_ps(-activation.limit);
  const __m512 up_offset = _mm512_set1_ps(activation.up_offset);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m512 g = _mm512_loadu_ps(gate + i), u = _mm512_loadu_ps(up + i);
    if (gate_bias != nullptr) g = _mm512_add_ps(g, _mm512_loadu_ps(gate_bias + i));
    if (up_bias != nullptr) u = _mm512_add_ps(u, _mm512_loadu_ps(up_bias + i));
    g = _mm512_min_ps(limit, g);
    u = _mm512_min_ps(limit, _mm512_max_ps(negative_limit, u));
    const __m512 a = _mm512_mul_ps(alpha, g);
    const __m512 e = ExpNonPositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
    const __m512 inverse = _mm512_div_ps(one, _mm512_add_ps(one, e));  // sigmoid(|a|)
    const __mmask16 negative = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_mask_mul_ps(inverse, negative, inverse, e);  // a < 0: e / (1 + e)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_add_ps(u, up_offset)));
  }
  return i;
}

// What every AVX-512 kernel shares: the instruction set, the 16-channel-block layout and the
// activation.
template <WeightFormat kFormat>
class Avx512Kernel : public MatrixKernel {
 public:
  Isa isa() const override { return Isa::kAvx512; }
  WeightFormat format() const override { return kFormat; }
  PackLayout layout() const override { return PackLayout::kChannelBlocked; }
  int64_t channel_block() const override { return kLanes; }
  void Activate(const float* gate, const float* up, const float* gate_bias, const float* up_bias, int64_t count,
                const GatedActivation& activation, float* out) const override {
    const int64_t i = ActivateAvx512(gate, up, gate_bias, up_bias, count, activation, out);
    // The last few, in scalar.
    MatrixKernel::Activate(gate + i, up + i, gate_bias != nullptr ? gate_bias + i : nullptr,
                           up_bias != nullptr ? up_bias + i : nullptr, count - i, activation, out + i);
  }
};

// fp32, bf16 and int8 tiles span one interleaved group of blocks: up to kStreamRows rows, then 6
// rows (24 accumulators, 4 weight vectors and a broadcast): up to 18 rows in two or three row
// tiles that take the weights chunk by chunk as they stream, over cached weights above. The tile
// of 8 rows x 3 blocks used before the blocks were interleaved is as fast over cached weights
// (int8, 192 rows: 447 against 452 GOP/s), but streaming across groups of 4 it is slower (int8,
// one thread at 5 / 8 / 16 rows: 168 - 208 / 275 - 297 / 324 - 344 GOP/s against 311 - 319 / 331
// - 343 / 374 - 385).
constexpr int kDenseBlocks = static_cast<int>(kInterleavedBlocks), kDenseTallRows = 6;

template <class Dot, WeightFormat kFormat>
class DenseKernel final : public Avx512Kernel<kFormat> {
 public:
  bool SupportsSize(int64_t size) const override { return size % kLanes == 0; }
  int64_t channel_tile() const override { return kLanes * kDenseBlocks; }
  int64_t ActivationBytes(int64_t cols) const override {
    return RoundUp(cols * Dot::kValueBytes, 64) + (kFormat == WeightFormat::kInt8 ? 64 : 0);
  }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    if constexpr (kFormat == WeightFormat::kFp32) {
      std::memcpy(out, x, cols * sizeof(float));
    } else if constexpr (kFormat == WeightFormat::kBf16) {
      // Round to nearest even, as Bf16FromFloat; cols is a multiple of 16.
      int64_t c = 0;
      for (; c + 32 <= cols; c += 32) {
        const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c));
        _mm512_storeu_si512(out + 2 * c, (__m512i)pair);
      }
      if (c < cols) {
        const __m256bh last = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * c), (__m256i)last);
      }
    } else {
      int8_t* q = reinterpret_cast<int8_t*>(out);
      const float scale = QuantizeRowInt8(x, cols, q);
      const int32_t correction = -128 * SumInt8(q, cols);
      std::memcpy(out + RoundUp(cols, 64), &scale, 4);
      std::memcpy(out + RoundUp(cols, 64) + 4, &correction, 4);
    }
  }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride, OutputWrites writes) const override {
    EPMOE_CHECK(n_begin % kLanes == 0 && n_end % kLanes == 0);
    const bool streamed = writes == OutputWrites::kStreamed;
    const TileArgs base{&w, 0, acts, ActivationBytes(w.cols), out, out_stride, streamed};
    const FenceStreamedStores fence{streamed};
    const int64_t block_begin = n_begin / kLanes, block_end = n_end / kLanes;
    if (rows <= kStreamRows) {
      RunTiles<DenseTiles<Dot>::template Stream, 1, kStreamRows, kDenseBlocks>(base, block_begin, block_end, rows);
      return;
    }
    if (rows <= kDenseTallRows) {
      RunTiles<DenseTiles<Dot>::template Stream, kStreamRows + 1, kDenseTallRows, kDenseBlocks, kDenseTallRows>(
          base, block_begin, block_end, rows);
      return;
    }
    if (rows <= 2 * kDenseTallRows) {
      RunTiles<DenseTiles<Dot>::template Pair, kDenseTallRows + 1, 2 * kDenseTallRows, kDenseBlocks,
               2 * kDenseTallRows>(base, block_begin, block_end, rows);
      return;
    }
    // 13 - 18 rows: three row tiles chunk by chunk, which read the weights faster than three tiles
    // each over the whole group in turn (one thread from memory, BM_MatMul, int8 at 13 / 16 / 18
    // rows: 543 - 568 / 634 - 655 / 623 - 679 against 402 - 460 / 494 - 560 / 563 - 605 G op/s).
    // Four row tiles chunk by chunk for 19 - 24 rows were no faster than the groups below.
    if (rows <= 3 * kDenseTallRows) {
      RunTiles<DenseTiles<Dot>::template Triple, 2 * kDenseTallRows + 1, 3 * kDenseTallRows, kDenseBlocks,
               3 * kDenseTallRows>(base, block_begin, block_end, rows);
      return;
    }
    // Four or more row tiles per group of blocks: the first reads the group's weights from memory,
    // the others from cache. While they run they prefetch the next group's weights into L2 (past
    // n_end too, within the matrix: the next work item, which this thread is likely to take as
    // well), so that the next group's first row tile does not wait for memory either. The layer at
    // T = 256 and 1024 (medians of 4 - 6 alternated runs, slow memory state): bf16 0.705 -> 0.765
    // and 0.885 -> 0.905 of the roofline bound, int8 0.655 -> 0.695 and 0.81 -> 0.84; in the fast
    // state level. Over one or two row tiles the prefetches competed with the group's own stream
    // (T = 64, fast state: bf16 0.85 - 0.89 -> 0.75 - 0.78).
    const int64_t block_bytes = kLanes * w.row_bytes;
    const int64_t matrix_bytes = static_cast<int64_t>(w.values.size());
    for (int64_t b = block_begin; b < block_end; b += kDenseBlocks) {
      const int64_t blocks = std::min<int64_t>(kDenseBlocks, block_end - b);
      TileArgs group = base;
      group.out = out + (b - block_begin) * kLanes;
      const int64_t next = std::min((b + blocks) * block_bytes, matrix_bytes);
      group.prefetch = w.values.data() + next;
      group.prefetch_lines = std::min(kDenseBlocks * block_bytes, matrix_bytes - next) / 64;
      RunTiles<DenseTiles<Dot>::template Cached, 3 * kDenseTallRows + 1, kDenseTallRows, kDenseBlocks>(
          group, b, b + blocks, rows);
    }
  }
};

// ---- 4-bit (nvfp4, mxfp4) ----

// 4-bit activation row: FourBitCorrectionOffset and FourBitScaleOffset (kernels/kernel.h).

template <WeightFormat kFormat>
struct FourBit {
  static constexpr int kScaleBlock = kFormat == WeightFormat::kNvfp4 ? 16 : 32;  // inputs per block scale
  static constexpr int kGroupsPerScale = kScaleBlock / 4;
  // Scale blocks whose codes span kPrefetchBytes (128 code bytes per 16 inputs).
  static constexpr int64_t kScaleBlocksAhead = kPrefetchBytes / (128 * kScaleBlock / 16);

  static int64_t ScaleOffset(int64_t cols) { return FourBitScaleOffset(cols, kScaleBlock); }
  // What LaneScales' values are multiplied by to give the block scales.
  static constexpr float kScaleFactor = kFormat == WeightFormat::kNvfp4 ? 0x1p120f : 1.0f;

  // kE2m1TwicePlus12 repeated in each 16 bytes: VPERMB (AVX512_VBMI) then ignores index bits 4-5,
  // so neither nibble needs masking.
  static __m512i Table() {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1TwicePlus12)));
  }

  // The 4 int8 weight vectors (input groups 4i..4i+3 of 16 channels) of one 128-byte chunk, whose
  // two 64-byte halves are p0 and p1 (ExpandChunk: the chunk at `chunk`).
  __attribute__((target("avx512vbmi"))) static inline void ExpandRaw(__m512i p0, __m512i p1, __m512i table,
                                                                     __m512i (&v)[4]) {
    v[0] = _mm512_permutexvar_epi8(p0, table);
    v[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(p0, 4), table);
    v[2] = _mm512_permutexvar_epi8(p1, table);
    v[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(p1, 4), table);
  }
  __attribute__((target("avx512vbmi"))) static inline void ExpandChunk(const uint8_t* chunk, __m512i table,
                                                                       __m512i (&v)[4]) {
    ExpandRaw(_mm512_loadu_si512(chunk), _mm512_loadu_si512(chunk + 64), table, v);
  }

  // The 16 channels' scales of one scale block, as fp32 (lane c: channel c of the block).
  static inline __m512 LaneScales(const uint8_t* codes) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    if constexpr (kFormat == WeightFormat::kNvfp4) {
      // E4M3 (non-negative, never NaN here) -> fp32 times 2^-120 (kScaleFactor): the exponent and
      // mantissa bits placed as they are, so the exponent keeps E4M3's bias 7 instead of 127.
      // Subnormal codes come out exactly as fp32 subnormals, which FMA takes at full speed here.
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 20));
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 23));  // E8M0: the code is the fp32 exponent
    }
  }

  // Prefill: what ScaleAdd multiplies a scale block's sums by, for the 16 channels whose codes are
  // at `codes`: nvfp4 the scales (LaneScales); mxfp4 the scale exponents (code - 127) as fp32.
  static inline __m512 LaneFactors(const uint8_t* codes) {
    if constexpr (kFormat == WeightFormat::kMxfp4) {
      const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      return _mm512_cvtepi32_ps(_mm512_sub_epi32(wide, _mm512_set1_epi32(127)));
    } else {
      return LaneScales(codes);
    }
  }

  // Prefill: acc[r][j] += sum[r][j] (one scale block's int32 sums) times the block scales given by
  // `factors` (LaneFactors). mxfp4 scales by a power of two with VSCALEFPS and adds, which run
  // beside VPDPBUSD, where an FMA would take a VPDPBUSD's slot (Zen 4: prefill tile 8% faster); the
  // result is the same, scaling by a power of two being exact. nvfp4's scales are not powers of
  // two: an FMA. (The decode tiles keep the FMA for both: there the longer chain of conversion,
  // scaling and add cost more than the slot it frees.)
  template <int R, int B>
  static inline __attribute__((always_inline)) void ScaleAdd(__m512 factors, const __m512i (&sum)[R][B], int j,
                                                             __m512 (&acc)[R][B]) {
    for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(sum[r][j]);
      if constexpr (kFormat == WeightFormat::kMxfp4) {
        acc[r][j] = _mm512_add_ps(acc[r][j], _mm512_scalef_ps(dot, factors));
      } else {
        acc[r][j] = _mm512_fmadd_ps(dot, factors, acc[r][j]);
      }
    }
  }

  // Writes an R x B tile. The lookup table doubled the values: halve here, with the activation,
  // tensor and lane scale factors.
  template <int R, int B>
  static inline __attribute__((always_inline)) void StoreTile(const TileArgs& a, const __m512 (&acc)[R][B]) {
    const float tensor = kFormat == WeightFormat::kNvfp4 ? a.weights->tensor_scale : 1.0f;
    for (int r = 0; r < R; ++r) {
      const float act_scale = LoadFloat(a.acts + r * a.act_stride + ScaleOffset(a.weights->cols));
      const __m512 factor = _mm512_set1_ps(0.5f * act_scale * tensor);
      // acc first, which is small by kScaleFactor (so factor * kScaleFactor cannot overflow).
      for (int j = 0; j < B; ++j)
        StoreOutput(a.out + r * a.out_stride + j * kLanes,
                    _mm512_mul_ps(_mm512_mul_ps(acc[r][j], _mm512_set1_ps(kScaleFactor)), factor), a.streamed_outputs);
    }
  }

  // Decode: expands the weights in registers as they stream by, once for all R rows. With
  // kFillPanel (prefill), also writes what it expanded into the panel (TileArgs::expanded), for the
  // row tiles that follow.
  template <int R, int B, bool kFillPanel = false>
  struct StreamTile {
    __attribute__((target("avx512vbmi"))) static void Run(const TileArgs& a) {
      const PackedMatrix& m = *a.weights;
      const int64_t chunks = m.cols / 16, scale_blocks = m.cols / kScaleBlock, block_bytes = chunks * 128;
      const __m512i table = Table();
      const uint8_t* act[R];
      for (int r = 0; r < R; ++r) act[r] = a.acts + r * a.act_stride;
      const uint8_t* w[B];
      const uint8_t* s[B];
      for (int j = 0; j < B; ++j) {
        w[j] = m.values.data() + (a.block + j) * block_bytes;
        s[j] = m.scales.data() + (a.block + j) * scale_blocks * kLanes;
      }
      __m512 acc[R][B];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < B; ++j) acc[r][j] = _mm512_setzero_ps();
      // Each chunk's codes are loaded one chunk ahead, so that its expansion and dot products do not
      // wait for them (one thread from memory, 4 rows: mxfp4 15 - 25%, nvfp4 about 3% faster; nvfp4
      // 8 - 16 rows 3 - 6%). Not in mxfp4's tiles of 5 - 8 rows: with two chunks per scale block
      // in flight GCC spills their registers (18% slower).
      constexpr bool kLoadAhead = R <= 4 || kScaleBlock == 16;
      __m512i raw[B][2];
      if constexpr (kLoadAhead) {
        for (int j = 0; j < B; ++j) {
          raw[j][0] = _mm512_loadu_si512(w[j]);
          raw[j][1] = _mm512_loadu_si512(w[j] + 64);
        }
      }
      for (int64_t sb = 0; sb < scale_blocks; ++sb) {
        // Each block's scales are a second, smaller stream (16 bytes per scale block), too short
        // for the hardware prefetcher to pick up in time (2 KB a block at 2048 inputs): prefetched
        // as far ahead in time as the codes, once per cache line (one thread, the skewed T = 64
        // layer: nvfp4 about 4%, mxfp4 about 2% less time).
        if (sb % (64 / kLanes) == 0) {
          const int64_t scale_bytes = scale_blocks * kLanes;
          const uint8_t* ahead = StreamAhead(s[0], B, scale_bytes, (sb + kScaleBlocksAhead) * kLanes);
          for (int j = 0; j < B; ++j) PrefetchL2(ahead + j * scale_bytes);
        }
        __m512i sum[R][B];
        for (int r = 0; r < R; ++r) {
          const __m512i correction =
              _mm512_set1_epi32(LoadInt32(act[r] + FourBitCorrectionOffset(m.cols) + 4 * sb));
          for (int j = 0; j < B; ++j) sum[r][j] = correction;
        }
        for (int chunk = 0; chunk < kScaleBlock / 16; ++chunk) {
          const int64_t c = sb * (kScaleBlock / 16) + chunk;
          // The last chunk loads itself again rather than past the end of its block.
          const int64_t next = c + 1 < chunks ? c + 1 : c;
          __m512i v[B][4];
          const uint8_t* near = StreamAhead(w[0], B, block_bytes, c * 128 + kPrefetchBytes);
          const uint8_t* far = StreamAhead(w[0], B, block_bytes, c * 128 + 2 * kPrefetchBytes);
          for (int j = 0; j < B; ++j) {
            PrefetchL2(near + j * block_bytes);
            PrefetchL2(near + j * block_bytes + 64);
            // The short tiles (up to kStreamRows rows), which do the least arithmetic per byte,
            // prefetch each line again twice as far ahead. A single prefetch 16 KB ahead was level,
            // so it is the repetition that helps, as if the first were sometimes dropped (one
            // thread, BM_MatMul at 1 - 3 rows: nvfp4 +4 - 5%, mxfp4 +14 - 21%). The 4-row tile
            // gains too in the layer with two threads (every expert 4 rows, fraction of the read
            // rate: nvfp4 0.86 - 0.87 -> 0.90 - 0.91 in the memory's slow state, 0.55 -> 0.65 in
            // its fast one), though one thread alone measures it slower.
            if constexpr (R <= kStreamRows) {
              PrefetchL2(far + j * block_bytes);
              PrefetchL2(far + j * block_bytes + 64);
            }
            // And from L2 into L1 just ahead.
            _mm_prefetch(reinterpret_cast<const char*>(w[j] + c * 128 + kFourBitL1PrefetchBytes), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(w[j] + c * 128 + kFourBitL1PrefetchBytes + 64), _MM_HINT_T0);
            if constexpr (kLoadAhead) {
              ExpandRaw(raw[j][0], raw[j][1], table, v[j]);
              raw[j][0] = _mm512_loadu_si512(w[j] + next * 128);
              raw[j][1] = _mm512_loadu_si512(w[j] + next * 128 + 64);
            } else {
              ExpandChunk(w[j] + c * 128, table, v[j]);
            }
            if constexpr (kFillPanel) {
              uint8_t* to = a.expanded + ((a.block - a.panel_block + j) * chunks + c) * 4 * 64;
              for (int i = 0; i < 4; ++i) _mm512_storeu_si512(to + i * 64, v[j][i]);
            }
          }
          for (int r = 0; r < R; ++r) {
            for (int i = 0; i < 4; ++i) {
              const __m512i x = BroadcastGroup(act[r] + c * 16 + 4 * i);
              for (int j = 0; j < B; ++j) sum[r][j] = DotAdd(sum[r][j], v[j][i], x);
            }
          }
        }
        for (int j = 0; j < B; ++j) {
          const __m512 scale = LaneScales(s[j] + sb * kLanes);
          for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][j]), scale, acc[r][j]);
          if constexpr (kFillPanel) {
            _mm512_storeu_ps(a.expanded_scales + ((a.block - a.panel_block + j) * scale_blocks + sb) * kLanes,
                             LaneFactors(s[j] + sb * kLanes));
          }
        }
      }
      StoreTile<R, B>(a, acc);
    }
  };
  template <int R, int B>
  using PanelFillTile = StreamTile<R, B, true>;

  // Prefill tile over expanded weights: per scale block, R x B int32 sums, then a ScaleAdd each (a
  // conversion and an FMA; mxfp4: a conversion, a VSCALEFPS and an add).
  template <int R, int B>
  struct CachedTile {
    static void Run(const TileArgs& a) {
      const PackedMatrix& m = *a.weights;
      const int64_t groups = m.cols / 4, scale_blocks = m.cols / kScaleBlock;
      const int64_t first = a.block - a.panel_block;
      const uint8_t* w = a.expanded + first * groups * 64;
      const float* s = a.expanded_scales + first * scale_blocks * kLanes;
      const uint8_t* act[R];
      for (int r = 0; r < R; ++r) act[r] = a.acts + r * a.act_stride;
      __m512 acc[R][B];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < B; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t sb = 0; sb < scale_blocks; ++sb) {
        for (int64_t line = sb; line < a.prefetch_lines; line += scale_blocks) PrefetchL2(a.prefetch + line * 64);
        __m512i sum[R][B];
        for (int r = 0; r < R; ++r) {
          const __m512i correction = _mm512_set1_epi32(LoadInt32(act[r] + FourBitCorrectionOffset(m.cols) + 4 * sb));
          for (int j = 0; j < B; ++j) sum[r][j] = correction;
        }
        // A scale block's groups unrolled, the row pointers taken once: GCC 12 otherwise kept a
        // loop counter and recomputed every row's address in each group (one thread, cached weights,
        // nvfp4 at 64 / 256 rows: 0.89 / 0.92 -> 0.92 / 0.95 of the block-scaled peak, mxfp4 +1 -
        // 2%; the layer at T = 1024, 4 alternated runs: nvfp4 0.623 -> 0.638, mxfp4 0.740 -> 0.752).
#pragma GCC unroll 8
        for (int i = 0; i < kGroupsPerScale; ++i) {
          const int64_t g = sb * kGroupsPerScale + i;
          __m512i wv[B];
          for (int j = 0; j < B; ++j) {
            wv[j] = _mm512_loadu_si512(w + (j * groups + g) * 64);
            asm("" : "+v"(wv[j]));  // held in a register, as in DenseTile
          }
          for (int r = 0; r < R; ++r) {
            const __m512i x = BroadcastGroup(act[r] + 4 * g);
            for (int j = 0; j < B; ++j) sum[r][j] = DotAdd(sum[r][j], wv[j], x);
          }
        }
        for (int j = 0; j < B; ++j) ScaleAdd(_mm512_loadu_ps(s + (j * scale_blocks + sb) * kLanes), sum, j, acc);
      }
      StoreTile<R, B>(a, acc);
    }
  };
};

// 4-bit tiles: decode up to 4 rows x 2 blocks (8 sums, 8 accumulators, 8 expanded vectors: two
// weight streams); from 5 rows to kFourBitStreamMaxRows in tiles of up to 8 rows x 1 block (each
// expansion serves twice the rows; one stream is enough when there is that much arithmetic per
// byte); prefill 6 rows x 2 blocks (12 sums, 12 accumulators).
constexpr int kFourBitStreamBlocks = 2, kFourBitStreamTallRows = 8, kFourBitPrefillRows = 6, kFourBitPrefillBlocks = 2;
// Channel blocks expanded at once in prefill: 64 channels, 128 KB of int8 at cols = 2048 (L2).
constexpr int64_t kFourBitPanelBlocks = 4;
// Up to this many rows, 4-bit weights are expanded in registers as they stream, once per row tile
// (from memory for the first, from cache for the others). Above, a panel's first kPanelFillRows
// rows run a streaming tile that also writes what it expands into the panel, and the other rows
// run prefill tiles over it. (A pass of its own that expanded the panel did no arithmetic while it
// read the codes, and so paid only from 49 rows on for both formats.) With the expansion in the
// first row tile (`epmoe bench kernels --formats nvfp4,mxfp4 --tokens
// 256,1024 --no-decode`, 15 alternated runs, medians of the fraction of the bound at 48 / 32 / 16
// rows): nvfp4 T = 256 0.56 - 0.57 / 0.59 - 0.61 / 0.55, T = 1024 0.59 / 0.60 - 0.61 / 0.59 - 0.60;
// mxfp4 T = 256 0.58 / 0.58 / 0.61 - 0.64, T = 1024 0.64 - 0.68 / 0.67 - 0.68 / 0.66 - 0.70.
// (mxfp4's streaming tiles of 5 - 8 rows load no chunk ahead, see StreamTile, which may be why its
// panels pay from fewer rows.)
template <WeightFormat kFormat>
constexpr int64_t kFourBitStreamMaxRows = kFormat == WeightFormat::kNvfp4 ? 32 : 16;
constexpr int kPanelFillRows = 8;

template <WeightFormat kFormat>
class FourBitKernel final : public Avx512Kernel<kFormat> {
  using Ops = FourBit<kFormat>;

 public:
  bool SupportsSize(int64_t size) const override { return size % kLanes == 0 && size % Ops::kScaleBlock == 0; }
  int64_t channel_tile() const override { return kLanes * kFourBitPanelBlocks; }
  int64_t ActivationBytes(int64_t cols) const override { return RoundUp(Ops::ScaleOffset(cols) + 4, 64); }
  void QuantizeActivations(const float* x, int64_t cols, uint8_t* out) const override {
    int8_t* q = reinterpret_cast<int8_t*>(out);
    const float scale = QuantizeRowInt8(x, cols, q);
    FourBitCorrections(q, cols, Ops::kScaleBlock, out + FourBitCorrectionOffset(cols));
    std::memcpy(out + Ops::ScaleOffset(cols), &scale, 4);
  }
  void MatMul(const PackedMatrix& w, int64_t n_begin, int64_t n_end, const uint8_t* acts, int64_t rows, float* out,
              int64_t out_stride, OutputWrites writes) const override {
    EPMOE_CHECK(n_begin % kLanes == 0 && n_end % kLanes == 0);
    const bool streamed = writes == OutputWrites::kStreamed;
    TileArgs base{&w, 0, acts, ActivationBytes(w.cols), out, out_stride, streamed};
    const FenceStreamedStores fence{streamed};
    const int64_t block_begin = n_begin / kLanes, block_end = n_end / kLanes;
    if (rows == 1) {
      // One row runs the 2-row tile over the row twice (activation and output stride 0: read again,
      // its result written to the same place): from memory the 1-row tile read less than the 2-row
      // tile does on the same weights (one thread, BM_MatMul: nvfp4 25.3 -> 30.5 GB/s, mxfp4 25.4
      // -> 29.1; alternated within one process, level on average but less steady), and the
      // repeated row's arithmetic costs little while the tile waits for memory.
      // Not the 3-row tile: a core spends per 128 bytes of codes R x 4 VPDPBUSD and R
      // FMA (nvfp4) for R rows on the two pipes these share, the 4 VPERMB running beside them (Zen
      // 4 takes one every two cycles on a third pipe), so the 3-row tile cannot expand
      // faster than about 31 GB/s a core (measured over cached nvfp4 weights: 27 - 28; the 2-row
      // tile 35, the 1-row tile 46), which is about what one core reads from memory here:
      // whenever the host slows the core or the memory speeds up, it stops the tile. One thread
      // from memory, 1 and 2 rows, the tiles alternated within one process, 4 sets of 8 runs:
      // nvfp4 1 row 0.67 - 0.94 -> 0.84 - 0.93 of the read rate, 2 rows 0.77 - 0.88
      // -> 0.92 - 0.95; mxfp4 1 row 0.79 - 0.93 -> 0.85 - 0.90, 2 rows 0.84 - 0.93 -> 0.91 - 0.95;
      // the layer at one thread, 5 alternated runs, T = 1 / 8 / 16 / 64: nvfp4 0.78 / 0.78 / 0.74 /
      // 0.57 -> 0.86 / 0.83 / 0.83 / 0.61 of the bound, mxfp4 level; with two threads -0.02 to
      // +0.02 (mxfp4 T = 1 +0.09).
      base.act_stride = 0;
      base.out_stride = 0;
      rows = 2;
    }
    if (rows <= kStreamRows) {
      RunTiles<Ops::template StreamTile, 2, kStreamRows, kFourBitStreamBlocks>(base, block_begin, block_end, rows);
      return;
    }
    if (rows <= kFourBitStreamMaxRows<kFormat>) {
      RunTiles<Ops::template StreamTile, kStreamRows + 1, kFourBitStreamTallRows, 1>(base, block_begin, block_end,
                                                                                     rows);
      return;
    }
    // Grow-only per-thread panel buffers: MatMul runs on pool threads, many times per step.
    thread_local std::vector<uint8_t> values;
    thread_local std::vector<float> scales;
    values.resize(kFourBitPanelBlocks * kLanes * w.cols);
    scales.resize(kFourBitPanelBlocks * kLanes * (w.cols / Ops::kScaleBlock));
    for (int64_t b = block_begin; b < block_end; b += kFourBitPanelBlocks) {
      const int64_t blocks = std::min(kFourBitPanelBlocks, block_end - b);
      TileArgs panel = base;
      panel.out = out + (b - block_begin) * kLanes;
      panel.expanded = values.data();
      panel.expanded_scales = scales.data();
      panel.panel_block = b;
      // The first rows stream the panel's codes, and expand them into it as they go.
      RunTiles<Ops::template PanelFillTile, kPanelFillRows, kPanelFillRows, 1, kPanelFillRows>(panel, b, b + blocks,
                                                                                               kPanelFillRows);
      panel.acts += kPanelFillRows * panel.act_stride;
      panel.out += kPanelFillRows * panel.out_stride;
      // While this panel's tiles run, the next panel's 4-bit weights come into L2 (past block_end
      // too: the next work item of this expert, which this thread is likely to take as well).
      const int64_t next_blocks = std::clamp<int64_t>(w.rows / kLanes - b - blocks, 0, kFourBitPanelBlocks);
      panel.prefetch = w.values.data() + (b + blocks) * (w.cols / 16 * 128);
      panel.prefetch_lines = next_blocks * (w.cols / 16 * 128) / 64;
      RunTiles<Ops::template CachedTile, kFourBitStreamMaxRows<kFormat> + 1 - kPanelFillRows, kFourBitPrefillRows,
               kFourBitPrefillBlocks>(panel, b, b + blocks, rows - kPanelFillRows);
    }
  }
};

}  // namespace

std::unique_ptr<MatrixKernel> MakeAvx512Kernel(WeightFormat format) {
  switch (format) {
    case WeightFormat::kFp32: return std::make_unique<DenseKernel<Fp32Dot, WeightFormat::kFp32>>();
    case WeightFormat::kBf16: return std::make_unique<DenseKernel<Bf16Dot, WeightFormat::kBf16>>();
    case WeightFormat::kInt8: return std::make_unique<DenseKernel<Int8Dot, WeightFormat::kInt8>>();
    case WeightFormat::kNvfp4: return std::make_unique<FourBitKernel<WeightFormat::kNvfp4>>();
    case WeightFormat::kMxfp4: return std::make_unique<FourBitKernel<WeightFormat::kMxfp4>>();
  }
  return nullptr;
}

}  // namespace epmoe::kernels
