// libFuzzer target: the safetensors header parser on arbitrary bytes and, when it accepts them,
// block reads from every tensor: the first row and the end of the last row, at most 64 values
// each. A crash, sanitizer report (a read outside the input) or failed check is a finding; a
// refused input is not.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "epmoe/safetensors.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace epmoe;
  const auto* input = reinterpret_cast<const std::byte*>(data);
  auto file = SafetensorsFile::Parse({input, size}, "fuzz");
  if (!file.ok()) {
    Check(!file.status().message().empty());  // every refusal says why
    return 0;
  }
  constexpr int64_t kMaxColumns = 64;
  std::vector<float> out(kMaxColumns);
  int64_t covered = 0;
  for (const TensorInfo& tensor : (*file)->tensors()) {
    Check((*file)->Find(tensor.name) == &tensor);
    Check(tensor.offset == covered);  // contiguous, in data-offset order
    covered += tensor.bytes;
    const std::span<const std::byte> bytes = (*file)->Data(tensor);
    Check(bytes.data() >= input && bytes.data() + bytes.size() <= input + size);
    const int element_bytes = TensorDtypeBytes(tensor.dtype);
    if (tensor.dtype != TensorDtype::kUnknown) Check(tensor.bytes == tensor.elements() * element_bytes);

    const int64_t cols = tensor.shape.empty() ? 1 : tensor.shape.back();
    const int64_t rows = cols == 0 ? 0 : tensor.elements() / cols;
    const int64_t read_cols = std::min(cols, kMaxColumns);
    const bool readable = tensor.dtype != TensorDtype::kBool && tensor.dtype != TensorDtype::kUnknown;
    if (rows > 0) {
      Check((*file)->ReadFloat(tensor, 0, 1, 0, read_cols, out.data()).ok() == readable);
      Check((*file)->ReadFloat(tensor, rows - 1, 1, cols - read_cols, read_cols, out.data()).ok() == readable);
    }
    Check(!(*file)->ReadFloat(tensor, rows, 1, 0, 1, out.data()).ok());
    Check(!(*file)->ReadFloat(tensor, 0, 1, cols, 1, out.data()).ok());
  }
  uint64_t header_bytes;
  std::memcpy(&header_bytes, data, 8);
  Check(covered == static_cast<int64_t>(size - 8 - header_bytes));  // all of the data section
  return 0;
}
