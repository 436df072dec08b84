// The device's copy rate for `epmoe calibrate` (memory.copy_gbs): what DWDP's fetches cost where
// the ranks share a device, since a read from a shared-memory window is a memcpy by the reader; and
// its row codec rate (row_codec_ns): what a2a's pack and unpack cost per number.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "epmoe/hardware.h"
#include "epmoe/row_codec.h"
#include "epmoe/thread_pool.h"

namespace epmoe {

Result<double> MeasureCopyBandwidth(ThreadPool& pool, const CopyBandwidthOptions& options) {
  if (options.buffer_bytes < (int64_t{1} << 20) || options.repetitions < 1)
    return InvalidArgument(
        fmt::format("copy bandwidth: buffers of {} bytes (at least 1 MB) and {} repetitions (at "
                    "least 1)",
                    options.buffer_bytes, options.repetitions));
  const size_t bytes = static_cast<size_t>(options.buffer_bytes);
  std::unique_ptr<std::byte[]> from(new (std::nothrow) std::byte[bytes]);
  std::unique_ptr<std::byte[]> to(new (std::nothrow) std::byte[bytes]);
  if (from == nullptr || to == nullptr)
    return OutOfRange(fmt::format("copy bandwidth: cannot allocate two buffers of {} bytes", bytes));
  // Both buffers touched first, so no page is mapped inside the timed copies.
  std::memset(from.get(), 1, bytes);
  std::memset(to.get(), 2, bytes);
  const int threads = pool.size();
  auto copy = [&](int t) {
    const size_t begin = bytes * t / threads, end = bytes * (t + 1) / threads;
    std::memcpy(to.get() + begin, from.get() + begin, end - begin);
  };
  std::vector<double> rates;
  for (int rep = 0; rep <= options.repetitions; ++rep) {  // the first is a warm-up
    const auto start = std::chrono::steady_clock::now();
    pool.RunOnAll(copy);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rep > 0) rates.push_back(static_cast<double>(bytes) / seconds / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

Result<double> MeasureRowCodecNs(const RowCodecOptions& options) {
  if (options.rows < 1 || options.repetitions < 1)
    return InvalidArgument(
        fmt::format("row codec rate: {} rows and {} repetitions (at least 1 each)", options.rows, options.repetitions));
  EPMOE_RETURN_IF_ERROR(CheckRowWidth(RowFormat::kBf16, options.cols).WithContext("row codec rate"));
  const int64_t cols = options.cols, row_bytes = RowBytes(RowFormat::kBf16, cols);
  std::vector<float> values(options.rows * cols), sums(options.rows * cols, 0.0f);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 1000) * 1e-3f;
  std::vector<uint8_t> encoded(options.rows * row_bytes);
  std::vector<int64_t> order(options.rows);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(1));
  std::vector<double> ns;
  for (int rep = 0; rep <= options.repetitions; ++rep) {  // the first is a warm-up
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < options.rows; ++i)
      EncodeRow(RowFormat::kBf16, &values[order[i] * cols], cols, &encoded[i * row_bytes]);
    for (int64_t i = 0; i < options.rows; ++i)
      AddDecodedRow(RowFormat::kBf16, &encoded[i * row_bytes], cols, &sums[order[i] * cols]);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rep > 0) ns.push_back(seconds * 1e9 / (2.0 * static_cast<double>(options.rows * cols)));
  }
  std::sort(ns.begin(), ns.end());
  return ns[ns.size() / 2];
}

}  // namespace epmoe
