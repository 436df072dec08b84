// KernelExpertStore: the ExpertStore of every weight format and instruction set. Packs each
// expert's three matrices once into its matrix kernel's layout, and its biases in fp32; Run is the
// grouped gated FFN over all local experts, in four parallel phases (quantize input rows, gate + up
// + activation, quantize the intermediate rows, down). Two paths by rows per expert: decode (up to
// kDecodeMaxRows rows: one pass over the expert's weights, split into small channel blocks so few
// experts still spread over every thread; a thread takes runs of one expert's consecutive blocks
// and runs each run as one block, so that its weight reads stay one sequential stream per matrix)
// and prefill (more rows: cache-blocked, row blocks sized for L2 and weight blocks re-read from L2,
// register tiles inside). Immutable after construction; Run is thread-safe. Run keeps its scratch
// (the step's rows in the kernel's format, the intermediate rows in fp32 and in the kernel's
// format) per calling thread between calls, sized by the largest step that thread ran: a serving
// loop's steady state then takes no page faults.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/huge_pages.h"
#include "epmoe/expert_ffn.h"
#include "kernels/kernel.h"

namespace epmoe::kernels {

class KernelExpertStore final : public ExpertStore {
 public:
  // Rows per expert up to which the decode path runs.
  static constexpr int64_t kDecodeMaxRows = 16;

  // Expert e's fp32 weights, the source's own or made into `scratch` (which lives while e is packed).
  using Source = std::function<Result<const ExpertWeights*>(int expert, ExpertWeights* scratch)>;

  // Packs `count` experts of shape [intermediate x hidden] taken from `source` (on the pool's
  // threads, each expert once), for the kernel chosen for that shape at or below `highest`.
  static Result<std::unique_ptr<KernelExpertStore>> Create(int count, int64_t hidden, int64_t intermediate,
                                                           const Source& source, WeightFormat format,
                                                           const GatedActivation& activation, Isa highest,
                                                           ThreadPool* pool);

  WeightFormat format() const override { return format_; }
  int num_experts() const override { return static_cast<int>(experts_.size()); }
  int64_t hidden() const override { return hidden_; }
  int64_t intermediate() const override { return intermediate_; }
  int64_t expert_bytes(int expert) const override;
  std::string kernel_name() const override;
  void Run(const float* rows, std::span<const int64_t> offsets, float* out, ThreadPool& pool) const override;
  int64_t activation_row_bytes() const override;
  void QuantizeRows(const float* rows, int64_t count, std::byte* out, ThreadPool& pool) const override;
  void RunQuantized(const std::byte* rows, std::span<const int64_t> offsets, float* out,
                    ThreadPool& pool) const override;
  Status ExportExpert(int expert, std::span<std::byte> out) const override;
  Status ImportExpert(int expert, std::span<const std::byte> bytes) override;
  Result<std::vector<std::span<std::byte>>> MutableExpertParts(int expert) override;

 private:
  struct PackedExpert {
    PackedMatrix gate, up, down;
    std::vector<float> gate_bias, up_bias, down_bias;  // each empty or full length
  };
  KernelExpertStore() = default;

  WeightFormat format_ = WeightFormat::kFp32;
  GatedActivation activation_;
  int64_t hidden_ = 0;
  int64_t intermediate_ = 0;
  std::unique_ptr<MatrixKernel> kernel_;
  HugePageMemory weights_memory_;  // every expert's packed matrices
  std::vector<PackedExpert> experts_;
};

}  // namespace epmoe::kernels
