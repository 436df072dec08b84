// Every (weight format, instruction set) this CPU runs, for the kernel tests' parameterized suites.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epmoe/cpu.h"
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

}  // namespace epmoe::testing
