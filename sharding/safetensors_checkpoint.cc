// SafetensorsCheckpoint: which files make up a model directory (§2.1).
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors.h"
#include "sharding/safetensors_internal.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {

using internal::Sv;
namespace {

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Reads the index's weight_map: tensor name -> shard file name.
absl::StatusOr<std::map<std::string, std::string>> ReadWeightMap(const std::string& index_path) {
  JsonParseOptions options;
  options.reject_duplicate_keys = true;  // a name listed twice is ambiguous
  EXL3_ASSIGN_OR_RETURN(nlohmann::json index, ReadJsonFile(index_path, options));
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::DataLossError(
        absl::StrCat(index_path, ": expected an object with a `weight_map` object"));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::DataLossError(absl::StrCat(index_path, ": weight_map entry for `", name,
                                              "` is a ", file.type_name(),
                                              ", expected a file name"));
    }
    const std::string& file_name = file.get_ref<const std::string&>();
    if (file_name.empty() || file_name.find('/') != std::string::npos || file_name == "." ||
        file_name == "..") {
      return absl::DataLossError(absl::StrCat(index_path, ": weight_map entry for `", name,
                                              "` names `", file_name,
                                              "`, expected a file name inside the directory"));
    }
    weight_map[name] = file_name;
  }
  return weight_map;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::Open(
    const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("opening model directory ", dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": not a directory"));
  }
  std::unique_ptr<SafetensorsCheckpoint> ckpt(new SafetensorsCheckpoint());
  ckpt->dir_ = dir;
  const std::string prefix = dir.empty() || dir.back() == '/' ? dir : dir + "/";

  auto open_file = [&](const std::string& file_name) -> absl::Status {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                          SafetensorsFile::Open(prefix + file_name));
    ckpt->files_.push_back(std::move(file));
    return absl::OkStatus();
  };
  // Registers every tensor of the last opened file; a name seen before is an
  // error (two files claim it).
  auto register_last = [&]() -> absl::Status {
    const SafetensorsFile* file = ckpt->files_.back().get();
    for (const TensorInfo& info : file->tensors()) {
      auto [it, inserted] = ckpt->by_name_.try_emplace(info.name, Located{file, &info});
      if (!inserted) {
        return absl::DataLossError(absl::StrCat("tensor `", info.name, "` appears in both ",
                                                it->second.file->path(), " and ",
                                                file->path()));
      }
    }
    return absl::OkStatus();
  };

  const std::string single = prefix + std::string(kSingleFileName);
  const std::string index_path = prefix + std::string(kShardIndexFileName);
  if (IsRegularFile(single)) {
    EXL3_RETURN_IF_ERROR(open_file(std::string(kSingleFileName)));
    EXL3_RETURN_IF_ERROR(register_last());
    return ckpt;
  }

  if (IsRegularFile(index_path)) {
    EXL3_ASSIGN_OR_RETURN(auto weight_map, ReadWeightMap(index_path));
    std::map<std::string, std::string> first_tensor_of_file;  // for messages
    for (const auto& [name, file] : weight_map) first_tensor_of_file.try_emplace(file, name);
    for (const auto& [file_name, example] : first_tensor_of_file) {
      if (!IsRegularFile(prefix + file_name)) {
        return absl::DataLossError(absl::StrCat(index_path, " lists `", file_name,
                                                "` (e.g. for tensor `", example,
                                                "`), which does not exist in ", dir));
      }
      EXL3_RETURN_IF_ERROR(open_file(file_name));
      const SafetensorsFile* file = ckpt->files_.back().get();
      for (const TensorInfo& info : file->tensors()) {
        auto listed = weight_map.find(info.name);
        if (listed == weight_map.end()) {
          return absl::DataLossError(absl::StrCat("tensor `", info.name, "` in ", file->path(),
                                                  " is not listed in ", index_path));
        }
        if (listed->second != file_name) {
          return absl::DataLossError(absl::StrCat("tensor `", info.name, "` is in ",
                                                  file->path(), " but ", index_path,
                                                  " assigns it to `", listed->second, "`"));
        }
      }
      EXL3_RETURN_IF_ERROR(register_last());
    }
    for (const auto& [name, file_name] : weight_map) {
      if (!ckpt->by_name_.contains(name)) {
        return absl::DataLossError(absl::StrCat("tensor `", name, "` is listed in ", index_path,
                                                " for `", file_name, "` but that file lacks it"));
      }
    }
    return ckpt;
  }

  std::error_code ec;
  std::vector<std::string> names;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (absl::EndsWith(name, ".safetensors") && IsRegularFile(prefix + name)) {
      names.push_back(name);
    }
  }
  if (ec) {
    return ErrnoStatus(ec.value(), absl::StrCat("listing model directory ", dir));
  }
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, ": no ", Sv(kSingleFileName), ", no ",
                                            Sv(kShardIndexFileName), " and no *.safetensors files"));
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    EXL3_RETURN_IF_ERROR(open_file(name));
    EXL3_RETURN_IF_ERROR(register_last());
  }
  return ckpt;
}

std::optional<SafetensorsCheckpoint::Located> SafetensorsCheckpoint::Find(
    std::string_view name) const {
  auto it = by_name_.find(Sv(name));
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> SafetensorsCheckpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(by_name_.size());
  for (const auto& [name, unused] : by_name_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

uint64_t SafetensorsCheckpoint::total_tensor_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, located] : by_name_) total += located.info->ByteSize();
  return total;
}

}  // namespace exl3serve::sharding
