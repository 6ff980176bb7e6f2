// kernels/ops.h — the per-token ops of a decoder layer besides the linears:
// RMSNorm, rotate-half RoPE, attention over a paged fp16/fp32 K/V pool
// (decode and chunked prefill) and sampling (greedy, temperature / top-k /
// top-p / min-p with a caller-supplied uniform). The CPU backend; the CUDA
// twins with the same names and arguments are in kernels/cuda/ops.h. The
// 128-point Hadamard (FWHT-128) is kernels/hadamard.h's BlockHadamardRows.
//
//   EXL3_RETURN_IF_ERROR(RmsNorm(x, rows, dim, w, 1e-6, x));                  // in place
//   EXL3_RETURN_IF_ERROR(ApplyRope(q, tokens, heads, head_dim, positions, inv_freq));
//   EXL3_RETURN_IF_ERROR(DecodeAttention(q, seqs, seq_lens, kv, params, out));
//   EXL3_RETURN_IF_ERROR(Sample(logits, rows, vocab, filters, uniforms, ids));
//
// Every op is a pure function of its arguments (no global state except the
// shared CPU thread pool, whose scheduling does not change results). Every
// op validates its arguments first and returns InvalidArgument, naming the
// argument, the rule and the value, before writing any output; on error the
// outputs are untouched. Buffers are borrowed host memory. Thread-safe.
//
// Precision: fp32 activations; the reductions below are fp32 except where
// noted (RMSNorm's sum of squares and the sampling distribution are float64,
// as in worker/model/transformer.cc and worker/model/sampler.cc). Results do
// not depend on the thread count. They are the reference the CUDA twins are
// compared with (within the tolerances their tests name).
#ifndef EXL3SERVE_KERNELS_OPS_H_
#define EXL3SERVE_KERNELS_OPS_H_

#include <cstdint>

#include "absl/status/status.h"

namespace exl3serve::kernels {

// ---------------------------------------------------------------------------
// RMSNorm: out[r][i] = x[r][i] * inv_r * weight[i] (evaluated left to right
// in fp32), inv_r = float(1 / sqrt(sum_i double(x[r][i])^2 / dim + eps)).
// x and out are [rows][dim]; out may equal x (in place), other overlap is not
// allowed. Errors: InvalidArgument for rows < 0, dim <= 0, eps < 0 or NaN, or a
// null pointer with rows > 0.
absl::Status RmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight, double eps,
                     float* out);

// ---------------------------------------------------------------------------
// Rotate-half RoPE in place on x [tokens][heads][head_dim]: for token t at
// position p = positions[t] and every pair (i, i + head_dim/2), i < head_dim/2,
//   angle = double(p) * inv_freq[i]; c = float(cos(angle)); s = float(sin(angle))
//   x[i] <- x[i]·c − x[i+half]·s ;  x[i+half] <- x[i+half]·c + x[i]·s   (fp32)
// inv_freq [head_dim/2] is the model's table (theta^(-2i/head_dim) with any
// rope scaling — linear, llama3 — already applied: worker/model/model_config.h
// RopeInverseFrequencies), so scaling needs nothing here.
// Errors: InvalidArgument for tokens < 0, heads < 0, head_dim <= 0 or odd, a
// negative position, or a null pointer with tokens·heads > 0.
absl::Status ApplyRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                       const int64_t* positions, const double* inv_freq);

// Partial RoPE (GLM-4 MoE's partial_rotary_factor): as ApplyRope on the first
// rotary_dim dims of every head only — pairs (i, i + rotary_dim/2) for
// i < rotary_dim/2 with inv_freq [rotary_dim/2]; dims [rotary_dim, head_dim)
// are left as they are. ApplyRope is the case rotary_dim == head_dim (same
// arithmetic, bit for bit). Errors: those of ApplyRope, and InvalidArgument
// for a rotary_dim that is odd, <= 0 or > head_dim.
absl::Status ApplyPartialRope(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                              int64_t rotary_dim, const int64_t* positions,
                              const double* inv_freq);

// ---------------------------------------------------------------------------
// Attention over a paged K/V pool.
//
// Layout (kv heads innermost, as worker/model/kv_cache.h stores one layer):
//   k, v        [num_pages][page_size][kv_heads][head_dim], fp32 or fp16
//               (IEEE half bit patterns, uint16_t)
//   page_table  [num_seqs][pages_per_seq] int32: position p of sequence s is
//               slot p % page_size of page page_table[s][p / page_size]
// GQA: query head h reads kv head h / (q_heads / kv_heads).
// A query at position p sees keys [lo(p), p], lo(p) = 0, or
// max(0, p − sliding_window + 1) with a window; scores are q·k·scale,
// softmax with the maximum subtracted, fp32 throughout.
enum class KvDtype { kFp32, kFp16 };

struct PagedKv {
  const void* k = nullptr;  // borrowed; see the layout above
  const void* v = nullptr;
  KvDtype dtype = KvDtype::kFp16;
  int64_t num_pages = 0;
  int64_t page_size = 0;               // positions per page
  const int32_t* page_table = nullptr;  // borrowed; [num_seqs][pages_per_seq]
  int64_t pages_per_seq = 0;           // row stride of page_table
};

struct AttentionParams {
  int64_t q_heads = 0;
  int64_t kv_heads = 0;        // q_heads must be a multiple
  int64_t head_dim = 0;
  float scale = 0.0f;          // softmax scale, usually 1/sqrt(head_dim)
  int64_t sliding_window = 0;  // 0: off (Mistral: 4096)
};

// One new token per sequence: sequence s has seq_lens[s] >= 1 positions in
// the pool (its new token's key and value already written at position
// seq_lens[s] − 1) and its query q[s] attends to them.
// q, out: [num_seqs][q_heads][head_dim]; must not overlap.
// Errors: InvalidArgument for bad params (non-positive heads or head_dim,
// q_heads % kv_heads != 0, non-finite scale, negative window), a seq_len < 1
// or beyond pages_per_seq·page_size, a page id outside [0, num_pages) among
// those a sequence uses, or a null pointer. Cost: allocates scratch of
// max context · kv_heads · head_dim floats per sequence.
absl::Status DecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                             const PagedKv& kv, const AttentionParams& params, float* out);

// Chunked prefill: sequence s has query_starts[s+1] − query_starts[s] new
// tokens (rows of q from query_starts[s]) at positions start_positions[s] ..
// start_positions[s] + count − 1, whose keys and values are already in the
// pool after the cached prefix [0, start_positions[s]). Token t attends
// causally: keys [lo(p), p], p = start_positions[s] + t.
// q, out: [query_starts[num_seqs]][q_heads][head_dim]; must not overlap.
// query_starts: [num_seqs + 1], query_starts[0] = 0, non-decreasing.
// Errors: those of DecodeAttention, plus InvalidArgument for query_starts
// that do not start at 0 or decrease and negative start_positions.
absl::Status PrefillAttention(const float* q, int64_t num_seqs, const int32_t* query_starts,
                              const int32_t* start_positions, const PagedKv& kv,
                              const AttentionParams& params, float* out);

// The inner loop both attention ops (and the attention modules, whose cache
// stores int8/int4 too and hands over dequantized contiguous rows) run for
// one query head: `count` >= 1 key/value rows k + j·row_stride,
// v + j·row_stride (j ascending) of head_dim floats; with F = head_dim
// rounded down to a multiple of 16, every product rounded before its add:
//   lane[l] = Σ_{c ascending} q[16c+l]·k_j[16c+l]  (16 lanes over [0, F))
//   dot_j = tree(lane): pairs (l, l+8), then (l, l+4), (l, l+2), (l, l+1);
//           then + q[i]·k_j[i] for i = F .. head_dim-1 in order
//   scores[j] = dot_j · scale
//   w_j = exp(scores[j] − max) / Σ exp(...)   (fp32 sum, ascending j)
//   out[i] = Σ_j w_j · v_j[i]                 (fp32, ascending j)
// Every variant (kernels/cpu/attend_row.h, runtime-dispatched) gives exactly
// this, bit for bit.
// `scores` is caller scratch of `count` floats. No validation (a kernel, not
// an edge): Requires count >= 1, head_dim >= 1, valid pointers, out not
// overlapping the inputs.
void AttendRow(const float* q, const float* k, const float* v, int64_t count,
               int64_t row_stride, int64_t head_dim, float scale, float* scores, float* out);

// AttendRow for `heads` query heads q + h·q_stride that read the same keys
// and values (a GQA group at one position): out + h·out_stride is bit for bit
// AttendRow's for head h, but each key and value row is read once for all
// of them (at long contexts the rows come from memory, not cache, and the
// group's heads would otherwise read them `heads` times). `scores` is
// scratch of heads·count floats. Requires what AttendRow requires, heads >= 1.
void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k, const float* v,
                 int64_t count, int64_t row_stride, int64_t head_dim, float scale, float* scores,
                 float* out, int64_t out_stride);

// ---------------------------------------------------------------------------
// Sampling, one row of logits at a time; steps 3–7 of worker/model/sampler.h
// (penalties, steps 1–2, are the caller's):
//   temperature 0: greedy — ArgMax (lowest id on ties);
//   otherwise, in float64: p = softmax(z / temperature);
//   top-k: keep the k most probable (lowest id first on ties; 0 = off);
//   top-p: in that order, keep a token while the mass before it (over the
//          tokens top-k kept) is < top_p (1 = off);
//   min-p: keep tokens with p >= min_p · max p (0 = off);
//   draw:  the first id (ascending) whose running sum of p / kept mass over
//          the kept ids exceeds u; the last kept id when rounding leaves u
//          above the total.
struct SamplingFilter {
  float temperature = 1.0f;  // >= 0, finite
  int top_k = 0;             // >= 0
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
};

// ids[r] = the lowest index of the largest logits[r][*]; for a row holding
// NaN the result is some index in [0, vocab) (unspecified which).
// logits: [rows][vocab]. Errors: InvalidArgument for rows < 0, vocab <= 0,
// vocab > INT32_MAX or a null pointer with rows > 0.
absl::Status ArgMax(const float* logits, int64_t rows, int64_t vocab, int32_t* ids);

// ids[r] = the token drawn for row r with filters[r] and uniforms[r] in
// [0, 1) (the caller's RNG; the draw is deterministic given u).
// Errors: those of ArgMax, plus InvalidArgument naming the row and field for
// a filter outside the ranges above or a uniform outside [0, 1), and, for a
// row with temperature > 0, a NaN or +inf logit or no finite logit (-inf
// masks a token).
// Cost: O(vocab log vocab) per row with top-p, O(vocab log k) otherwise.
absl::Status Sample(const float* logits, int64_t rows, int64_t vocab,
                    const SamplingFilter* filters, const double* uniforms, int32_t* ids);

// The distribution Sample draws from for one row (kept tokens' p / kept mass,
// zero elsewhere; one-hot for temperature 0), for tests and diagnostics.
// Requires: the arguments Sample validates (not re-checked); probs [vocab].
void SamplingDistribution(const float* logits, int64_t vocab, const SamplingFilter& filter,
                          double* probs);

// The argument checks each op above runs before touching its outputs, so
// the CUDA twins' host-memory overloads (kernels/cuda/ops.h) return the same
// errors. Not for other callers.
namespace internal {
absl::Status ValidateRmsNorm(const float* x, int64_t rows, int64_t dim, const float* weight,
                             double eps, const float* out);
absl::Status ValidateRope(const float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                          const int64_t* positions, const double* inv_freq);
absl::Status ValidateDecodeAttention(const float* q, int64_t num_seqs, const int32_t* seq_lens,
                                     const PagedKv& kv, const AttentionParams& params,
                                     const float* out);
absl::Status ValidatePrefillAttention(const float* q, int64_t num_seqs,
                                      const int32_t* query_starts, const int32_t* start_positions,
                                      const PagedKv& kv, const AttentionParams& params,
                                      const float* out);
absl::Status ValidateArgMax(const float* logits, int64_t rows, int64_t vocab, const int32_t* ids);
absl::Status ValidateSample(const float* logits, int64_t rows, int64_t vocab,
                            const SamplingFilter* filters, const double* uniforms,
                            const int32_t* ids);
}  // namespace internal

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_OPS_H_
