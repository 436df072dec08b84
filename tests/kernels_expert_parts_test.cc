// ExpertStore::MutableExpertParts: the in-place ranges of an expert's stored bytes, in exported
// order. Writing another store's exported bytes through them must equal ImportExpert: the same
// bytes on export and the same outputs, bit for bit, in every format, with and without biases.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/expert_ffn.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

constexpr int64_t kHidden = 64;
constexpr int64_t kIntermediate = 32;

std::vector<float> Values(const Matrix& m) {
  return {m.data.begin(), m.data.end()};
}

ExpertWeights Expert(uint64_t seed, int index, bool biased) {
  ExpertWeights e;
  e.gate = SyntheticMatrix(seed, {TensorKind::kExpertGate, 0, index, kIntermediate, kHidden});
  e.up = SyntheticMatrix(seed, {TensorKind::kExpertUp, 0, index, kIntermediate, kHidden});
  e.down = SyntheticMatrix(seed, {TensorKind::kExpertDown, 0, index, kHidden, kIntermediate});
  if (biased) {
    e.gate_bias = Values(SyntheticMatrix(seed, {TensorKind::kExpertGateBias, 0, index, 1, kIntermediate}));
    e.up_bias = Values(SyntheticMatrix(seed, {TensorKind::kExpertUpBias, 0, index, 1, kIntermediate}));
    e.down_bias = Values(SyntheticMatrix(seed, {TensorKind::kExpertDownBias, 0, index, 1, kHidden}));
  }
  return e;
}

std::unique_ptr<ExpertStore> Store(WeightFormat format, uint64_t seed, bool biased = false) {
  const std::vector<ExpertWeights> experts = {Expert(seed, 0, biased), Expert(seed, 1, biased),
                                              Expert(seed, 2, biased)};
  const std::vector<const ExpertWeights*> pointers = {&experts[0], &experts[1], &experts[2]};
  auto store = PackExperts(pointers, PackOptions{format});
  EPMOE_CHECK_MSG(store.ok(), store.status().ToString());
  return std::move(*store);
}

std::vector<std::byte> Exported(const ExpertStore& store, int expert) {
  std::vector<std::byte> bytes(store.expert_bytes(expert));
  EPMOE_CHECK(store.ExportExpert(expert, bytes).ok());
  return bytes;
}

TEST(ExpertParts, WritingExportedBytesInPlaceEqualsImport) {
  ThreadPool pool(1);
  for (const auto& [format, biased] : {std::pair{WeightFormat::kFp32, false},
                                       {WeightFormat::kBf16, false},
                                       {WeightFormat::kInt8, false},
                                       {WeightFormat::kNvfp4, false},
                                       {WeightFormat::kMxfp4, false},
                                       {WeightFormat::kInt8, true},
                                       {WeightFormat::kMxfp4, true}}) {
    SCOPED_TRACE(std::string(WeightFormatName(format)) + (biased ? " with biases" : ""));
    auto source = Store(format, 11, biased);
    auto target = Store(format, 22, biased);
    const std::vector<std::byte> sent = Exported(*source, 1);
    ASSERT_NE(Exported(*target, 2), sent);  // different weights before the write

    auto parts = target->MutableExpertParts(2);
    ASSERT_TRUE(parts.ok()) << parts.status().ToString();
    size_t at = 0;
    for (const std::span<std::byte>& part : *parts) {
      ASSERT_FALSE(part.empty());
      ASSERT_LE(at + part.size(), sent.size());
      std::memcpy(part.data(), sent.data() + at, part.size());
      at += part.size();
    }
    EXPECT_EQ(static_cast<int64_t>(at), target->expert_bytes(2));  // the parts cover the expert exactly
    EXPECT_EQ(Exported(*target, 2), sent);

    // Expert 2 of the target now computes as expert 1 of the source, bit for bit.
    const Matrix rows = SyntheticMatrix(33, {TensorKind::kRows, 0, 0, 5, kHidden});
    const std::vector<int64_t> one_expert_source = {0, 0, 5, 5};
    const std::vector<int64_t> one_expert_target = {0, 0, 0, 5};
    std::vector<float> want(5 * kHidden), got(5 * kHidden);
    source->Run(rows.data.data(), one_expert_source, want.data(), pool);
    target->Run(rows.data.data(), one_expert_target, got.data(), pool);
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
  }
}

TEST(ExpertParts, RefusesExpertsOutOfRange) {
  auto store = Store(WeightFormat::kBf16, 1);
  EXPECT_EQ(store->MutableExpertParts(-1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->MutableExpertParts(3).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace epmoe
