// The kernels harness: every (weight format x instruction set x path) against the fp32 reference.
//
// Two bounds per case, both as normalized max error (max |actual - expected| / max |expected|):
//  - against ReferenceExpertFfn on the original fp32 weights: quantization plus kernel error, the
//    bound users rely on (kFormatTolerance, also what `epmoe layer --check` enforces);
//  - against ReferenceExpertFfn on the dequantized weights: the kernel's own error (activation
//    rounding and summation order), much tighter, so a kernel bug cannot hide in quantization noise.
// Rows per expert 0, 1, 2, 3, 4, 7, 8, 13 (decode path), 20 (several decode tiles; the 4-bit kernels
// stream up to 48 rows), 64 and 1000 (prefill path), uneven, with experts that get no rows; input sizes
// that are not multiples of the vector or group width; the work split over 1 - 4 threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "epmoe/cpu.h"
#include "epmoe/expert_ffn.h"
#include "epmoe/quantize.h"
#include "epmoe/thread_pool.h"
#include "kernel_testing.h"
#include "kernels/expert_store.h"
#include "kernels/kernel.h"

namespace epmoe {
namespace {

double FormatTolerance(WeightFormat format) {
  switch (format) {
    case WeightFormat::kFp32: return 1e-4;
    case WeightFormat::kBf16: return 1.5e-2;
    case WeightFormat::kInt8: return 5e-2;
    case WeightFormat::kNvfp4: return 3e-1;    // E2M1 has 3 bits of magnitude: errors up to 1/6 of a block's max
    case WeightFormat::kMxfp4: return 3.5e-1;  // and power-of-two scales leave up to 2x headroom unused
  }
  return 0;
}

// Kernel error alone: fp32 activations (reference, avx2) or bf16 / int8 activations (avx512).
double KernelTolerance(WeightFormat format, Isa isa) {
  if (isa == Isa::kReference || format == WeightFormat::kFp32) return 1e-4;
  // bf16: the AVX-512 kernel rounds the activations to bf16, the AVX2 one keeps them in fp32.
  if (format == WeightFormat::kBf16) return isa == Isa::kAvx512 ? 1e-2 : 1e-4;
  return 5e-2;  // int8 activations
}

using epmoe::testing::RandomMatrix;

std::vector<float> RandomValues(int64_t count, float bound, std::mt19937& rng) {
  const Matrix m = RandomMatrix(1, count, bound, rng);
  return {m.data.begin(), m.data.end()};
}

std::vector<ExpertWeights> RandomExperts(int count, int64_t hidden, int64_t inter, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<ExpertWeights> experts(count);
  for (auto& e : experts) {
    e.gate = RandomMatrix(inter, hidden, 1.0f / std::sqrt(static_cast<float>(hidden)), rng);
    e.up = RandomMatrix(inter, hidden, 1.0f / std::sqrt(static_cast<float>(hidden)), rng);
    e.down = RandomMatrix(hidden, inter, 1.0f / std::sqrt(static_cast<float>(inter)), rng);
    // A few outliers per matrix, as real weights have, so scales are not all alike.
    for (Matrix* m : {&e.gate, &e.up, &e.down}) {
      for (int i = 0; i < 8; ++i) m->data[rng() % m->data.size()] *= 6.0f;
    }
  }
  return experts;
}

// The weights as stored: quantized and back (biases are kept in fp32).
ExpertWeights DequantizedExpert(const ExpertWeights& e, WeightFormat format) {
  ExpertWeights d = e;
  d.gate = Dequantize(*Quantize(format, e.gate));
  d.up = Dequantize(*Quantize(format, e.up));
  d.down = Dequantize(*Quantize(format, e.down));
  return d;
}

std::vector<int64_t> Offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(1, 0);
  for (int64_t c : counts) offsets.push_back(offsets.back() + c);
  return offsets;
}

Matrix ReferenceOutputs(const std::vector<ExpertWeights>& experts, const Matrix& rows,
                        const std::vector<int64_t>& offsets, const GatedActivation& activation = {}) {
  Matrix out(rows.rows, rows.cols);
  for (size_t e = 0; e < experts.size(); ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      ReferenceExpertFfn(experts[e], activation, rows.row_span(r), out.row_span(r));
  }
  return out;
}

std::vector<const ExpertWeights*> Pointers(const std::vector<ExpertWeights>& experts) {
  std::vector<const ExpertWeights*> p;
  for (const auto& e : experts) p.push_back(&e);
  return p;
}

Matrix RunStore(const ExpertStore& store, const Matrix& rows, const std::vector<int64_t>& offsets, int threads) {
  ThreadPool pool(threads);
  Matrix out(rows.rows, rows.cols);
  // Poison the output: every row must be written.
  std::fill(out.data.begin(), out.data.end(), std::nanf(""));
  store.Run(rows.data.data(), offsets, out.data.data(), pool);
  return out;
}

using epmoe::testing::AllKernelCases;
using epmoe::testing::KernelCase;
using epmoe::testing::KernelCaseName;

class KernelHarness : public ::testing::TestWithParam<KernelCase> {};

// The kernel a store asked for `isa` runs on shapes every set takes: isa, or the set EPMOE_ISA
// lowers it to (the suite also runs under EPMOE_ISA=avx2).
std::string KernelThatRuns(WeightFormat format, Isa isa) {
  const Result<Isa> highest = ResolveIsa(IsaName(isa));
  EXPECT_TRUE(highest.ok()) << highest.status().ToString();
  return std::string(WeightFormatName(format)) + "/" + IsaName(IsaForFormat(format, highest.ok() ? *highest : isa));
}

// 12 experts, rows per expert 0, 1, 2, 3, 4, 7, 8, 13, 20, 64, 1000, 5: both paths, every decode
// tile height (4 rows: the tallest short tile, which loads 4-bit codes a chunk ahead; 8 and 13 rows:
// two and three row tiles over each group of blocks) and zero-pick experts.
TEST_P(KernelHarness, MatchesReferenceForEveryRowCount) {
  const auto [format, isa] = GetParam();
  constexpr int64_t kHidden = 512, kInter = 256;
  const std::vector<int64_t> counts = {0, 1, 2, 3, 4, 7, 8, 13, 20, 64, 1000, 5};
  const int n = static_cast<int>(counts.size());
  const std::vector<ExpertWeights> experts = RandomExperts(n, kHidden, kInter, 7);
  const std::vector<int64_t> offsets = Offsets(counts);
  std::mt19937 rng(11);
  const Matrix rows = RandomMatrix(offsets.back(), kHidden, 1.0f, rng);
  const auto pointers = Pointers(experts);
  auto store = PackExperts(pointers, PackOptions{format, IsaName(isa)});
  ASSERT_TRUE(store.ok()) << store.status().message();
  EXPECT_EQ((*store)->kernel_name(), KernelThatRuns(format, isa));
  for (int e = 0; e < n; ++e) EXPECT_EQ((*store)->expert_bytes(e), ExpertByteCount(format, kHidden, kInter));

  const Matrix actual = RunStore(**store, rows, offsets, 2);
  ASSERT_EQ(FirstNonFinite(actual.data), -1);
  std::vector<ExpertWeights> dequantized;
  for (const auto& e : experts) dequantized.push_back(DequantizedExpert(e, format));
  const Matrix exact = ReferenceOutputs(experts, rows, offsets);
  const Matrix same_weights = ReferenceOutputs(dequantized, rows, offsets);
  // Per expert, so each row count (path) is judged on its own.
  for (int e = 0; e < n; ++e) {
    const int64_t count = offsets[e + 1] - offsets[e];
    if (count == 0) continue;
    Matrix a(count, kHidden), x(count, kHidden), q(count, kHidden);
    std::copy_n(actual.row(offsets[e]), count * kHidden, a.data.begin());
    std::copy_n(exact.row(offsets[e]), count * kHidden, x.data.begin());
    std::copy_n(same_weights.row(offsets[e]), count * kHidden, q.data.begin());
    EXPECT_LE(NormalizedMaxError(a, x), FormatTolerance(format)) << "expert " << e << " rows " << count;
    EXPECT_LE(NormalizedMaxError(a, q), KernelTolerance(format, isa)) << "expert " << e << " rows " << count;
  }
  // The result of a row depends neither on the thread count nor on the other rows.
  const Matrix single = RunStore(**store, rows, offsets, 1);
  EXPECT_EQ(single.data, actual.data);
}

// gpt-oss's experts: a bias after each projection and the clamped activation (GatedActivation),
// with a limit that the gate and up values often pass. Both paths; biases count in the stored
// bytes.
TEST_P(KernelHarness, BiasesAndClampedActivationMatchReference) {
  const auto [format, isa] = GetParam();
  constexpr int64_t kHidden = 256, kInter = 192;
  const std::vector<int64_t> counts = {0, 1, 3, 8, 20, 64, 300};
  const int n = static_cast<int>(counts.size());
  std::vector<ExpertWeights> experts = RandomExperts(n, kHidden, kInter, 23);
  std::mt19937 rng(29);
  for (ExpertWeights& e : experts) {
    e.gate_bias = RandomValues(kInter, 1.0f, rng);
    e.up_bias = RandomValues(kInter, 1.0f, rng);
    e.down_bias = RandomValues(kHidden, 0.5f, rng);
  }
  const GatedActivation activation{1.702f, 0.6f, 1.0f};
  const std::vector<int64_t> offsets = Offsets(counts);
  const Matrix rows = RandomMatrix(offsets.back(), kHidden, 1.0f, rng);
  auto store = PackExperts(Pointers(experts), PackOptions{format, IsaName(isa), nullptr, activation});
  ASSERT_TRUE(store.ok()) << store.status().message();
  const int64_t bias_bytes = (2 * kInter + kHidden) * 4;
  EXPECT_EQ((*store)->expert_bytes(0), ExpertByteCount(format, kHidden, kInter) + bias_bytes);
  const Matrix actual = RunStore(**store, rows, offsets, 2);
  ASSERT_EQ(FirstNonFinite(actual.data), -1);
  std::vector<ExpertWeights> dequantized;
  for (const auto& e : experts) dequantized.push_back(DequantizedExpert(e, format));
  EXPECT_LE(NormalizedMaxError(actual, ReferenceOutputs(experts, rows, offsets, activation)), FormatTolerance(format));
  EXPECT_LE(NormalizedMaxError(actual, ReferenceOutputs(dequantized, rows, offsets, activation)),
            KernelTolerance(format, isa));
  // Neither the clamps nor the biases are idle here.
  EXPECT_GT(NormalizedMaxError(actual, ReferenceOutputs(dequantized, rows, offsets, {1.702f, 100.0f, 1.0f})), 0.1);
  std::vector<ExpertWeights> unbiased = dequantized;
  for (ExpertWeights& e : unbiased) e.down_bias.clear();
  EXPECT_GT(NormalizedMaxError(actual, ReferenceOutputs(unbiased, rows, offsets, activation)), 0.1);
}

// The work split: many experts of 1 - 10 rows (the skew of a T = 64 step), each in several work
// items of both phases, on 1 - 4 threads. Threads take runs of one expert's consecutive items,
// long while much is left and single items at the end; whichever thread runs an item, every output
// is written once and is the same bit for bit.
TEST_P(KernelHarness, WorkSplitOverThreadsGivesTheSameRows) {
  const auto [format, isa] = GetParam();
  constexpr int64_t kHidden = 256, kInter = 512;  // decode items: 4 per expert for gate/up, 2 for down
  const std::vector<int64_t> counts = {3, 1, 0, 10, 2, 4, 4, 9, 1, 2, 5, 0, 3, 8, 6, 2, 4, 7, 3, 1, 2, 4, 5, 3};
  const int n = static_cast<int>(counts.size());
  const std::vector<ExpertWeights> experts = RandomExperts(n, kHidden, kInter, 17);
  const std::vector<int64_t> offsets = Offsets(counts);
  std::mt19937 rng(19);
  const Matrix rows = RandomMatrix(offsets.back(), kHidden, 1.0f, rng);
  auto store = PackExperts(Pointers(experts), PackOptions{format, IsaName(isa)});
  ASSERT_TRUE(store.ok()) << store.status().message();
  const Matrix single = RunStore(**store, rows, offsets, 1);
  ASSERT_EQ(FirstNonFinite(single.data), -1);
  EXPECT_LE(NormalizedMaxError(single, ReferenceOutputs(experts, rows, offsets)), FormatTolerance(format));
  for (int threads : {2, 3, 4}) EXPECT_EQ(RunStore(**store, rows, offsets, threads).data, single.data) << threads;
}

// Uneven counts, zero-pick experts, and sizes that are multiples of the format's block but not of
// the vector width: 16 channels per block for the AVX-512 kernels, which then give way to a lower
// instruction set (stated in kernel_name); 4-bit sizes are multiples of 16 and 32 by format.
TEST_P(KernelHarness, OddSizesAndUnevenCounts) {
  const auto [format, isa] = GetParam();
  const bool four_bit = BlockSize(format) > 1;
  const int64_t hidden = four_bit ? 96 : 40, inter = four_bit ? 160 : 24;
  const std::vector<ExpertWeights> experts = RandomExperts(5, hidden, inter, 3);
  const std::vector<int64_t> offsets = Offsets({3, 0, 17, 0, 40});
  std::mt19937 rng(5);
  const Matrix rows = RandomMatrix(offsets.back(), hidden, 1.0f, rng);
  const auto pointers = Pointers(experts);
  auto store = PackExperts(pointers, PackOptions{format, IsaName(isa)});
  ASSERT_TRUE(store.ok()) << store.status().message();
  const Matrix actual = RunStore(**store, rows, offsets, 2);
  const Matrix exact = ReferenceOutputs(experts, rows, offsets);
  EXPECT_LE(NormalizedMaxError(actual, exact), FormatTolerance(format)) << (*store)->kernel_name();
  for (int e = 0; e < 5; ++e) EXPECT_EQ((*store)->expert_bytes(e), ExpertByteCount(format, hidden, inter));
}

// fp32, bf16 and int8 avx512 weights are interleaved in groups of 4 channel blocks (64 channels),
// and a matrix's last group may be short: gate and up of 48 channels (one group of 3 blocks), down
// of 80 (a group of 4 and one of 1). 1 and 3 rows run the short streaming tiles, 7 the 6-row
// streaming tile, 14 a column of three 6-row streaming tiles per group (run group by group, each
// prefetching the next), 40 the tiles over cached weights: tiles of 4 blocks that then meet the
// short groups.
TEST_P(KernelHarness, ShortInterleavedGroups) {
  const auto [format, isa] = GetParam();
  if (BlockSize(format) > 1) GTEST_SKIP() << "the 4-bit layouts are not interleaved";
  constexpr int64_t kHidden = 80, kInter = 48;
  const std::vector<ExpertWeights> experts = RandomExperts(5, kHidden, kInter, 23);
  const std::vector<int64_t> offsets = Offsets({1, 3, 7, 14, 40});
  std::mt19937 rng(29);
  const Matrix rows = RandomMatrix(offsets.back(), kHidden, 1.0f, rng);
  auto store = PackExperts(Pointers(experts), PackOptions{format, IsaName(isa)});
  ASSERT_TRUE(store.ok()) << store.status().message();
  EXPECT_EQ((*store)->kernel_name(), KernelThatRuns(format, isa));
  const Matrix actual = RunStore(**store, rows, offsets, 2);
  EXPECT_LE(NormalizedMaxError(actual, ReferenceOutputs(experts, rows, offsets)), FormatTolerance(format));
}

// Rows quantized one at a time, elsewhere and in another order (as a row travelling in the kernel's
// format is quantized on its home rank), then run: bit for bit what Run gives on the fp32 rows.
TEST_P(KernelHarness, RowsQuantizedApartRunAsRun) {
  const auto [format, isa] = GetParam();
  constexpr int64_t kHidden = 256, kInter = 128;
  const std::vector<ExpertWeights> experts = RandomExperts(3, kHidden, kInter, 9);
  const std::vector<int64_t> offsets = Offsets({2, 0, 21});
  std::mt19937 rng(13);
  const Matrix rows = RandomMatrix(offsets.back(), kHidden, 1.0f, rng);
  auto store = PackExperts(Pointers(experts), PackOptions{format, IsaName(isa)});
  ASSERT_TRUE(store.ok()) << store.status().message();
  const int64_t row_bytes = (*store)->activation_row_bytes();
  ASSERT_GE(row_bytes, kHidden);
  std::vector<std::byte> quantized(offsets.back() * row_bytes);
  ThreadPool pool(2);
  for (int64_t r = offsets.back() - 1; r >= 0; --r)
    (*store)->QuantizeRows(rows.row(r), 1, quantized.data() + r * row_bytes, pool);
  Matrix from_quantized(rows.rows, rows.cols);
  (*store)->RunQuantized(quantized.data(), offsets, from_quantized.data.data(), pool);
  EXPECT_EQ(from_quantized.data, RunStore(**store, rows, offsets, 2).data);
}

INSTANTIATE_TEST_SUITE_P(AllFormatsAndIsas, KernelHarness, ::testing::ValuesIn(AllKernelCases()), KernelCaseName);

// Each instruction set's activation against the scalar one (MatrixKernel's): lengths that leave a
// scalar tail, values past the clamps, both signs of alpha * g far out, and a NaN passed through.
TEST(Activate, VectorKernelsMatchTheScalarOne) {
  std::mt19937 rng(31);
  constexpr int64_t kCount = 45;
  std::vector<float> gate = RandomValues(kCount, 30.0f, rng), up = RandomValues(kCount, 10.0f, rng);
  const std::vector<float> gate_bias = RandomValues(kCount, 1.0f, rng), up_bias = RandomValues(kCount, 1.0f, rng);
  gate[3] = std::nanf("");
  up[20] = std::nanf("");
  for (Isa isa : AllIsas()) {
    if (!FormatSupportedBy(isa, WeightFormat::kFp32, DetectCpuFeatures())) continue;
    const auto kernel = kernels::ChooseKernel(WeightFormat::kFp32, isa, 64, 64);
    ASSERT_EQ(kernel->isa(), isa);
    for (const GatedActivation& activation : {GatedActivation{}, GatedActivation{1.702f, 7.0f, 1.0f}}) {
      for (bool biased : {false, true}) {
        const float* gb = biased ? gate_bias.data() : nullptr;
        const float* ub = biased ? up_bias.data() : nullptr;
        std::vector<float> expected(kCount), actual(kCount);
        kernel->kernels::MatrixKernel::Activate(gate.data(), up.data(), gb, ub, kCount, activation, expected.data());
        kernel->Activate(gate.data(), up.data(), gb, ub, kCount, activation, actual.data());
        for (int64_t i = 0; i < kCount; ++i) {
          if (std::isnan(expected[i])) {
            EXPECT_TRUE(std::isnan(actual[i])) << IsaName(isa) << " " << i;
            continue;
          }
          EXPECT_NEAR(actual[i], expected[i], 1e-6 * std::max(1.0f, std::abs(expected[i])))
              << IsaName(isa) << " " << i << " limit " << activation.limit << " biased " << biased;
        }
      }
    }
  }
}

TEST(KernelChoice, VectorKernelsGiveWayOnShapesTheyCannotRun) {
  const CpuFeatures& cpu = DetectCpuFeatures();
  if (!FormatSupportedBy(Isa::kAvx512, WeightFormat::kNvfp4, cpu) ||
      !FormatSupportedBy(Isa::kAvx512, WeightFormat::kBf16, cpu))
    GTEST_SKIP() << "this CPU runs no 4-bit or bf16 avx512 kernels";
  // What a request for avx512 runs on shapes it can take: avx512, or the set EPMOE_ISA lowers it to.
  const Result<Isa> requested = ResolveIsa("avx512");
  ASSERT_TRUE(requested.ok()) << requested.status().ToString();
  const std::string isa = IsaName(*requested);
  const std::vector<ExpertWeights> experts = RandomExperts(1, 96, 160, 1);
  const auto pointers = Pointers(experts);
  auto nvfp4 = PackExperts(pointers, PackOptions{WeightFormat::kNvfp4, "avx512"});
  ASSERT_TRUE(nvfp4.ok());
  EXPECT_EQ((*nvfp4)->kernel_name(), "nvfp4/" + isa);
  auto mxfp4 = PackExperts(pointers, PackOptions{WeightFormat::kMxfp4, "avx512"});
  ASSERT_TRUE(mxfp4.ok());
  EXPECT_EQ((*mxfp4)->kernel_name(), "mxfp4/" + isa);
  const std::vector<ExpertWeights> odd = RandomExperts(1, 40, 24, 1);  // not whole 16-channel blocks
  const auto odd_pointers = Pointers(odd);
  auto bf16 = PackExperts(odd_pointers, PackOptions{WeightFormat::kBf16, "avx512"});
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ((*bf16)->kernel_name(), "bf16/reference");  // avx2 needs whole blocks too
}

// IsaForFormat (what `epmoe calibrate` prices each format by) names the kernel a store picks for a
// shape every set can run, for every request this CPU takes.
TEST(KernelChoice, IsaForFormatNamesTheKernelThatRuns) {
  const std::vector<ExpertWeights> experts = RandomExperts(1, 96, 160, 1);
  const auto pointers = Pointers(experts);
  for (Isa requested : AllIsas()) {
    if (!IsaSupported(requested)) continue;
    const Result<Isa> highest = ResolveIsa(IsaName(requested));
    ASSERT_TRUE(highest.ok()) << highest.status().ToString();
    for (WeightFormat format : AllWeightFormats()) {
      auto store = PackExperts(pointers, PackOptions{format, IsaName(requested)});
      ASSERT_TRUE(store.ok()) << store.status().ToString();
      EXPECT_EQ((*store)->kernel_name(),
                std::string(WeightFormatName(format)) + "/" + IsaName(IsaForFormat(format, *highest)));
    }
  }
}

TEST(KernelChoice, RefusesWhatItCannotStore) {
  const auto experts = RandomExperts(1, 64, 48, 1);  // 48 is not a multiple of MXFP4's 32
  const auto pointers = Pointers(experts);
  EXPECT_FALSE(PackExperts(pointers, PackOptions{WeightFormat::kMxfp4, "auto"}).ok());
  EXPECT_TRUE(PackExperts(pointers, PackOptions{WeightFormat::kNvfp4, "auto"}).ok());
  EXPECT_FALSE(PackExperts(pointers, PackOptions{WeightFormat::kInt8, "sse9"}).ok());
  auto bad = RandomExperts(1, 64, 32, 2);
  bad[0].up.at(3, 5) = std::nanf("");
  const auto bad_pointers = Pointers(bad);
  auto refused = PackExperts(bad_pointers, PackOptions{WeightFormat::kInt8, "auto"});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("row 3, column 5"), std::string::npos) << refused.status().message();
}

// Experts made one at a time pack into the same bytes as the same experts given at once, on a pool
// and without one; a maker's error or a wrong shape fails the pack with the expert named.
TEST(PackFromMaker, PacksWhatTheSpanPacks) {
  const auto experts = RandomExperts(5, 64, 32, 7);
  ThreadPool pool(2);
  for (WeightFormat format : AllWeightFormats()) {
    SCOPED_TRACE(WeightFormatName(format));
    auto given = PackExperts(Pointers(experts), PackOptions{format, "auto"});
    ASSERT_TRUE(given.ok()) << given.status().message();
    for (ThreadPool* on : {static_cast<ThreadPool*>(nullptr), &pool}) {
      std::atomic<int> calls{0};
      auto made = PackExperts(
          5, 64, 32,
          [&](int e, ExpertWeights* out) {
            ++calls;
            *out = experts[e];
            return Status::Ok();
          },
          PackOptions{format, "auto", on});
      ASSERT_TRUE(made.ok()) << made.status().message();
      EXPECT_EQ(calls.load(), 5);
      EXPECT_EQ((*made)->kernel_name(), (*given)->kernel_name());
      for (int e = 0; e < 5; ++e) {
        ASSERT_EQ((*made)->expert_bytes(e), (*given)->expert_bytes(e));
        std::vector<std::byte> a((*made)->expert_bytes(e)), b(a.size());
        ASSERT_TRUE((*made)->ExportExpert(e, a).ok());
        ASSERT_TRUE((*given)->ExportExpert(e, b).ok());
        EXPECT_TRUE(a == b) << "expert " << e;
      }
    }
  }
}

TEST(PackFromMaker, NamesTheExpertThatFailed) {
  const auto experts = RandomExperts(3, 64, 32, 8);
  auto failing = PackExperts(
      3, 64, 32,
      [&](int e, ExpertWeights* out) {
        if (e == 2) return IoError("weights file truncated");
        *out = experts[e];
        return Status::Ok();
      },
      PackOptions{WeightFormat::kInt8, "auto"});
  ASSERT_FALSE(failing.ok());
  EXPECT_NE(failing.status().message().find("expert 2"), std::string::npos) << failing.status().message();
  EXPECT_NE(failing.status().message().find("truncated"), std::string::npos) << failing.status().message();

  const auto wider = RandomExperts(1, 128, 32, 9);
  auto misshapen = PackExperts(
      3, 64, 32,
      [&](int e, ExpertWeights* out) {
        *out = e == 1 ? wider[0] : experts[e];
        return Status::Ok();
      },
      PackOptions{WeightFormat::kInt8, "auto"});
  ASSERT_FALSE(misshapen.ok());
  EXPECT_NE(misshapen.status().message().find("expert 1 has shapes"), std::string::npos)
      << misshapen.status().message();

  auto none = PackExperts(
      0, 64, 32,
      [&](int e, ExpertWeights* out) {
        *out = experts[e];
        return Status::Ok();
      },
      PackOptions{WeightFormat::kInt8, "auto"});
  EXPECT_FALSE(none.ok());
}

// Which formats each CPU generation runs on avx512 (the others give way to avx2).
TEST(KernelChoice, Avx512FormatsFollowTheCpuFeatures) {
  CpuFeatures skylake;  // AVX-512 F, BW, VL, DQ: no VNNI
  skylake.avx2 = skylake.fma = skylake.f16c = true;
  skylake.avx512f = skylake.avx512bw = skylake.avx512vl = skylake.avx512dq = true;
  CpuFeatures cascade_lake = skylake;
  cascade_lake.avx512vnni = true;
  CpuFeatures ice_lake = cascade_lake;
  ice_lake.avx512vbmi = true;
  CpuFeatures zen4 = ice_lake;
  zen4.avx512bf16 = true;
  auto avx512_formats = [](const CpuFeatures& cpu) {
    std::string names;
    for (WeightFormat f : AllWeightFormats())
      if (FormatSupportedBy(Isa::kAvx512, f, cpu)) names += std::string(names.empty() ? "" : " ") + WeightFormatName(f);
    return names;
  };
  EXPECT_FALSE(IsaSupportedBy(Isa::kAvx512, skylake));
  EXPECT_EQ(avx512_formats(skylake), "");
  EXPECT_EQ(avx512_formats(cascade_lake), "fp32 int8");
  EXPECT_EQ(avx512_formats(ice_lake), "fp32 int8 nvfp4 mxfp4");
  EXPECT_EQ(avx512_formats(zen4), "fp32 bf16 int8 nvfp4 mxfp4");
  for (WeightFormat f : AllWeightFormats()) {
    EXPECT_TRUE(FormatSupportedBy(Isa::kAvx2, f, skylake));
    EXPECT_FALSE(FormatSupportedBy(Isa::kAvx2, f, CpuFeatures{}));
    EXPECT_TRUE(FormatSupportedBy(Isa::kReference, f, CpuFeatures{}));
  }
}

// Sets EPMOE_ISA for its lifetime, then puts back what the run was started with (the suite also
// runs under EPMOE_ISA=avx2, and the tests after this one must see it).
class ScopedIsaEnvironment {
 public:
  explicit ScopedIsaEnvironment(const char* value) {
    if (const char* old = std::getenv("EPMOE_ISA")) saved_ = old;
    setenv("EPMOE_ISA", value, 1);
  }
  ~ScopedIsaEnvironment() {
    if (saved_) {
      setenv("EPMOE_ISA", saved_->c_str(), 1);
    } else {
      unsetenv("EPMOE_ISA");
    }
  }

 private:
  std::optional<std::string> saved_;
};

TEST(KernelChoice, EnvironmentLowersTheInstructionSet) {
  const auto experts = RandomExperts(1, 256, 256, 1);
  const auto pointers = Pointers(experts);
  {
    ScopedIsaEnvironment lowered("reference");
    auto store = PackExperts(pointers, PackOptions{WeightFormat::kInt8, "auto"});
    ASSERT_TRUE(store.ok());
    EXPECT_EQ((*store)->kernel_name(), "int8/reference");
  }
  ScopedIsaEnvironment unknown("fast");
  EXPECT_FALSE(ResolveIsa("auto").ok());
}

}  // namespace
}  // namespace epmoe
