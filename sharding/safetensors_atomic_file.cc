#include "sharding/safetensors_atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(
    const std::string& path) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating ", tmp));
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, fd));
}

AtomicFileWriter::AtomicFileWriter(std::string path, int fd)
    : path_(std::move(path)), tmp_path_(path_ + ".tmp"), fd_(fd) {}

AtomicFileWriter::~AtomicFileWriter() {
  if (committed_) return;
  if (fd_ >= 0) ::close(fd_);
  ::unlink(tmp_path_.c_str());
}

absl::Status AtomicFileWriter::Append(std::string_view bytes) {
  return Append(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()),
                                         bytes.size()));
}

absl::Status AtomicFileWriter::Append(std::span<const uint8_t> bytes) {
  if (failed_ || committed_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("writing ", tmp_path_, ": writer already failed or committed"));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      failed_ = true;
      return ErrnoStatus(errno, absl::StrCat("writing ", tmp_path_));
    }
    done += static_cast<size_t>(n);
  }
  bytes_written_ += bytes.size();
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (failed_ || committed_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("committing ", tmp_path_, ": writer already failed or committed"));
  }
  failed_ = true;  // Until the rename succeeds; the destructor then cleans up.
  if (::fsync(fd_) != 0) return ErrnoStatus(errno, absl::StrCat("fsync ", tmp_path_));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return ErrnoStatus(errno, absl::StrCat("closing ", tmp_path_));
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("renaming ", tmp_path_, " to ", path_));
  }
  committed_ = true;
  failed_ = false;
  // Make the rename itself durable. A failure here leaves a complete file in
  // place, so it is reported but nothing is undone.
  const std::string dir = DirectoryOf(path_);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return ErrnoStatus(errno, absl::StrCat("opening directory ", dir));
  const int rc = ::fsync(dir_fd);
  const int fsync_errno = errno;
  ::close(dir_fd);
  if (rc != 0) return ErrnoStatus(fsync_errno, absl::StrCat("fsync directory ", dir));
  return absl::OkStatus();
}

}  // namespace exl3serve::sharding
