// Writing safetensors files and shard indexes (§2.1, §2.6).
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors.h"
#include "sharding/safetensors_atomic_file.h"
#include "sharding/safetensors_internal.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {

using internal::Sv;
namespace {

// Element count of `shape`, or an error for negative dimensions / overflow.
absl::StatusOr<uint64_t> CheckedByteSize(const std::string& name, DType dtype,
                                         const std::vector<int64_t>& shape) {
  uint64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor `", name, "`: shape ",
                                                     ShapeToString(shape),
                                                     " has a negative dimension"));
    }
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor `", name, "`: shape ", ShapeToString(shape), " overflows"));
    }
  }
  uint64_t bytes = 0;
  if (elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
      __builtin_mul_overflow(elements, static_cast<uint64_t>(DTypeSize(dtype)), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor `", name, "`: shape ", ShapeToString(shape), " overflows"));
  }
  return bytes;
}

// A TensorToWrite whose fill copies from an owned vector of T.
template <typename T>
TensorToWrite FromVector(std::string name, DType dtype, std::vector<int64_t> shape,
                         std::vector<T> values) {
  auto data = std::make_shared<const std::vector<T>>(std::move(values));
  TensorToWrite t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.fill = [data, tensor_name = t.name](std::span<uint8_t> out) -> absl::Status {
    const uint64_t have = static_cast<uint64_t>(data->size()) * sizeof(T);
    if (have != out.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor `", tensor_name, "`: got ", have,
                                                     " bytes of data, shape needs ",
                                                     out.size()));
    }
    if (!out.empty()) std::memcpy(out.data(), data->data(), out.size());
    return absl::OkStatus();
  };
  return t;
}

}  // namespace

TensorToWrite TensorFromBytes(std::string name, DType dtype, std::vector<int64_t> shape,
                              std::vector<uint8_t> bytes) {
  return FromVector<uint8_t>(std::move(name), dtype, std::move(shape), std::move(bytes));
}

TensorToWrite TensorFromFloats(std::string name, std::vector<int64_t> shape,
                               std::vector<float> values) {
  return FromVector<float>(std::move(name), DType::kF32, std::move(shape), std::move(values));
}

TensorToWrite TensorFromHalfBits(std::string name, DType dtype, std::vector<int64_t> shape,
                                 std::vector<uint16_t> bits) {
  return FromVector<uint16_t>(std::move(name), dtype, std::move(shape), std::move(bits));
}

TensorToWrite TensorFromInt16(std::string name, std::vector<int64_t> shape,
                              std::vector<int16_t> values) {
  return FromVector<int16_t>(std::move(name), DType::kI16, std::move(shape), std::move(values));
}

TensorToWrite TensorFromInt32(std::string name, std::vector<int64_t> shape,
                              std::vector<int32_t> values) {
  return FromVector<int32_t>(std::move(name), DType::kI32, std::move(shape), std::move(values));
}

TensorToWrite TensorScalarInt32(std::string name, int32_t value) {
  return FromVector<int32_t>(std::move(name), DType::kI32, {}, std::vector<int32_t>{value});
}

absl::Status WriteSafetensorsFile(const std::string& path, std::vector<TensorToWrite> tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  SafetensorsWriteOptions options) {
  // Validate everything and lay out the data before touching the disk.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[std::string(kSafetensorsMetadataKey)] = std::move(meta);
  }
  std::set<std::string_view> seen;
  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    const std::string where = absl::StrCat("writing ", path);
    if (t.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a tensor has an empty name"));
    }
    if (t.name == kSafetensorsMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": `", Sv(kSafetensorsMetadataKey), "` is reserved, not a tensor name"));
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tensor `", t.name, "` given twice"));
    }
    if (!t.fill) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tensor `", t.name, "` has no fill function"));
    }
    absl::StatusOr<uint64_t> bytes = CheckedByteSize(t.name, t.dtype, t.shape);
    if (!bytes.ok()) return Annotate(bytes.status(), where);
    uint64_t end = 0;
    if (__builtin_add_overflow(offset, *bytes, &end)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": total size overflows"));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, end}}};
    sizes.push_back(*bytes);
    offset = end;
  }

  std::string header_text;
  try {
    header_text = header.dump();  // minified
  } catch (const nlohmann::json::exception& e) {
    // dump() rejects strings that are not valid UTF-8.
    return absl::InvalidArgumentError(
        absl::StrCat("writing ", path, ": a tensor name or metadata string is not utf-8 (",
                     e.what(), ")"));
  }
  if (options.pad_header_to_8) {
    while ((8 + header_text.size()) % 8 != 0) header_text.push_back(' ');
  }
  uint8_t length_prefix[8];
  const uint64_t header_size = header_text.size();
  std::memcpy(length_prefix, &header_size, 8);  // little-endian host (see safetensors.cc)

  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> out, AtomicFileWriter::Create(path));
  EXL3_RETURN_IF_ERROR(out->Append(std::span<const uint8_t>(length_prefix, 8)));
  EXL3_RETURN_IF_ERROR(out->Append(header_text));
  std::vector<uint8_t> buffer;
  for (size_t i = 0; i < tensors.size(); ++i) {
    buffer.assign(static_cast<size_t>(sizes[i]), 0);
    absl::Status filled = tensors[i].fill(std::span<uint8_t>(buffer));
    if (!filled.ok()) {
      return Annotate(filled, absl::StrCat("writing ", path, ": tensor `", tensors[i].name, "`"));
    }
    EXL3_RETURN_IF_ERROR(out->Append(std::span<const uint8_t>(buffer)));
    // Drop the callable (and any data it owns) once written, so a list of
    // owning makers does not keep every tensor alive until the end.
    tensors[i].fill = nullptr;
  }
  return out->Commit();
}

absl::Status WriteShardIndex(const std::string& dir, uint64_t total_size,
                             const std::map<std::string, std::string>& weight_map) {
  nlohmann::json index;
  index["metadata"] = {{"total_size", total_size}};
  index["weight_map"] = nlohmann::json::object();
  for (const auto& [name, file] : weight_map) index["weight_map"][name] = file;
  std::string text;
  const std::string path =
      (dir.empty() || dir.back() == '/' ? dir : dir + "/") + std::string(kShardIndexFileName);
  try {
    text = index.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("writing ", path, ": a name is not utf-8 (", e.what(), ")"));
  }
  return WriteFileAtomically(path, text);
}

}  // namespace exl3serve::sharding
