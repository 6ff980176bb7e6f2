// sharding/safetensors_json.h — whole-file reads, atomic whole-file writes and
// JSON parsing that return Status instead of throwing.
//
// The safetensors module and the converter read small text files
// (config.json, model.safetensors.index.json, quantization_config.json) and
// write them back. These helpers keep nlohmann's exceptions and errno handling
// in one place, and word their errors the house way (one lowercase line naming
// the file and the problem).
//
//   EXL3_ASSIGN_OR_RETURN(nlohmann::json config, ReadJsonFile(dir + "/config.json"));
//   EXL3_RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", config.dump(2)));
#ifndef EXL3SERVE_SHARDING_SAFETENSORS_JSON_H_
#define EXL3SERVE_SHARDING_SAFETENSORS_JSON_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace exl3serve::sharding {

// Returns a Status for a failed system call: the code comes from
// absl::ErrnoToStatusCode (ENOENT -> NotFound, EACCES -> PermissionDenied, ...)
// and the message is "<what>: <strerror text>".
absl::Status ErrnoStatus(int errno_value, std::string_view what);

// Reads the whole file at `path`.
// Errors: the errno-derived code (NotFound, PermissionDenied, ...) with a
// message naming `path`; FailedPrecondition if `path` is a directory.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// How ParseJson treats inputs that nlohmann accepts but we may not want.
struct JsonParseOptions {
  // Python's json and nlohmann silently keep the last of two equal keys in
  // one object; with this set, a repeated key is an error instead.
  bool reject_duplicate_keys = false;
  // Deepest nesting accepted; the top-level value is depth 1 (so `{"a":[1]}`
  // has depth 2 for the array). 0 means no limit.
  int max_depth = 0;
};

// Parses `text` as one JSON value (surrounding whitespace allowed).
// `label` names the source in messages (usually a file path).
// Errors: DataLoss "<label>: invalid json: parse error at line L, column C:
// <reason>", "<label>: duplicate key `k`", "<label>: json nests deeper than N
// levels"; ResourceExhausted if memory runs out. Never throws.
absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, std::string_view label,
                                         JsonParseOptions options = {});

// ReadFileToString + ParseJson(text, path, options).
absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path,
                                            JsonParseOptions options = {});

// Writes `contents` to `path + ".tmp"`, fsyncs it, renames it over `path` and
// fsyncs the directory, so readers see either the old file or the complete new
// one. On failure the temporary file is removed and `path` is untouched.
// Errors: the errno-derived code with a message naming the path.
absl::Status WriteFileAtomically(const std::string& path, std::string_view contents);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_SAFETENSORS_JSON_H_
