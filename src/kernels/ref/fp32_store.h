// Fp32ReferenceStore: fp32 experts run by plain C++ loops (float accumulation, fixed order).
// The fallback of last resort and the production path before the vector kernels; its result for a
// row does not depend on the other rows or the thread count.
#pragma once

#include <span>
#include <vector>

#include "epmoe/expert_ffn.h"

namespace epmoe {

class Fp32ReferenceStore final : public ExpertStore {
 public:
  explicit Fp32ReferenceStore(std::span<const ExpertWeights* const> experts);

  WeightFormat format() const override { return WeightFormat::kFp32; }
  int num_experts() const override { return static_cast<int>(experts_.size()); }
  int64_t hidden() const override { return hidden_; }
  int64_t intermediate() const override { return intermediate_; }
  int64_t expert_bytes(int) const override { return ExpertByteCount(WeightFormat::kFp32, hidden_, intermediate_); }
  std::string kernel_name() const override { return "fp32/reference"; }
  void Run(const float* rows, std::span<const int64_t> offsets, float* out, ThreadPool& pool) const override;

 private:
  int64_t hidden_;
  int64_t intermediate_;
  std::vector<ExpertWeights> experts_;
};

}  // namespace epmoe
