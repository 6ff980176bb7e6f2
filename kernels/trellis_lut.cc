#include "kernels/trellis_lut.h"

#include <cmath>
#include <memory>
#include <mutex>

namespace exl3serve::kernels {
namespace {

std::unique_ptr<CodebookTable> BuildTable(Codebook codebook) {
  auto table = std::make_unique<CodebookTable>();
  table->codebook = codebook;
  double sum_squares = 0.0;
  for (int s = 0; s < kNumStates; ++s) {
    const uint16_t bits = DecodeState(codebook, static_cast<uint16_t>(s));
    table->half_bits[s] = bits;
    table->value[s] = HalfBitsToFloat(bits);
    sum_squares += static_cast<double>(table->value[s]) * table->value[s];
  }
  table->rms = std::sqrt(sum_squares / kNumStates);
  return table;
}

}  // namespace

const CodebookTable& GetCodebookTable(Codebook codebook) {
  static std::once_flag once[3];
  static std::unique_ptr<CodebookTable> tables[3];
  const int index = static_cast<int>(codebook);
  std::call_once(once[index], [&] { tables[index] = BuildTable(codebook); });
  return *tables[index];
}

const char* CodebookName(Codebook codebook) {
  switch (codebook) {
    case Codebook::kMcg:
      return "mcg";
    case Codebook::kMul1:
      return "mul1";
    case Codebook::k3Inst:
    default:
      return "3inst";
  }
}

bool ParseCodebookName(std::string_view name, Codebook* codebook) {
  if (name == "3inst") {
    *codebook = Codebook::k3Inst;
  } else if (name == "mcg") {
    *codebook = Codebook::kMcg;
  } else if (name == "mul1") {
    *codebook = Codebook::kMul1;
  } else {
    return false;
  }
  return true;
}

}  // namespace exl3serve::kernels
