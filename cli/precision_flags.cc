#include "cli/precision_flags.h"

#include "common/status_macros.h"
#include "worker/model/linear.h"

namespace exl3serve::cli {
namespace {

kernels::TrellisGemmPrecision FromName(const std::string& name) {
  if (name == "bf16") return kernels::TrellisGemmPrecision::kBf16;
  if (name == "int8") return kernels::TrellisGemmPrecision::kInt8;
  return kernels::TrellisGemmPrecision::kFloat;  // "fp32" (CLI11 checked the set)
}

}  // namespace

kernels::TrellisGemmPrecision PrecisionFlags::Prefill() const { return FromName(prefill); }
kernels::TrellisGemmPrecision PrecisionFlags::Decode() const { return FromName(decode); }

std::optional<kernels::TrellisGemmPrecision> PrecisionFlags::PrefillIfGiven() const {
  if (prefill_option == nullptr || prefill_option->count() == 0) return std::nullopt;
  return Prefill();
}

std::optional<kernels::TrellisGemmPrecision> PrecisionFlags::DecodeIfGiven() const {
  if (decode_option == nullptr || decode_option->count() == 0) return std::nullopt;
  return Decode();
}

absl::Status PrecisionFlags::Apply() const {
  EXL3_RETURN_IF_ERROR(worker::SetPrefillPrecision(Prefill()));
  return worker::SetDecodePrecision(Decode());
}

void AddPrecisionFlags(CLI::App& app, PrecisionFlags* flags) {
  flags->prefill_option =
      app.add_option("--prefill-precision", flags->prefill,
                     "EXL3 linears with > 16 rows (prefill): fp32 (exact) or bf16 "
                     "(AMX/AVX512-BF16, ~0.3 % error); every rank")
          ->check(CLI::IsMember({"fp32", "bf16"}))
          ->capture_default_str();
  flags->decode_option =
      app.add_option("--decode-precision", flags->decode,
                     "EXL3 linears with <= 16 rows (decode): int8 (mul1 linears only, others "
                     "stay fp32; +2 % KL at 4 bpw per docs/QUALITY.md, ~1.8x GEMV) or fp32 "
                     "(exact); every rank")
          ->check(CLI::IsMember({"fp32", "int8"}))
          ->capture_default_str();
}

}  // namespace exl3serve::cli
