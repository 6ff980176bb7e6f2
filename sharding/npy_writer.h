// sharding/npy_writer.h — writes a float32 array as a NumPy .npy file (format
// version 1.0: magic, little-endian header dict padded to 64 bytes, raw data),
// so anyone can check a layer from outside with numpy.load.
#ifndef EXL3SERVE_SHARDING_NPY_WRITER_H_
#define EXL3SERVE_SHARDING_NPY_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace exl3serve::sharding {

// Writes `data` (row-major, C order, shape `shape`) to `path` as '<f4'.
// Errors: InvalidArgument if data.size() != product(shape); Internal with the
// path and errno text on I/O failure. The file is written to path.tmp and
// renamed, so a failure never leaves a partial .npy behind.
absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const std::vector<float>& data);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_NPY_WRITER_H_
