// Safetensors checkpoints: a strict reader (memory-mapped, header checked before any tensor is
// touched) and a writer.
//
// A safetensors file is: a little-endian u64 N, N bytes of JSON header, then the data section. The
// header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets
// into the data section) and may hold "__metadata__", an object of string -> string. The reader
// refuses what the reference implementation refuses: a header that is not a JSON object or is over
// 100 MB, malformed fields, a byte range that does not match its shape and dtype, tensors that
// overlap or leave bytes of the data section to no tensor. Dtype names it does not know are kept
// (TensorDtype::kUnknown) with only their byte ranges checked. Errors name the file, the tensor and
// the field.
//
// A SafetensorsFile is immutable once parsed: thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/status.h"

namespace epmoe {

// Every dtype of the safetensors spec: BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32 F32 F64
// I64 U64; kUnknown for a name this reader does not know.
enum class TensorDtype {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kI16,
  kU16,
  kF16,
  kBf16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
  kUnknown
};

// The name as the spec writes it ("BF16", "F8_E4M3", ...); "unknown" for kUnknown.
const char* TensorDtypeName(TensorDtype dtype);
// The dtype a spec name stands for; kUnknown for any other string.
TensorDtype TensorDtypeFromName(std::string_view name);
// Bytes per element; 0 for kUnknown.
int TensorDtypeBytes(TensorDtype dtype);

// One tensor of a file, as its header describes it.
struct TensorInfo {
  std::string name;
  std::string dtype_name;  // as written in the file (kept for dtypes this reader does not know)
  TensorDtype dtype = TensorDtype::kUnknown;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // byte offset from the start of the data section
  int64_t bytes = 0;

  // The product of the dimensions (1 for a 0-D tensor).
  int64_t elements() const;
};

class SafetensorsFile {
 public:
  // Maps the file read-only (mmap) and parses and checks its header. Errors name the path.
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Parses and checks a whole file held in memory. `source` names it in errors. The bytes must
  // outlive the returned object.
  static Result<std::unique_ptr<SafetensorsFile>> Parse(std::span<const std::byte> file, std::string source);

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();  // unmaps a file that Open mapped

  const std::string& source() const { return source_; }
  // In data-offset order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr if the file has no tensor of that name.
  const TensorInfo* Find(std::string_view name) const;
  // The header's "__metadata__" (empty if it has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor's bytes; `tensor` must be one of tensors().
  std::span<const std::byte> Data(const TensorInfo& tensor) const;

  // Converts the block [row_begin, row_begin + row_count) x [col_begin, col_begin + col_count) of
  // the tensor to fp32 into out (row-major, row_count x col_count). The tensor is seen as a matrix
  // [product of all dims but the last] x [last dim]; a 1-D tensor is one row, a 0-D one 1 x 1.
  // F32, F16, BF16, F8_E5M2 and F8_E4M3 (OCP E4M3FN: no infinities, S.1111.111 is NaN) convert
  // exactly; F64 and the integer types round to the nearest fp32. Refuses BOOL, unknown dtypes and
  // a block out of range (InvalidArgument). `tensor` must be one of tensors().
  Status ReadFloat(const TensorInfo& tensor, int64_t row_begin, int64_t row_count, int64_t col_begin, int64_t col_count,
                   float* out) const;

 private:
  SafetensorsFile() = default;

  std::string source_;
  const std::byte* data_ = nullptr;  // the data section
  int64_t data_bytes_ = 0;
  std::vector<TensorInfo> tensors_;
  std::vector<int32_t> by_name_;  // indices into tensors_, sorted by name, for Find
  std::map<std::string, std::string> metadata_;
  void* mapping_ = nullptr;  // set when Open mapped the file
  size_t mapping_bytes_ = 0;
};

// One tensor to write: `bytes` must hold exactly elements * TensorDtypeBytes(dtype) bytes.
struct TensorToWrite {
  std::string name;
  TensorDtype dtype = TensorDtype::kUnknown;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

// Writes a safetensors file: the header padded with spaces to a multiple of 8 bytes (as the
// reference implementation does), then the tensors in the given order, contiguous. Writes
// through an AtomicFile, so a failed write leaves no partial file under `path`. Refuses
// (InvalidArgument) duplicate names, "__metadata__" as a name, names or metadata that are not
// UTF-8, negative dimensions, wrong byte counts and unknown dtypes.
Status WriteSafetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                        const std::map<std::string, std::string>& metadata = {});

// Appends `values` encoded as F32, BF16 or F16 to out, rounding to nearest even (NaN stays NaN,
// values past the format's range become infinities). Other dtypes are refused (InvalidArgument).
Status EncodeFloats(std::span<const float> values, TensorDtype dtype, std::vector<std::byte>* out);

}  // namespace epmoe
