// kernels/trellis_lut.h — the three codebooks as 65 536-entry tables, built
// once per process from kernels/trellis_decode.h (exl3-format.md §4.4: "build
// the three tables once and check them against the SHA-256 values").
//
//   const CodebookTable& t = GetCodebookTable(Codebook::kMul1);
//   uint16_t bits = t.half_bits[state];  float w = t.value[state];
//
// Thread safety: GetCodebookTable is thread-safe (tables are built on first
// use under a std::call_once and never change afterwards).
#ifndef EXL3SERVE_KERNELS_TRELLIS_LUT_H_
#define EXL3SERVE_KERNELS_TRELLIS_LUT_H_

#include <cstdint>
#include <string_view>

#include "kernels/trellis_decode.h"

namespace exl3serve::kernels {

inline constexpr int kNumStates = 65536;

struct CodebookTable {
  Codebook codebook;
  alignas(64) uint16_t half_bits[kNumStates];  // fp16 bit pattern per state
  alignas(64) float value[kNumStates];         // the same values as float (exact)
  double rms;                                  // sqrt(mean(value^2)) over all states
};

// The table of `codebook`; built on first call (about 1 ms each).
const CodebookTable& GetCodebookTable(Codebook codebook);

// "3inst" / "mcg" / "mul1", the names used in quantization_config (§2.2).
const char* CodebookName(Codebook codebook);

// Parses a codebook name; returns false for anything else.
bool ParseCodebookName(std::string_view name, Codebook* codebook);

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_TRELLIS_LUT_H_
