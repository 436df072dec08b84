#include "epmoe/recorder.h"

#include <algorithm>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "epmoe/balance.h"

namespace epmoe {
namespace {
constexpr int kHistory = 1000;  // per-step balancedness values kept (the longest window reported)
}  // namespace

const char* RecorderModeName(RecorderMode mode) {
  switch (mode) {
    case RecorderMode::kStat: return "stat";
    case RecorderMode::kPerStep: return "per_step";
    case RecorderMode::kPerToken: return "per_token";
  }
  return "?";
}

Result<RecorderMode> ParseRecorderMode(std::string_view name) {
  for (RecorderMode mode : {RecorderMode::kStat, RecorderMode::kPerStep, RecorderMode::kPerToken})
    if (name == RecorderModeName(mode)) return mode;
  return InvalidArgument(fmt::format("unknown recorder mode \"{}\" (stat, per_step, per_token)", name));
}

Result<LoadRecorder> LoadRecorder::Create(const RecorderOptions& options, PlacementPtr placement) {
  if (placement == nullptr) return InvalidArgument("recorder: no placement");
  if (options.window_steps < 1)
    return InvalidArgument(fmt::format("recorder: window_steps {} must be >= 1", options.window_steps));
  if (!(options.bytes_per_expert > 0))
    return InvalidArgument(fmt::format("recorder: bytes_per_expert {} must be > 0", options.bytes_per_expert));
  LoadRecorder r;
  r.options_ = options;
  r.num_layers_ = placement->num_layers();
  r.num_experts_ = placement->num_experts();
  const size_t per_step = static_cast<size_t>(r.num_layers_) * r.num_experts_;
  r.current_.assign(per_step, 0);
  r.current_rows_.assign(r.num_layers_, 0);
  r.layer_recorded_.assign(r.num_layers_, false);
  r.ring_.assign(per_step * options.window_steps, 0);
  r.ring_rows_.assign(options.window_steps, 0);
  if (options.mode == RecorderMode::kPerToken) {
    r.ring_tokens_.assign(options.window_steps, std::vector<Picks>(r.num_layers_));
    r.current_tokens_.assign(r.num_layers_, Picks{});
  }
  r.last_expert_.assign(per_step, 0);
  r.last_slot_.assign(static_cast<size_t>(r.num_layers_) * placement->num_slots(), 0.0);
  r.last_rank_.assign(static_cast<size_t>(r.num_layers_) * placement->num_ranks(), 0.0);
  r.placement_ = placement;
  r.next_placement_ = std::move(placement);
  return r;
}

Status LoadRecorder::SetPlacement(PlacementPtr placement) {
  if (placement == nullptr) return InvalidArgument("recorder: no placement");
  if (placement->num_layers() != num_layers_ || placement->num_experts() != num_experts_ ||
      placement->num_slots() != placement_->num_slots() || placement->num_ranks() != placement_->num_ranks())
    return InvalidArgument(fmt::format(
        "recorder: new placement has {} layers, {} experts, {} slots, {} ranks; the recorder has {}, {}, {}, {}",
        placement->num_layers(), placement->num_experts(), placement->num_slots(), placement->num_ranks(), num_layers_,
        num_experts_, placement_->num_slots(), placement_->num_ranks()));
  next_placement_ = std::move(placement);
  return Status::Ok();
}

Status LoadRecorder::SetDispatch(std::optional<DispatchTable> dispatch) {
  if (dispatch && (dispatch->num_layers() != num_layers_ || dispatch->num_experts() != num_experts_))
    return InvalidArgument("recorder: dispatch table shape differs from the placement's");
  dispatch_ = std::move(dispatch);
  return Status::Ok();
}

Status LoadRecorder::Record(int layer, const Picks& picks) {
  if (layer < 0 || layer >= num_layers_)
    return InvalidArgument(fmt::format("recorder: layer {} outside [0, {})", layer, num_layers_));
  if (picks.k < 0 || picks.experts.size() != static_cast<size_t>(picks.rows) * picks.k)
    return InvalidArgument(fmt::format("recorder: picks hold {} ids for {} rows x k {}", picks.experts.size(),
                                       picks.rows, picks.k));
  int64_t* counts = current_.data() + static_cast<size_t>(layer) * num_experts_;
  const uint32_t limit = static_cast<uint32_t>(num_experts_);
  for (size_t i = 0; i < picks.experts.size(); ++i) {
    const int32_t expert = picks.experts[i];
    if (static_cast<uint32_t>(expert) >= limit) {
      // Undo this call's counts so a refused call leaves no trace.
      for (size_t j = 0; j < i; ++j) --counts[picks.experts[j]];
      return InvalidArgument(fmt::format("recorder: layer {} pick {} is expert {}, outside [0, {})", layer, i,
                                         expert, num_experts_));
    }
    ++counts[expert];
  }
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
  const Placement& placement = *placement_;
  const int num_slots = placement.num_slots();
  const int num_ranks = placement.num_ranks();
  const size_t per_step = static_cast<size_t>(num_layers_) * num_experts_;
  int32_t* ring = ring_.data() + static_cast<size_t>(next_) * per_step;
  int64_t rows = 0;
  for (int layer = 0; layer < num_layers_; ++layer) rows = std::max(rows, current_rows_[layer]);
  for (size_t i = 0; i < per_step; ++i) {
    EPMOE_CHECK(current_[i] <= std::numeric_limits<int32_t>::max());
    ring[i] = static_cast<int32_t>(current_[i]);
  }
  ring_rows_[next_] = rows;
  std::vector<int64_t> slot_counts(num_slots);
  std::vector<double> copies_read(num_ranks);
  double balance_sum = 0, byte_balance_sum = 0;
  int layers = 0;
  for (int layer = 0; layer < num_layers_; ++layer) {
    std::span<const int64_t> counts(current_.data() + static_cast<size_t>(layer) * num_experts_, num_experts_);
    std::span<double> slots(last_slot_.data() + static_cast<size_t>(layer) * num_slots, num_slots);
    std::span<double> ranks(last_rank_.data() + static_cast<size_t>(layer) * num_ranks, num_ranks);
    if (dispatch_) {
      dispatch_->SlotPicks(layer, counts, slot_counts);
      std::fill(ranks.begin(), ranks.end(), 0.0);
      for (int slot = 0; slot < num_slots; ++slot) {
        slots[slot] = static_cast<double>(slot_counts[slot]);
        ranks[placement.rank_of_slot(slot)] += slots[slot];
      }
    } else {
      auto phy2log = placement.phy2log(layer);
      auto logcnt = placement.logcnt(layer);
      for (int slot = 0; slot < num_slots; ++slot)
        slots[slot] = static_cast<double>(counts[phy2log[slot]]) / logcnt[phy2log[slot]];
      ::epmoe::RankPicks(placement, layer, counts, ranks);
    }
    if (layer_recorded_[layer]) {
      balance_sum += Balancedness(ranks);
      std::fill(copies_read.begin(), copies_read.end(), 0.0);
      for (int slot = 0; slot < num_slots; ++slot) copies_read[placement.rank_of_slot(slot)] += std::min(1.0, slots[slot]);
      byte_balance_sum += Balancedness(copies_read);  // bytes = copies x bytes_per_expert: same ratio
      ++layers;
    }
  }
  if (options_.mode == RecorderMode::kPerToken)
    for (int layer = 0; layer < num_layers_; ++layer) ring_tokens_[next_][layer] = std::exchange(current_tokens_[layer], Picks{});
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
  std::fill(current_rows_.begin(), current_rows_.end(), 0);
  std::fill(layer_recorded_.begin(), layer_recorded_.end(), false);
  placement_ = next_placement_;
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
  const size_t n = placement_->num_slots();
  return {last_slot_.data() + layer * n, n};
}
std::span<const double> LoadRecorder::RankPicks(int layer) const {
  const size_t n = placement_->num_ranks();
  return {last_rank_.data() + layer * n, n};
}

}  // namespace epmoe
