// Hand-priceable inputs of the planner's tests: a profile of round rates and a tiny model.
#pragma once

#include "epmoe/hardware.h"
#include "epmoe/model.h"

namespace epmoe::testing {

// Reading 1 B/us, arithmetic 1 flop/us, 2 ranks per node, both links 1 B/us and 10 us per
// collective step, kernel fixed cost 5 us.
inline HardwareProfile UnitProfile() {
  HardwareProfile p;
  p.name = "unit";
  p.description = "hand-priced";
  p.sources = {"test"};
  p.gpus_per_node = 2;
  p.memory_capacity_gb = 1e6;
  p.memory_bandwidth_gbs = 1e-3;  // 1e6 B/s = 1 B/us
  p.memory_read_efficiency = 1;
  p.peak_tflops = {1e-6, 1e-6, 1e-6, 1e-6, 1e-6};  // 1e6 flop/s = 1 flop/us
  p.arithmetic_efficiency = 1;
  p.gemm_efficiency = 1;
  p.kernel_fixed_us = 5;
  p.intra_node = {1e-3, 1, 10};  // 1 B/us, 10 us per collective
  p.inter_node = {1e-3, 1, 10};
  return p;
}

// 4 experts of hidden 16 and intermediate 16, top_k picks per row, one layer, no shared expert, no
// dense layers.
inline ModelConfig TinyPlanModel(int top_k) {
  ModelConfig m;
  m.name = "tiny";
  m.hidden = 16;
  m.num_experts = 4;
  m.expert_intermediate = 16;
  m.top_k = top_k;
  m.num_layers = 1;
  m.scoring = Scoring::kSoftmax;
  return m;
}

}  // namespace epmoe::testing
