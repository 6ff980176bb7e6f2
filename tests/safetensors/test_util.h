// tests/safetensors/test_util.h — scratch directories for the safetensors tests.
#ifndef EXL3SERVE_TESTS_SAFETENSORS_TEST_UTIL_H_
#define EXL3SERVE_TESTS_SAFETENSORS_TEST_UTIL_H_

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"

namespace exl3serve::sharding::testing {

using ::exl3serve::testing::ScratchDir;

inline std::vector<uint8_t> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

inline void WriteBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A whole safetensors file: 8-byte little-endian length, `header`, then
// `data_bytes` bytes of data (value i & 0xFF at position i).
inline std::vector<uint8_t> MakeFileBytes(const std::string& header, size_t data_bytes) {
  // Sized up front: GCC 12 warns falsely (-Warray-bounds) on vector::insert here.
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = static_cast<uint8_t>(i);
  return out;
}

inline bool FileExists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

}  // namespace exl3serve::sharding::testing

#endif  // EXL3SERVE_TESTS_SAFETENSORS_TEST_UTIL_H_
