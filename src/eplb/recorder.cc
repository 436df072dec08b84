#include "epmoe/recorder.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "epmoe/balance.h"
#include "epmoe/enum_names.h"

namespace epmoe {
namespace {
constexpr int kHistory = 1000;  // per-step balancedness values kept (the longest window reported)
}  // namespace

namespace {
constexpr EnumNames<RecorderMode, 3> kRecorderModes("recorder mode", {{{RecorderMode::kStat, "stat"},
                                                                       {RecorderMode::kPerStep, "per-step"},
                                                                       {RecorderMode::kPerToken, "per-token"}}});
}  // namespace

const char* RecorderModeName(RecorderMode mode) {
  return kRecorderModes.Name(mode);
}
Result<RecorderMode> ParseRecorderMode(std::string_view name) {
  return kRecorderModes.Parse(name);
}

Result<LoadRecorder> LoadRecorder::Create(const RecorderOptions& options, std::shared_ptr<const LivePlacement> live) {
  if (live == nullptr) return InvalidArgument("recorder: no placement");
  const PlacementPtr placement = live->placement();
  if (options.window_steps < 1)
    return InvalidArgument(fmt::format("recorder: window_steps {} must be >= 1", options.window_steps));
  if (!(options.bytes_per_expert > 0))
    return InvalidArgument(fmt::format("recorder: bytes_per_expert {} must be > 0", options.bytes_per_expert));
  LoadRecorder r;
  r.options_ = options;
  r.num_layers_ = placement->num_layers();
  r.num_experts_ = placement->num_experts();
  r.num_slots_ = placement->num_slots();
  r.num_ranks_ = placement->num_ranks();
  const size_t per_step = static_cast<size_t>(r.num_layers_) * r.num_experts_;
  r.current_.assign(per_step, 0);
  r.current_slots_.assign(static_cast<size_t>(r.num_layers_) * r.num_slots_, 0);
  r.call_counts_.assign(r.num_experts_, 0);
  r.call_slots_.assign(r.num_slots_, 0);
  r.current_rows_.assign(r.num_layers_, 0);
  r.layer_recorded_.assign(r.num_layers_, false);
  r.ring_.assign(per_step * options.window_steps, 0);
  r.ring_rows_.assign(options.window_steps, 0);
  if (options.mode == RecorderMode::kPerToken) {
    r.ring_tokens_.assign(options.window_steps, std::vector<Picks>(r.num_layers_));
    r.current_tokens_.assign(r.num_layers_, Picks{});
  }
  r.last_expert_.assign(per_step, 0);
  r.last_slot_.assign(static_cast<size_t>(r.num_layers_) * r.num_slots_, 0.0);
  r.last_rank_.assign(static_cast<size_t>(r.num_layers_) * r.num_ranks_, 0.0);
  r.live_ = std::move(live);
  return r;
}

Status LoadRecorder::Record(int layer, const Picks& picks) {
  if (layer < 0 || layer >= num_layers_)
    return InvalidArgument(fmt::format("recorder: layer {} outside [0, {})", layer, num_layers_));
  if (picks.k < 0 || picks.experts.size() != static_cast<size_t>(picks.rows) * picks.k)
    return InvalidArgument(
        fmt::format("recorder: picks hold {} ids for {} rows x k {}", picks.experts.size(), picks.rows, picks.k));
  std::fill(call_counts_.begin(), call_counts_.end(), 0);
  const uint32_t limit = static_cast<uint32_t>(num_experts_);
  for (size_t i = 0; i < picks.experts.size(); ++i) {
    const int32_t expert = picks.experts[i];
    if (static_cast<uint32_t>(expert) >= limit)  // refused before anything is counted
      return InvalidArgument(
          fmt::format("recorder: layer {} pick {} is expert {}, outside [0, {})", layer, i, expert, num_experts_));
    ++call_counts_[expert];
  }
  if (step_snapshot_ == nullptr) step_snapshot_ = live_->current();
  // The executor deals each Forward's picks afresh (its nth pick of an expert in that call), so
  // each call is dealt on its own here too.
  step_snapshot_->dispatch.SlotPicks(layer, call_counts_, call_slots_);
  int64_t* counts = current_.data() + static_cast<size_t>(layer) * num_experts_;
  for (int e = 0; e < num_experts_; ++e) counts[e] += call_counts_[e];
  int64_t* slots = current_slots_.data() + static_cast<size_t>(layer) * num_slots_;
  for (int slot = 0; slot < num_slots_; ++slot) slots[slot] += call_slots_[slot];
  current_rows_[layer] += picks.rows;
  layer_recorded_[layer] = true;
  if (options_.mode == RecorderMode::kPerToken) {
    Picks& kept = current_tokens_[layer];
    if (kept.k == 0) kept.k = picks.k;
    if (kept.k == picks.k) {
      kept.rows += picks.rows;
      kept.experts.insert(kept.experts.end(), picks.experts.begin(), picks.experts.end());
      kept.weights.insert(kept.weights.end(), picks.weights.begin(), picks.weights.end());
    }
  }
  return Status::Ok();
}

void LoadRecorder::EndStep() {
  if (step_snapshot_ == nullptr) step_snapshot_ = live_->current();  // a step with nothing recorded
  const Placement& placement = *step_snapshot_->placement;
  const int num_slots = num_slots_;
  const int num_ranks = num_ranks_;
  const size_t per_step = static_cast<size_t>(num_layers_) * num_experts_;
  int32_t* ring = ring_.data() + static_cast<size_t>(next_) * per_step;
  int64_t rows = 0;
  for (int layer = 0; layer < num_layers_; ++layer) rows = std::max(rows, current_rows_[layer]);
  for (size_t i = 0; i < per_step; ++i) {
    EPMOE_CHECK(current_[i] <= std::numeric_limits<int32_t>::max());
    ring[i] = static_cast<int32_t>(current_[i]);
  }
  ring_rows_[next_] = rows;
  std::vector<double> copies_read(num_ranks);
  double balance_sum = 0, byte_balance_sum = 0;
  int layers = 0;
  for (int layer = 0; layer < num_layers_; ++layer) {
    const int64_t* slot_counts = current_slots_.data() + static_cast<size_t>(layer) * num_slots;
    std::span<double> slots(last_slot_.data() + static_cast<size_t>(layer) * num_slots, num_slots);
    std::span<double> ranks(last_rank_.data() + static_cast<size_t>(layer) * num_ranks, num_ranks);
    std::fill(ranks.begin(), ranks.end(), 0.0);
    for (int slot = 0; slot < num_slots; ++slot) {
      slots[slot] = static_cast<double>(slot_counts[slot]);
      ranks[placement.rank_of_slot(slot)] += slots[slot];
    }
    if (layer_recorded_[layer]) {
      balance_sum += Balancedness(ranks);
      std::fill(copies_read.begin(), copies_read.end(), 0.0);
      for (int slot = 0; slot < num_slots; ++slot)
        copies_read[placement.rank_of_slot(slot)] += std::min(1.0, slots[slot]);
      byte_balance_sum += Balancedness(copies_read);  // bytes = copies x bytes_per_expert: same ratio
      ++layers;
    }
  }
  if (options_.mode == RecorderMode::kPerToken)
    for (int layer = 0; layer < num_layers_; ++layer)
      ring_tokens_[next_][layer] = std::exchange(current_tokens_[layer], Picks{});
  std::copy(current_.begin(), current_.end(), last_expert_.begin());
  if (balance_history_.size() < kHistory) {
    balance_history_.push_back(0), byte_balance_history_.push_back(0);
  }
  balance_history_[steps_ % kHistory] = layers > 0 ? balance_sum / layers : 1.0;
  byte_balance_history_[steps_ % kHistory] = layers > 0 ? byte_balance_sum / layers : 1.0;
  ++steps_;
  next_ = (next_ + 1) % options_.window_steps;
  kept_ = std::min<int64_t>(kept_ + 1, options_.window_steps);
  std::fill(current_.begin(), current_.end(), 0);
  std::fill(current_slots_.begin(), current_slots_.end(), 0);
  std::fill(current_rows_.begin(), current_rows_.end(), 0);
  std::fill(layer_recorded_.begin(), layer_recorded_.end(), false);
  step_snapshot_ = nullptr;
}

BalanceReport LoadRecorder::Balance() const {
  BalanceReport report;
  report.steps = steps_;
  auto mean_last = [&](const std::vector<double>& history, int64_t n) {
    n = std::min<int64_t>({n, steps_, kHistory});
    if (n == 0) return 1.0;
    double sum = 0;
    for (int64_t i = 1; i <= n; ++i) sum += history[(steps_ - i) % kHistory];
    return sum / n;
  };
  report.current = mean_last(balance_history_, 1);
  report.last10 = mean_last(balance_history_, 10);
  report.last100 = mean_last(balance_history_, 100);
  report.last1000 = mean_last(balance_history_, 1000);
  report.bytes_current = mean_last(byte_balance_history_, 1);
  report.bytes_last10 = mean_last(byte_balance_history_, 10);
  report.bytes_last100 = mean_last(byte_balance_history_, 100);
  report.bytes_last1000 = mean_last(byte_balance_history_, 1000);
  return report;
}

ExpertLoad LoadRecorder::Load() const {
  const size_t per_step = static_cast<size_t>(num_layers_) * num_experts_;
  if (options_.mode == RecorderMode::kStat) {
    ExpertLoad out(1, num_layers_, num_experts_);
    for (int64_t index = 0; index < kept_; ++index) {
      const int32_t* ring = ring_.data() + static_cast<size_t>(RingIndex(index)) * per_step;
      for (size_t i = 0; i < per_step; ++i) out.counts[i] += ring[i];
      out.rows[0] += ring_rows_[RingIndex(index)];
    }
    return out;
  }
  ExpertLoad out(kept_, num_layers_, num_experts_);
  for (int64_t index = 0; index < kept_; ++index) {
    const int32_t* ring = ring_.data() + static_cast<size_t>(RingIndex(index)) * per_step;
    std::copy(ring, ring + per_step, out.counts.begin() + index * per_step);
    out.rows[index] = ring_rows_[RingIndex(index)];
  }
  return out;
}

ExpertLoad LoadRecorder::Series(int64_t max_steps) const {
  EPMOE_CHECK(max_steps >= 1);
  const size_t per_step = static_cast<size_t>(num_layers_) * num_experts_;
  const int64_t blocks = std::max<int64_t>(1, std::min(kept_, max_steps));
  ExpertLoad out(blocks, num_layers_, num_experts_);
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t index = block * kept_ / blocks; index < (block + 1) * kept_ / blocks; ++index) {
      const int32_t* ring = ring_.data() + static_cast<size_t>(RingIndex(index)) * per_step;
      for (size_t i = 0; i < per_step; ++i) out.counts[block * per_step + i] += ring[i];
      out.rows[block] += ring_rows_[RingIndex(index)];
    }
  return out;
}

const Picks& LoadRecorder::TokenPicks(int64_t index, int layer) const {
  static const Picks kEmpty;
  if (options_.mode != RecorderMode::kPerToken || index < 0 || index >= kept_ || layer < 0 || layer >= num_layers_)
    return kEmpty;
  return ring_tokens_[RingIndex(index)][layer];
}

std::span<const int64_t> LoadRecorder::ExpertPicks(int layer) const {
  return {last_expert_.data() + static_cast<size_t>(layer) * num_experts_, static_cast<size_t>(num_experts_)};
}
std::span<const double> LoadRecorder::SlotPicks(int layer) const {
  const size_t n = num_slots_;
  return {last_slot_.data() + layer * n, n};
}
std::span<const double> LoadRecorder::RankPicks(int layer) const {
  const size_t n = num_ranks_;
  return {last_rank_.data() + layer * n, n};
}

}  // namespace epmoe
