// Places DeepSeek's README example (2 layers of 12 experts, 16 slots on 8 GPUs in 2 nodes, 4 expert
// groups) with the installed library and prints phy2log per layer; exits 1 if the library refuses.
#include <cstdio>

#include "epmoe/eplb_policy.h"
#include "epmoe/load_matrix.h"

int main() {
  epmoe::LoadMatrix load(1, 2, 12);
  load.values = {90, 132, 40,  61, 104, 165, 39,  4,   73,  56, 183, 86,
                 20, 107, 104, 64, 19,  197, 187, 157, 172, 86, 16,  27};
  epmoe::PolicyOptions options;
  options.shape = {.num_ranks = 8, .num_nodes = 2, .num_groups = 4, .num_redundant = 4};
  auto placement = epmoe::ComputePlacement(load, options);
  if (!placement.ok()) {
    std::fprintf(stderr, "%s\n", placement.status().ToString().c_str());
    return 1;
  }
  for (int layer = 0; layer < placement->num_layers(); ++layer) {
    for (int slot : placement->phy2log(layer)) std::printf("%d ", slot);
    std::printf("\n");
  }
  return 0;
}
