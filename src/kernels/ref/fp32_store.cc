#include "kernels/ref/fp32_store.h"

#include <cmath>

#include "epmoe/thread_pool.h"

namespace epmoe {

Fp32ReferenceStore::Fp32ReferenceStore(std::span<const ExpertWeights* const> experts)
    : hidden_(experts[0]->hidden()), intermediate_(experts[0]->intermediate()) {
  experts_.reserve(experts.size());
  for (const ExpertWeights* e : experts) experts_.push_back(*e);
}

void Fp32ReferenceStore::Run(const float* rows, std::span<const int64_t> offsets, float* out, ThreadPool& pool) const {
  EPMOE_CHECK(static_cast<int>(offsets.size()) == num_experts() + 1);
  // Work items are single rows; each finds its expert by walking the offsets.
  const int64_t total = offsets.back();
  pool.ParallelFor(total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> act(intermediate_);
    int e = 0;
    for (int64_t p = begin; p < end; ++p) {
      while (offsets[e + 1] <= p) ++e;
      const ExpertWeights& w = experts_[e];
      const float* x = rows + p * hidden_;
      for (int64_t i = 0; i < intermediate_; ++i) {
        const float* g_row = w.gate.row(i);
        const float* u_row = w.up.row(i);
        float g = 0, u = 0;
        for (int64_t c = 0; c < hidden_; ++c) {
          g += g_row[c] * x[c];
          u += u_row[c] * x[c];
        }
        act[i] = g / (1.0f + std::exp(-g)) * u;
      }
      float* y = out + p * hidden_;
      for (int64_t h = 0; h < hidden_; ++h) {
        const float* d_row = w.down.row(h);
        float acc = 0;
        for (int64_t i = 0; i < intermediate_; ++i) acc += d_row[i] * act[i];
        y[h] = acc;
      }
    }
  });
}

}  // namespace epmoe
