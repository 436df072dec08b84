// RollCall: after an exchange of the rebalancing protocol timed out, finds out which ranks stopped
// answering, so the error names the culprit instead of the rank that noticed.
//
// A collective that times out cannot tell who did not take part, so the roll call uses private
// two-rank communicators, one pairing each rank r > 0 with rank 0, made collectively while every
// rank is healthy (Create). Every rank whose exchange timed out calls Missing(): it answers rank 0
// on its pair; rank 0 waits up to `wait_seconds` for the answers, then tells each rank that
// answered which ranks did not. A rank that gets no answer from rank 0 names rank 0. Every wait is
// bounded (Missing returns within about 2 * wait_seconds + the transport's latency).
// After a roll call the pair communicators may hold exchanges that never complete: they (and their
// buffers) are leaked on purpose, never freed; the job is expected to abort. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/status.h"

namespace epmoe {

class RollCall {
 public:
  // Collective over `comm` (size - 1 splits); a world of one rank makes an empty roll call.
  static Result<std::unique_ptr<RollCall>> Create(Communicator& comm);
  ~RollCall();
  RollCall(const RollCall&) = delete;
  RollCall& operator=(const RollCall&) = delete;

  // The ranks (never this one) that did not answer within wait_seconds, ascending. Only one roll
  // call per RollCall (the pairs are spent afterwards): a second call fails with FailedPrecondition.
  Result<std::vector<int>> Missing(double wait_seconds);

 private:
  struct Parked;
  RollCall(int rank, int size) : rank_(rank), size_(size) {}
  int rank_;
  int size_;
  bool spent_ = false;
  // Rank 0: pairs_[r] pairs it with rank r (pairs_[0] empty). Rank r > 0: pairs_[0] only.
  std::vector<std::unique_ptr<Communicator>> pairs_;
};

// "3" or "1, 5" (ascending ranks).
std::string RankList(const std::vector<int>& ranks);

}  // namespace epmoe
