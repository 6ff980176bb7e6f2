#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {

size_t CommDataTypeSize(CommDataType type) {
  switch (type) {
    case CommDataType::kF32:
      return 4;
    case CommDataType::kBF16:
      return 2;
  }
  return 0;
}

const char* CommDataTypeName(CommDataType type) {
  switch (type) {
    case CommDataType::kF32:
      return "f32";
    case CommDataType::kBF16:
      return "bf16";
  }
  return "?";
}

}  // namespace exl3serve::worker::comm
