// Traveling rows (a2a): the executor's dispatch + combine exchanges against a raw MPI_Alltoallv pair
// moving the same bytes between the same ranks, in the same run, alternating iteration by
// iteration (medians over iterations reported); and the measured copies per row against
// G (1 - C(E - E/G, k) / C(E, k)).
//
// What each figure holds (per iteration; every counter is the median over iterations, in ms):
//   exchange_ms   the executor's dispatch + combine stages (count all-gather wait, row
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
//   counts_ms, rows_ms, outputs_ms  the executor's three exchanges apart (its wait for the count
//                 all-gather, which travels while records are packed; the row alltoallv; the output
//                 alltoallv), each as the last rank to arrive spends it (minimum over ranks).
//   raw_fresh_ms  the raw pair with its send buffers written just before each call (as the
//                 executor's are), same statistic.
//   raw_cold_ms   the same, with each rank's caches first filled with 4 MiB of other data (as the
//                 executor's work between exchanges fills them), same statistic.
//   out_skew_ms, out_last_post_ms, out_last_wait_ms  the output alltoallv on the rank that started
//                 it last: how long after the first rank it started, how long posting its
//                 messages took, and how long it then waited for what was sent to it.
//   sends_ms      finishing the previous step's row and output sends (the executor waits only for
//                 what it receives and finishes its sends before it reuses their buffers), same
//                 statistic; part of exchange_ms.
//   nbc_wait_ms   the raw pair as nonblocking collectives (MPI_Ialltoallv, Open MPI's libnbc)
//                 completed by a blocking MPI_Wait, same statistic.
//   comm_alltoallv_ms the raw pair's bytes through the Communicator (its alltoallv and its bounded,
//                 polled wait), after a barrier, same statistic.
//
// Run under mpirun (every rank runs the same fixed iteration counts; rank 0 reports):
//   mpirun -np 4 build/benchmarks/ep_exchange_bench
// Shape: qwen3-30b-a3b routing (E = 128, top-8, hidden 2048) with uniform picks. The experts are
// made trivially small (intermediate 16) so the step is mostly the exchange; step times with real
// experts come from `epmoe run --option all`.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/executor.h"
#include "epmoe/load_figures.h"
#include "epmoe/row_codec.h"
#include "epmoe/statistics.h"
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

// Forwards every call to another Communicator and times, on this rank, each exchange it started
// (the time starting it plus the time its Wait took; the blocking forms are Start + Wait), in the
// order the waits finish: what the executor spends in each exchange of a step. Not thread-safe (the bench drives it
// from one thread).
class TimingCommunicator : public Communicator {
 public:
  explicit TimingCommunicator(Communicator& inner) : inner_(inner) {}

  // Microseconds of each wait since the last Clear(), in order, and what it was; and for each, when
  // its exchange was started and when the wait returned (steady_clock, microseconds: one clock for
  // every rank of a machine), and how long starting it took.
  std::vector<double> wait_us;
  std::vector<std::string> wait_what;
  std::vector<double> started_at_us, done_at_us, start_us;
  void Clear() {
    wait_us.clear();
    wait_what.clear();
    started_at_us.clear();
    done_at_us.clear();
    start_us.clear();
  }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int node_of(int rank) const override { return inner_.node_of(rank); }
  int num_nodes() const override { return inner_.num_nodes(); }
  std::string description() const override { return inner_.description(); }
  Status Barrier() override { return inner_.Barrier(); }
  Result<std::unique_ptr<Request>> StartAllgatherv(const void* send, int64_t send_bytes, void* recv,
                                                   std::span<const int64_t> recv_bytes,
                                                   std::span<const int64_t> recv_offsets) override {
    return Timed("allgatherv",
                 [&] { return inner_.StartAllgatherv(send, send_bytes, recv, recv_bytes, recv_offsets); });
  }
  Result<std::unique_ptr<Request>> StartReduceScatter(const float* send, float* recv,
                                                      std::span<const int64_t> recv_counts) override {
    return Timed("reduce-scatter", [&] { return inner_.StartReduceScatter(send, recv, recv_counts); });
  }
  Result<std::unique_ptr<Request>> StartAllreduce(float* data, int64_t count) override {
    return Timed("allreduce", [&] { return inner_.StartAllreduce(data, count); });
  }
  Result<std::unique_ptr<Request>> StartAlltoallv(const void* send, std::span<const int64_t> send_bytes,
                                                  std::span<const int64_t> send_offsets, void* recv,
                                                  std::span<const int64_t> recv_bytes,
                                                  std::span<const int64_t> recv_offsets) override {
    return Timed("alltoallv",
                 [&] { return inner_.StartAlltoallv(send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets); });
  }
  Result<std::unique_ptr<Request>> StartCappedAlltoallv(const void* send, std::span<const int64_t> send_bytes,
                                                        std::span<const int64_t> send_offsets, void* recv,
                                                        int64_t capacity, std::span<int64_t> received_bytes) override {
    return Timed("capped alltoallv", [&] {
      return inner_.StartCappedAlltoallv(send, send_bytes, send_offsets, recv, capacity, received_bytes);
    });
  }
  Result<std::unique_ptr<CappedExchange>> CreateCappedExchange(void* recv, int64_t capacity) override {
    return inner_.CreateCappedExchange(recv, capacity);
  }
  Status ExchangeCounts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    return inner_.ExchangeCounts(send, recv);
  }
  Status AllgatherInt64(std::span<const int64_t> send, std::span<int64_t> recv) override {
    return inner_.AllgatherInt64(send, recv);
  }
  Status AllgatherDouble(std::span<const double> send, std::span<double> recv) override {
    return inner_.AllgatherDouble(send, recv);
  }
  Result<int64_t> AllreduceMax(int64_t value) override { return inner_.AllreduceMax(value); }
  Result<double> AllreduceSum(double value) override { return inner_.AllreduceSum(value); }
  Result<std::unique_ptr<Window>> AllocateWindow(int64_t bytes) override { return inner_.AllocateWindow(bytes); }
  bool concurrent_threads() const override { return inner_.concurrent_threads(); }
  void Progress() override { inner_.Progress(); }
  Result<std::unique_ptr<Communicator>> Split(int color, int key) override { return inner_.Split(color, key); }
  [[noreturn]] void Abort(int exit_code) override {
    inner_.Abort(exit_code);
    std::abort();
  }

 private:
  class TimedRequest : public Request {
   public:
    TimedRequest(TimingCommunicator* owner, const char* what, double started_at_us, double start_us,
                 std::unique_ptr<Request> inner)
        : owner_(owner), what_(what), started_at_us_(started_at_us), start_us_(start_us), inner_(std::move(inner)) {}
    Status Wait() override { return Timed(&Request::Wait, ""); }
    Status WaitReceived() override { return Timed(&Request::WaitReceived, " received"); }
    bool Test() override { return inner_->Test(); }

   private:
    // Times one wait; the first one also counts the time starting the exchange took.
    Status Timed(Status (Request::*wait)(), const char* side) {
      const auto start = std::chrono::steady_clock::now();
      Status status = (inner_.get()->*wait)();
      const auto done = std::chrono::steady_clock::now();
      owner_->wait_us.push_back(start_us_ + std::chrono::duration<double, std::micro>(done - start).count());
      owner_->wait_what.push_back(std::string(what_) + side);
      owner_->started_at_us.push_back(started_at_us_);
      owner_->done_at_us.push_back(AbsoluteUs(done));
      owner_->start_us.push_back(start_us_);
      start_us_ = 0;
      return status;
    }

    TimingCommunicator* owner_;
    const char* what_;
    double started_at_us_;
    double start_us_;  // the time starting it took, counted with its first wait
    std::unique_ptr<Request> inner_;
  };
  template <typename StartFn>
  Result<std::unique_ptr<Request>> Timed(const char* what, StartFn start_exchange) {
    const auto start = std::chrono::steady_clock::now();
    Result<std::unique_ptr<Request>> started = start_exchange();
    const double start_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    if (!started.ok()) return started.status();
    return std::unique_ptr<Request>(
        new TimedRequest(this, what, AbsoluteUs(start), start_us, std::move(started).value()));
  }
  static double AbsoluteUs(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
  }

  Communicator& inner_;
};

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

// qwen3-30b-a3b's routing (E = 128, top-8, hidden 2048) with experts of intermediate 16, so a
// step is mostly the exchange.
ModelConfig ExchangeModel() {
  auto base = LoadModel("qwen3-30b-a3b");
  EPMOE_CHECK(base.ok());
  return ScaledModel(*base, 0, 16);
}

// args: T (rows per step over all ranks), dispatch format (0 fp32, 1 bf16, 2 q8, 3 q4).
void BM_A2aExchangeVsRawAlltoallv(benchmark::State& state) {
  Communicator& comm = World();
  const int g = comm.size(), me = comm.rank();
  const int64_t total = state.range(0);
  const RowFormat format = static_cast<RowFormat>(state.range(1));
  const ModelConfig model = ExchangeModel();
  ThreadPool pool(1);
  ExecutorOptions options;
  options.option = EpOption::kA2a;
  options.dispatch_format = format;
  options.combine_format = RowFormat::kBf16;
  TimingCommunicator timed(comm);
  auto executor = CreateExecutor(timed, model, options, pool);
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

  std::vector<double> exchange_us, raw_us, wrapper_us, wait_us, pack_us, counts_us, rows_us, outputs_us, nbc_us,
      fresh_us, cold_us, sends_us, out_skew_us, out_post_us, out_wait_us;
  std::vector<char> evict(4 << 20);
  std::vector<int64_t> ds_b(dispatch_send.begin(), dispatch_send.end()),
      dr_b(dispatch_recv.begin(), dispatch_recv.end()), cs_b(combine_send.begin(), combine_send.end()),
      cr_b(combine_recv.begin(), combine_recv.end());
  std::vector<int64_t> ds_o(ds_d.begin(), ds_d.end()), dr_o(dr_d.begin(), dr_d.end()), cs_o(cs_d.begin(), cs_d.end()),
      cr_o(cr_d.begin(), cr_d.end());
  double copies = 0, rows_seen = 0;
  auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
  };
  // The step's two exchanges of raw bytes: side 0 the dispatch, side 1 the combine.
  auto raw_alltoallv = [&](int side) {
    if (side == 0) {
      MPI_Alltoallv(ds.data(), dispatch_send.data(), ds_d.data(), MPI_BYTE, dr.data(), dispatch_recv.data(),
                    dr_d.data(), MPI_BYTE, MPI_COMM_WORLD);
    } else {
      MPI_Alltoallv(cs.data(), combine_send.data(), cs_d.data(), MPI_BYTE, cr.data(), combine_recv.data(),
                    cr_d.data(), MPI_BYTE, MPI_COMM_WORLD);
    }
  };
  // Both sides after a barrier, each timed on every rank (`prepare` runs untimed before each): the
  // last-arriving rank's time of the dispatch plus that of the combine.
  auto time_pair = [&](auto prepare, auto exchange) {
    MPI_Barrier(MPI_COMM_WORLD);
    double side_us[2];
    for (int side = 0; side < 2; ++side) {
      prepare(side);
      const auto t0 = std::chrono::steady_clock::now();
      exchange(side);
      side_us[side] = since(t0);
    }
    return MinOverRanks(side_us[0]) + MinOverRanks(side_us[1]);
  };
  const auto untouched = [](int) {};
  for (auto _ : state) {
    Matrix out;
    StepStats st;
    MPI_Barrier(MPI_COMM_WORLD);
    timed.Clear();
    const Status status = (*executor)->Forward(0, rows, picks, &out, &st);
    EPMOE_CHECK_MSG(status.ok(), status.ToString());
    const double ours = MinOverRanks(st.dispatch_us) + MinOverRanks(st.combine_us);
    wait_us.push_back(MaxOverRanks(st.dispatch_us + st.combine_us) - MinOverRanks(st.dispatch_us + st.combine_us));
    pack_us.push_back(MaxOverRanks(st.pack_us + st.unpack_us));
    // The step's exchanges one by one (one round: counts, rows, outputs, and the previous step's
    // sends finished first), each as the last rank to arrive spends it.
    double counts = 0, sends = 0;
    std::vector<double> received, completed;
    for (size_t i = 0; i < timed.wait_us.size(); ++i) {
      const std::string& what = timed.wait_what[i];
      if (what == "allgatherv") counts += timed.wait_us[i];
      if (what == "alltoallv received") received.push_back(timed.wait_us[i]);
      if (what == "alltoallv") completed.push_back(timed.wait_us[i]);
    }
    // An executor that completes each exchange wholly has no sends left to finish.
    if (received.empty()) std::swap(received, completed);
    for (double us : completed) sends += us;
    EPMOE_CHECK_MSG(received.size() == 2, "the bench expects one round: a row and an output alltoallv");
    const std::vector<double>& alltoallv = received;
    counts_us.push_back(MinOverRanks(counts));
    rows_us.push_back(MinOverRanks(alltoallv[0]));
    outputs_us.push_back(MinOverRanks(alltoallv[1]));
    {
      // The output exchange on the rank that started it last: how long after the first rank it
      // started (skew), how long posting its messages took, and how long it then waited.
      std::vector<size_t> at;
      for (size_t i = 0; i < timed.wait_what.size(); ++i)
        if (timed.wait_what[i] == "alltoallv received") at.push_back(i);
      const size_t i = at[1];
      const double mine[3] = {timed.started_at_us[i], timed.start_us[i], timed.done_at_us[i]};
      std::vector<double> all(3 * g);
      MPI_Allgather(mine, 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, MPI_COMM_WORLD);
      int last = 0;
      double first_start = all[0];
      for (int r = 0; r < g; ++r) {
        if (all[3 * r] > all[3 * last]) last = r;
        first_start = std::min(first_start, all[3 * r]);
      }
      out_skew_us.push_back(all[3 * last] - first_start);
      out_post_us.push_back(all[3 * last + 1]);
      out_wait_us.push_back(all[3 * last + 2] - all[3 * last] - all[3 * last + 1]);
    }
    sends_us.push_back(MinOverRanks(sends));
    const double raw = time_pair(untouched, raw_alltoallv);
    // The raw pair again with its send buffers written just before each call, as the executor's
    // are (packed records, encoded outputs): the bytes leave from this core's cache, not memory.
    const char fill = static_cast<char>(raw_us.size());
    fresh_us.push_back(time_pair(
        [&](int side) {
          std::vector<char>& send = side == 0 ? ds : cs;
          std::fill(send.begin(), send.end(), fill);
        },
        raw_alltoallv));
    // The raw pair again with its send buffers written just before each call and this rank's
    // caches first filled with other data (4 MiB written, more than a core's L2), as the
    // executor's work between exchanges fills them: the bytes land in memory that is not cached.
    cold_us.push_back(time_pair(
        [&](int side) {
          std::fill(evict.begin(), evict.end(), fill);
          std::vector<char>& send = side == 0 ? ds : cs;
          std::fill(send.begin(), send.end(), fill);
        },
        raw_alltoallv));
    // The same pair as nonblocking collectives (libnbc) completed by a blocking MPI_Wait.
    nbc_us.push_back(time_pair(untouched, [&](int side) {
      MPI_Request request;
      if (side == 0) {
        MPI_Ialltoallv(ds.data(), dispatch_send.data(), ds_d.data(), MPI_BYTE, dr.data(), dispatch_recv.data(),
                       dr_d.data(), MPI_BYTE, MPI_COMM_WORLD, &request);
      } else {
        MPI_Ialltoallv(cs.data(), combine_send.data(), cs_d.data(), MPI_BYTE, cr.data(), combine_recv.data(),
                       cr_d.data(), MPI_BYTE, MPI_COMM_WORLD, &request);
      }
      MPI_Wait(&request, MPI_STATUS_IGNORE);
    }));
    // The same pair through the Communicator (its alltoallv and its bounded wait): the transport
    // wrapper's own cost, without the executor's work between exchanges.
    wrapper_us.push_back(time_pair(untouched, [&](int side) {
      const Status status = side == 0 ? comm.Alltoallv(ds.data(), ds_b, ds_o, dr.data(), dr_b, dr_o)
                                      : comm.Alltoallv(cs.data(), cs_b, cs_o, cr.data(), cr_b, cr_o);
      EPMOE_CHECK(status.ok());
    }));
    exchange_us.push_back(ours);
    raw_us.push_back(raw);
    copies += static_cast<double>(st.row_copies);
    rows_seen += static_cast<double>(st.rows);
    state.SetIterationTime(ours * 1e-6);
  }
  const double ours_median = Median(exchange_us), raw_median = Median(raw_us);
  double all_copies = 0, all_rows = 0;
  MPI_Allreduce(&copies, &all_copies, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&rows_seen, &all_rows, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  state.counters["ranks"] = g;
  // Medians over iterations (the machine is shared and noisy).
  state.counters["exchange_ms"] = ours_median / 1000;
  state.counters["raw_alltoallv_ms"] = raw_median / 1000;
  state.counters["overhead_pct"] = raw_median > 0 ? 100.0 * (ours_median / raw_median - 1.0) : 0;
  state.counters["counts_ms"] = Median(counts_us) / 1000;
  state.counters["rows_ms"] = Median(rows_us) / 1000;
  state.counters["outputs_ms"] = Median(outputs_us) / 1000;
  state.counters["sends_ms"] = Median(sends_us) / 1000;
  state.counters["out_skew_ms"] = Median(out_skew_us) / 1000;
  state.counters["out_last_post_ms"] = Median(out_post_us) / 1000;
  state.counters["out_last_wait_ms"] = Median(out_wait_us) / 1000;
  state.counters["nbc_wait_ms"] = Median(nbc_us) / 1000;
  state.counters["raw_fresh_ms"] = Median(fresh_us) / 1000;
  state.counters["raw_cold_ms"] = Median(cold_us) / 1000;
  state.counters["comm_alltoallv_ms"] = Median(wrapper_us) / 1000;
  state.counters["wait_ms"] = Median(wait_us) / 1000;
  state.counters["pack_ms"] = Median(pack_us) / 1000;
  state.counters["with_pack_pct"] = raw_median > 0 ? 100.0 * ((ours_median + Median(pack_us)) / raw_median - 1.0) : 0;
  state.counters["copies_per_row"] = all_rows > 0 ? all_copies / all_rows : 0;
  state.counters["expected_copies"] = ExpectedRanksPerRow(model.num_experts, model.top_k, g);
  // Bytes this rank (rank 0) sends to other ranks per step.
  state.counters["MB_per_rank"] = static_cast<double>(ds.size() + cs.size()) / 1e6;
}

// Fixed iteration counts: every rank must run the same number of collective iterations.
BENCHMARK(BM_A2aExchangeVsRawAlltoallv)
    ->ArgNames({"T", "fmt"})
    ->Args({64, 1})
    ->Args({256, 1})
    ->Args({4096, 1})
    ->Args({256, 2})
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// a2a's two modes on the same rows and picks, alternating step by step (which goes first
// alternates too): normal (count all-gather, then alltoallv) against low-latency (buffers sized
// at creation for the largest rank's share of T, one capped message per peer, no counts).
// Per step and mode: the dispatch + combine stages as the last rank to arrive spends each
// (minimum over ranks, as exchange_ms above) and the whole Forward on the slowest rank; medians.
//   mpirun -np 4 build/benchmarks/ep_exchange_bench --benchmark_filter=A2aModes
void BM_A2aModes(benchmark::State& state) {
  Communicator& comm = World();
  const int g = comm.size(), me = comm.rank();
  const int64_t total = state.range(0);
  const ModelConfig model = ExchangeModel();
  ThreadPool pool(1);
  ExecutorOptions options;
  options.option = EpOption::kA2a;
  options.dispatch_format = RowFormat::kBf16;
  options.combine_format = RowFormat::kBf16;
  options.max_rows_per_rank = RowBegin(total, g, 1);
  std::unique_ptr<MoeExecutor> executors[2];
  for (int mode = 0; mode < 2; ++mode) {
    options.a2a_mode = mode == 0 ? A2aMode::kNormal : A2aMode::kLowLatency;
    auto executor = CreateExecutor(comm, model, options, pool);
    EPMOE_CHECK_MSG(executor.ok(), executor.status().ToString());
    executors[mode] = std::move(executor).value();
  }
  const int64_t first = RowBegin(total, g, me), n = RowBegin(total, g, me + 1) - first;
  const Matrix rows = SyntheticRows(1, model, 0, first, n);
  const Picks picks = UniformPicks(model, n, 11, first);
  std::vector<double> exchange_us[2], step_us[2];
  int iteration = 0;
  for (auto _ : state) {
    for (int i = 0; i < 2; ++i) {
      const int mode = (iteration + i) % 2;
      Matrix out;
      StepStats st;
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = std::chrono::steady_clock::now();
      const Status status = executors[mode]->Forward(0, rows, picks, &out, &st);
      const double wall = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      EPMOE_CHECK_MSG(status.ok(), status.ToString());
      exchange_us[mode].push_back(MinOverRanks(st.dispatch_us) + MinOverRanks(st.combine_us));
      step_us[mode].push_back(MaxOverRanks(wall));
    }
    state.SetIterationTime(exchange_us[1].back() * 1e-6);
    ++iteration;
  }
  const double normal = Median(exchange_us[0]), low_latency = Median(exchange_us[1]);
  state.counters["ranks"] = g;
  state.counters["normal_exchange_ms"] = normal / 1000;
  state.counters["low_latency_exchange_ms"] = low_latency / 1000;
  state.counters["low_latency_pct"] = normal > 0 ? 100.0 * (low_latency / normal - 1.0) : 0;
  state.counters["normal_step_ms"] = Median(step_us[0]) / 1000;
  state.counters["low_latency_step_ms"] = Median(step_us[1]) / 1000;
}

BENCHMARK(BM_A2aModes)
    ->ArgNames({"T"})
    ->Args({16})
    ->Args({64})
    ->Args({256})
    ->Args({1024})
    ->Args({4096})
    ->Iterations(200)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Low-latency's dispatch as one-sided puts (DeepEP's low-latency kernels write each record
// straight into the receiver's buffer and then set a flag there): every rank exposes a window of
// one capacity-sized slot per sender and a flag per sender; a sender puts each peer's block (its
// 8-byte header holding the block's size) into its slot on that peer, completes the puts
// (MPI_Win_flush_all), then writes the exchange's sequence number into its flag there; a receiver
// polls its flags until every peer's shows this exchange. A sender puts into a slot again only
// after its receiver has sent back that exchange's outputs (the combine), so one slot per sender
// suffices. Raw MPI here because it is measured
// against the Communicator's transports, not yet one of them. Null when MPI has no one-sided
// transport between these ranks (Open MPI's TCP transport under MPI_THREAD_MULTIPLE).
class OneSidedDispatch {
 public:
  static std::unique_ptr<OneSidedDispatch> Create(int64_t capacity) {
    int g = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &g);
    const int64_t bytes = g * capacity + g * static_cast<int64_t>(sizeof(int64_t));
    void* base = nullptr;
    MPI_Win window = MPI_WIN_NULL;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    const int code = MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &window);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL);
    // Every rank is refused alike (the transports are the job's), so no window is left to free.
    if (code != MPI_SUCCESS) return nullptr;
    std::memset(base, 0, bytes);
    MPI_Win_lock_all(MPI_MODE_NOCHECK, window);
    MPI_Barrier(MPI_COMM_WORLD);  // every flag zeroed before any peer writes one
    return std::unique_ptr<OneSidedDispatch>(new OneSidedDispatch(g, capacity, base, window));
  }
  ~OneSidedDispatch() {
    MPI_Win_unlock_all(window_);
    MPI_Win_free(&window_);
  }
  OneSidedDispatch(const OneSidedDispatch&) = delete;
  OneSidedDispatch& operator=(const OneSidedDispatch&) = delete;

  // Puts `send`'s block for each peer (sizes `bytes`, at `offsets`; this rank's own skipped), then
  // the flags. The blocks' first 8 bytes must hold their sizes.
  void Start(const uint8_t* send, std::span<const int64_t> bytes, std::span<const int64_t> offsets) {
    ++sequence_;
    for (int s = 0; s < g_; ++s)
      if (s != me_ && bytes[s] > 0)
        MPI_Put(send + offsets[s], static_cast<int>(bytes[s]), MPI_BYTE, s, static_cast<MPI_Aint>(me_ * capacity_),
                static_cast<int>(bytes[s]), MPI_BYTE, window_);
    MPI_Win_flush_all(window_);  // the records are in place before the flag says so
    for (int s = 0; s < g_; ++s)
      if (s != me_)
        MPI_Accumulate(&sequence_, 1, MPI_INT64_T, s, static_cast<MPI_Aint>(g_ * capacity_ + me_ * sizeof(int64_t)), 1,
                       MPI_INT64_T, MPI_REPLACE, window_);
    MPI_Win_flush_all(window_);  // sequence_ may change once the flags have landed
  }

  // Waits for every peer's flag of the last Start; `received[s]` gets the size of s's block.
  void WaitReceived(std::span<int64_t> received) {
    const auto* flags = reinterpret_cast<const int64_t*>(static_cast<uint8_t*>(base_) + g_ * capacity_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (int s = 0; s < g_; ++s) {
      if (s == me_) continue;
      while (__atomic_load_n(&flags[s], __ATOMIC_ACQUIRE) != sequence_) {
        int arrived = 0;  // drives MPI's progress, which a transport without remote memory access needs
        MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &arrived, MPI_STATUS_IGNORE);
        MPI_Win_sync(window_);
        EPMOE_CHECK_MSG(std::chrono::steady_clock::now() < deadline, "one-sided dispatch: no flag from a peer in 60 s");
      }
      std::memcpy(&received[s], slot(s), sizeof(int64_t));
    }
    received[me_] = 0;
  }

  const uint8_t* slot(int sender) const { return static_cast<const uint8_t*>(base_) + sender * capacity_; }

 private:
  OneSidedDispatch(int g, int64_t capacity, void* base, MPI_Win window)
      : g_(g), capacity_(capacity), base_(base), window_(window) {
    MPI_Comm_rank(MPI_COMM_WORLD, &me_);
  }
  int g_ = 0, me_ = 0;
  int64_t capacity_ = 0;
  int64_t sequence_ = 0;
  void* base_ = nullptr;
  MPI_Win window_ = MPI_WIN_NULL;
};

// Low-latency mode's transports for its dispatch on the same bytes, in turn iteration by iteration
// (which goes first rotates too): (a) StartCappedAlltoallv, a receive of the capacity posted per
// peer and exchange, (b) CappedExchange, receives posted ahead and re-armed as the executor does
// (once the records are read, before the combine), and (c) OneSidedDispatch's puts, where MPI has
// a one-sided transport between the ranks (one_sided 1). Each runs kLayers layers
// back to back after one barrier, as a decode step does: write the records (header and bf16
// records for T uniform rows at top-8, the executor's bytes), dispatch, read what came, then the
// combine (one bf16 output per pick, through the Communicator's alltoallv). Per layer sequence and
// transport: the dispatch as the last rank to arrive spends it (minimum over ranks of the summed
// dispatch waits, as exchange_ms above), the dispatch + combine likewise, and the sequence on the
// slowest rank; medians.
//   mpirun -np 4 build/benchmarks/ep_exchange_bench --benchmark_filter=LowLatencyTransports
void BM_LowLatencyTransports(benchmark::State& state) {
  constexpr int kLayers = 8;
  Communicator& comm = World();
  const int g = comm.size(), me = comm.rank();
  const int64_t total = state.range(0);
  const ModelConfig model = ExchangeModel();
  const int64_t n = RowBegin(total, g, me + 1) - RowBegin(total, g, me), most = RowBegin(total, g, 1);
  const Picks picks = UniformPicks(model, n, 11, RowBegin(total, g, me));
  const int k = model.top_k, per_rank = model.num_experts / g;
  constexpr int64_t kHeader = 8;
  const int64_t record = k * 8 + RowBytes(RowFormat::kBf16, model.hidden);
  const int64_t output = RowBytes(RowFormat::kBf16, model.hidden), capacity = kHeader + most * record;
  // Bytes per peer: the header and one record per row with a pick there; one output back per pick.
  std::vector<int64_t> message(g, kHeader), back(g, 0);
  for (int64_t r = 0; r < n; ++r) {
    std::vector<bool> seen(g, false);
    for (int j = 0; j < k; ++j) {
      const int dest = picks.expert(r, j) / per_rank;
      back[dest] += output;
      if (!seen[dest]) message[dest] += record;
      seen[dest] = true;
    }
  }
  message[me] = 0;
  back[me] = 0;
  std::vector<int64_t> back_recv(g);
  EPMOE_CHECK(comm.ExchangeCounts(back, back_recv).ok());
  const std::vector<int64_t> message_at = PrefixOffsets(message), back_at = PrefixOffsets(back),
                             back_recv_at = PrefixOffsets(back_recv);
  std::vector<uint8_t> send(message_at[g]), back_send(back_at[g]), back_landed(back_recv_at[g]);
  std::vector<uint8_t> recv[2] = {std::vector<uint8_t>(g * capacity), std::vector<uint8_t>(g * capacity)};
  std::vector<int64_t> received(g);
  auto made = comm.CreateCappedExchange(recv[1].data(), capacity);
  EPMOE_CHECK_MSG(made.ok(), made.status().ToString());
  std::unique_ptr<CappedExchange> pre_posted = std::move(made).value();
  const std::unique_ptr<OneSidedDispatch> one_sided = OneSidedDispatch::Create(capacity);
  const int transports = one_sided != nullptr ? 3 : 2;
  // Where each transport's blocks land: one slot of the capacity per sender.
  auto landed = [&](int transport, int sender) {
    return transport == 2 ? one_sided->slot(sender) : recv[transport].data() + sender * capacity;
  };
  const std::span<const int64_t> offsets(message_at.data(), g), outputs_at(back_at.data(), g),
      outputs_land(back_recv_at.data(), g);
  std::vector<double> dispatch_us[3], exchange_us[3], sequence_us[3];
  uint64_t checksum = 0;
  int iteration = 0;
  for (auto _ : state) {
    for (int i = 0; i < transports; ++i) {
      const int transport = (iteration + i) % transports;
      double dispatch = 0, combine = 0;
      MPI_Barrier(MPI_COMM_WORLD);
      const auto sequence_start = std::chrono::steady_clock::now();
      std::unique_ptr<Request> dispatch_sends, combine_sends;
      for (int layer = 0; layer < kLayers; ++layer) {
        if (dispatch_sends != nullptr) EPMOE_CHECK(dispatch_sends->Wait().ok());
        std::fill(send.begin(), send.end(), static_cast<uint8_t>(layer));
        for (int s = 0; s < g; ++s)  // the header: the block's size (one-sided receivers read it)
          if (message[s] > 0) std::memcpy(send.data() + message_at[s], &message[s], kHeader);
        const auto t0 = std::chrono::steady_clock::now();
        if (transport == 2) {
          one_sided->Start(send.data(), message, offsets);
          one_sided->WaitReceived(received);
        } else {
          auto started = transport == 0 ? comm.StartCappedAlltoallv(send.data(), message, offsets, recv[0].data(),
                                                                    capacity, received)
                                        : pre_posted->Start(send.data(), message, offsets, received);
          EPMOE_CHECK_MSG(started.ok(), started.status().ToString());
          dispatch_sends = std::move(started).value();
          EPMOE_CHECK(dispatch_sends->WaitReceived().ok());
        }
        dispatch += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        for (int s = 0; s < g; ++s) checksum += landed(transport, s)[received[s] / 2];
        if (combine_sends != nullptr) EPMOE_CHECK(combine_sends->Wait().ok());
        std::fill(back_send.begin(), back_send.end(), static_cast<uint8_t>(layer));
        const auto t1 = std::chrono::steady_clock::now();
        auto outputs =
            comm.StartAlltoallv(back_send.data(), back, outputs_at, back_landed.data(), back_recv, outputs_land);
        EPMOE_CHECK(outputs.ok());
        combine_sends = std::move(outputs).value();
        if (transport == 1) EPMOE_CHECK(pre_posted->Rearm().ok());
        EPMOE_CHECK(combine_sends->WaitReceived().ok());
        combine += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t1).count();
      }
      if (dispatch_sends != nullptr) EPMOE_CHECK(dispatch_sends->Wait().ok());
      EPMOE_CHECK(combine_sends->Wait().ok());
      const double wall =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - sequence_start).count();
      dispatch_us[transport].push_back(MinOverRanks(dispatch));
      exchange_us[transport].push_back(MinOverRanks(dispatch) + MinOverRanks(combine));
      sequence_us[transport].push_back(MaxOverRanks(wall));
    }
    state.SetIterationTime(dispatch_us[1].back() * 1e-6);
    ++iteration;
  }
  benchmark::DoNotOptimize(checksum);
  const auto pct = [](const std::vector<double>& posted, const std::vector<double>& ahead) {
    const double a = Median(posted), b = Median(ahead);
    return a > 0 ? 100.0 * (b / a - 1.0) : 0.0;
  };
  state.counters["ranks"] = g;
  state.counters["per_exchange_dispatch_ms"] = Median(dispatch_us[0]) / kLayers / 1000;
  state.counters["pre_posted_dispatch_ms"] = Median(dispatch_us[1]) / kLayers / 1000;
  state.counters["dispatch_pct"] = pct(dispatch_us[0], dispatch_us[1]);
  state.counters["per_exchange_exchange_ms"] = Median(exchange_us[0]) / kLayers / 1000;
  state.counters["pre_posted_exchange_ms"] = Median(exchange_us[1]) / kLayers / 1000;
  state.counters["exchange_pct"] = pct(exchange_us[0], exchange_us[1]);
  state.counters["per_exchange_layer_ms"] = Median(sequence_us[0]) / kLayers / 1000;
  state.counters["pre_posted_layer_ms"] = Median(sequence_us[1]) / kLayers / 1000;
  state.counters["layer_pct"] = pct(sequence_us[0], sequence_us[1]);
  state.counters["one_sided"] = one_sided != nullptr;
  if (one_sided != nullptr) {
    state.counters["one_sided_dispatch_ms"] = Median(dispatch_us[2]) / kLayers / 1000;
    state.counters["one_sided_dispatch_pct"] = pct(dispatch_us[1], dispatch_us[2]);  // against pre-posted
    state.counters["one_sided_exchange_ms"] = Median(exchange_us[2]) / kLayers / 1000;
    state.counters["one_sided_layer_ms"] = Median(sequence_us[2]) / kLayers / 1000;
    state.counters["one_sided_layer_pct"] = pct(sequence_us[1], sequence_us[2]);
  }
}

BENCHMARK(BM_LowLatencyTransports)
    ->ArgNames({"T"})
    ->Args({16})
    ->Args({64})
    ->Iterations(300)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Encoding the rows that travel, alone (no MPI): 256 rows of 2048 normal values in the format
// state.range(0) (1 bf16, 2 q8, 3 q4), one row at a time as the executor packs them.
void BM_EncodeRow(benchmark::State& state) {
  constexpr int64_t kRows = 256, kCols = 2048;
  const auto format = static_cast<RowFormat>(state.range(0));
  std::vector<float> values(kRows * kCols);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& v : values) v = normal(rng);
  const int64_t row_bytes = RowBytes(format, kCols);
  std::vector<uint8_t> encoded(kRows * row_bytes);
  for (auto _ : state) {
    for (int64_t r = 0; r < kRows; ++r)
      EncodeRow(format, values.data() + r * kCols, kCols, encoded.data() + r * row_bytes);
    benchmark::DoNotOptimize(encoded.data());
  }
  state.SetItemsProcessed(state.iterations() * kRows * kCols);  // values per second
  state.SetLabel(RowFormatName(format));
}

BENCHMARK(BM_EncodeRow)->DenseRange(1, 3);

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
