// The small MoE model the multi-rank tests run (hidden 64, 16 experts of intermediate 32, top-4,
// 2 layers), so that 8 oversubscribed ranks stay fast; `shared` shared experts of intermediate 32.
#pragma once

#include "epmoe/model.h"
#include "epmoe/status.h"

namespace epmoe::testing {

inline ModelConfig TinyModel(int shared) {
  ModelConfig m;
  m.name = "tiny";
  m.hidden = 64;
  m.num_experts = 16;
  m.expert_intermediate = 32;
  m.top_k = 4;
  m.num_shared_experts = shared;
  m.shared_intermediate = shared ? 32 : 0;
  m.num_layers = 2;
  m.scoring = Scoring::kSoftmax;
  m.renormalize = true;
  EPMOE_CHECK(ValidateModel(m, "tiny").ok());
  return m;
}

}  // namespace epmoe::testing
