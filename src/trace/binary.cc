// epmoe's binary trace format: TraceWriter and the streamed reader. See trace.h for the layout.
#include "trace/binary.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

namespace epmoe {
namespace trace_internal {
namespace {

static_assert(std::endian::native == std::endian::little, "the trace format is little-endian; add byte swapping");

constexpr int64_t kStepsOffset = 8 + 4 * 6;

// Streams steps from a binary trace, checking each against the header and the remaining bytes
// before allocating. Not thread-safe.
class BinaryTraceReader final : public TraceReader {
 public:
  BinaryTraceReader(std::unique_ptr<std::istream> in, int64_t size, std::string source)
      : in_(std::move(in)), size_(size), source_(std::move(source)) {}

  Status ReadHeader() {
    char magic[8];
    EPMOE_RETURN_IF_ERROR(ReadBytes(magic, 8, "magic"));
    if (std::memcmp(magic, kTraceMagic, 8) != 0)
      return Corrupt(0, "wrong magic (not an epmoe binary trace)");
    uint32_t version, flags, layers, experts, top_k, reserved;
    EPMOE_RETURN_IF_ERROR(ReadValue(&version, "version"));
    if (version != kTraceVersion)
      return Corrupt(8, fmt::format("version {} is not supported (this build reads version {})", version,
                                    kTraceVersion));
    EPMOE_RETURN_IF_ERROR(ReadValue(&flags, "flags"));
    EPMOE_RETURN_IF_ERROR(ReadValue(&layers, "layers"));
    EPMOE_RETURN_IF_ERROR(ReadValue(&experts, "experts"));
    EPMOE_RETURN_IF_ERROR(ReadValue(&top_k, "top_k"));
    EPMOE_RETURN_IF_ERROR(ReadValue(&reserved, "reserved"));
    EPMOE_RETURN_IF_ERROR(ReadValue(&declared_steps_, "steps"));
    if ((flags & ~(kFlagPicks | kFlagWeights)) != 0 || ((flags & kFlagWeights) && !(flags & kFlagPicks)))
      return Corrupt(12, fmt::format("unknown flags {:#x}", flags));
    if (layers < 1 || layers > static_cast<uint32_t>(kMaxLayers)) return Corrupt(16, fmt::format("{} layers", layers));
    if (experts < 1 || experts > static_cast<uint32_t>(kMaxExperts))
      return Corrupt(20, fmt::format("{} experts", experts));
    if (top_k > static_cast<uint32_t>(kMaxTopK) || top_k > experts || ((flags & kFlagPicks) && top_k == 0))
      return Corrupt(24, fmt::format("top-{} with {} experts", top_k, experts));
    if (reserved != 0) return Corrupt(28, fmt::format("reserved field is {}, expected 0", reserved));
    if (declared_steps_ < 0) return Corrupt(kStepsOffset, fmt::format("{} steps", declared_steps_));
    info_.format = "epmoe";
    info_.num_layers = static_cast<int>(layers);
    info_.num_experts = static_cast<int>(experts);
    info_.top_k = static_cast<int>(top_k);
    info_.has_picks = flags & kFlagPicks;
    info_.has_weights = flags & kFlagWeights;
    info_.num_steps = declared_steps_;
    if (offset_ + static_cast<int64_t>(layers) * 4 > size_) return Truncated("layer ids");
    info_.layer_ids.resize(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      int32_t id;
      const int64_t at = offset_;
      EPMOE_RETURN_IF_ERROR(ReadValue(&id, "layer id"));
      if (id < 0 || (l > 0 && id <= info_.layer_ids[l - 1]))
        return Corrupt(at, fmt::format("layer id {} (ids must be non-negative and ascending)", id));
      info_.layer_ids[l] = id;
    }
    return Status::Ok();
  }

  Result<bool> Next(StepPicks* step) override {
    if (done_) return false;
    const int64_t at = offset_;
    uint32_t magic;
    EPMOE_RETURN_IF_ERROR(ReadValue(&magic, "step marker"));
    if (magic == kTrailerMagic) {
      int64_t steps, picks;
      EPMOE_RETURN_IF_ERROR(ReadValue(&steps, "trailer step count"));
      EPMOE_RETURN_IF_ERROR(ReadValue(&picks, "trailer pick count"));
      if (steps != steps_read_ || steps != declared_steps_)
        return Corrupt(at + 4, fmt::format("trailer says {} steps, header {}, file holds {}", steps, declared_steps_,
                                           steps_read_));
      if (picks != picks_read_)
        return Corrupt(at + 12, fmt::format("trailer says {} picks, the steps hold {}; counts do not add up", picks,
                                            picks_read_));
      if (offset_ != size_) return Corrupt(offset_, fmt::format("{} bytes after the trailer", size_ - offset_));
      done_ = true;
      return false;
    }
    if (magic != kStepMagic) return Corrupt(at, fmt::format("expected a step marker, found {:#010x}", magic));
    if (steps_read_ >= declared_steps_)
      return Corrupt(at, fmt::format("more steps than the {} the header declares", declared_steps_));
    int64_t rows;
    EPMOE_RETURN_IF_ERROR(ReadValue(&rows, "rows"));
    const int L = info_.num_layers, E = info_.num_experts, k = info_.top_k;
    const int64_t remaining = size_ - offset_;
    if (info_.has_picks) {
      const int64_t per_row = static_cast<int64_t>(k) * L * (info_.has_weights ? 8 : 4);
      if (rows < 0 || rows > remaining / per_row)
        return Corrupt(at + 4, fmt::format("{} rows of {} bytes, but only {} bytes remain", rows, per_row, remaining));
    } else {
      const int64_t step_bytes = static_cast<int64_t>(L) * E * 8;
      if (rows < 0 || rows > kMaxRowsPerStep || step_bytes > remaining)
        return Corrupt(at + 4, fmt::format("{} rows and {} bytes of counts, but only {} bytes remain", rows,
                                           step_bytes, remaining));
    }
    step->rows = rows;
    step->counts.assign(static_cast<size_t>(L) * E, 0);
    if (info_.has_picks) {
      step->layers.resize(L);
      for (int l = 0; l < L; ++l) {
        Picks& picks = step->layers[l];
        picks.rows = rows;
        picks.k = k;
        picks.experts.resize(static_cast<size_t>(rows) * k);
        const int64_t ids_at = offset_;
        EPMOE_RETURN_IF_ERROR(ReadBytes(picks.experts.data(), picks.experts.size() * 4, "expert ids"));
        for (size_t i = 0; i < picks.experts.size(); ++i) {
          const int32_t e = picks.experts[i];
          if (e < 0 || e >= E)
            return Corrupt(ids_at + static_cast<int64_t>(i) * 4,
                           fmt::format("expert id {} out of range [0, {}) (step {}, layer {}, row {})", e, E,
                                       steps_read_, info_.layer_ids[l], static_cast<int64_t>(i) / k));
          for (size_t j = i - i % k; j < i; ++j)
            if (picks.experts[j] == e)
              return Corrupt(ids_at + static_cast<int64_t>(i) * 4,
                             fmt::format("expert {} picked twice in a row (step {}, layer {}, row {})", e, steps_read_,
                                         info_.layer_ids[l], static_cast<int64_t>(i) / k));
          ++step->counts[static_cast<size_t>(l) * E + e];
        }
        picks.weights.clear();
        if (info_.has_weights) {
          picks.weights.resize(picks.experts.size());
          const int64_t weights_at = offset_;
          EPMOE_RETURN_IF_ERROR(ReadBytes(picks.weights.data(), picks.weights.size() * 4, "weights"));
          for (size_t i = 0; i < picks.weights.size(); ++i)
            if (!std::isfinite(picks.weights[i]))
              return Corrupt(weights_at + static_cast<int64_t>(i) * 4,
                             fmt::format("weight {} is not finite (step {}, layer {})", picks.weights[i], steps_read_,
                                         info_.layer_ids[l]));
        }
      }
      picks_read_ += rows * k * L;
    } else {
      step->layers.clear();
      const int64_t counts_at = offset_;
      EPMOE_RETURN_IF_ERROR(ReadBytes(step->counts.data(), step->counts.size() * 8, "counts"));
      int64_t first_sum = -1;
      for (int l = 0; l < L; ++l) {
        int64_t sum = 0;
        for (int e = 0; e < E; ++e) {
          const int64_t count = step->counts[static_cast<size_t>(l) * E + e];
          const int64_t count_at = counts_at + (static_cast<int64_t>(l) * E + e) * 8;
          if (count < 0 || sum > (int64_t{1} << 62) - count)
            return Corrupt(count_at, fmt::format("bad count {} (step {}, layer {}, expert {})", count, steps_read_,
                                                 info_.layer_ids[l], e));
          sum += count;
        }
        if (sum == 0) continue;
        if (first_sum < 0) first_sum = sum;
        if (sum != first_sum || (rows > 0 && k > 0 && sum != rows * k))
          return Corrupt(counts_at + static_cast<int64_t>(l) * E * 8,
                         fmt::format("layer {} of step {} holds {} picks, expected {}; counts do not add up",
                                     info_.layer_ids[l], steps_read_, sum, rows > 0 && k > 0 ? rows * k : first_sum));
        if (picks_read_ > (int64_t{1} << 62) - sum) return Corrupt(counts_at, "pick total overflows");
        picks_read_ += sum;
      }
    }
    ++steps_read_;
    return true;
  }

 private:
  Status Corrupt(int64_t offset, const std::string& message) const {
    return IoError(fmt::format("{}: byte offset {}: {}", source_, offset, message));
  }
  Status Truncated(const char* what) const {
    return IoError(fmt::format("{}: byte offset {}: truncated file (reading {}; the file has {} bytes)", source_,
                               offset_, what, size_));
  }
  Status ReadBytes(void* data, size_t bytes, const char* what) {
    if (offset_ + static_cast<int64_t>(bytes) > size_) return Truncated(what);
    in_->read(static_cast<char*>(data), static_cast<std::streamsize>(bytes));
    if (in_->gcount() != static_cast<std::streamsize>(bytes)) return Truncated(what);
    offset_ += static_cast<int64_t>(bytes);
    return Status::Ok();
  }
  template <typename T>
  Status ReadValue(T* value, const char* what) {
    return ReadBytes(value, sizeof(T), what);
  }

  std::unique_ptr<std::istream> in_;
  int64_t size_;
  std::string source_;
  int64_t offset_ = 0;
  int64_t declared_steps_ = 0;
  int64_t steps_read_ = 0;
  int64_t picks_read_ = 0;
  bool done_ = false;
};

}  // namespace

bool HasTraceMagic(const char* bytes, size_t size) {
  return size >= sizeof(kTraceMagic) && std::memcmp(bytes, kTraceMagic, sizeof(kTraceMagic)) == 0;
}

Result<std::unique_ptr<TraceReader>> OpenBinaryTrace(std::unique_ptr<std::istream> in, int64_t size,
                                                     const std::string& source) {
  auto reader = std::make_unique<BinaryTraceReader>(std::move(in), size, source);
  EPMOE_RETURN_IF_ERROR(reader->ReadHeader());
  return std::unique_ptr<TraceReader>(std::move(reader));
}

}  // namespace trace_internal

namespace {
template <typename T>
void WriteValue(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}
}  // namespace

Result<std::unique_ptr<TraceWriter>> TraceWriter::Create(const std::string& path, const TraceInfo& info) {
  using namespace trace_internal;
  if (info.num_layers < 1 || info.num_layers > kMaxLayers || info.num_experts < 1 || info.num_experts > kMaxExperts ||
      info.top_k < 0 || info.top_k > kMaxTopK || info.top_k > info.num_experts || (info.has_picks && info.top_k == 0) ||
      (info.has_weights && !info.has_picks))
    return InvalidArgument(fmt::format("{}: cannot write a trace of {} layers, {} experts, top-{}{}", path,
                                       info.num_layers, info.num_experts, info.top_k,
                                       info.has_picks ? " with picks" : ""));
  std::vector<int> layer_ids = info.layer_ids;
  if (layer_ids.empty())
    for (int l = 0; l < info.num_layers; ++l) layer_ids.push_back(l);
  if (static_cast<int>(layer_ids.size()) != info.num_layers)
    return InvalidArgument(fmt::format("{}: {} layer ids for {} layers", path, layer_ids.size(), info.num_layers));
  for (size_t l = 0; l < layer_ids.size(); ++l)
    if (layer_ids[l] < 0 || (l > 0 && layer_ids[l] <= layer_ids[l - 1]))
      return InvalidArgument(fmt::format("{}: layer ids must be non-negative and ascending", path));
  std::unique_ptr<TraceWriter> writer(new TraceWriter());
  writer->path_ = path;
  writer->info_ = info;
  writer->info_.layer_ids = layer_ids;
  EPMOE_ASSIGN_OR_RETURN(writer->file_, AtomicFile::Create(path));
  std::string out(kTraceMagic, sizeof(kTraceMagic));
  WriteValue<uint32_t>(out, kTraceVersion);
  WriteValue<uint32_t>(out, (info.has_picks ? kFlagPicks : 0) | (info.has_weights ? kFlagWeights : 0));
  WriteValue<uint32_t>(out, static_cast<uint32_t>(info.num_layers));
  WriteValue<uint32_t>(out, static_cast<uint32_t>(info.num_experts));
  WriteValue<uint32_t>(out, static_cast<uint32_t>(info.top_k));
  WriteValue<uint32_t>(out, 0);
  WriteValue<int64_t>(out, 0);  // steps: filled in by Close
  for (int id : layer_ids) WriteValue<int32_t>(out, id);
  EPMOE_RETURN_IF_ERROR(writer->file_->Append(out));
  return writer;
}

Status TraceWriter::Append(const StepPicks& step) {
  using namespace trace_internal;
  if (closed_) return FailedPrecondition(fmt::format("{}: append after close", path_));
  const int L = info_.num_layers, E = info_.num_experts, k = info_.top_k;
  const std::string where = fmt::format("{}: step {}", path_, steps_);
  if (step.rows < 0 || step.rows > TraceReader::kMaxRowsPerStep)
    return InvalidArgument(fmt::format("{}: {} rows", where, step.rows));
  if (info_.has_picks) {
    if (static_cast<int>(step.layers.size()) != L)
      return InvalidArgument(fmt::format("{}: {} layers of picks, expected {}", where, step.layers.size(), L));
    for (int l = 0; l < L; ++l) {
      const Picks& picks = step.layers[l];
      if (picks.rows != step.rows || picks.k != k ||
          picks.experts.size() != static_cast<size_t>(step.rows) * k ||
          (info_.has_weights && picks.weights.size() != picks.experts.size()))
        return InvalidArgument(fmt::format("{} layer {}: {} rows of top-{} with {} weights, expected {} rows of top-{}{}",
                                           where, l, picks.rows, picks.k, picks.weights.size(), step.rows, k,
                                           info_.has_weights ? " with weights" : ""));
      Picks checked = picks;
      if (!info_.has_weights) checked.weights.assign(checked.experts.size(), 1.0f);
      Status status = ValidatePicks(checked, E);
      if (!status.ok()) return status.WithContext(fmt::format("{} layer {}", where, l));
    }
    buffer_.clear();
    WriteValue<uint32_t>(buffer_, kStepMagic);
    WriteValue<int64_t>(buffer_, step.rows);
    for (int l = 0; l < L; ++l) {
      const Picks& picks = step.layers[l];
      buffer_.append(reinterpret_cast<const char*>(picks.experts.data()), picks.experts.size() * 4);
      if (info_.has_weights)
        buffer_.append(reinterpret_cast<const char*>(picks.weights.data()), picks.weights.size() * 4);
    }
    total_picks_ += step.rows * k * L;
  } else {
    if (step.counts.size() != static_cast<size_t>(L) * E)
      return InvalidArgument(fmt::format("{}: {} counts, expected {}", where, step.counts.size(),
                                         static_cast<int64_t>(L) * E));
    int64_t first_sum = -1, total = 0;
    for (int l = 0; l < L; ++l) {
      int64_t sum = 0;
      for (int e = 0; e < E; ++e) {
        const int64_t count = step.counts[static_cast<size_t>(l) * E + e];
        if (count < 0) return InvalidArgument(fmt::format("{}: negative count at layer {} expert {}", where, l, e));
        sum += count;
      }
      if (sum == 0) continue;
      if (first_sum < 0) first_sum = sum;
      if (sum != first_sum || (step.rows > 0 && k > 0 && sum != step.rows * k))
        return InvalidArgument(fmt::format("{}: layer {} holds {} picks, expected {}; counts do not add up", where, l,
                                           sum, step.rows > 0 && k > 0 ? step.rows * k : first_sum));
      total += sum;
    }
    buffer_.clear();
    WriteValue<uint32_t>(buffer_, kStepMagic);
    WriteValue<int64_t>(buffer_, step.rows);
    buffer_.append(reinterpret_cast<const char*>(step.counts.data()), step.counts.size() * 8);
    total_picks_ += total;
  }
  ++steps_;
  return file_->Append(buffer_);
}

Status TraceWriter::Close() {
  using namespace trace_internal;
  if (closed_) return Status::Ok();
  closed_ = true;
  std::string trailer;
  WriteValue<uint32_t>(trailer, kTrailerMagic);
  WriteValue<int64_t>(trailer, steps_);
  WriteValue<int64_t>(trailer, total_picks_);
  EPMOE_RETURN_IF_ERROR(file_->Append(trailer));
  std::string steps;
  WriteValue<int64_t>(steps, steps_);
  EPMOE_RETURN_IF_ERROR(file_->WriteAt(kStepsOffset, steps));
  return file_->Commit();
}

}  // namespace epmoe
