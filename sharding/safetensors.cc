// Safetensors header parsing and the memory-mapped reader (format: §2.6).
#include "sharding/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/trellis_decode.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors_internal.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {

using internal::Sv;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; the reader copies it verbatim");

namespace {

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  int64_t size;
};

constexpr std::array<DTypeEntry, 15> kDTypes = {{
    {DType::kBool, "BOOL", 1},
    {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},
    {DType::kU16, "U16", 2},
    {DType::kI32, "I32", 4},
    {DType::kU32, "U32", 4},
    {DType::kI64, "I64", 8},
    {DType::kU64, "U64", 8},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
}};

const DTypeEntry& Entry(DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e;
  }
  EXL3_CHECK(false) << "unknown DType value " << static_cast<int>(dtype);
  return kDTypes[0];
}

// The deepest nesting a valid header has: root object > tensor entry > shape.
constexpr int kMaxHeaderDepth = 3;

// Reads an unsigned JSON integer (nlohmann stores non-negative integers as
// number_unsigned). Returns false for anything else, including negatives and
// floats such as 8.0.
bool JsonToUint64(const nlohmann::json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// "an array", "a number": JSON type names with their article, for messages.
std::string TypeWithArticle(const nlohmann::json& value) {
  const std::string_view type = value.type_name();
  const bool vowel = !type.empty() && std::string_view("aeiou").find(type[0]) != std::string_view::npos;
  return absl::StrCat(vowel ? "an " : "a ", Sv(type));
}

// A short, single-line rendering of a JSON value for messages.
std::string Brief(const nlohmann::json& value) {
  std::string text;
  try {
    text = value.dump(-1, ' ', /*ensure_ascii=*/true);
  } catch (const nlohmann::json::exception&) {
    text = std::string("<") + value.type_name() + ">";
  }
  constexpr size_t kMaxChars = 60;
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars) + "...";
  return text;
}

// Validates one tensor entry; `prefix` is "<file>: tensor `<name>`".
absl::Status ParseTensorEntry(const std::string& prefix, const nlohmann::json& entry,
                              uint64_t data_section_size, TensorInfo* info) {
  if (!entry.is_object()) {
    return absl::DataLossError(
        absl::StrCat(prefix, ": entry is ", TypeWithArticle(entry), ", expected an object"));
  }
  for (const auto& [key, unused] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return absl::DataLossError(absl::StrCat(
          prefix, ": unexpected key `", key, "` (allowed: dtype, shape, data_offsets)"));
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) {
      return absl::DataLossError(absl::StrCat(prefix, ": missing `", key, "`"));
    }
  }

  const nlohmann::json& dtype = entry["dtype"];
  if (!dtype.is_string()) {
    return absl::DataLossError(
        absl::StrCat(prefix, ": dtype must be a string, got ", Brief(dtype)));
  }
  if (!ParseDTypeName(dtype.get_ref<const std::string&>(), &info->dtype)) {
    return absl::DataLossError(absl::StrCat(prefix, ": unknown dtype ", Brief(dtype)));
  }

  const nlohmann::json& shape = entry["shape"];
  if (!shape.is_array()) {
    return absl::DataLossError(
        absl::StrCat(prefix, ": shape must be an array, got ", Brief(shape)));
  }
  info->shape.clear();
  info->shape.reserve(shape.size());
  uint64_t elements = 1;
  bool overflow = false;
  for (const nlohmann::json& dim : shape) {
    uint64_t d = 0;
    if (!JsonToUint64(dim, &d) || d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::DataLossError(absl::StrCat(
          prefix, ": shape ", Brief(shape), " has ", Brief(dim),
          ", dimensions must be non-negative integers"));
    }
    info->shape.push_back(static_cast<int64_t>(d));
    overflow = overflow || __builtin_mul_overflow(elements, d, &elements);
  }
  const uint64_t element_size = static_cast<uint64_t>(DTypeSize(info->dtype));
  uint64_t needed_bytes = 0;
  if (overflow || elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
      __builtin_mul_overflow(elements, element_size, &needed_bytes)) {
    return absl::DataLossError(absl::StrCat(prefix, ": shape ", ShapeToString(info->shape), " ",
                                            Sv(DTypeName(info->dtype)),
                                            " overflows 64-bit sizes"));
  }

  const nlohmann::json& offsets = entry["data_offsets"];
  uint64_t begin = 0;
  uint64_t end = 0;
  if (!offsets.is_array() || offsets.size() != 2 || !JsonToUint64(offsets[0], &begin) ||
      !JsonToUint64(offsets[1], &end)) {
    return absl::DataLossError(absl::StrCat(
        prefix, ": data_offsets must be [begin, end] non-negative integers, got ",
        Brief(offsets)));
  }
  if (begin > end) {
    return absl::DataLossError(
        absl::StrCat(prefix, ": data_offsets [", begin, ", ", end, "] end before they begin"));
  }
  if (end > data_section_size) {
    return absl::DataLossError(absl::StrCat(prefix, ": data_offsets [", begin, ", ", end,
                                            "] run past the data section of ",
                                            data_section_size, " bytes"));
  }
  if (end - begin != needed_bytes) {
    return absl::DataLossError(absl::StrCat(
        prefix, ": data_offsets [", begin, ", ", end, "] hold ", end - begin, " bytes, shape ",
        ShapeToString(info->shape), " ", Sv(DTypeName(info->dtype)), " needs ", needed_bytes));
  }
  info->begin = begin;
  info->end = end;
  return absl::OkStatus();
}

absl::Status ParseMetadata(std::string_view file_label, const nlohmann::json& value,
                           std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return absl::DataLossError(absl::StrCat(Sv(file_label), ": `", Sv(kSafetensorsMetadataKey),
                                            "` must be an object of strings, got ",
                                            TypeWithArticle(value)));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return absl::DataLossError(absl::StrCat(Sv(file_label), ": `", Sv(kSafetensorsMetadataKey),
                                              "` must map strings to strings, key `", key,
                                              "` holds ", TypeWithArticle(item)));
    }
    (*metadata)[key] = item.get<std::string>();
  }
  return absl::OkStatus();
}

absl::Status ShortFileError(std::string_view file_label, uint64_t size) {
  return absl::DataLossError(absl::StrCat(Sv(file_label), ": file is ", size,
                                          " bytes, shorter than the 8-byte header length"));
}

}  // namespace

int64_t DTypeSize(DType dtype) { return Entry(dtype).size; }

std::string_view DTypeName(DType dtype) { return Entry(dtype).name; }

bool ParseDTypeName(std::string_view name, DType* dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.name == name) {
      *dtype = e.dtype;
      return true;
    }
  }
  return false;
}

int64_t TensorInfo::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t TensorInfo::ByteSize() const {
  return static_cast<uint64_t>(NumElements()) * static_cast<uint64_t>(DTypeSize(dtype));
}

std::string ShapeToString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::StatusOr<ParsedHeader> ParseSafetensorsHeader(std::string_view header_json,
                                                     uint64_t data_section_size,
                                                     std::string_view file_label) {
  JsonParseOptions options;
  options.reject_duplicate_keys = true;
  options.max_depth = kMaxHeaderDepth;
  absl::StatusOr<nlohmann::json> parsed = ParseJson(header_json, file_label, options);
  if (!parsed.ok()) {
    // ParseJson reports bad input as DataLoss already; keep its message.
    return parsed.status();
  }
  const nlohmann::json& root = *parsed;
  if (!root.is_object()) {
    return absl::DataLossError(
        absl::StrCat(Sv(file_label), ": header is ", TypeWithArticle(root), ", expected an object"));
  }

  ParsedHeader header;
  header.tensors.reserve(root.size());
  try {
    for (const auto& [name, entry] : root.items()) {
      if (name == kSafetensorsMetadataKey) {
        absl::Status status = ParseMetadata(file_label, entry, &header.metadata);
        if (!status.ok()) return status;
        continue;
      }
      TensorInfo info;
      info.name = name;
      absl::Status status = ParseTensorEntry(absl::StrCat(Sv(file_label), ": tensor `", name, "`"),
                                             entry, data_section_size, &info);
      if (!status.ok()) return status;
      header.tensors.push_back(std::move(info));
    }
  } catch (const nlohmann::json::exception& e) {
    // Not expected after the type checks above; kept so no exception escapes.
    return absl::DataLossError(absl::StrCat(Sv(file_label), ": malformed header: ", e.what()));
  }

  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  // Sorted by begin, non-empty tensors overlap exactly when one starts before
  // the furthest end seen so far.
  const TensorInfo* furthest = nullptr;
  for (const TensorInfo& t : header.tensors) {
    if (t.begin == t.end) continue;
    if (furthest != nullptr && t.begin < furthest->end) {
      return absl::DataLossError(absl::StrCat(
          Sv(file_label), ": tensors `", furthest->name, "` [", furthest->begin, ", ", furthest->end,
          "] and `", t.name, "` [", t.begin, ", ", t.end, "] overlap"));
    }
    if (furthest == nullptr || t.end > furthest->end) furthest = &t;
  }
  return header;
}

absl::StatusOr<ParsedHeader> ParseSafetensorsBytes(std::span<const uint8_t> file_bytes,
                                                   std::string_view file_label,
                                                   SafetensorsLayout* layout) {
  if (file_bytes.size() < 8) return ShortFileError(file_label, file_bytes.size());
  uint64_t header_size = 0;
  std::memcpy(&header_size, file_bytes.data(), 8);  // little-endian (static_assert above)
  if (header_size > kMaxSafetensorsHeaderBytes) {
    return absl::DataLossError(absl::StrCat(Sv(file_label), ": header length ", header_size,
                                            " exceeds the limit of ",
                                            kMaxSafetensorsHeaderBytes, " bytes"));
  }
  const uint64_t after_prefix = file_bytes.size() - 8;
  if (header_size > after_prefix) {
    return absl::DataLossError(absl::StrCat(Sv(file_label), ": header length ", header_size,
                                            " runs past the end of the file (",
                                            file_bytes.size(), " bytes)"));
  }
  SafetensorsLayout local;
  local.header_size = header_size;
  local.data_section_offset = 8 + header_size;
  local.data_section_size = after_prefix - header_size;
  const std::string_view header(reinterpret_cast<const char*>(file_bytes.data()) + 8,
                                static_cast<size_t>(header_size));
  absl::StatusOr<ParsedHeader> parsed =
      ParseSafetensorsHeader(header, local.data_section_size, file_label);
  if (parsed.ok() && layout != nullptr) *layout = local;
  return parsed;
}

// ---------------------------------------------------------------------------
// SafetensorsFile

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrCat("stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return ShortFileError(path, size);
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // The mapping keeps its own reference to the file.
  if (map == MAP_FAILED) return ErrnoStatus(map_errno, absl::StrCat("mmap ", path));

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = static_cast<const uint8_t*>(map);
  file->map_size_ = size;
  EXL3_ASSIGN_OR_RETURN(
      ParsedHeader header,
      ParseSafetensorsBytes(std::span<const uint8_t>(file->map_, size), path, &file->layout_));
  file->tensors_ = std::move(header.tensors);
  file->metadata_ = std::move(header.metadata);
  file->index_.reserve(file->tensors_.size());
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(Sv(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> SafetensorsFile::Data(const TensorInfo& info) const {
  EXL3_CHECK(info.begin <= info.end && info.end <= layout_.data_section_size)
      << "tensor `" << info.name << "` is not from " << path_;
  return std::span<const uint8_t>(map_ + layout_.data_section_offset + info.begin,
                                  info.end - info.begin);
}

void SafetensorsFile::ReadTensorBytes(const TensorInfo& info, void* dst) const {
  const std::span<const uint8_t> bytes = Data(info);
  if (!bytes.empty()) std::memcpy(dst, bytes.data(), bytes.size());
}

namespace {

absl::Status WrongDType(const std::string& path, const TensorInfo& info, std::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor `", info.name, "` is ",
                                                 Sv(DTypeName(info.dtype)), ", expected ", Sv(want)));
}

// Copies `bytes` (unaligned) into a vector of T.
template <typename T>
std::vector<T> CopyOut(std::span<const uint8_t> bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

}  // namespace

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadAsFloat(const TensorInfo& info) const {
  const std::span<const uint8_t> bytes = Data(info);
  switch (info.dtype) {
    case DType::kF32:
      return CopyOut<float>(bytes);
    case DType::kF16: {
      std::vector<uint16_t> bits = CopyOut<uint16_t>(bytes);
      std::vector<float> out(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) out[i] = kernels::HalfBitsToFloat(bits[i]);
      return out;
    }
    case DType::kBF16: {
      std::vector<uint16_t> bits = CopyOut<uint16_t>(bytes);
      std::vector<float> out(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) {
        out[i] = kernels::BitsToFloat(static_cast<uint32_t>(bits[i]) << 16);
      }
      return out;
    }
    case DType::kF64: {
      std::vector<double> wide = CopyOut<double>(bytes);
      return std::vector<float>(wide.begin(), wide.end());
    }
    default:
      return WrongDType(path_, info, "F16, BF16, F32 or F64");
  }
}

absl::StatusOr<std::vector<int16_t>> SafetensorsFile::ReadAsInt16(const TensorInfo& info) const {
  if (info.dtype != DType::kI16) return WrongDType(path_, info, "I16");
  return CopyOut<int16_t>(Data(info));
}

absl::StatusOr<std::vector<uint16_t>> SafetensorsFile::ReadAsUint16(const TensorInfo& info) const {
  if (DTypeSize(info.dtype) != 2) return WrongDType(path_, info, "a 2-byte dtype");
  return CopyOut<uint16_t>(Data(info));
}

absl::StatusOr<std::vector<int32_t>> SafetensorsFile::ReadAsInt32(const TensorInfo& info) const {
  if (info.dtype != DType::kI32) return WrongDType(path_, info, "I32");
  return CopyOut<int32_t>(Data(info));
}

absl::StatusOr<int64_t> SafetensorsFile::ReadScalarInt(const TensorInfo& info) const {
  if (info.NumElements() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor `", info.name, "` has shape ",
                                                   ShapeToString(info.shape),
                                                   ", expected a single element"));
  }
  const std::span<const uint8_t> bytes = Data(info);
  switch (info.dtype) {
    case DType::kBool:
    case DType::kU8:
      return static_cast<int64_t>(CopyOut<uint8_t>(bytes)[0]);
    case DType::kI8:
      return static_cast<int64_t>(CopyOut<int8_t>(bytes)[0]);
    case DType::kI16:
      return static_cast<int64_t>(CopyOut<int16_t>(bytes)[0]);
    case DType::kU16:
      return static_cast<int64_t>(CopyOut<uint16_t>(bytes)[0]);
    case DType::kI32:
      return static_cast<int64_t>(CopyOut<int32_t>(bytes)[0]);
    case DType::kU32:
      return static_cast<int64_t>(CopyOut<uint32_t>(bytes)[0]);
    case DType::kI64:
      return CopyOut<int64_t>(bytes)[0];
    case DType::kU64: {
      const uint64_t v = CopyOut<uint64_t>(bytes)[0];
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor `", info.name,
                                                       "` holds ", v, ", above int64 range"));
      }
      return static_cast<int64_t>(v);
    }
    default:
      return WrongDType(path_, info, "an integer dtype");
  }
}

}  // namespace exl3serve::sharding
