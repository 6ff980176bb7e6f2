// tests/testing/shared_data.h — where the read-only shared test data lives
// (../shared beside the checkout, present in CI; EXL3_SHARED_DIR in the
// environment overrides the configured path), and a skip for tests that need
// it when a user's clone has none.
//
//   EXL3_REQUIRE_SHARED(path, "models/stories260K/stories260K.bin");
//   ... use path (a std::string) ...
#ifndef EXL3SERVE_TESTS_TESTING_SHARED_DATA_H_
#define EXL3SERVE_TESTS_TESTING_SHARED_DATA_H_

#include <cstdlib>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace exl3serve::testing {

// The shared folder: $EXL3_SHARED_DIR, else the configured EXL3_SHARED_DIR.
inline std::string SharedDir() {
  const char* env = std::getenv("EXL3_SHARED_DIR");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string(EXL3_SHARED_DIR);
}

// SharedDir() + "/" + relative.
inline std::string SharedPath(const std::string& relative) { return SharedDir() + "/" + relative; }

}  // namespace exl3serve::testing

// Declares `var` = the shared path of `relative`, or skips the test with a
// message saying what is missing when it does not exist.
#define EXL3_REQUIRE_SHARED(var, relative)                                               \
  const std::string var = ::exl3serve::testing::SharedPath(relative);                    \
  if (!std::filesystem::exists(var)) {                                                   \
    GTEST_SKIP() << "shared test data " << var                                           \
                 << " not found (../shared beside the checkout; CI has it)";             \
  }

#endif  // EXL3SERVE_TESTS_TESTING_SHARED_DATA_H_
