#include "epmoe/machine_limits.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include "core/huge_pages.h"
#include "epmoe/statistics.h"
#include "epmoe/thread_pool.h"
#include "kernels/cpu/limits_kernels.h"

namespace epmoe {
namespace {

Isa Lowered(Isa isa) {
  return std::min(isa, BestSupportedIsa());
}

}  // namespace

namespace kernels {
uint64_t ReadSumReference(const uint8_t* data, int64_t bytes) {
  uint64_t total = 0;
  for (int64_t i = 0; i < bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, data + i, 8);
    total += word;
  }
  return total;
}
}  // namespace kernels

const char* ArithmeticPathName(ArithmeticPath path) {
  switch (path) {
    case ArithmeticPath::kFp32Fma: return "fp32_fma";
    case ArithmeticPath::kBf16Dot: return "bf16_dot";
    case ArithmeticPath::kInt8Vnni: return "int8_vnni";
    case ArithmeticPath::kInt8Madd: return "int8_madd";
    case ArithmeticPath::kInt8VnniScale16: return "int8_vnni_scale16";
    case ArithmeticPath::kInt8VnniScale32: return "int8_vnni_scale32";
  }
  return "unknown";
}

ArithmeticPath PathForFormat(WeightFormat format, Isa isa) {
  if (isa == Isa::kReference || format == WeightFormat::kFp32) return ArithmeticPath::kFp32Fma;
  if (format == WeightFormat::kBf16) return isa == Isa::kAvx512 ? ArithmeticPath::kBf16Dot : ArithmeticPath::kFp32Fma;
  return isa == Isa::kAvx512 ? ArithmeticPath::kInt8Vnni : ArithmeticPath::kInt8Madd;
}

ArithmeticPath BlockScaledPathForFormat(WeightFormat format, Isa isa) {
  if (isa == Isa::kAvx512 && format == WeightFormat::kNvfp4) return ArithmeticPath::kInt8VnniScale16;
  if (isa == Isa::kAvx512 && format == WeightFormat::kMxfp4) return ArithmeticPath::kInt8VnniScale32;
  return PathForFormat(format, isa);
}

double MeasureReadRate(ThreadPool& pool, std::span<const std::span<const std::byte>> ranges, Isa isa) {
  // Pieces of 256 KB: many per thread for a layer's weights, long enough for the prefetching
  // stream to run at full speed.
  constexpr int64_t kPiece = int64_t{256} << 10;
  struct Piece {
    const uint8_t* data;
    int64_t bytes;
  };
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (const std::span<const std::byte> range : ranges) {
    const auto* data = reinterpret_cast<const uint8_t*>(range.data());
    const int64_t size = static_cast<int64_t>(range.size());
    for (int64_t at = 0; at < size; at += kPiece) pieces.push_back({data + at, std::min(kPiece, size - at)});
    total += size;
  }
  const Isa use = Lowered(isa);
  // The vector loops take whole 256-byte blocks; a piece's tail is summed byte by byte.
  auto read = [use](const Piece& piece) {
    const int64_t whole = piece.bytes / 256 * 256;
    uint64_t sum = 0;
    switch (use) {
      case Isa::kAvx512: sum = kernels::ReadSumAvx512(piece.data, whole); break;
      case Isa::kAvx2: sum = kernels::ReadSumAvx2(piece.data, whole); break;
      case Isa::kReference: sum = kernels::ReadSumReference(piece.data, whole); break;
    }
    for (int64_t i = whole; i < piece.bytes; ++i) sum += piece.data[i];
    return sum;
  };
  std::atomic<uint64_t> sink{0};  // the sums, kept so that the reads are not optimized away
  const auto start = std::chrono::steady_clock::now();
  // Runs of consecutive pieces per task, so that each thread reads long sequential stretches (as
  // the kernels' threads do) rather than alternating with the others piece by piece.
  const int64_t count = static_cast<int64_t>(pieces.size());
  const int64_t run = std::max<int64_t>(1, count / (4 * static_cast<int64_t>(pool.size())));
  pool.ParallelFor(count, run, [&](int64_t begin, int64_t end) {
    uint64_t sum = 0;
    for (int64_t i = begin; i < end; ++i) sum += read(pieces[i]);
    sink.fetch_add(sum, std::memory_order_relaxed);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return seconds > 0 ? static_cast<double>(total) / seconds / 1e9 : 0.0;
}

Result<MemoryReadProbe> MemoryReadProbe::Create(ThreadPool& pool, int64_t bytes, Isa isa) {
  constexpr int64_t kChunk = int64_t{1} << 20;
  if (bytes < kMinBytes)
    return InvalidArgument(
        fmt::format("bandwidth buffer of {} bytes is under 64 MB: it would be read from cache", bytes));
  bytes = bytes / kChunk * kChunk;
  // On 2 MiB pages, as the expert stores' weights are.
  HugePageMemory buffer = AllocateHugePageMemory(bytes);
  if (buffer == nullptr) return OutOfRange(fmt::format("cannot allocate {} bytes for the bandwidth test", bytes));
  // Touch every page with non-zero data so the reads hit real memory.
  pool.ParallelFor(bytes / kChunk, 1, [&](int64_t begin, int64_t end) {
    std::memset(buffer.get() + begin * kChunk, 1, (end - begin) * kChunk);
  });
  return MemoryReadProbe(std::unique_ptr<uint8_t, Free>(buffer.release()), bytes, isa);
}

void MemoryReadProbe::Free::operator()(uint8_t* memory) const {
  FreeHugePageMemory{}(memory);
}

double MemoryReadProbe::Read(ThreadPool& pool) {
  const std::span<const std::byte> whole(reinterpret_cast<const std::byte*>(buffer_.get()), bytes_);
  return MeasureReadRate(pool, {&whole, 1}, isa_);
}

Result<double> MeasureMemoryBandwidth(ThreadPool& pool, const BandwidthOptions& options, Isa isa) {
  EPMOE_ASSIGN_OR_RETURN(MemoryReadProbe probe, MemoryReadProbe::Create(pool, options.buffer_bytes, isa));
  std::vector<double> rates;
  for (int rep = 0; rep < std::max(1, options.repetitions); ++rep) rates.push_back(probe.Read(pool));
  return Median(rates);
}

Result<double> MeasurePeak(ArithmeticPath path, ThreadPool& pool, const PeakOptions& options, Isa isa) {
  const Isa use = Lowered(isa);
  auto loop = [use, path](int64_t iterations, float* sink) -> int64_t {
    switch (use) {
      case Isa::kAvx512: return kernels::ArithmeticLoopAvx512(path, iterations, sink);
      case Isa::kAvx2: return kernels::ArithmeticLoopAvx2(path, iterations, sink);
      case Isa::kReference: break;
    }
    return 0;
  };
  float probe = 0;
  if (loop(1, &probe) == 0)
    return FailedPrecondition(
        fmt::format("instruction set {} has no {} instruction", IsaName(use), ArithmeticPathName(path)));
  // Chunks of about 0.5 ms on one thread, so that a thread overruns the deadline by little.
  constexpr double kChunkSeconds = 0.5e-3;
  int64_t chunk = 1 << 10;
  while (true) {
    const auto start = std::chrono::steady_clock::now();
    loop(chunk, &probe);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > kChunkSeconds / 4 || chunk > (int64_t{1} << 34)) {
      chunk = std::max<int64_t>(1, static_cast<int64_t>(chunk * kChunkSeconds / std::max(seconds, 1e-9)));
      break;
    }
    chunk *= 4;
  }
  // Every thread runs chunks until a common deadline, and the peak is the sum of the threads' own
  // rates (operations over the time from their own start to their own end), which the kernels,
  // handing out work as threads free up, can use whole. (Equal work per thread, timed to the
  // slowest, lets one thread slowed by the host stand for all.)
  std::vector<double> rates;
  std::vector<float> sinks(pool.size(), 0.0f);
  std::vector<double> thread_rates(pool.size(), 0.0);
  for (int rep = 0; rep < std::max(1, options.repetitions); ++rep) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options.seconds_per_repetition));
    pool.RunOnAll([&](int thread) {
      const auto start = Clock::now();
      int64_t operations = 0;
      auto now = start;
      do {
        operations += loop(chunk, &sinks[thread]);
        now = Clock::now();
      } while (now < deadline);
      thread_rates[thread] = static_cast<double>(operations) / std::chrono::duration<double>(now - start).count();
    });
    double total = 0;
    for (double rate : thread_rates) total += rate;
    rates.push_back(total / 1e9);
  }
  return Median(rates);
}

}  // namespace epmoe
