#include "epmoe/atomic_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace epmoe {
namespace {

// Distinguishes the temporaries of several writers in one process (the pid distinguishes processes).
std::atomic<uint64_t> temporary_counter{0};

}  // namespace

Result<std::unique_ptr<AtomicFile>> AtomicFile::Create(const std::string& path) {
  if (path.empty()) return InvalidArgument("an output path is empty");
  std::unique_ptr<AtomicFile> file(new AtomicFile());
  file->path_ = path;
  file->target_ = path;
  struct stat info {};
  if (::lstat(path.c_str(), &info) == 0 && S_ISLNK(info.st_mode)) {
    // Rename over the file the link names, not over the link.
    std::error_code error;
    const std::filesystem::path resolved = std::filesystem::canonical(path, error);
    if (!error) file->target_ = resolved.string();
  }
  if (::stat(file->target_.c_str(), &info) == 0) {
    if (S_ISDIR(info.st_mode)) return IoError(fmt::format("{}: is a directory, not a file to write", path));
    if (!S_ISREG(info.st_mode)) {
      // A device or FIFO: a rename would replace the device node itself, so write into it.
      file->file_ = std::fopen(file->target_.c_str(), "wb");
      if (file->file_ == nullptr)
        return IoError(fmt::format("{}: cannot open for writing: {}", path, std::strerror(errno)));
      return file;
    }
  }
  file->temporary_ =
      fmt::format("{}.tmp.{}.{}", file->target_, static_cast<long>(::getpid()), temporary_counter.fetch_add(1));
  const int fd = ::open(file->temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    const int error = errno;
    file->temporary_.clear();
    return IoError(fmt::format("{}: cannot create: {}", path, std::strerror(error)));
  }
  file->file_ = ::fdopen(fd, "wb");
  if (file->file_ == nullptr) {
    const int error = errno;
    ::close(fd);
    return IoError(fmt::format("{}: cannot create: {}", path, std::strerror(error)));
  }
  return file;
}

AtomicFile::~AtomicFile() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_ && !temporary_.empty()) ::unlink(temporary_.c_str());
}

Status AtomicFile::Fail(const std::string& what, int error) {
  if (error_.ok()) error_ = IoError(fmt::format("{}: {}: {}", path_, what, std::strerror(error)));
  return error_;
}

Status AtomicFile::Append(std::string_view bytes) {
  if (!error_.ok()) return error_;
  if (file_ == nullptr) return FailedPrecondition(fmt::format("{}: write after commit", path_));
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size())
    return Fail("write failed", errno);  // fwrite sets errno; nothing runs between
  return Status::Ok();
}

Status AtomicFile::WriteAt(int64_t offset, std::string_view bytes) {
  if (!error_.ok()) return error_;
  if (file_ == nullptr) return FailedPrecondition(fmt::format("{}: write after commit", path_));
  // Flushed first, so that an error of the bytes buffered so far is reported as the write it is.
  if (std::fflush(file_) != 0) return Fail("write failed", errno);
  if (::fseeko(file_, offset, SEEK_SET) != 0) return Fail("cannot seek", errno);
  EPMOE_RETURN_IF_ERROR(Append(bytes));
  if (::fseeko(file_, 0, SEEK_END) != 0) return Fail("cannot seek", errno);
  return Status::Ok();
}

Status AtomicFile::Commit() {
  if (!error_.ok()) return error_;
  if (file_ == nullptr) return FailedPrecondition(fmt::format("{}: committed twice", path_));
  std::FILE* file = file_;
  file_ = nullptr;
  // fsync before the rename, so that after a crash the destination holds the old file or all of the new.
  const bool flushed = std::fflush(file) == 0 && (temporary_.empty() || ::fsync(::fileno(file)) == 0);
  const int flush_error = errno;
  const bool closed = std::fclose(file) == 0;
  const int close_error = errno;
  if (!flushed) return Fail("write failed", flush_error);
  if (!closed) return Fail("write failed", close_error);
  if (!temporary_.empty() && std::rename(temporary_.c_str(), target_.c_str()) != 0) {
    const int rename_error = errno;
    return Fail(fmt::format("cannot rename {} over it", temporary_), rename_error);
  }
  committed_ = true;
  return Status::Ok();
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(path));
  EPMOE_RETURN_IF_ERROR(file->Append(contents));
  return file->Commit();
}

Status CheckOutputIsNotInput(const std::string& input, const std::string& output) {
  struct stat in {
  }, out{};
  if (::stat(input.c_str(), &in) != 0 || ::stat(output.c_str(), &out) != 0) return Status::Ok();
  if (in.st_dev == out.st_dev && in.st_ino == out.st_ino && S_ISREG(in.st_mode))
    return InvalidArgument(
        fmt::format("{}: the output is the input {}; writing it would destroy the input", output, input));
  return Status::Ok();
}

}  // namespace epmoe
