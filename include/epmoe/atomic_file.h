// AtomicFile: how every epmoe writer puts a file in place, so that a failed or interrupted write
// (a full disk, a corrupt input, an error half way) never leaves a partial file under the final name.
//
// Create() opens a uniquely named temporary beside the destination (so two writers of one path do not
// collide); Commit() flushes it, fsyncs it and renames it over the destination. A writer that is
// destroyed without a successful Commit() removes its temporary and leaves the destination as it
// was. A destination that exists and is not a regular file or directory (a device such as
// /dev/null or /dev/full, a FIFO) cannot be replaced by a rename: it is written in place, and every
// write error is still reported. A directory is refused. Not thread-safe (one writer).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

#include "epmoe/status.h"

namespace epmoe {

class AtomicFile {
 public:
  static Result<std::unique_ptr<AtomicFile>> Create(const std::string& path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends bytes; the first failure is kept and reported by this call and by Commit().
  Status Append(std::string_view bytes);
  Status Append(const void* bytes, size_t count) {
    return Append(std::string_view(static_cast<const char*>(bytes), count));
  }
  // Overwrites bytes already written at `offset` (e.g. a header's count known only at the end);
  // later Appends go on at the end.
  Status WriteAt(int64_t offset, std::string_view bytes);
  // Flushes, syncs and renames the temporary over the destination. Call once.
  Status Commit();

  const std::string& path() const { return path_; }

 private:
  AtomicFile() = default;
  Status Fail(const std::string& what, int error);

  std::string path_;       // the destination as given (named in messages)
  std::string target_;     // the destination with symbolic links resolved (renamed over)
  std::string temporary_;  // empty when writing in place
  std::FILE* file_ = nullptr;
  Status error_;
  bool committed_ = false;
};

// Writes `contents` to `path` through an AtomicFile.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// Refuses (naming both) an output that is the same file as an input, e.g. `trace convert t.bin t.bin`,
// which would destroy the input while reading it. Paths that do not exist yet are never the same.
Status CheckOutputIsNotInput(const std::string& input, const std::string& output);

}  // namespace epmoe
