#include "roll_call.h"

#include <fmt/format.h>

#include <chrono>
#include <thread>

namespace epmoe {
namespace {

using Clock = std::chrono::steady_clock;

// One exchange on a pair communicator: both ranks send `values` int64 and receive both.
struct PairExchange {
  std::vector<int64_t> send, recv;
  std::unique_ptr<Request> request;
  bool done = false;
};

Result<std::unique_ptr<PairExchange>> StartPairExchange(Communicator& pair, std::vector<int64_t> send) {
  auto exchange = std::make_unique<PairExchange>();
  const int64_t bytes = static_cast<int64_t>(send.size() * sizeof(int64_t));
  exchange->send = std::move(send);
  exchange->recv.assign(exchange->send.size() * 2, 0);
  const std::vector<int64_t> recv_bytes{bytes, bytes}, recv_offsets{0, bytes};
  EPMOE_ASSIGN_OR_RETURN(exchange->request, pair.StartAllgatherv(exchange->send.data(), bytes, exchange->recv.data(),
                                                                 recv_bytes, recv_offsets));
  return exchange;
}

// Polls until every exchange completed or the deadline passed; marks the completed ones done.
void PollUntil(std::vector<PairExchange*>& exchanges, Clock::time_point deadline) {
  for (;;) {
    bool all = true;
    for (PairExchange* e : exchanges) {
      if (e != nullptr && !e->done) e->done = e->request->Test();
      all = all && (e == nullptr || e->done);
    }
    if (all || Clock::now() >= deadline) return;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// An exchange that never completed may still be written by the transport (a late peer): its
// request and buffers are never freed, and its request is never waited for (that could block).
void Park(std::unique_ptr<PairExchange> exchange) {
  if (exchange == nullptr || exchange->done) return;
  (void)exchange.release();
}

Clock::time_point After(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

std::string RankList(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += fmt::format("{}{}", out.empty() ? "" : ", ", r);
  return out;
}

Result<std::unique_ptr<RollCall>> RollCall::Create(Communicator& comm) {
  const int me = comm.rank(), size = comm.size();
  std::unique_ptr<RollCall> call(new RollCall(me, size));
  call->pairs_.resize(me == 0 ? size : 1);
  for (int r = 1; r < size; ++r) {
    const bool member = me == 0 || me == r;
    EPMOE_ASSIGN_OR_RETURN(auto pair, comm.Split(member ? 0 : 1, me));
    if (!member) continue;  // the others' group is not used
    call->pairs_[me == 0 ? r : 0] = std::move(pair);
  }
  return call;
}

RollCall::~RollCall() {
  // After a roll call, exchanges on the pairs may never complete: leave the communicators alone.
  if (spent_)
    for (auto& pair : pairs_) (void)pair.release();
}

Result<std::vector<int>> RollCall::Missing(double wait_seconds) {
  if (spent_) return FailedPrecondition("roll call: already held once (the pair communicators are spent)");
  spent_ = true;
  std::vector<int> missing;
  if (size_ == 1) return missing;
  if (rank_ == 0) {
    std::vector<std::unique_ptr<PairExchange>> arrivals(size_);
    std::vector<PairExchange*> polled(size_, nullptr);
    for (int r = 1; r < size_; ++r) {
      EPMOE_ASSIGN_OR_RETURN(arrivals[r], StartPairExchange(*pairs_[r], {1}));
      polled[r] = arrivals[r].get();
    }
    PollUntil(polled, After(wait_seconds));
    std::vector<int64_t> flags(size_, 0);
    for (int r = 1; r < size_; ++r)
      if (!arrivals[r]->done) {
        missing.push_back(r);
        flags[r] = 1;
      }
    // Tells every rank that answered who did not.
    std::vector<std::unique_ptr<PairExchange>> verdicts(size_);
    std::vector<PairExchange*> sent(size_, nullptr);
    for (int r = 1; r < size_; ++r) {
      if (flags[r] != 0) continue;
      EPMOE_ASSIGN_OR_RETURN(verdicts[r], StartPairExchange(*pairs_[r], flags));
      sent[r] = verdicts[r].get();
    }
    PollUntil(sent, After(wait_seconds));
    for (int r = 1; r < size_; ++r) {
      Park(std::move(arrivals[r]));
      Park(std::move(verdicts[r]));
    }
    return missing;
  }
  // Rank 0 may enter its roll call a little later than this rank: allow it twice the wait.
  EPMOE_ASSIGN_OR_RETURN(auto arrival, StartPairExchange(*pairs_[0], {1}));
  std::vector<PairExchange*> polled{arrival.get()};
  PollUntil(polled, After(2 * wait_seconds));
  if (!arrival->done) {
    Park(std::move(arrival));
    return std::vector<int>{0};
  }
  // Rank 0 sends its verdict at most wait_seconds after it started collecting answers.
  EPMOE_ASSIGN_OR_RETURN(auto verdict, StartPairExchange(*pairs_[0], std::vector<int64_t>(size_, 0)));
  polled = {verdict.get()};
  PollUntil(polled, After(2 * wait_seconds));
  if (!verdict->done) {
    Park(std::move(verdict));
    return std::vector<int>{0};  // rank 0 answered, then stopped before its verdict
  }
  for (int r = 1; r < size_; ++r)
    if (verdict->recv[r] != 0) missing.push_back(r);  // rank 0's flags come first (pair rank 0)
  return missing;
}

}  // namespace epmoe
