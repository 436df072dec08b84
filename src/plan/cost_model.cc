// The cost model and the planner: per option, EP size and batch, the slowest rank's kernel and the
// communication of one MoE layer, summed into a step. See include/epmoe/plan.h for the model.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <optional>
#include <random>

#include "epmoe/eplb_policy.h"
#include "epmoe/plan.h"

namespace epmoe {
namespace {

constexpr int kMaxGpus = 4096;
constexpr int64_t kMaxBatch = int64_t{1} << 24;

// Per-rank rates of one EP size on a profile. On a shared device (a CPU server) the ranks of a node
// divide its bandwidth and arithmetic among themselves.
class RankRates {
 public:
  RankRates(const HardwareProfile& hw, int gpus) : hw_(hw) { share_ = hw.RanksPerDevice(gpus); }
  // Microseconds per byte of weights in `format` read by an expert kernel: its measured line, else
  // plain memory traffic.
  double UsPerByte(WeightFormat format) const {
    if (auto line = hw_.LineFor(format)) return line->us_per_gb * 1e-9 * share_;
    return UsPerMemoryByte();
  }
  // Grouped expert kernels (routed experts) reach arithmetic_efficiency of the peak; plain GEMMs
  // (shared expert, dense layers) gemm_efficiency.
  double UsPerFlop(WeightFormat format, bool gemm = false) const {
    return share_ / (hw_.PeakTflopsFor(format) * 1e6 * (gemm ? hw_.gemm_efficiency : hw_.arithmetic_efficiency));
  }
  double FixedUs(WeightFormat format) const {
    if (auto line = hw_.LineFor(format)) return line->fixed_us;
    return hw_.kernel_fixed_us;
  }
  // Measured extra fixed cost of sliced experts (narrow slices), 0 without a line.
  double SlicedExtraUs(WeightFormat format) const {
    if (auto line = hw_.LineFor(format)) return line->sliced_extra_us;
    return 0;
  }
  // Microseconds per byte of plain memory traffic (rows in and out of the kernel), at the device's
  // read rate shared by its ranks.
  double UsPerMemoryByte() const { return share_ / (hw_.memory_bandwidth_gbs * 1e3 * hw_.memory_read_efficiency); }
  // Microseconds per byte a rank copies while every rank of its device copies too (the device's
  // copy rate divided among them).
  double CopyUsPerByte() const { return share_ / (hw_.CopyBytesPerSecond() * 1e-6); }

 private:
  const HardwareProfile& hw_;
  int share_ = 1;
};

// One rank's kernel time, split by what bounds each part.
struct KernelParts {
  double fixed = 0, read = 0, arith = 0, rows = 0;
  double bytes = 0;  // routed expert bytes read
  double picks = 0;  // picks this rank computes (a slice's pick counts once per slice)
  double total() const { return fixed + read + arith + rows; }
  // A block of weights used by `flops` of arithmetic: bound by the slower of reading and computing.
  void Add(double bytes_read, double flops, WeightFormat format, const RankRates& rates, bool gemm = false) {
    const double read_us = bytes_read * rates.UsPerByte(format);
    const double arith_us = flops * rates.UsPerFlop(format, gemm);
    if (read_us >= arith_us) {
      read += read_us;
    } else {
      arith += arith_us;
    }
  }
};

// The nodes an EP group of `gpus` ranks spans: rank g is on node g / per_node; the last node may
// hold fewer ranks.
struct NodeLayout {
  NodeLayout(const HardwareProfile& hw, int gpus)
      : gpus(gpus), per_node(std::min(gpus, hw.gpus_per_node)), count((gpus + per_node - 1) / per_node) {}
  int node_of(int rank) const { return rank / per_node; }
  int ranks_on(int node) const { return std::min(per_node, gpus - node * per_node); }
  // Share of a rank's G-1 peers on other nodes.
  double remote_share(int rank) const {
    return gpus > 1 ? static_cast<double>(gpus - ranks_on(node_of(rank))) / (gpus - 1) : 0.0;
  }
  int gpus, per_node, count;
};

// Time to move `bytes` out of (or into) one rank spread evenly over its G-1 peers: the intra- and
// inter-node shares travel in parallel on their own links.
// `one_sided`: the bytes are read from the peers (DWDP) rather than sent by collectives.
double TransferUs(const HardwareProfile& hw, int gpus, double bytes, bool one_sided = false) {
  if (gpus <= 1 || bytes <= 0) return 0;
  const int local = std::min(gpus, hw.gpus_per_node);
  const double to_other_nodes = static_cast<double>(gpus - local) / (gpus - 1);
  auto rate = [one_sided](const LinkSpec& link) {
    return (one_sided ? link.one_sided_bytes_per_second() : link.bytes_per_second()) * 1e-6;
  };
  const double intra = bytes * (1 - to_other_nodes) / rate(hw.intra_node);
  const double inter = bytes * to_other_nodes / rate(hw.inter_node);
  return std::max(intra, inter);
}

// DWDP's fetch of `bytes` per rank and layer where the ranks share a device (a CPU server). A read
// from a rank on the same node is a memcpy by the reader's cores (a shared-memory window) through the
// memory the kernel reads: each byte is read once and written once, at the device's copy rate
// shared by the ranks copying at once, and it takes that memory and those cores from the kernel:
//   fetch_us = node_bytes x ranks_per_device / copy_bytes_per_us,   layer = kernel + fetch
// (node_bytes: the bytes from ranks on this node, (local - 1) / (G - 1) of them). Bytes from other
// nodes arrive over the inter-node link's one-sided reads, in parallel with the copies.
double SharedDeviceFetchUs(const HardwareProfile& hw, int gpus, double bytes, const RankRates& rates) {
  if (gpus <= 1 || bytes <= 0) return 0;
  const int local = std::min(gpus, hw.gpus_per_node);
  const double to_other_nodes = static_cast<double>(gpus - local) / (gpus - 1);
  const double copy = bytes * (1 - to_other_nodes) * rates.CopyUsPerByte();
  const double inter = bytes * to_other_nodes / (hw.inter_node.one_sided_bytes_per_second() * 1e-6);
  return std::max(copy, inter);
}

double CollectiveLatencyUs(const HardwareProfile& hw, int gpus) {
  if (gpus <= 1) return 0;
  if (gpus > hw.gpus_per_node) return std::max(hw.intra_node.latency_us, hw.inter_node.latency_us);
  return hw.intra_node.latency_us;
}

// Fixed cost of one of a2a's all-to-all steps (dispatch, combine): the measured all-to-all step
// of the link the group spans, as CollectiveLatencyUs picks the link.
double ExchangeStepUs(const HardwareProfile& hw, int gpus) {
  if (gpus <= 1) return 0;
  if (gpus > hw.gpus_per_node) return std::max(hw.intra_node.exchange_step_us(), hw.inter_node.exchange_step_us());
  return hw.intra_node.exchange_step_us();
}

struct Context {
  const ModelConfig& model;
  const HardwareProfile& hw;
  const PlanConfig& config;
  ModelBytes bytes;
  double expert_flops_per_pick = 0;      // 2 x weights of one expert
  const Placement* placement = nullptr;  // whole experts' placement at the EP size priced; null: trivial

  // A row of partial sums, as the all-gather options reduce-scatter them (bf16 or fp32).
  double PartialSumRowBytes() const { return static_cast<double>(model.hidden) * hw.partial_sum_bytes; }
};

// Whole experts under a balancer's placement: an expert's picks are dealt evenly over its copies.
std::vector<KernelParts> PlacedKernel(const Context& c, const LayerLoad& load, const RankRates& rates) {
  const Placement& placement = *c.placement;
  const int layer = load.layer % placement.num_layers();
  std::vector<KernelParts> per_rank(placement.num_ranks());
  const auto logcnt = placement.logcnt(layer);
  for (int e = 0; e < c.model.num_experts; ++e) {
    const int64_t n = load.picks[e];
    if (n == 0) continue;
    const auto copies = placement.copies(layer, e);
    const int64_t count = logcnt[e];
    for (int64_t j = 0; j < count; ++j) {
      const int64_t share = n / count + (j < n % count ? 1 : 0);
      if (share == 0) continue;
      KernelParts& k = per_rank[placement.rank_of_slot(copies[j])];
      k.bytes += static_cast<double>(c.bytes.expert);
      k.picks += static_cast<double>(share);
      k.Add(static_cast<double>(c.bytes.expert), c.expert_flops_per_pick * share, c.config.formats.experts, rates);
    }
  }
  return per_rank;
}

// Routed experts' kernel per rank under whole or sliced experts: rank of expert e = e * groups / E,
// each group of `slices` ranks holds 1/slices of its experts (slices = G: option 1, 1: options 2/4).
std::vector<KernelParts> RoutedKernel(const Context& c, const LayerLoad& load, int gpus, int slices,
                                      const RankRates& rates) {
  const int groups = gpus / slices;
  const int experts = c.model.num_experts;
  std::vector<KernelParts> per_group(groups);
  for (int e = 0; e < experts; ++e) {
    const int64_t n = load.picks[e];
    if (n == 0) continue;
    KernelParts& k = per_group[static_cast<int64_t>(e) * groups / experts];
    const double bytes = static_cast<double>(c.bytes.expert) / slices;
    k.bytes += bytes;
    k.picks += static_cast<double>(n);
    k.Add(bytes, c.expert_flops_per_pick * n / slices, c.config.formats.experts, rates);
  }
  std::vector<KernelParts> per_rank(gpus);
  for (int g = 0; g < gpus; ++g) per_rank[g] = per_group[g / slices];
  return per_rank;
}

// Option 5: every rank runs every expert its own rows picked. A rank's rows are 1/G of the batch,
// so its picks of expert e are a multinomial share of e's picks.
std::vector<KernelParts> TravelingWeightsKernel(const Context& c, const LayerLoad& load, int gpus,
                                                const RankRates& rates, std::mt19937_64* rng) {
  std::vector<KernelParts> per_rank(gpus);
  std::vector<int64_t> share(gpus);
  std::uniform_int_distribution<int> any_rank(0, gpus - 1);
  for (int e = 0; e < c.model.num_experts; ++e) {
    const int64_t n = load.picks[e];
    if (n == 0) continue;
    std::fill(share.begin(), share.end(), 0);
    if (n <= 4LL * gpus) {
      for (int64_t i = 0; i < n; ++i) ++share[any_rank(*rng)];
    } else {
      int64_t left = n;
      for (int g = 0; g < gpus && left > 0; ++g) {
        share[g] = g + 1 == gpus ? left : std::binomial_distribution<int64_t>(left, 1.0 / (gpus - g))(*rng);
        left -= share[g];
      }
    }
    for (int g = 0; g < gpus; ++g) {
      if (share[g] == 0) continue;
      per_rank[g].bytes += static_cast<double>(c.bytes.expert);
      per_rank[g].picks += static_cast<double>(share[g]);
      per_rank[g].Add(static_cast<double>(c.bytes.expert), c.expert_flops_per_pick * share[g], c.config.formats.experts,
                      rates);
    }
  }
  return per_rank;
}

// The shared expert's part of every rank's kernel: sliced (1/G of it for all rows) or copied
// (all of it for the rank's own rows); the same on every rank.
KernelParts SharedExpertParts(const Context& c, EpOption option, int gpus, int64_t rows, const RankRates& rates) {
  KernelParts shared;
  if (c.bytes.shared_layer == 0) return shared;
  const double flops_all_rows = 2.0 * WeightsPerSharedExpert(c.model) * rows;
  const bool sliced = SharedIsSliced(option, c.config.shared);
  const double bytes = sliced ? static_cast<double>(c.bytes.shared_layer) / gpus : c.bytes.shared_layer;
  const double flops = flops_all_rows / gpus;  // sliced: 1/G of it for every row; copied: all of it for 1/G of rows
  shared.Add(bytes, flops, c.config.formats.shared, rates, /*gemm=*/true);
  return shared;
}

// One dense FFN layer: sliced (all-gather + reduce-scatter of 16-bit rows) or copied (no exchange).
double DenseLayerUs(const Context& c, EpOption option, int gpus, int64_t rows, const RankRates& rates) {
  if (c.model.num_dense_layers == 0) return 0;
  const bool sliced = SharedIsSliced(option, c.config.dense);
  const double rows_per_rank = static_cast<double>(rows) / gpus;
  KernelParts k;
  k.fixed = c.hw.kernel_fixed_us;
  const double flops = 2.0 * WeightsPerDenseLayer(c.model) * rows / gpus;
  k.Add(sliced ? static_cast<double>(c.bytes.dense_layer) / gpus : c.bytes.dense_layer, flops, c.config.formats.dense,
        rates, /*gemm=*/true);
  double comm = 0;
  if (sliced && gpus > 1) {
    const double gathered = rows_per_rank * (gpus - 1) * RowBytes(RowFormat::kBf16, c.model.hidden);
    const double reduced = rows_per_rank * (gpus - 1) * c.PartialSumRowBytes();
    comm = 2 * CollectiveLatencyUs(c.hw, gpus) + TransferUs(c.hw, gpus, gathered) + TransferUs(c.hw, gpus, reduced);
  }
  return k.total() + comm;
}

struct SampleCost {
  double kernel = 0, kernel_mean = 0, comm = 0, layer = 0;
  double read = 0, arith = 0, fixed = 0, rows = 0, read_bytes = 0, copies = 0;
  double inter_bytes = 0, intra_bytes = 0;  // a rank's bytes sent per layer on each link kind, mean over ranks
  double balancedness = 1;
};

// Every rank's kernel for one layer load: routed experts, fixed cost, the picks' rows and the
// shared expert.
std::vector<KernelParts> RankKernels(const Context& c, EpOption option, int gpus, int slices, const LayerLoad& load,
                                     const RankRates& rates, std::mt19937_64* rng) {
  std::vector<KernelParts> per_rank;
  switch (option) {
    case EpOption::kSliced: per_rank = RoutedKernel(c, load, gpus, gpus, rates); break;
    case EpOption::kHybrid: per_rank = RoutedKernel(c, load, gpus, slices, rates); break;
    case EpOption::kWhole:
    case EpOption::kA2a:
      per_rank = c.placement != nullptr ? PlacedKernel(c, load, rates) : RoutedKernel(c, load, gpus, 1, rates);
      break;
    case EpOption::kDwdp: per_rank = TravelingWeightsKernel(c, load, gpus, rates, rng); break;
  }
  double fixed = rates.FixedUs(c.config.formats.experts);
  if (option == EpOption::kSliced || option == EpOption::kHybrid)
    fixed += rates.SlicedExtraUs(c.config.formats.experts);
  // Every pick moves its row through the kernel, however narrow the slice: the input row in the
  // kernel's activation format, the output row written and read back by the combine.
  const double row_us = static_cast<double>(PickRowBytes(c.model, c.config.formats.experts, c.hw.partial_sum_bytes)) *
                        rates.UsPerMemoryByte();
  const KernelParts shared = SharedExpertParts(c, option, gpus, load.rows, rates);
  for (auto& k : per_rank) {
    k.fixed = fixed;
    k.rows = k.picks * row_us;
    k.read += shared.read;
    k.arith += shared.arith;
  }
  return per_rank;
}

// Adds the slowest rank's kernel, its split and the mean rank's to `cost` (TBO adds both
// micro-batches'), and sets the balancedness of the picks.
void SummarizeKernels(const std::vector<KernelParts>& per_rank, EpOption option, SampleCost* cost) {
  const auto slowest =
      std::max_element(per_rank.begin(), per_rank.end(),
                       [](const KernelParts& a, const KernelParts& b) { return a.total() < b.total(); });
  cost->kernel += slowest->total();
  cost->read += slowest->read;
  cost->arith += slowest->arith;
  cost->fixed += slowest->fixed;
  cost->rows += slowest->rows;
  cost->read_bytes += slowest->bytes;
  double sum = 0;
  std::vector<double> rank_picks;
  for (const auto& k : per_rank) {
    sum += k.total();
    rank_picks.push_back(k.picks);
  }
  cost->kernel_mean += sum / static_cast<double>(per_rank.size());
  if (option != EpOption::kSliced) cost->balancedness = Balancedness(rank_picks);
}

// The count exchange of normal mode: every rank's G row counts (8 bytes each) all-gathered.
double CountStepUs(const HardwareProfile& hw, int gpus) {
  if (gpus <= 1) return 0;
  return CollectiveLatencyUs(hw, gpus) + TransferUs(hw, gpus, 8.0 * gpus * (gpus - 1));
}

// Option 4's exchange of one layer load, from the share of the picks each rank computes (a rank
// holding a share f of the picks is reached by 1 - C(E - fE, k) / C(E, k) of the rows, a node by
// the same with its ranks' shares summed). Per rank, each step moves max(sent, received) records
// on each link kind, the two kinds in parallel; the rank with the longest dispatch + combine decides.
//   flat:      one record per (row, rank holding a pick); dispatch = latency + data.
//   two-level: a row bound for another node crosses once per node, to the gateway with the sender's
//              local index (a gateway receives the rows of (G - ranks on its node) / (ranks on its
//              node) senders), which forwards it to each other rank of its node holding a pick (an
//              intra-node step of its own); rows for the home node go straight there, beside the
//              inter-node step. The combine reverses it, one row back per node.
//   normal mode adds the count step (CountStepUs) before the dispatch; low-latency does not.
struct A2aExchange {
  double dispatch = 0, combine = 0;
  double codec_rows = 0;  // the slowest rank's records and outputs it encodes or decodes
  double copies = 0;      // copies of a row sent to other ranks (flat records)
  double inter_bytes = 0, intra_bytes = 0;
};

// What one rank moves in one direction of option 4's exchange, in rows: straight to ranks of its
// node and between nodes (sent, received), and forwarded inside its node by a gateway (two-level).
struct A2aTraffic {
  double sent_intra = 0, received_intra = 0, sent_inter = 0, received_inter = 0;
  double forwarded = 0, forwarded_in = 0;
};

// Rank g's traffic when its rows put weight[h] rows on rank h each (per row of a rank) and
// node_weight[n] on node n (two-level: what crosses to the node). The dispatch's weights are the
// chances that a row reaches a rank (a node); the combine's are the outputs returned (as many, or
// one per pick). Whatever g sends to h, h sends to g by symmetry, so each link's time is
// max(sent, received).
A2aTraffic RankTraffic(const NodeLayout& nodes, int g, bool two_level, double rows_per_rank,
                       const std::vector<double>& weight, const std::vector<double>& node_weight,
                       const std::vector<double>& node_covered) {
  A2aTraffic t;
  const int node = nodes.node_of(g);
  const int on_node = nodes.ranks_on(node);
  const int first = node * nodes.per_node;
  for (int h = 0; h < nodes.gpus; ++h) {
    if (h == g) continue;
    (nodes.node_of(h) == node ? t.sent_intra : t.sent_inter) += rows_per_rank * weight[h];
  }
  t.received_intra = rows_per_rank * (on_node - 1) * weight[g];
  t.received_inter = rows_per_rank * (nodes.gpus - on_node) * weight[g];
  if (!two_level) return t;
  t.sent_inter = 0;
  for (int n = 0; n < nodes.count; ++n)
    if (n != node) t.sent_inter += rows_per_rank * node_weight[n];
  // This gateway's share of the rows crossing to its node: those of (G - L) / L senders.
  const double crossing = rows_per_rank * (nodes.gpus - on_node) / on_node;
  t.received_inter = crossing * node_weight[node];
  if (node_covered[node] > 0) {
    double others = 0;
    for (int h = first; h < first + on_node; ++h)
      if (h != g) others += weight[h];
    t.forwarded = crossing * others;
    t.forwarded_in = (on_node - 1) * crossing * weight[g];
  }
  return t;
}

A2aExchange PriceA2aExchange(const Context& c, const A2aVariant& variant, int gpus, int64_t rows,
                             const std::vector<KernelParts>& per_rank) {
  A2aExchange x;
  if (gpus <= 1) return x;
  const NodeLayout nodes(c.hw, gpus);
  const int experts = c.model.num_experts;
  const int top_k = c.model.top_k;
  double all_picks = 0;
  for (const auto& k : per_rank) all_picks += k.picks;
  // Per rank and node: the chance a row reaches it, and the outputs a row gets back from it (one
  // per pick, or one summed row per rank visited).
  std::vector<double> covered(gpus, 0.0), returned(gpus, 0.0);
  std::vector<double> node_held(nodes.count, 0.0), node_covered(nodes.count, 0.0), node_returned(nodes.count, 0.0);
  double covered_sum = 0;
  for (int g = 0; g < gpus; ++g) {
    const double share = all_picks > 0 ? per_rank[g].picks / all_picks : 0.0;
    covered[g] = 1.0 - ProbabilityNoneHeld(experts, share * experts, top_k);
    returned[g] = c.config.a2a_partial_sums ? covered[g] : share * top_k;
    covered_sum += covered[g];
    node_held[nodes.node_of(g)] += share * experts;
    node_returned[nodes.node_of(g)] += share * top_k;
  }
  for (int n = 0; n < nodes.count; ++n) {
    node_covered[n] = 1.0 - ProbabilityNoneHeld(experts, node_held[n], top_k);
    if (c.config.a2a_partial_sums) node_returned[n] = node_covered[n];
  }
  x.copies = covered_sum * (gpus - 1) / gpus;

  // Rows travel in the dispatch format; outputs come back weighted in the combine format.
  const double out_row = static_cast<double>(RowBytes(c.config.rows, c.model.hidden));
  const double back_row = static_cast<double>(RowBytes(c.config.combine, c.model.hidden));
  const double intra_rate = c.hw.intra_node.bytes_per_second() * 1e-6;  // bytes per us
  const double inter_rate = c.hw.inter_node.bytes_per_second() * 1e-6;
  const bool two_level = variant.levels == A2aLevels::kTwoLevel && nodes.count > 1;
  const double rows_per_rank = static_cast<double>(rows) / gpus;
  // One direction's time: straight to the ranks (both link kinds at once), then the forwarding
  // inside the node (its own step; nothing to forward inside a node of one rank).
  auto direction_us = [&](const A2aTraffic& t, double row_bytes, int on_node) {
    const double direct = std::max(std::max(t.sent_intra, t.received_intra) * row_bytes / intra_rate,
                                   std::max(t.sent_inter, t.received_inter) * row_bytes / inter_rate);
    if (!two_level || on_node < 2) return direct;
    return direct + c.hw.intra_node.exchange_step_us() + std::max(t.forwarded, t.forwarded_in) * row_bytes / intra_rate;
  };
  double worst = -1;
  for (int g = 0; g < gpus; ++g) {
    const int on_node = nodes.ranks_on(nodes.node_of(g));
    const A2aTraffic out = RankTraffic(nodes, g, two_level, rows_per_rank, covered, node_covered, node_covered);
    const A2aTraffic back = RankTraffic(nodes, g, two_level, rows_per_rank, returned, node_returned, node_covered);
    const double dispatch = direction_us(out, out_row, on_node);
    const double combine = direction_us(back, back_row, on_node);
    if (dispatch + combine > worst) {
      worst = dispatch + combine;
      x.dispatch = dispatch;
      x.combine = combine;
      x.codec_rows = out.sent_intra + out.sent_inter + out.received_intra + out.received_inter + back.sent_intra +
                     back.sent_inter + back.received_intra + back.received_inter;
    }
    // What this rank sends: its records out, and the outputs of the records it received.
    x.inter_bytes += out.sent_inter * out_row + back.received_inter * back_row;
    x.intra_bytes += (out.sent_intra + out.forwarded) * out_row + (back.received_intra + back.forwarded_in) * back_row;
  }
  x.inter_bytes /= gpus;
  x.intra_bytes /= gpus;
  const double latency = ExchangeStepUs(c.hw, gpus);
  x.dispatch += latency;
  x.combine += latency;
  if (variant.mode == A2aMode::kNormal) x.dispatch += CountStepUs(c.hw, gpus);
  return x;
}

// a2a's pack and unpack on a CPU server: every number of each record sent or received and each
// output returned or received encoded into its travel format or decoded and added back, on the
// rank's thread, which has a core or, where the device's ranks outnumber its cores, a share of one.
double RowCodecUs(const HardwareProfile& hw, int gpus, double rows, int64_t hidden) {
  const double share = hw.cores > 0 ? std::max(1.0, static_cast<double>(hw.RanksPerDevice(gpus)) / hw.cores) : 1.0;
  return rows * static_cast<double>(hidden) * hw.row_codec_ns * 1e-3 * share;
}

// A layer load split into two micro-batches (TBO): half the rows each, every pick drawn to one of
// them with probability 1/2 (deterministic in rng).
std::pair<LayerLoad, LayerLoad> SplitLoad(const LayerLoad& load, std::mt19937_64* rng) {
  std::pair<LayerLoad, LayerLoad> halves{load, load};
  halves.first.rows = load.rows / 2;
  halves.second.rows = load.rows - halves.first.rows;
  for (size_t e = 0; e < load.picks.size(); ++e) {
    const int64_t first = std::binomial_distribution<int64_t>(load.picks[e], 0.5)(*rng);
    halves.first.picks[e] = first;
    halves.second.picks[e] = load.picks[e] - first;
  }
  return halves;
}

// One batch's stages run by one thread: in order, or with SBO the shared expert beside the dispatch.
double OneAfterOtherUs(const LayerStages& s, bool sbo) {
  return sbo ? SingleBatchOverlapUs(s) : SequentialUs(s);
}

// Option 4 under `variant`: its stages per micro-batch, overlapped as the variant runs them.
SampleCost PriceA2aSample(const Context& c, const A2aVariant& variant, int gpus, const LayerLoad& load,
                          const RankRates& rates, std::mt19937_64* rng) {
  SampleCost cost;
  std::vector<double> rank_picks(gpus, 0.0);  // over both micro-batches
  auto stages_of = [&](const LayerLoad& part) {
    const std::vector<KernelParts> per_rank = RankKernels(c, EpOption::kA2a, gpus, 1, part, rates, rng);
    SummarizeKernels(per_rank, EpOption::kA2a, &cost);
    for (int g = 0; g < gpus; ++g) rank_picks[g] += per_rank[g].picks;
    const A2aExchange x = PriceA2aExchange(c, variant, gpus, part.rows, per_rank);
    cost.copies = x.copies;
    cost.inter_bytes += x.inter_bytes;
    cost.intra_bytes += x.intra_bytes;
    LayerStages stages;
    stages.dispatch = x.dispatch;
    stages.combine = x.combine;
    stages.shared = SharedExpertParts(c, EpOption::kA2a, gpus, part.rows, rates).total();
    double slowest = 0;
    for (const auto& k : per_rank) slowest = std::max(slowest, k.total());
    stages.routed = slowest - stages.shared + RowCodecUs(c.hw, gpus, x.codec_rows, c.model.hidden);
    return stages;
  };
  if (variant.tbo) {
    const auto [first, second] = SplitLoad(load, rng);
    const LayerStages a = stages_of(first);
    const LayerStages b = stages_of(second);
    cost.balancedness = Balancedness(rank_picks);
    cost.kernel = a.compute() + b.compute();
    cost.comm = a.dispatch + a.combine + b.dispatch + b.combine;
    // Where the rank's two lanes outnumber the cores it gets, a lane waiting on its exchange polls
    // MPI on the core the other lane would compute on: the lanes take turns and nothing is hidden.
    cost.layer = c.hw.LanesOutnumberCores(gpus, 2) ? OneAfterOtherUs(a, variant.sbo) + OneAfterOtherUs(b, variant.sbo)
                                                   : TwoBatchOverlapUs(a, b, variant.sbo);
  } else {
    const LayerStages s = stages_of(load);
    cost.kernel = s.compute();
    cost.comm = s.dispatch + s.combine;
    cost.layer = OneAfterOtherUs(s, variant.sbo);
  }
  return cost;
}

SampleCost PriceSample(const Context& c, EpOption option, const A2aVariant& variant, int gpus, int slices,
                       const LayerLoad& load, const RankRates& rates, std::mt19937_64* rng) {
  if (option == EpOption::kA2a) return PriceA2aSample(c, variant, gpus, load, rates, rng);
  const int64_t rows = load.rows;
  const double rows_per_rank = static_cast<double>(rows) / gpus;
  SampleCost cost;
  SummarizeKernels(RankKernels(c, option, gpus, slices, load, rates, rng), option, &cost);
  // Bytes a rank sends to peers spread evenly over its G-1 peers, split by link kind.
  const NodeLayout nodes(c.hw, gpus);
  auto spread = [&](double bytes) {
    for (int g = 0; g < gpus; ++g) {
      cost.inter_bytes += bytes * nodes.remote_share(g) / gpus;
      cost.intra_bytes += bytes * (1 - nodes.remote_share(g)) / gpus;
    }
  };
  // The all-gather moves 16-bit rows and the options reduce-scatter partial sums.
  const double out_row = static_cast<double>(RowBytes(RowFormat::kBf16, c.model.hidden));
  const double back_row = c.PartialSumRowBytes();
  if (option == EpOption::kDwdp) {
    const double fetched = static_cast<double>(DwdpBytesPerRankPerLayer(c.model, c.config.formats.experts, gpus));
    spread(fetched);
    if (c.hw.ranks_share_device) {
      // A CPU server: the fetches are copies on the kernel's cores and memory and add to it.
      cost.comm = SharedDeviceFetchUs(c.hw, gpus, fetched, rates);
      cost.layer = cost.kernel + cost.comm;
    } else {
      // GPUs: one-sided reads start a layer ahead on the copy engines and overlap the kernel.
      cost.comm = TransferUs(c.hw, gpus, fetched, /*one_sided=*/true);
      cost.layer = std::max(cost.kernel, cost.comm);
    }
    return cost;
  }
  // Options 1-3.
  if (gpus > 1) {
    cost.copies = gpus - 1;
    const double gathered = rows_per_rank * (gpus - 1) * out_row;
    const double reduced = rows_per_rank * (gpus - 1) * back_row;
    spread(gathered + reduced);
    cost.comm =
        2 * CollectiveLatencyUs(c.hw, gpus) + TransferUs(c.hw, gpus, gathered) + TransferUs(c.hw, gpus, reduced);
  }
  cost.layer = cost.kernel + cost.comm;
  return cost;
}

// Option 4's variants at one EP size and batch, auto resolved as epmoe run resolves it (low-latency
// up to kAutoLowLatencyMaxRows rows per rank), each once, in the order asked (levels, then mode,
// then without and with TBO, then SBO).
std::vector<A2aVariant> A2aVariants(const PlanConfig& config, const HardwareProfile& hw, int gpus, int64_t batch) {
  const NodeLayout nodes(hw, gpus);
  std::vector<A2aVariant> variants;
  for (A2aLevels levels : config.a2a_levels) {
    for (A2aMode mode : config.a2a_modes) {
      A2aVariant v;
      const int64_t rows_per_rank = (batch + gpus - 1) / gpus;
      v.mode = mode != A2aMode::kAuto                    ? mode
               : rows_per_rank <= kAutoLowLatencyMaxRows ? A2aMode::kLowLatency
                                                         : A2aMode::kNormal;
      v.levels = levels != A2aLevels::kAuto                                            ? levels
                 : v.mode == A2aMode::kNormal && nodes.count > 1 && nodes.per_node > 1 ? A2aLevels::kTwoLevel
                                                                                       : A2aLevels::kFlat;
      for (bool tbo : {false, true}) {
        if (tbo && !config.tbo) continue;
        for (bool sbo : {false, true}) {
          if (sbo && !config.sbo) continue;
          v.tbo = tbo;
          v.sbo = sbo;
          if (std::find(variants.begin(), variants.end(), v) == variants.end()) variants.push_back(v);
        }
      }
    }
  }
  return variants;
}

// Why option 4 cannot run `variant` on a step of `batch` rows, or "".
std::string VariantNotApplicable(const A2aVariant& variant, int64_t batch) {
  if (variant.levels == A2aLevels::kTwoLevel && variant.mode == A2aMode::kLowLatency)
    return "low-latency sends straight to every rank (flat only)";
  if (variant.tbo && batch < 2) return "two-batch overlap needs at least 2 rows to split";
  return "";
}

// Why `option` at `gpus` cannot run, or "" when it can (the hybrid's splits are checked by HybridSplits).
std::string NotApplicable(const ModelConfig& m, EpOption option, int gpus) {
  switch (option) {
    case EpOption::kSliced:
      if (m.expert_intermediate % gpus != 0)
        return fmt::format("expert_intermediate {} is not a multiple of {} ranks", m.expert_intermediate, gpus);
      return "";
    case EpOption::kHybrid:
      if (gpus < 4) return "needs at least 4 ranks (groups of at least 2, sliced at least 2 ways)";
      return "";
    case EpOption::kWhole:
    case EpOption::kA2a:
    case EpOption::kDwdp:
      if (gpus > m.num_experts) return fmt::format("more ranks ({}) than experts ({})", gpus, m.num_experts);
      return "";
  }
  return "";
}

std::vector<int> HybridSplits(const ModelConfig& m, int gpus) {
  std::vector<int> splits;
  for (int slices = 2; slices < gpus; ++slices) {
    if (gpus % slices != 0 || m.expert_intermediate % slices != 0) continue;
    if (gpus / slices > m.num_experts || gpus / slices < 2) continue;
    splits.push_back(slices);
  }
  return splits;
}

OptionCost PriceOption(const Context& c, EpOption option, const A2aVariant& variant, int gpus, int slices,
                       const std::vector<LayerLoad>& loads) {
  OptionCost out;
  out.option = option;
  if (option == EpOption::kA2a) out.a2a = variant;
  out.gpus = gpus;
  out.batch = loads.front().rows;
  out.slices = option == EpOption::kSliced ? gpus : slices;
  const RankRates rates(c.hw, gpus);
  std::mt19937_64 rng(c.config.seed + 7919ULL * gpus + static_cast<uint64_t>(out.batch));
  SampleCost mean;
  double balancedness = 0;
  for (const auto& load : loads) {
    const SampleCost s = PriceSample(c, option, variant, gpus, slices, load, rates, &rng);
    mean.kernel += s.kernel;
    mean.kernel_mean += s.kernel_mean;
    mean.comm += s.comm;
    mean.layer += s.layer;
    mean.read += s.read;
    mean.arith += s.arith;
    mean.fixed += s.fixed;
    mean.rows += s.rows;
    mean.read_bytes += s.read_bytes;
    mean.copies += s.copies;
    mean.inter_bytes += s.inter_bytes;
    mean.intra_bytes += s.intra_bytes;
    balancedness += s.balancedness;
  }
  const double n = static_cast<double>(loads.size());
  out.kernel_us = mean.kernel / n;
  out.kernel_mean_us = mean.kernel_mean / n;
  out.comm_us = mean.comm / n;
  out.layer_us = mean.layer / n;
  out.read_us = mean.read / n;
  out.arith_us = mean.arith / n;
  out.fixed_us = mean.fixed / n;
  out.rows_us = mean.rows / n;
  out.read_gb = mean.read_bytes / n / 1e9;
  out.copies_per_row = mean.copies / n;
  out.exposed_comm_us = out.layer_us - out.kernel_us;
  out.inter_node_mb = mean.inter_bytes / n / 1e6;
  out.intra_node_mb = mean.intra_bytes / n / 1e6;
  out.balancedness = balancedness / n;
  out.imbalance_us = out.kernel_us - out.kernel_mean_us;
  out.dense_us = DenseLayerUs(c, option, gpus, out.batch, rates);
  out.step_ms = (c.model.num_moe_layers() * out.layer_us + c.model.num_dense_layers * out.dense_us) / 1000.0;
  const MemoryPerRank memory =
      ComputeMemoryPerRank(c.model, c.config.formats, option, gpus, c.config.shared, c.config.dense);
  out.memory_bytes = memory.total();
  if (c.placement != nullptr && (option == EpOption::kWhole || option == EpOption::kA2a))
    out.memory_bytes +=
        (c.placement->num_slots() - c.model.num_experts) * c.bytes.expert / gpus * c.model.num_moe_layers();
  out.fits = out.memory_bytes <= c.hw.memory_capacity_gb * 1e9 / c.hw.RanksPerDevice(gpus);
  // What dominates: the largest share of the slowest rank's layer time.
  const std::pair<double, const char*> parts[] = {
      {out.read_us, "reading weights"},       {out.arith_us, "arithmetic"},    {out.rows_us, "moving rows"},
      {out.exposed_comm_us, "communication"}, {out.imbalance_us, "imbalance"}, {out.fixed_us, "fixed costs"}};
  out.dominant = std::max_element(std::begin(parts), std::end(parts))->second;
  return out;
}

// "12.3 us/layer shorter" for how much less the winner spends on a part than the next best.
std::string Compare(double saved_us) {
  if (std::fabs(saved_us) < 0.05) return "the same";
  return fmt::format("{:.1f} us/layer {}", std::fabs(saved_us), saved_us > 0 ? "shorter" : "longer");
}

// The time of the part that dominates a cost (the same parts PriceOption compares).
double DominantUs(const OptionCost& cost) {
  if (cost.dominant == "reading weights") return cost.read_us;
  if (cost.dominant == "arithmetic") return cost.arith_us;
  if (cost.dominant == "moving rows") return cost.rows_us;
  if (cost.dominant == "communication") return cost.exposed_comm_us;
  if (cost.dominant == "imbalance") return cost.imbalance_us;
  return cost.fixed_us;
}

std::string ExplainWinner(const OptionCost& best, const OptionCost* next, bool any_fits) {
  std::string why = fmt::format("{}: {:.0f}% of the layer is {}", CostLabel(best.option, best.slices, best.a2a),
                                100.0 * DominantUs(best) / std::max(best.layer_us, 1e-9), best.dominant);
  if (next != nullptr) {
    const double kernel = next->kernel_us - best.kernel_us;
    const double comm = (next->layer_us - next->kernel_us) - (best.layer_us - best.kernel_us);
    why += fmt::format("; next best {} ({:.2f} ms per step): kernel {}, communication {}",
                       CostLabel(next->option, next->slices, next->a2a), next->step_ms, Compare(kernel), Compare(comm));
  }
  if (!any_fits) why += "; no option fits the weights in memory at this EP size";
  return why;
}

}  // namespace

std::string A2aVariantLabel(const A2aVariant& v) {
  std::string label = "a2a";
  if (v.levels == A2aLevels::kTwoLevel) label += " two-level";
  if (v.mode == A2aMode::kLowLatency) label += " low-latency";
  if (v.tbo) label += " +tbo";
  if (v.sbo) label += " +sbo";
  return label;
}

std::string CostLabel(EpOption option, int slices, const A2aVariant& a2a) {
  if (option == EpOption::kHybrid) return fmt::format("hybrid x{}", slices);
  if (option == EpOption::kA2a) return A2aVariantLabel(a2a);
  return EpOptionName(option);
}

double SequentialUs(const LayerStages& s) {
  return s.dispatch + s.shared + s.routed + s.combine;
}

double SingleBatchOverlapUs(const LayerStages& s) {
  return std::max(s.dispatch, s.shared) + s.routed + s.combine;
}

double TwoBatchOverlapUs(const LayerStages& a, const LayerStages& b, bool sbo) {
  const double first = sbo ? std::max(a.dispatch, a.shared) + std::max(a.routed, b.dispatch)
                           : a.dispatch + std::max(a.compute(), b.dispatch);
  return first + std::max(a.combine, b.compute()) + b.combine;
}

Result<PlanResult> RunPlan(const ModelConfig& model, const HardwareProfile& hw, const PlanConfig& config,
                           const ExpertLoad* trace, const std::string& load_description) {
  EPMOE_RETURN_IF_ERROR(ValidateModel(model, model.name));
  EPMOE_RETURN_IF_ERROR(ValidateHardware(hw, hw.name));
  if (config.batches.empty()) return InvalidArgument("no batch sizes given");
  if (config.gpus.empty()) return InvalidArgument("no EP sizes given");
  EPMOE_RETURN_IF_ERROR(CheckRowWidth(config.rows, model.hidden).WithContext("rows under a2a"));
  if (config.options.empty()) return InvalidArgument("no options given");
  if (config.a2a_levels.empty() || config.a2a_modes.empty())
    return InvalidArgument("no a2a levels or modes given (auto prices what the runtime would run)");
  if (config.samples < 1 || config.samples > 4096)
    return InvalidArgument(fmt::format("samples must be in 1..4096, got {}", config.samples));
  for (int64_t b : config.batches)
    if (b < 1 || b > kMaxBatch) return InvalidArgument(fmt::format("batch {} is out of range 1..{}", b, kMaxBatch));
  for (int g : config.gpus)
    if (g < 1 || g > kMaxGpus) return InvalidArgument(fmt::format("EP size {} is out of range 1..{}", g, kMaxGpus));
  // Bounded work: the even router draws batch x k picks per sample, and every option walks
  // experts x ranks per sample.
  constexpr double kMaxWork = double{1 << 28};
  for (int64_t b : config.batches)
    if (trace == nullptr && static_cast<double>(b) * model.top_k * config.samples > kMaxWork)
      return InvalidArgument(
          fmt::format("batch {} x top-{} x {} samples is more picks than the planner draws ({:.0f}); "
                      "lower --samples",
                      b, model.top_k, config.samples, kMaxWork));
  for (int g : config.gpus)
    if (static_cast<double>(g) * model.num_experts * config.samples > kMaxWork)
      return InvalidArgument(
          fmt::format("{} ranks x {} experts x {} samples is more work than the planner does ({:.0f}); "
                      "lower --samples",
                      g, model.num_experts, config.samples, kMaxWork));

  Context c{model, hw, config, ComputeModelBytes(model, config.formats), 2.0 * WeightsPerExpert(model)};
  PlanResult result;
  result.model = model.name;
  result.hardware = hw.name;
  result.phase = config.phase;
  result.load = load_description;

  // A balancer's placement is fitted on the first half of the trace and priced on the second.
  const bool balanced = config.placement != "trivial";
  std::optional<Policy> policy;
  ExpertLoad fit_load, priced_load;
  if (balanced) {
    auto parsed = ParsePolicy(config.placement);
    if (!parsed.ok()) return parsed.status().WithContext("placement");
    policy = *parsed;
    if (config.redundant < 0)
      return InvalidArgument(fmt::format("redundant copies must not be negative, got {}", config.redundant));
    if (trace != nullptr) {
      if (trace->num_steps < 2)
        return InvalidArgument(
            "a balancer's placement needs a trace of at least 2 steps (fit on one half, priced on the other)");
      fit_load = SliceSteps(*trace, 0, trace->num_steps / 2);
      priced_load = SliceSteps(*trace, trace->num_steps / 2, trace->num_steps);
    } else {
      // The even router: fit on loads of its own, independent of the priced ones.
      const int64_t rows = config.batches.front();
      const auto fit = EvenRouterLoads(model, rows, config.samples, config.seed + 1000003);
      fit_load = ExpertLoad(static_cast<int64_t>(fit.size()), 1, model.num_experts, model.top_k);
      for (size_t s = 0; s < fit.size(); ++s) {
        fit_load.rows[s] = rows;
        std::copy(fit[s].picks.begin(), fit[s].picks.end(), fit_load.at(static_cast<int64_t>(s), 0).begin());
      }
    }
  }
  const ExpertLoad* priced = balanced && trace != nullptr ? &priced_load : trace;
  std::map<int, Result<Placement>> placements;  // per EP size, computed once
  auto placement_for = [&](int gpus) -> const Result<Placement>& {
    auto it = placements.find(gpus);
    if (it != placements.end()) return it->second;
    PolicyOptions options;
    options.policy = *policy;
    options.shape.num_ranks = gpus;
    options.shape.num_nodes = gpus > hw.gpus_per_node && gpus % hw.gpus_per_node == 0 ? gpus / hw.gpus_per_node : 1;
    options.shape.num_groups = model.num_expert_groups;
    options.shape.num_redundant = config.redundant;
    Result<Placement> placement = ValidateBalanceShape(options.shape, model.num_experts).ok()
                                      ? ComputePlacement(fit_load, options)
                                      : Result<Placement>(ValidateBalanceShape(options.shape, model.num_experts));
    return placements.emplace(gpus, std::move(placement)).first->second;
  };

  for (int64_t batch : config.batches) {
    std::vector<LayerLoad> loads;
    if (priced != nullptr) {
      EPMOE_ASSIGN_OR_RETURN(loads, TraceLayerLoads(*priced, model, batch, config.samples, config.seed));
    } else {
      loads = EvenRouterLoads(model, batch, config.samples, config.seed);
    }
    for (int gpus : config.gpus) {
      const size_t first = result.costs.size();
      for (EpOption option : config.options) {
        for (const A2aVariant& variant :
             option == EpOption::kA2a ? A2aVariants(config, hw, gpus, batch) : std::vector<A2aVariant>{{}}) {
          OptionCost cost;
          std::string why_not = NotApplicable(model, option, gpus);
          if (why_not.empty() && option == EpOption::kA2a) why_not = VariantNotApplicable(variant, batch);
          std::vector<int> splits = option == EpOption::kHybrid ? HybridSplits(model, gpus) : std::vector<int>{1};
          if (why_not.empty() && splits.empty())
            why_not = fmt::format("no split of {} ranks into sliced groups fits the model", gpus);
          c.placement = nullptr;
          const bool placed = option == EpOption::kWhole || option == EpOption::kA2a;
          if (why_not.empty() && balanced && placed) {
            const Result<Placement>& placement = placement_for(gpus);
            if (placement.ok()) {
              c.placement = &*placement;
            } else {
              why_not = fmt::format("no {} placement: {}", config.placement, placement.status().message());
            }
          }
          if (!why_not.empty()) {
            cost.option = option;
            cost.gpus = gpus;
            cost.batch = batch;
            if (option == EpOption::kA2a) cost.a2a = variant;
            cost.applicable = false;
            cost.not_applicable = why_not;
          } else {
            for (size_t i = 0; i < splits.size(); ++i) {
              OptionCost candidate = PriceOption(c, option, variant, gpus, splits[i], loads);
              if (i == 0 || candidate.step_ms < cost.step_ms) cost = candidate;
            }
          }
          result.costs.push_back(cost);
        }
      }
      // The winner among the options that run and fit (or that run, when none fits).
      std::vector<const OptionCost*> ranked;
      bool any_fits = false;
      for (size_t i = first; i < result.costs.size(); ++i) {
        if (!result.costs[i].applicable) continue;
        any_fits = any_fits || result.costs[i].fits;
      }
      for (size_t i = first; i < result.costs.size(); ++i)
        if (result.costs[i].applicable && (result.costs[i].fits || !any_fits)) ranked.push_back(&result.costs[i]);
      if (ranked.empty()) continue;
      std::stable_sort(ranked.begin(), ranked.end(),
                       [](const OptionCost* a, const OptionCost* b) { return a->step_ms < b->step_ms; });
      PlanWinner w;
      w.batch = batch;
      w.gpus = gpus;
      w.option = ranked[0]->option;
      w.slices = ranked[0]->slices;
      w.a2a = ranked[0]->a2a;
      w.step_ms = ranked[0]->step_ms;
      w.why = ExplainWinner(*ranked[0], ranked.size() > 1 ? ranked[1] : nullptr, any_fits);
      result.winners.push_back(w);
    }
  }
  return result;
}

}  // namespace epmoe
