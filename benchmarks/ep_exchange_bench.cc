// Traveling rows (a2a): the executor's dispatch + combine exchanges against a raw MPI_Alltoallv pair
// moving the same bytes between the same ranks, in the same run, alternating iteration by
// iteration (medians over iterations reported); and the measured copies per row against
// G (1 - C(E - E/G, k) / C(E, k)).
//
// What each figure holds (per iteration; every counter is the median over iterations, in ms):
//   exchange_ms   the executor's dispatch + combine stages (count alltoall, round all-reduce, row
//                 alltoallv; output alltoallv) as the LAST rank to arrive at each exchange spends
//                 them: per exchange the minimum over ranks. The other ranks' extra time there is
//                 waiting for that rank to finish packing or computing (load imbalance, reported as
//                 wait_ms), which is not exchange work.
//   raw_alltoallv_ms  the same statistic for two MPI_Alltoallv calls moving exactly the bytes the
//                 executor hands MPI (a rank's own records and outputs are copied by the executor's
//                 packing, not by MPI, in both), after a barrier.
//   overhead_pct  exchange_ms / raw_alltoallv_ms - 1 (the target is at most 15%).
//   wait_ms       max over ranks minus min over ranks of the executor's dispatch + combine.
//   pack_ms       the executor's own work around the exchanges, slowest rank: layout, packing and
//                 encoding records, decoding them into expert order, weighting and encoding
//                 outputs, summing returned outputs (pack + unpack stages).
//   with_pack_pct (exchange_ms + pack_ms) / raw_alltoallv_ms - 1: the step's whole traveling-rows
//                 cost against the bare transfer.
//   comm_alltoallv_ms the raw pair's bytes through the Communicator (nonblocking MPI plus the
//                 bounded, polled wait), after a barrier, maximum over ranks.
//
// Run under mpirun (every rank runs the same fixed iteration counts; rank 0 reports):
//   mpirun -np 4 build/benchmarks/ep_exchange_bench
// Shape: qwen3-30b-a3b routing (E = 128, top-8, hidden 2048) with uniform picks. The experts are
// made trivially small (intermediate 16) so the step is mostly the exchange; step times with real
// experts come from `epmoe run --option all`.
#include <mpi.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/synthetic.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

Communicator& World() {
  static std::unique_ptr<Communicator> comm = [] {
    auto world = WorldCommunicator(CommOptions{});
    EPMOE_CHECK_MSG(world.ok(), world.status().ToString());
    return std::move(world).value();
  }();
  return *comm;
}

double MaxOverRanks(double value) {
  double result = 0;
  MPI_Allreduce(&value, &result, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return result;
}

double MinOverRanks(double value) {
  double result = 0;
  MPI_Allreduce(&value, &result, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return result;
}

// args: T (rows per step over all ranks), dispatch format (0 fp32, 1 bf16, 2 q8, 3 q4).
void BM_A2aExchangeVsRawAlltoallv(benchmark::State& state) {
  Communicator& comm = World();
  const int g = comm.size(), me = comm.rank();
  const int64_t total = state.range(0);
  const RowFormat format = static_cast<RowFormat>(state.range(1));
  auto base = LoadModel("qwen3-30b-a3b");
  EPMOE_CHECK(base.ok());
  const ModelConfig model = ScaledModel(*base, 0, 16);
  ThreadPool pool(1);
  ExecutorOptions options;
  options.option = EpOption::kA2a;
  options.dispatch_format = format;
  options.combine_format = RowFormat::kBf16;
  auto executor = CreateExecutor(comm, model, options, pool);
  EPMOE_CHECK_MSG(executor.ok(), executor.status().ToString());

  const int64_t first = RowBegin(total, g, me), n = RowBegin(total, g, me + 1) - first;
  const Matrix rows = SyntheticRows(1, model, 0, first, n);
  const Picks picks = UniformPicks(model, n, 11, first);

  // The same bytes per destination as the executor hands MPI (trivial placement: expert e on rank
  // e / (E/G)): one record per (row, other rank), one bf16 output per pick run on another rank.
  const int k = model.top_k, per_rank = model.num_experts / g;
  const int64_t record = k * 8 + RowBytes(format, model.hidden), output = RowBytes(RowFormat::kBf16, model.hidden);
  std::vector<int> dispatch_send(g, 0), combine_recv(g, 0);
  for (int64_t r = 0; r < n; ++r) {
    std::vector<bool> seen(g, false);
    for (int j = 0; j < k; ++j) {
      const int dest = picks.expert(r, j) / per_rank;
      if (dest == me) continue;
      combine_recv[dest] += static_cast<int>(output);
      if (!seen[dest]) dispatch_send[dest] += static_cast<int>(record);
      seen[dest] = true;
    }
  }
  std::vector<int> dispatch_recv(g), combine_send(g);
  MPI_Alltoall(dispatch_send.data(), 1, MPI_INT, dispatch_recv.data(), 1, MPI_INT, MPI_COMM_WORLD);
  MPI_Alltoall(combine_recv.data(), 1, MPI_INT, combine_send.data(), 1, MPI_INT, MPI_COMM_WORLD);
  auto displs = [](const std::vector<int>& counts) {
    std::vector<int> d(counts.size(), 0);
    for (size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
    return d;
  };
  const auto ds_d = displs(dispatch_send), dr_d = displs(dispatch_recv), cs_d = displs(combine_send),
             cr_d = displs(combine_recv);
  std::vector<char> ds(ds_d.back() + dispatch_send.back()), dr(dr_d.back() + dispatch_recv.back()),
      cs(cs_d.back() + combine_send.back()), cr(cr_d.back() + combine_recv.back());

  std::vector<double> exchange_us, raw_us, wrapper_us, wait_us, pack_us;
  std::vector<int64_t> ds_b(dispatch_send.begin(), dispatch_send.end()), dr_b(dispatch_recv.begin(), dispatch_recv.end()),
      cs_b(combine_send.begin(), combine_send.end()), cr_b(combine_recv.begin(), combine_recv.end());
  std::vector<int64_t> ds_o(ds_d.begin(), ds_d.end()), dr_o(dr_d.begin(), dr_d.end()), cs_o(cs_d.begin(), cs_d.end()),
      cr_o(cr_d.begin(), cr_d.end());
  double copies = 0, rows_seen = 0;
  auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
  };
  for (auto _ : state) {
    Matrix out;
    StepStats st;
    MPI_Barrier(MPI_COMM_WORLD);
    const Status status = (*executor)->Forward(0, rows, picks, &out, &st);
    EPMOE_CHECK_MSG(status.ok(), status.ToString());
    const double ours = MinOverRanks(st.dispatch_us) + MinOverRanks(st.combine_us);
    wait_us.push_back(MaxOverRanks(st.dispatch_us + st.combine_us) - MinOverRanks(st.dispatch_us + st.combine_us));
    pack_us.push_back(MaxOverRanks(st.pack_us + st.unpack_us));
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = std::chrono::steady_clock::now();
    MPI_Alltoallv(ds.data(), dispatch_send.data(), ds_d.data(), MPI_BYTE, dr.data(), dispatch_recv.data(), dr_d.data(),
                  MPI_BYTE, MPI_COMM_WORLD);
    const double raw_dispatch = since(t0);
    t0 = std::chrono::steady_clock::now();
    MPI_Alltoallv(cs.data(), combine_send.data(), cs_d.data(), MPI_BYTE, cr.data(), combine_recv.data(), cr_d.data(),
                  MPI_BYTE, MPI_COMM_WORLD);
    const double raw = MinOverRanks(raw_dispatch) + MinOverRanks(since(t0));
    // The same two exchanges through the Communicator (nonblocking MPI plus the bounded, polled
    // wait): the transport wrapper's own cost, without the executor's work between exchanges.
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t1 = std::chrono::steady_clock::now();
    EPMOE_CHECK(comm.Alltoallv(ds.data(), ds_b, ds_o, dr.data(), dr_b, dr_o).ok());
    EPMOE_CHECK(comm.Alltoallv(cs.data(), cs_b, cs_o, cr.data(), cr_b, cr_o).ok());
    wrapper_us.push_back(MaxOverRanks(since(t1)));
    exchange_us.push_back(ours);
    raw_us.push_back(raw);
    copies += static_cast<double>(st.row_copies);
    rows_seen += static_cast<double>(st.rows);
    state.SetIterationTime(ours * 1e-6);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  const double ours_median = median(exchange_us), raw_median = median(raw_us);
  double all_copies = 0, all_rows = 0;
  MPI_Allreduce(&copies, &all_copies, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&rows_seen, &all_rows, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  state.counters["ranks"] = g;
  // Medians over iterations (the machine is shared and noisy).
  state.counters["exchange_ms"] = ours_median / 1000;
  state.counters["raw_alltoallv_ms"] = raw_median / 1000;
  state.counters["overhead_pct"] = raw_median > 0 ? 100.0 * (ours_median / raw_median - 1.0) : 0;
  state.counters["comm_alltoallv_ms"] = median(wrapper_us) / 1000;
  state.counters["wait_ms"] = median(wait_us) / 1000;
  state.counters["pack_ms"] = median(pack_us) / 1000;
  state.counters["with_pack_pct"] =
      raw_median > 0 ? 100.0 * ((ours_median + median(pack_us)) / raw_median - 1.0) : 0;
  state.counters["copies_per_row"] = all_rows > 0 ? all_copies / all_rows : 0;
  state.counters["expected_copies"] = ExpectedCopiesPerRow(model.num_experts, model.top_k, g);
  // Bytes this rank (rank 0) sends to other ranks per step.
  state.counters["MB_per_rank"] = static_cast<double>(ds.size() + cs.size()) / 1e6;
}

// Fixed iteration counts: every rank must run the same number of collective iterations.
BENCHMARK(BM_A2aExchangeVsRawAlltoallv)
    ->ArgNames({"T", "fmt"})
    ->Args({64, 1})->Args({256, 1})->Args({4096, 1})->Args({256, 2})
    ->Iterations(20)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace epmoe

int main(int argc, char** argv) {
  epmoe::World();  // initializes MPI
  benchmark::Initialize(&argc, argv);
  if (epmoe::World().rank() == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    // Other ranks run the same benchmarks silently.
    class Silent : public benchmark::BenchmarkReporter {
     public:
      bool ReportContext(const Context&) override { return true; }
      void ReportRuns(const std::vector<Run>&) override {}
    } silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  return 0;
}
