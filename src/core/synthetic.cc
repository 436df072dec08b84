#include "epmoe/synthetic.h"

#include <cmath>

#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

// SplitMix64 finalizer: a bijective mix with good avalanche, enough for test data.
inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1).
inline float UnitValue(uint64_t tensor_key, uint64_t element) {
  const uint64_t bits = Mix(tensor_key ^ Mix(element));
  return static_cast<float>(static_cast<double>(bits >> 11) * 0x1.0p-52 - 1.0);
}

uint64_t TensorKey(uint64_t seed, const SyntheticTensor& t) {
  uint64_t key = Mix(seed);
  key = Mix(key ^ static_cast<uint64_t>(t.kind));
  key = Mix(key ^ static_cast<uint64_t>(static_cast<uint32_t>(t.layer)));
  key = Mix(key ^ static_cast<uint64_t>(static_cast<uint32_t>(t.index)));
  return key;
}

float Amplitude(const SyntheticTensor& t) {
  switch (t.kind) {
    case TensorKind::kRows: return 1.0f;
    case TensorKind::kRouterBias: return 0.1f;
    case TensorKind::kExpertGateBias:
    case TensorKind::kExpertUpBias:
    case TensorKind::kExpertDownBias: return 0.5f;
    default: return static_cast<float>(1.0 / std::sqrt(static_cast<double>(t.cols)));
  }
}

}  // namespace

// An x86-64-v4 (AVX-512) clone, chosen at load time where the CPU has it: its 64-bit multiplies and
// conversions run eight values at a time, the same integer and float operations in the same order.
[[gnu::target_clones("arch=x86-64-v4", "default")]] void FillSynthetic(uint64_t seed, const SyntheticTensor& tensor,
                                                                       int64_t row_begin, int64_t row_count,
                                                                       int64_t col_begin, int64_t col_count,
                                                                       float* out) {
  const uint64_t key = TensorKey(seed, tensor);
  const float amplitude = Amplitude(tensor);
  for (int64_t r = 0; r < row_count; ++r) {
    const uint64_t base = static_cast<uint64_t>(row_begin + r) * static_cast<uint64_t>(tensor.cols);
    for (int64_t c = 0; c < col_count; ++c) {
      out[r * col_count + c] = amplitude * UnitValue(key, base + static_cast<uint64_t>(col_begin + c));
    }
  }
}

Matrix SyntheticMatrix(uint64_t seed, const SyntheticTensor& tensor, ThreadPool* pool) {
  Matrix m(tensor.rows, tensor.cols);
  auto fill = [&](int64_t begin, int64_t end) {
    FillSynthetic(seed, tensor, begin, end - begin, 0, tensor.cols, m.row(begin));
  };
  ParallelFor(pool, tensor.rows, 64, fill);
  return m;
}

Matrix SyntheticRows(uint64_t seed, const ModelConfig& model, int step, int64_t first_row, int64_t count) {
  SyntheticTensor t{TensorKind::kRows, 0, step, first_row + count, model.hidden};
  Matrix m(count, model.hidden);
  FillSynthetic(seed, t, first_row, count, 0, model.hidden, m.data.data());
  return m;
}

}  // namespace epmoe
