// sharding/safetensors.h — reading and writing safetensors files and
// checkpoints (one file or several shards with an index). Knows nothing about
// EXL3; the EXL3 model description sits on top of it.
//
// Format facts (exl3-format.md §2.6): a file is an 8-byte little-endian header
// length N, N bytes of UTF-8 JSON, then the data section starting at byte 8+N.
// The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin,
// end]}, offsets relative to the data section; an optional "__metadata__" is a
// string->string map. exllamav3 writes minified JSON without padding, so 8+N
// is often odd and tensor data is NOT aligned: copy it out (memcpy) or use the
// Read* helpers; never cast Data() to int16_t*/float*. The standard safetensors
// writer pads the header with spaces to a multiple of 8; both are accepted.
// Sharded directories (§2.1) hold model-0000K-of-0000N.safetensors and
// model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}).
//
// Usage sketch:
//   EXL3_ASSIGN_OR_RETURN(auto ckpt, SafetensorsCheckpoint::Open(dir));
//   auto t = ckpt->Find("model.layers.0.mlp.down_proj.trellis");
//   if (!t) return absl::NotFoundError(...);
//   EXL3_ASSIGN_OR_RETURN(std::vector<int16_t> trellis, t->file->ReadAsInt16(*t->info));
//
//   std::vector<TensorToWrite> out;
//   out.push_back(TensorFromInt16("w.trellis", {8, 8, 32}, std::move(words)));
//   out.push_back(TensorScalarInt32("w.mul1", marker));
//   EXL3_RETURN_IF_ERROR(WriteSafetensorsFile(path, std::move(out), {}, {}));
#ifndef EXL3SERVE_SHARDING_SAFETENSORS_H_
#define EXL3SERVE_SHARDING_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3serve::sharding {

// ---------------------------------------------------------------------------
// Format constants (§2.6).

// Headers longer than this are rejected before parsing (exllamav3 and the
// safetensors library use the same 100 MB bound against hostile lengths).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
// The reserved header key for the string->string metadata map.
inline constexpr std::string_view kSafetensorsMetadataKey = "__metadata__";
// File names of §2.1.
inline constexpr std::string_view kSingleFileName = "model.safetensors";
inline constexpr std::string_view kShardIndexFileName = "model.safetensors.index.json";

// ---------------------------------------------------------------------------
// Element types, with the safetensors dtype tags in comments.
enum class DType {
  kBool,     // BOOL, 1 byte
  kU8,       // U8
  kI8,       // I8
  kI16,      // I16
  kU16,      // U16
  kI32,      // I32
  kU32,      // U32
  kI64,      // I64
  kU64,      // U64
  kF16,      // F16 (IEEE half)
  kBF16,     // BF16
  kF32,      // F32
  kF64,      // F64
  kF8E4M3,   // F8_E4M3
  kF8E5M2,   // F8_E5M2
};

// Bytes per element (1, 2, 4 or 8).
int64_t DTypeSize(DType dtype);
// The safetensors tag ("F16", "F8_E4M3", ...).
std::string_view DTypeName(DType dtype);
// Parses a safetensors tag (exact, case-sensitive). Returns false and leaves
// *dtype untouched for an unknown tag.
bool ParseDTypeName(std::string_view name, DType* dtype);

// One tensor's entry in a header. Offsets are relative to the data section.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;  // [] for a 0-d scalar (1 element)
  uint64_t begin = 0;
  uint64_t end = 0;

  // Product of shape (1 for 0-d). Parsed headers guarantee no overflow.
  int64_t NumElements() const;
  // NumElements() * DTypeSize(dtype) == end - begin for parsed headers.
  uint64_t ByteSize() const;
};

// "[8,8,16]" — how shapes are written in messages.
std::string ShapeToString(std::span<const int64_t> shape);

// A validated header.
struct ParsedHeader {
  // Sorted by (begin, name): the order of the data in the file.
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// Validates one header's JSON against a data section of `data_section_size`
// bytes. A pure function of its arguments (the fuzz target). Checks: the JSON
// is an object without duplicate keys; every entry but "__metadata__" is an
// object with exactly "dtype" (a known tag), "shape" (non-negative integers,
// [] allowed) and "data_offsets" ([begin, end] unsigned integers, begin <=
// end <= data_section_size, end - begin == bytes the shape needs, no
// overflow); non-empty tensors do not overlap (zero-size ones may sit
// anywhere in range); "__metadata__", if present, maps strings to strings.
// "{}" is a valid (empty) header. Bytes of the data section not covered by any
// tensor are allowed.
// Errors: DataLoss, one line, naming `file_label`, the tensor and the rule,
// e.g. "model.safetensors: tensor `a`: data_offsets [0, 100] hold 100 bytes,
// shape [8,8,64] I16 needs 8192".
absl::StatusOr<ParsedHeader> ParseSafetensorsHeader(std::string_view header_json,
                                                     uint64_t data_section_size,
                                                     std::string_view file_label);

// Where the header and data sit in a whole file.
struct SafetensorsLayout {
  uint64_t header_size = 0;          // N
  uint64_t data_section_offset = 0;  // 8 + N
  uint64_t data_section_size = 0;    // file size - 8 - N
};

// Splits a whole file (`file_bytes`) into length prefix, header and data, and
// parses the header. Also rejects files shorter than 8 bytes, N > 100 MB and
// N > file size - 8. Never reads past `file_bytes`. Errors: DataLoss naming
// `file_label`.
absl::StatusOr<ParsedHeader> ParseSafetensorsBytes(std::span<const uint8_t> file_bytes,
                                                   std::string_view file_label,
                                                   SafetensorsLayout* layout = nullptr);

// ---------------------------------------------------------------------------
// One safetensors file, memory-mapped read-only.
//
// Thread safety: thread-safe after Open (all methods are const reads of the
// immutable map).
// Ownership: owns the mapping; TensorInfo pointers and Data() spans stay valid
// until the object is destroyed. If another process truncates the file while
// it is mapped, touching the lost pages raises SIGBUS; checkpoints are
// treated as immutable while loaded.
class SafetensorsFile {
 public:
  // Maps `path` (PROT_READ, MAP_PRIVATE) and validates its header.
  // Errors: NotFound / PermissionDenied / ... from open(2), naming the path;
  // FailedPrecondition if `path` is not a regular file; DataLoss for a
  // malformed file (see ParseSafetensorsBytes).
  // Cost: one open + mmap; data pages are read lazily by the kernel.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // The tensors sorted by data offset (file order).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor called `name`, or nullptr.
  const TensorInfo* Find(std::string_view name) const;
  // Absolute file offset of the data section (8 + N), for pread users.
  uint64_t data_section_offset() const { return layout_.data_section_offset; }
  uint64_t data_section_size() const { return layout_.data_section_size; }
  uint64_t file_size() const { return map_size_; }

  // The bytes of `info`. NOT aligned in general (§2.6): memcpy out of it.
  // Requires: `info` came from this file's tensors() or Find().
  std::span<const uint8_t> Data(const TensorInfo& info) const;

  // Copies the tensor's ByteSize() bytes to `dst`.
  // Requires: `info` from this file; dst holds ByteSize() bytes.
  void ReadTensorBytes(const TensorInfo& info, void* dst) const;

  // Typed copies. Errors: InvalidArgument naming file, tensor and dtype when
  // the dtype is not one the helper converts.
  // F16, BF16, F32, F64 -> float (F64 rounded to nearest float).
  absl::StatusOr<std::vector<float>> ReadAsFloat(const TensorInfo& info) const;
  // I16 only.
  absl::StatusOr<std::vector<int16_t>> ReadAsInt16(const TensorInfo& info) const;
  // Raw 16-bit words of any 2-byte dtype (I16, U16, F16, BF16): fp16/bf16 bits.
  absl::StatusOr<std::vector<uint16_t>> ReadAsUint16(const TensorInfo& info) const;
  // I32 only.
  absl::StatusOr<std::vector<int32_t>> ReadAsInt32(const TensorInfo& info) const;
  // The single value of a 1-element integer or bool tensor (e.g. the 0-d I32
  // codebook markers of §2.4). Errors: InvalidArgument if not integer or not
  // exactly one element. U64 values above INT64_MAX are an error too.
  absl::StatusOr<int64_t> ReadScalarInt(const TensorInfo& info) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  const uint8_t* map_ = nullptr;  // the whole file, map_size_ (>= 8) bytes
  uint64_t map_size_ = 0;
  SafetensorsLayout layout_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  absl::flat_hash_map<std::string, size_t> index_;  // name -> position in tensors_
};

// ---------------------------------------------------------------------------
// A model directory's tensors, across one or several files.
//
// Which files (in this order of preference):
//   1. model.safetensors, if present (other *.safetensors are ignored, e.g.
//      test vectors' expected.safetensors);
//   2. else model.safetensors.index.json: its weight_map names every tensor's
//      file; every listed file must exist, every listed tensor must be in its
//      file, and every tensor of those files must be listed (exactly once);
//   3. else every *.safetensors in the directory, sorted by name; a tensor
//      name in two files is an error.
//
// Thread safety: thread-safe after Open (immutable).
// Ownership: owns its SafetensorsFiles; Located pointers live as long as the
// checkpoint.
class SafetensorsCheckpoint {
 public:
  // Errors: NotFound if `dir` is missing or holds no *.safetensors (naming the
  // dir); InvalidArgument if `dir` is not a directory; DataLoss for a malformed index, a missing shard file, a listed
  // tensor absent from its file, unlisted or duplicated tensors, and anything
  // SafetensorsFile::Open rejects (prefixed with the file name).
  // Cost: opens and maps every file; reads only headers.
  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& dir);

  struct Located {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  // Where `name` lives, or nullopt.
  std::optional<Located> Find(std::string_view name) const;
  bool Has(std::string_view name) const { return Find(name).has_value(); }
  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;
  // The files, in the order they were opened (sorted by file name).
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  const std::string& dir() const { return dir_; }
  // Sum of all tensors' byte sizes (what index.json calls total_size).
  uint64_t total_tensor_bytes() const;

 private:
  SafetensorsCheckpoint() = default;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  absl::flat_hash_map<std::string, Located> by_name_;
};

// ---------------------------------------------------------------------------
// Writing.

// One tensor to write. `fill` is called once, while the file is written, with
// a zeroed buffer of exactly the tensor's byte size (little-endian element
// data, C order) and must fill it; its error aborts the write. The writer
// releases each fill (and what it captured) as soon as that tensor is written.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::function<absl::Status(std::span<uint8_t>)> fill;
};

// Makers that own their data. Each checks at write time that the element
// count matches `shape` (InvalidArgument naming the tensor otherwise).
TensorToWrite TensorFromBytes(std::string name, DType dtype, std::vector<int64_t> shape,
                              std::vector<uint8_t> bytes);
TensorToWrite TensorFromFloats(std::string name, std::vector<int64_t> shape,
                               std::vector<float> values);  // F32
// `dtype` is kF16 or kBF16 (or kU16/kI16); values are raw bit patterns.
TensorToWrite TensorFromHalfBits(std::string name, DType dtype, std::vector<int64_t> shape,
                                 std::vector<uint16_t> bits);
TensorToWrite TensorFromInt16(std::string name, std::vector<int64_t> shape,
                              std::vector<int16_t> values);  // I16
TensorToWrite TensorFromInt32(std::string name, std::vector<int64_t> shape,
                              std::vector<int32_t> values);  // I32
// A 0-d I32 tensor (shape []), as the EXL3 codebook markers (§2.4).
TensorToWrite TensorScalarInt32(std::string name, int32_t value);

struct SafetensorsWriteOptions {
  // Pad the header JSON with spaces so the data section starts at a multiple
  // of 8 (what the safetensors library does). false reproduces exllamav3's
  // unpadded minified layout (§2.6).
  bool pad_header_to_8 = true;
};

// Writes a safetensors file: tensors back to back in the given order (no
// padding between them), minified header JSON with "__metadata__" first
// (omitted if empty, as the safetensors library does) and then the tensors'
// keys in the given order. Writes `path + ".tmp"`, fsyncs, renames over `path` and
// fsyncs the directory; on any failure the temporary file is removed and
// `path` is untouched. Holds one tensor's bytes in memory at a time.
// Errors: InvalidArgument for an empty or duplicate name, the name
// "__metadata__", a negative dimension, a missing fill, or a size overflow;
// whatever a fill returns (prefixed with the tensor name); the errno-derived
// code for I/O failures, naming the path.
absl::Status WriteSafetensorsFile(const std::string& path, std::vector<TensorToWrite> tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  SafetensorsWriteOptions options = {});

// Writes `dir`/model.safetensors.index.json (§2.1):
// {"metadata": {"total_size": total_size}, "weight_map": {name: file, ...}}
// with 2-space indentation and keys sorted, atomically.
absl::Status WriteShardIndex(const std::string& dir, uint64_t total_size,
                             const std::map<std::string, std::string>& weight_map);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_SAFETENSORS_H_
