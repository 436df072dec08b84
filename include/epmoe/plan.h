// The planner: predicts what each way of meeting the experts costs on a hardware profile, for a
// model preset and a routing load (a trace's picks or an even router), per EP size and batch.
//
// Cost model (DESIGN.md "Cost model"), per MoE layer and rank, for the picks that land on it:
//   kernel = fixed + sum over touched local experts (or slices) of max(bytes / read bandwidth,
//            flops / achieved peak) + picks x PickRowBytes / read bandwidth (a slice's pick moves
//            a whole row too), + the shared expert (sliced or copied);
//   communication: options 1-3 all-gather rows to G-1 ranks and reduce-scatter the results;
//            option 4 dispatches a row only to the ranks holding its experts and combines back;
//            option 5 fetches (G-1)/G of the layer's expert bytes, overlapped with the kernel on
//            GPUs; where ranks share a device (a CPU server) the fetch is a copy by the kernel's
//            cores (bytes x ranks per device / the device's copy rate) added to the kernel;
//   each collective costs latency + bytes / link bandwidth (intra- and inter-node shares in
//   parallel), and the slowest rank sets the layer's time. Step = MoE layers + dense FFN layers
//   (attention and everything else is not modeled).
//   Option 4's variants (A2aVariant): flat or two-level (a row crosses to another node once per
//   node, then is forwarded inside it), normal (counts all-gathered first: one more collective
//   step) or low-latency (no count step, flat), two-batch overlap and single-batch overlap
//   (LayerStages). Dispatch and combine pay the link's all-to-all step (exchange_step_us); on a CPU
//   server pack and unpack cost records x hidden x row_codec_ns, and TBO's lanes take turns where
//   ranks x 2 lanes outnumber the device's cores (docs/planner.md, "Several nodes").
// Functions are pure; the planner is thread-compatible (no shared state).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/ep_options.h"
#include "epmoe/hardware.h"
#include "epmoe/load.h"
#include "epmoe/load_figures.h"
#include "epmoe/model.h"
#include "epmoe/placement.h"
#include "epmoe/row_codec.h"
#include "epmoe/status.h"
#include "epmoe/weight_format.h"

namespace epmoe {

// The options, row formats and shared-expert modes are the executors' (ep_options.h, row_codec.h):
// a plan prices what `epmoe run` runs, under the same names.

enum class PlanPhase { kDecode, kPrefill };
const char* PlanPhaseName(PlanPhase phase);  // "decode", "prefill"
Result<PlanPhase> ParsePlanPhase(std::string_view name);

// ---- Derived quantities (from the preset alone) ----
int64_t WeightsPerExpert(const ModelConfig& model);        // 3 x hidden x expert_intermediate
int64_t WeightsPerSharedExpert(const ModelConfig& model);  // all shared experts of a layer
int64_t WeightsPerDenseLayer(const ModelConfig& model);    // 3 x hidden x dense_intermediate
int64_t FourBitBytes(int64_t weights);                     // weights / 2: 4 bits, no scales
// Share of a layer's experts an even router touches in a step of `tokens` rows: 1 - (1 - k/E)^T.
double EvenTouchedShare(const ModelConfig& model, int64_t tokens);
// Copies of a row sent to other ranks under a2a with the trivial placement, uniform routing:
// (G - 1) / G x ExpectedRanksPerRow (load_figures.h).
double CopiesSentPerRow(const ModelConfig& model, int gpus);
// Memory traffic of one pick through an expert kernel (or a slice of one), weights aside: its input
// row in the activation format the format's kernel takes (fp32 4 bytes, bf16 2, int8 1, nvfp4
// d/2 + d/16, mxfp4 d/2 + d/32) plus its output row, written by the kernel and read by the combine
// (2 x d x output_bytes: 4d in bf16, 8d in fp32; HardwareProfile::partial_sum_bytes).
int64_t PickRowBytes(const ModelConfig& model, WeightFormat experts, int output_bytes = 2);
// All-to-all bytes per token per layer: dispatch + combine of k copies, 2 x k x hidden x bytes.
int64_t AllToAllBytesPerToken(const ModelConfig& model, int bytes_per_number);

// Formats the planner prices the model's weights in.
struct WeightFormats {
  WeightFormat experts = WeightFormat::kNvfp4;  // routed experts
  WeightFormat shared = WeightFormat::kBf16;    // shared expert(s), as GLM-5.3's NVFP4 checkpoint
  WeightFormat dense = WeightFormat::kInt8;     // dense FFN layers (8 bits, as in that checkpoint)
};

struct ModelBytes {
  int64_t expert = 0;        // one routed expert, scales included
  int64_t routed_layer = 0;  // E experts
  int64_t shared_layer = 0;  // the shared expert(s) of a layer
  int64_t dense_layer = 0;   // one dense FFN layer
  int64_t routed_model = 0;  // all MoE layers' routed experts
};
ModelBytes ComputeModelBytes(const ModelConfig& model, const WeightFormats& formats);
// DWDP (option 5): bytes a rank fetches per layer, (G - 1) / G of the layer's routed experts.
int64_t DwdpBytesPerRankPerLayer(const ModelConfig& model, WeightFormat format, int gpus);

// Weight memory per rank (bytes), all layers, attention weights and KV cache not included.
struct MemoryPerRank {
  int64_t routed = 0, shared = 0, dense = 0, fetch_buffers = 0;
  int64_t total() const { return routed + shared + dense + fetch_buffers; }
};
MemoryPerRank ComputeMemoryPerRank(const ModelConfig& model, const WeightFormats& formats, EpOption option, int gpus,
                                   SharedMode shared, SharedMode dense);

// ---- Routing loads ----
// One layer of one step: picks per logical expert (E values) and the rows that made them.
struct LayerLoad {
  int64_t rows = 0;
  int layer = 0;  // the trace's layer (0 for an even router): selects the placement's layer
  std::vector<int64_t> picks;
};
// `samples` layer loads of an even router (k distinct uniform experts per row), deterministic in seed.
std::vector<LayerLoad> EvenRouterLoads(const ModelConfig& model, int64_t rows, int samples, uint64_t seed);
// Layer loads of `rows` rows from a trace: consecutive steps are joined until they hold `rows` rows,
// and a join that holds more keeps each pick with probability rows / held (deterministic in seed).
// At most `max_samples` (step group, layer) loads, spread over the trace. Refuses a trace whose
// experts differ from the model's, or whose rows per step are unknown and top_k is 0.
Result<std::vector<LayerLoad>> TraceLayerLoads(const ExpertLoad& trace, const ModelConfig& model, int64_t rows,
                                               int max_samples, uint64_t seed);
class TraceReader;
// Copies of a row sent to other ranks under option 4, measured from a trace's per-row picks: for
// each G, the mean over rows (of every layer, up to max_rows rows in all) of the ranks holding one
// of the row's experts (trivial placement), less the row's own rank (row r of a step of T rows
// starts on rank r*G/T). Refuses count-only traces and G outside 1..E.
Result<std::vector<double>> TraceCopiesPerRow(TraceReader& reader, const std::vector<int>& gpus, int64_t max_rows);
// Balancedness (load_figures.h) of one layer load's picks on G ranks holding E/G consecutive
// experts each.
double Balancedness(const LayerLoad& load, int gpus);

// ---- Option 4's variants ----
// One way `epmoe run` can run traveling rows (its --a2a-levels, --a2a-mode, --tbo, --sbo).
struct A2aVariant {
  A2aLevels levels = A2aLevels::kFlat;
  A2aMode mode = A2aMode::kNormal;
  bool tbo = false;  // two micro-batches: one's exchange in flight while the other's experts run
  bool sbo = false;  // the shared expert runs while the dispatch is in flight
  bool operator==(const A2aVariant&) const = default;
};
// "a2a" for flat, normal, no overlap; else e.g. "a2a two-level +tbo", "a2a low-latency +sbo".
std::string A2aVariantLabel(const A2aVariant& variant);

// One MoE layer's stages on the slowest rank (us): the dispatch (count step included), the shared
// expert, the routed experts and the combine.
struct LayerStages {
  double dispatch = 0, shared = 0, routed = 0, combine = 0;
  double compute() const { return shared + routed; }
};
// No overlap: dispatch + shared + routed + combine.
double SequentialUs(const LayerStages& s);
// SBO: the shared expert runs while the dispatch travels: max(dispatch, shared) + routed + combine.
double SingleBatchOverlapUs(const LayerStages& s);
// TBO of micro-batches a then b: a's dispatch, then a's experts beside b's dispatch, then a's
// combine beside b's experts, then b's combine:
//   a.dispatch + max(a.compute, b.dispatch) + max(a.combine, b.compute) + b.combine;
// with `sbo` each micro-batch's shared expert also runs beside its own dispatch where the cores are
// free (a's beside a.dispatch; b's after a's routed experts, beside a's combine):
//   max(a.dispatch, a.shared) + max(a.routed, b.dispatch) + max(a.combine, b.compute) + b.combine.
// Never above SequentialUs(a) + SequentialUs(b).
double TwoBatchOverlapUs(const LayerStages& a, const LayerStages& b, bool sbo);

// ---- Planner ----
struct PlanConfig {
  PlanPhase phase = PlanPhase::kDecode;
  std::vector<int64_t> batches;  // rows (tokens) per step over the whole EP group
  std::vector<int> gpus;         // EP sizes
  std::vector<EpOption> options = AllEpOptions();
  WeightFormats formats;
  RowFormat rows = RowFormat::kBf16;     // how rows travel out under a2a (1-3 gather bf16)
  RowFormat combine = RowFormat::kBf16;  // how a2a's outputs come back
  // a2a's combine: one summed row back per rank a row visited (GPU runtimes), or one output per
  // pick (`epmoe run` without --partial-sums).
  bool a2a_partial_sums = true;
  SharedMode shared = SharedMode::kDefault;
  SharedMode dense = SharedMode::kSliced;  // the seed's servers kept dense layers sliced
  int samples = 16;                        // layer loads per batch (even router or trace)
  uint64_t seed = 1;
  // Placement of whole experts (options 2 and 4): "trivial" (rank g holds experts [gE/G, (g+1)E/G))
  // or an EPLB policy name (deepseek, deepseek-guarded, per-step, cost) fitted on the first
  // half of the trace's steps (the even router's sampled loads without a trace) with `redundant`
  // extra copies per layer, and priced on the second half (held out).
  std::string placement = "trivial";
  int redundant = 0;
  // Option 4 is priced once per variant: every levels x every mode, each also with TBO and SBO
  // when asked. auto resolves as the runtime would: levels two-level when there are several nodes
  // and some node holds more than one rank (flat under low-latency, which is flat only); mode
  // low-latency in decode and normal in prefill (SGLang's --deepep-mode auto). A two-level
  // low-latency variant is listed as not applicable.
  std::vector<A2aLevels> a2a_levels = {A2aLevels::kAuto};
  std::vector<A2aMode> a2a_modes = {A2aMode::kAuto};
  bool tbo = false;  // also price each variant with two-batch overlap
  bool sbo = false;  // also price each variant with single-batch overlap
};

// What one option costs at one EP size and batch. Times per MoE layer are means over the sampled
// layer loads of the slowest rank; step_ms covers all MoE and dense FFN layers.
struct OptionCost {
  EpOption option = EpOption::kSliced;
  int gpus = 0;
  int64_t batch = 0;
  int slices = 1;  // hybrid (option 3): experts sliced this many ways in a group
  A2aVariant a2a;  // option 4: the variant priced (auto resolved)
  bool applicable = true;
  std::string not_applicable;  // why not, when !applicable
  double kernel_us = 0;        // slowest rank's expert kernel (+ shared expert) per MoE layer
                               // (TBO: both micro-batches')
  double kernel_mean_us = 0;   // the mean rank's
  double comm_us = 0;          // communication per MoE layer (option 5: the weight fetch)
  double exposed_comm_us = 0;  // the part of comm_us not hidden under compute: layer - kernel
  double layer_us = 0;         // kernel + comm (option 5 on GPUs, TBO, SBO: with the overlap)
  double inter_node_mb = 0;    // MB a rank sends per MoE layer between nodes (mean over ranks)
  double intra_node_mb = 0;    // ... and inside its node
  double dense_us = 0;         // one dense FFN layer
  double step_ms = 0;
  double read_us = 0, arith_us = 0, fixed_us = 0;  // slowest rank's kernel split
  double rows_us = 0;                              // ... and its rows' traffic (picks x PickRowBytes)
  double imbalance_us = 0;                         // kernel_us - kernel_mean_us
  double read_gb = 0;                              // slowest rank's expert bytes read per MoE layer
  double copies_per_row = 0;                       // copies of each row sent to other ranks
  double balancedness = 1;                         // picks, mean / max over ranks (1 for slices)
  int64_t memory_bytes = 0;                        // weights per rank
  bool fits = true;                                // memory_bytes <= the device's memory
  std::string dominant;  // "reading weights", "arithmetic", "moving rows", "communication", "imbalance",
                         // "fixed costs"
};

struct PlanWinner {
  int64_t batch = 0;
  int gpus = 0;
  EpOption option = EpOption::kSliced;
  int slices = 1;
  A2aVariant a2a;
  double step_ms = 0;
  std::string why;
};

struct PlanResult {
  std::string model;
  std::string hardware;
  PlanPhase phase = PlanPhase::kDecode;
  std::string load;               // "even router" or the trace's description
  std::vector<OptionCost> costs;  // batch-major, then gpus, then options (option 4 once per variant)
  std::vector<PlanWinner> winners;
};

// "hybrid x2", "a2a two-level +tbo", "whole": how tables name a priced option.
std::string CostLabel(EpOption option, int slices, const A2aVariant& a2a);

// Prices every option for every batch and EP size. `trace` null: an even router. Refuses EP sizes
// < 1 or > 4096, batches < 1, and a trace that does not match the model.
Result<PlanResult> RunPlan(const ModelConfig& model, const HardwareProfile& hardware, const PlanConfig& config,
                           const ExpertLoad* trace, const std::string& load_description);

// An SVG (written here, no plotting library) with three charts: step time against batch per option
// (at the largest EP size), copies per row against GPUs, balancedness against GPUs. `trace_copies`
// (optional): (G, copies per row) measured from a trace's per-row picks, drawn as its own line.
std::string PlanPlotSvg(const PlanResult& result, const ModelConfig& model,
                        const std::vector<std::pair<int, double>>& trace_copies = {});

}  // namespace epmoe
