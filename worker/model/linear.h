// worker/model/linear.h — one linear layer of a model, whichever way it is
// stored: an EXL3 quantized linear (run with kernels::TrellisGemm) or a plain
// bf16/fp16/fp32 weight (bf16/fp16 held in 16 bits, run with
// kernels/cpu/dense16_gemm.h; fp32 held and run as fp32), so EXL3
// directories and ordinary Hugging Face checkpoints run through the same code.
//
//   EXL3_ASSIGN_OR_RETURN(Linear q, Linear::Load(model, "model.layers.0.self_attn.q_proj",
//                                                hidden, q_out));
//   q.Forward(x, m, y);   // y[m x out] = x[m x in] · Wᵀ + bias
//   const RowRun plan[] = {{8, RowKind::kDecode}, {64, RowKind::kPrefill}};
//   q.Forward(x, 72, y, plan);  // rows 0-7 at decode precision, 8-71 at prefill
//
// Widths are the model's own (unpadded): an EXL3 linear stores k, n padded to
// multiples of 128, so Forward zero-extends inputs to k and drops the padded
// output columns.
#ifndef EXL3SERVE_WORKER_MODEL_LINEAR_H_
#define EXL3SERVE_WORKER_MODEL_LINEAR_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/reconstruct.h"
#include "kernels/cpu/dense16_gemm.h"
#include "kernels/trellis_gemm.h"

namespace exl3serve::sharding {
class Exl3Model;
}

namespace exl3serve::worker {

// Sees the input of every Linear::Forward while attached (calibration:
// worker/model/calibration.h). Called on the thread that runs the forward.
class InputObserver {
 public:
  virtual ~InputObserver() = default;
  // x is rows x in_features, row-major, valid only during the call.
  virtual void ObserveInput(const std::string& key, const float* x, int64_t rows,
                            int64_t in_features) = 0;
};

// Precision of the prefill-kind rows (see RowKind below: rows of a batch
// entry of at least kPrefillMinRows tokens; in the m-based Forward, every
// call of at least that many rows) of every EXL3 Linear::Forward in this
// process: kFloat (default, exact fp32) or kBf16 (bf16 weights and
// activations, fp32 sums; ~0.24-0.3 % RMS error, AMX where the CPU has it:
// kernels/trellis_gemm.h). Decode-kind rows run DecodePrecision().
// Set it before serving (`generate|serve|worker --prefill-precision bf16`;
// rank processes get it as a worker flag or in the coordinator's Setup);
// affects this process only. Thread-safe.
// Errors: InvalidArgument for kInt8 (mul1-only, not a prefill mode).
inline constexpr int64_t kPrefillMinRows = 17;
absl::Status SetPrefillPrecision(kernels::TrellisGemmPrecision precision);
kernels::TrellisGemmPrecision PrefillPrecision();

// Precision of the decode-kind rows (rows of a batch entry of fewer than
// kPrefillMinRows tokens; in the m-based Forward, calls of fewer rows) of
// every EXL3 Linear::Forward in this process: kFloat (default, exact fp32) or kInt8 (int8
// activations with a per-row scale, integer byte-sum dot products; ~0.8-0.9 %
// RMS output error, ~1.8x the kFloat GEMV at batch 1: kernels/trellis_gemm.h).
// kInt8 applies only to linears TrellisGemm runs in int8 — the mul1 codebook,
// any K; other linears (3inst, mcg) silently stay kFloat, bit for bit, so one
// setting serves a model of mixed codebooks. Plain (non-EXL3) linears are
// unaffected. Set it before serving (`generate|serve|worker
// --decode-precision int8`; rank processes get it as a worker flag or in the
// coordinator's Setup); affects this process only. Thread-safe.
// Errors: InvalidArgument for kBf16 (bf16 pays off only for GEMMs where the
// decode is amortised over many rows; at decode sizes it is slower than
// kFloat, so it is a prefill mode only).
absl::Status SetDecodePrecision(kernels::TrellisGemmPrecision precision);
kernels::TrellisGemmPrecision DecodePrecision();
// "fp32", "bf16" or "int8" (the flag spelling).
const char* GemmPrecisionName(kernels::TrellisGemmPrecision precision);

// Row plans: which precision rule each row of a Linear::Forward follows, so
// that a row's arithmetic depends on the batch entry it belongs to, never on
// what else shares the call ("batched == alone", "drafted == serial").
// A batch entry (one sequence's tokens in one forward) of fewer than
// kPrefillMinRows tokens is decode-kind — its rows run DecodePrecision() on
// mul1 linears — a longer one prefill-kind (PrefillPrecision()), exactly as
// the entry would run alone. The m-based Forward(x, m, y) is the plan
// {{m, RowKindForRows(m)}}.
// A sampled sequence's rows follow the position rule instead
// (worker/api/sampling.h PrefillKindEnd; PrefillRowsOfEntry below).
enum class RowKind : uint8_t { kDecode, kPrefill };
inline RowKind RowKindForRows(int64_t rows) {
  return rows < kPrefillMinRows ? RowKind::kDecode : RowKind::kPrefill;
}
// How many leading rows of a batch entry of `rows` new tokens from
// position `start` are prefill-kind (the rest are decode-kind): with
// prompt_len >= 0 the position rule (rows below PrefillKindEnd(prompt_len)),
// with prompt_len < 0 the size rule (all or none, RowKindForRows(rows)).
int64_t PrefillRowsOfEntry(int64_t start, int64_t rows, int64_t prompt_len);
// `rows` consecutive rows of one kind. A plan is a span of runs in row
// order; zero-row runs are allowed and skipped.
struct RowRun {
  int64_t rows = 0;
  RowKind kind = RowKind::kDecode;
};
// Appends `rows` rows of `kind` to *plan, extending its last run when that
// run has the same kind (so plans stay short: the scheduler puts decode
// entries first, which gives one or two runs). No-op for rows <= 0.
void AppendRowRun(std::vector<RowRun>* plan, int64_t rows, RowKind kind);
// Appends rows [first, first + count) of an entry whose first
// `prefill_rows` rows are prefill-kind (PrefillRowsOfEntry) to *plan.
void AppendEntryRows(std::vector<RowRun>* plan, int64_t prefill_rows, int64_t first,
                     int64_t count);

// Thread safety: immutable after Load; Forward is const and thread-safe
// (an attached InputObserver must tolerate the calling threads).
// Ownership: owns its weights (copied out of the checkpoint's memory map).
class Linear {
 public:
  Linear() = default;

  // Loads module `key`: `key`.trellis (EXL3) if present, else `key`.weight
  // ([out', in'] with out' >= out, in' >= in; a padded plain weight is cut to
  // [out, in]). `key`.bias is used when present (EXL3: part of the linear).
  // Errors: NotFound naming the tensor when neither exists; DataLoss for a
  // shape smaller than [out, in], a 1-d weight, or a bias of the wrong length.
  static absl::StatusOr<Linear> Load(const sharding::Exl3Model& model, std::string_view key,
                                     int64_t in_features, int64_t out_features);

  // The same from a plain weight tensor of another name (a tied lm_head reads
  // model.embed_tokens.weight). Errors as Load.
  static absl::StatusOr<Linear> LoadPlain(const sharding::Exl3Model& model,
                                          std::string_view weight_name, int64_t in_features,
                                          int64_t out_features);

  // One rank's window of linear `key` (tensor parallelism): input features
  // [in_begin, in_end) and output features [out_begin, out_end) of the
  // model's in_features x out_features linear; the bias (its [out_begin,
  // out_end) part) only when `with_bias`. Forward then maps x[m x in_size] to
  // y[m x out_size]: a column-parallel window (full input) gives its output
  // columns exactly, a row-parallel window (full output) a partial sum that
  // the ranks all-reduce. Only the window's bytes are read: for an EXL3
  // linear the 128-aligned superset of each range (extra input rows get zero
  // input, extra output columns are dropped — both exact).
  // Errors: those of Load; InvalidArgument for a range outside the linear.
  static absl::StatusOr<Linear> LoadWindow(const sharding::Exl3Model& model, std::string_view key,
                                           int64_t in_features, int64_t out_features,
                                           int64_t in_begin, int64_t in_end, int64_t out_begin,
                                           int64_t out_end, bool with_bias);

  // A plain linear from an fp32 weight [out][in] (HF orientation) and an
  // optional bias (empty = none). Requires: sizes match.
  static Linear FromDense(std::vector<float> weight, int64_t in_features, int64_t out_features,
                          std::vector<float> bias);
  // The same from 16-bit bit patterns [out][in] of `type`, held as such.
  static Linear FromDense16(std::vector<uint16_t> weight, kernels::cpu::Dense16Type type,
                            int64_t in_features, int64_t out_features, std::vector<float> bias);

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  bool quantized() const { return quantized_; }
  // Plain linears hold a BF16 / F16 checkpoint weight in its own 16 bits
  // (run by kernels/cpu/dense16_gemm.h, fp32 sums) and anything else (F32,
  // F64, FromDense) as fp32 (DenseGemmTransposed).
  enum class PlainDType { kF32, kBf16, kF16 };
  PlainDType plain_dtype() const { return plain_dtype_; }
  // The fp32 weight [out][in] of a plain linear held as fp32; nullptr for an
  // EXL3 or a 16-bit one (use DenseRowsToFloat).
  const float* dense_weight() const {
    return quantized_ || plain_dtype_ != PlainDType::kF32 ? nullptr : weight_.data();
  }
  // Rows [row, row + rows) of a plain linear's weight (output features) as
  // fp32 into out[rows x in] (exact for every storage). Requires: a plain
  // linear, 0 <= row <= row + rows <= out_features().
  void DenseRowsToFloat(int64_t row, int64_t rows, float* out) const;
  // Bytes of weight this linear holds: plain out·in·(4 | 2); EXL3 the
  // trellis (2 bytes a word) plus suh/svh (4 bytes each). Biases excluded.
  int64_t weight_bytes() const;

  // y = x · Wᵀ + bias for m rows; x is m x in, y is m x out, row-major.
  // An EXL3 linear runs all m rows at the precision of RowKindForRows(m):
  // the same as Forward(x, m, y, {{m, RowKindForRows(m)}}).
  // Errors: those of kernels::TrellisGemm (a broken EXL3 linear). y is
  // unspecified on error. Requires: y does not alias x. Cost: O(m·in·out);
  // an EXL3 linear with padding grows per-thread scratch to m·(k + n)
  // floats (allocation-free once grown).
  absl::Status Forward(const float* x, int64_t m, float* y) const;

  // The same with a row plan: an EXL3 linear runs each run of `plan` at its
  // kind's precision (decode: DecodePrecision() on a mul1 linear, kFloat on
  // 3inst/mcg; prefill: PrefillPrecision()). Consecutive runs that resolve
  // to the same precision go to kernels::TrellisGemm as one call, so with
  // equal decode and prefill precisions this is one call, bit for bit the
  // m-based Forward; otherwise each group's rows are bit for bit a kernel
  // call on just those rows. int8 rows have no row crossover, so they equal
  // the same rows in a call of any size; fp32/bf16 sums depend on the
  // call's row count (kernels/trellis_gemm.h).
  // Plain linears ignore the plan (their rows never depend on m).
  // Errors: InvalidArgument when the plan's rows do not sum to m (nothing
  // written); those of Forward. Cost: as Forward plus one weight decode per
  // extra kernel call; allocation-free where Forward is.
  absl::Status Forward(const float* x, int64_t m, float* y, std::span<const RowRun> plan) const;

  // The module key this linear was loaded as (its LinearSpec key).
  const std::string& key() const { return key_; }
  void set_key(std::string key) { key_ = std::move(key); }
  // Attaches `observer` (borrowed; must outlive its attachment) or detaches
  // with nullptr.
  void set_input_observer(InputObserver* observer) { observer_ = observer; }

 private:
  int64_t in_ = 0;
  int64_t out_ = 0;
  bool quantized_ = false;
  kernels::Exl3LinearData exl3_;  // quantized_: padded k x n (a window's aligned superset)
  int64_t in_offset_ = 0;         // quantized_: x column 0 is row in_offset_ of exl3_
  int64_t out_offset_ = 0;        // quantized_: y column 0 is column out_offset_ of exl3_
  std::vector<float> weight_;     // !quantized_, kF32: [out][in]
  PlainDType plain_dtype_ = PlainDType::kF32;
  std::vector<uint16_t> weight16_;  // !quantized_, kBf16 / kF16: [out][in] bit patterns
  std::vector<float> bias_;       // !quantized_: [out] or empty
  std::string key_;
  InputObserver* observer_ = nullptr;
};

// y[m x n] = x[m x k] · wᵀ (+ bias[n] when non-null), w row-major [n][k],
// fp32 accumulation; rows of w are spread over the shared CPU thread pool.
// Deterministic: each output's sum order depends only on k.
void DenseGemmTransposed(const float* x, int64_t m, int64_t k, const float* w, int64_t n,
                         const float* bias, float* y);

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_LINEAR_H_
