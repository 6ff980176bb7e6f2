// tests/testing/scratch_dir.h — a fresh scratch directory per test, removed
// with its contents when the test ends (also when it fails).
//
//   ScratchDir dir;
//   WriteSomething(dir.File("model.safetensors"));
#ifndef EXL3SERVE_TESTS_TESTING_SCRATCH_DIR_H_
#define EXL3SERVE_TESTS_TESTING_SCRATCH_DIR_H_

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace exl3serve::testing {

// A fresh directory under gtest's TempDir().
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = ::testing::TempDir() + "/exl3_test_XXXXXX";
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    const char* made = ::mkdtemp(buffer.data());
    EXPECT_NE(made, nullptr) << "mkdtemp " << pattern << ": " << std::strerror(errno);
    path_ = made ? made : pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace exl3serve::testing

#endif  // EXL3SERVE_TESTS_TESTING_SCRATCH_DIR_H_
