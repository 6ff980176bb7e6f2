// cli/precision_flags.h — `--prefill-precision fp32|bf16` and
// `--decode-precision fp32|int8`, shared by `generate`, `serve` and
// `worker`: the arithmetic of EXL3 linears with >= 17 rows (prefill) and
// fewer (decode) in every process that runs the model
// (worker::SetPrefillPrecision / SetDecodePrecision, worker/model/linear.h).
// The driver applies them in-process (one rank) and passes them to every
// rank (`worker --prefill-precision ... --decode-precision ...`); under a
// coordinator they travel in Setup (a rank's own flags win).
//
//   PrecisionFlags precision;  AddPrecisionFlags(app, &precision);
//   ... EXL3_RETURN_IF_ERROR(precision.Apply());
//
// A value outside the lists is a command-line error naming the flag and the
// values it takes ("--decode-precision: int4 not in {fp32,int8}").
// Thread safety: plain values, filled by CLI11 while parsing.
#ifndef EXL3SERVE_CLI_PRECISION_FLAGS_H_
#define EXL3SERVE_CLI_PRECISION_FLAGS_H_

#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "kernels/trellis_gemm.h"

namespace exl3serve::cli {

struct PrecisionFlags {
  std::string prefill = "fp32";  // --prefill-precision
  // int8 since the quality table (docs/QUALITY.md, "Decision"): +2 % KL at
  // 4 bpw on both real models for ~1.8x the GEMV speed; fp32 stays selectable.
  std::string decode = "int8";   // --decode-precision
  CLI::Option* prefill_option = nullptr;
  CLI::Option* decode_option = nullptr;

  kernels::TrellisGemmPrecision Prefill() const;
  kernels::TrellisGemmPrecision Decode() const;
  // The value only when the flag was given on the command line.
  std::optional<kernels::TrellisGemmPrecision> PrefillIfGiven() const;
  std::optional<kernels::TrellisGemmPrecision> DecodeIfGiven() const;
  // Sets both process-wide (worker::SetPrefillPrecision / SetDecodePrecision).
  absl::Status Apply() const;
};

// Registers both flags on `app`; `flags` must outlive parsing.
void AddPrecisionFlags(CLI::App& app, PrecisionFlags* flags);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_PRECISION_FLAGS_H_
