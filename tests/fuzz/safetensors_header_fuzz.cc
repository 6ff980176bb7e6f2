// libFuzzer target: a whole safetensors file in memory (8-byte length, header
// JSON, data) through ParseSafetensorsBytes. Never touches the disk.
//
// Beyond "no crash, no sanitizer report", every accepted header is checked
// against the contract in sharding/safetensors.h; a violation aborts, so the
// fuzzer reports it like a crash.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "sharding/safetensors.h"

namespace {

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "safetensors_header_fuzz: accepted header breaks: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace exl3serve::sharding;
  SafetensorsLayout layout;
  auto parsed = ParseSafetensorsBytes(std::span<const uint8_t>(data, size), "fuzz", &layout);
  if (!parsed.ok()) {
    Require(parsed.status().code() == absl::StatusCode::kDataLoss, "error code is DataLoss");
    return 0;
  }
  Require(layout.header_size <= kMaxSafetensorsHeaderBytes, "header within 100 MB");
  Require(layout.data_section_offset == 8 + layout.header_size, "data offset is 8 + N");
  Require(layout.data_section_offset + layout.data_section_size == size, "sizes add up");
  uint64_t previous_end = 0;
  for (const TensorInfo& t : parsed->tensors) {
    Require(t.name != kSafetensorsMetadataKey, "metadata key is not a tensor");
    Require(t.begin <= t.end && t.end <= layout.data_section_size, "offsets within data");
    Require(t.ByteSize() == t.end - t.begin, "byte size matches offsets");
    for (int64_t d : t.shape) Require(d >= 0, "dimensions non-negative");
    if (t.begin != t.end) {
      Require(t.begin >= previous_end, "non-empty tensors do not overlap");
      previous_end = t.end;
    }
  }
  return 0;
}
