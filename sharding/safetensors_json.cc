#include "sharding/safetensors_internal.h"
#include "sharding/safetensors_json.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "sharding/safetensors_atomic_file.h"

namespace exl3serve::sharding {

using internal::Sv;
namespace {

// Thrown from the parser callback and caught in ParseJson: the callback has
// no other way to stop nlohmann's parser. Never leaves this file.
struct JsonRuleViolation {
  std::string message;
};

// nlohmann messages start with "[json.exception.parse_error.101] "; drop it.
std::string_view StripExceptionTag(std::string_view what) {
  if (!what.empty() && what.front() == '[') {
    const size_t close = what.find("] ");
    if (close != std::string_view::npos) what.remove_prefix(close + 2);
  }
  return what;
}

}  // namespace

absl::Status ErrnoStatus(int errno_value, std::string_view what) {
  return absl::Status(absl::ErrnoToStatusCode(errno_value),
                      absl::StrCat(Sv(what), ": ", std::strerror(errno_value)));
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  std::string out;
  struct stat st;
  if (::fstat(fd, &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat("reading ", path, ": is a directory"));
    }
    if (st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  }
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("reading ", path));
    }
    out.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, std::string_view label,
                                         JsonParseOptions options) {
  // One set of keys per open object, to find repeated keys; a depth counter
  // over objects and arrays.
  std::vector<std::set<std::string>> open_objects;
  int depth = 0;
  auto callback = [&](int /*nlohmann_depth*/, nlohmann::json::parse_event_t event,
                      nlohmann::json& parsed) -> bool {
    using Event = nlohmann::json::parse_event_t;
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        ++depth;
        if (options.max_depth > 0 && depth > options.max_depth) {
          throw JsonRuleViolation{
              absl::StrCat("json nests deeper than ", options.max_depth, " levels")};
        }
        if (event == Event::object_start && options.reject_duplicate_keys) {
          open_objects.emplace_back();
        }
        break;
      case Event::object_end:
      case Event::array_end:
        --depth;
        if (event == Event::object_end && options.reject_duplicate_keys &&
            !open_objects.empty()) {
          open_objects.pop_back();
        }
        break;
      case Event::key:
        if (options.reject_duplicate_keys && !open_objects.empty() && parsed.is_string()) {
          const std::string& key = parsed.get_ref<const std::string&>();
          if (!open_objects.back().insert(key).second) {
            throw JsonRuleViolation{absl::StrCat("duplicate key `", key, "`")};
          }
        }
        break;
      case Event::value:
        break;
    }
    return true;
  };
  try {
    const bool need_callback = options.reject_duplicate_keys || options.max_depth > 0;
    if (need_callback) return nlohmann::json::parse(text.begin(), text.end(), callback);
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const JsonRuleViolation& violation) {
    return absl::DataLossError(absl::StrCat(Sv(label), ": ", violation.message));
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(
        absl::StrCat(Sv(label), ": invalid json: ", Sv(StripExceptionTag(e.what()))));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(Sv(label), ": out of memory parsing ", text.size(), " bytes of json"));
  }
}

absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path, JsonParseOptions options) {
  EXL3_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseJson(text, path, options);
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> writer, AtomicFileWriter::Create(path));
  EXL3_RETURN_IF_ERROR(writer->Append(contents));
  return writer->Commit();
}

}  // namespace exl3serve::sharding
