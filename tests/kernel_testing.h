// What the kernel tests share: every (weight format, instruction set) this CPU runs, for their
// parameterized suites, and random matrices.
#pragma once

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "epmoe/cpu.h"
#include "epmoe/matrix.h"
#include "epmoe/weight_format.h"

namespace epmoe::testing {

struct KernelCase {
  WeightFormat format;
  Isa isa;
};

inline std::vector<KernelCase> AllKernelCases() {
  std::vector<KernelCase> cases;
  for (WeightFormat f : AllWeightFormats()) {
    for (Isa isa : AllIsas()) {
      if (FormatSupportedBy(isa, f, DetectCpuFeatures())) cases.push_back({f, isa});
    }
  }
  return cases;
}

// "<format>_<isa>", the test name's suffix.
inline std::string KernelCaseName(const ::testing::TestParamInfo<KernelCase>& info) {
  return std::string(WeightFormatName(info.param.format)) + "_" + IsaName(info.param.isa);
}

// A [rows x cols] matrix of values uniform in [-bound, bound], drawn from `rng`.
inline Matrix RandomMatrix(int64_t rows, int64_t cols, float bound, std::mt19937& rng) {
  Matrix m(rows, cols);
  std::uniform_real_distribution<float> dist(-bound, bound);
  for (float& v : m.data) v = dist(rng);
  return m;
}

}  // namespace epmoe::testing
