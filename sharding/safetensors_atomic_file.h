// sharding/safetensors_atomic_file.h — write a file so that readers see either
// the previous version or the complete new one, never a partial file.
//
//   EXL3_ASSIGN_OR_RETURN(auto out, AtomicFileWriter::Create(path));
//   EXL3_RETURN_IF_ERROR(out->Append(bytes));
//   EXL3_RETURN_IF_ERROR(out->Commit());   // fsync, rename, fsync dir
//   // Destroying an uncommitted writer removes the temporary file.
#ifndef EXL3SERVE_SHARDING_SAFETENSORS_ATOMIC_FILE_H_
#define EXL3SERVE_SHARDING_SAFETENSORS_ATOMIC_FILE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3serve::sharding {

// Streams bytes into `path + ".tmp"` and renames it over `path` on Commit().
//
// Thread safety: thread-compatible (one writer per object).
// Ownership: owns the temporary file's descriptor; an uncommitted writer
// deletes the temporary file when destroyed, leaving `path` untouched.
class AtomicFileWriter {
 public:
  // Creates (truncates) `path + ".tmp"` with mode 0644.
  // Errors: errno-derived code (NotFound for a missing directory,
  // PermissionDenied, ...) with a message naming the temporary path.
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path);

  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends all of `bytes` (retries short writes and EINTR).
  // Errors: errno-derived code naming the temporary path (e.g.
  // ResourceExhausted for ENOSPC); the writer is then unusable.
  absl::Status Append(std::span<const uint8_t> bytes);
  absl::Status Append(std::string_view bytes);

  // fsync, close, rename to `path`, fsync the directory. Errors: the
  // errno-derived code naming the path; the temporary file is removed.
  absl::Status Commit();

  uint64_t bytes_written() const { return bytes_written_; }

 private:
  AtomicFileWriter(std::string path, int fd);

  const std::string path_;
  const std::string tmp_path_;
  int fd_ = -1;
  bool failed_ = false;
  bool committed_ = false;
  uint64_t bytes_written_ = 0;
};

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_SAFETENSORS_ATOMIC_FILE_H_
