// worker/model/modules/hyper_connections.h — the arithmetic of DeepSeek-V4.1's
// single-pass hyper-connections (mHC): H residual streams per token instead
// of one, mixed at every sublayer site (attention, feed-forward) by weights
// the token computes from all of its streams.
//
// Per site and token, with X the [H][d] stream stack and f = X flattened
// (stream 0 first), all in fp32:
//   m = (fn · f) · rsqrt(mean(f²) + norm_eps)          (2 + H)·H values
//   pre[j]  = sigmoid(m[j]·scale[0] + base[j]) + hc_eps          j < H
//   post[j] = 2·sigmoid(m[H + j]·scale[1] + base[H + j])
//   C[a][b] = m[2H + H·a + b]·scale[2] + base[2H + H·a + b]
//   C = softmax over b, + hc_eps; then C[a][b] /= Σ_a C[a][b] + hc_eps;
//   then (iters − 1) times: divide by the row sums over b (+ hc_eps), then
//   by the column sums over a (+ hc_eps)                      (Sinkhorn)
// Collapse (the sublayer's input): x = Σ_j pre[j]·X[j].
// Expand (after the sublayer's output y): X'[b] = post[b]·y + Σ_a C[a][b]·R[a],
// R the stack before the sublayer: a is the INPUT stream (DeepSeek's
// reference code, `Block.hc_post`; its paper's notation is the transpose).
// The weights a site computes collapse the NEXT site's input (the model
// carries `pre` forward; the head uses the last feed-forward site's).
//
// Exactness: every value depends only on its token's rows (no batch
// dependence); the two long dot products (fn·f, mean(f²)) sum in 16 fixed
// lanes combined in a fixed tree, so results are identical for any batch
// and thread count. Float64 reference: tests/worker/hyper_connections_test.cc.
//
// Status: the arithmetic only; the residual-scheme seam that runs it inside
// a forward is planned in docs/design/deepseek-v41.md.
//
//   HyperConnectionShape shape{.streams = 4, .hidden = d, .norm_eps = 1e-6f};
//   EXL3_RETURN_IF_ERROR(ComputeHyperConnectionMix(shape, site, x, rows, &mix));
//   CollapseStreams(shape, mix.pre.data(), x, rows, sublayer_in);
//   ... y = sublayer(norm(sublayer_in)) ...
//   ExpandStreams(shape, mix, y, rows, x);   // x updated in place
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_HYPER_CONNECTIONS_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_HYPER_CONNECTIONS_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace exl3serve::worker {

struct HyperConnectionShape {
  int streams = 4;          // H (`hc_mult`), >= 1
  int64_t hidden = 0;       // d, >= 1
  float norm_eps = 1e-6f;   // `rms_norm_eps`: the rsqrt(mean(f²)) floor
  float hc_eps = 1e-6f;     // `hc_eps`: pre's floor and Sinkhorn's
  int sinkhorn_iters = 20;  // `hc_sinkhorn_iters`, >= 1
  // (2 + H)·H: the mix values per token.
  int64_t mix_values() const { return int64_t{2 + streams} * streams; }
};

// One site's parameters (fp32, as the checkpoint stores them):
// `hc_{site}_fn` [(2 + H)·H][H·d], `hc_{site}_base` [(2 + H)·H], `hc_{site}_scale` [3].
struct HyperConnectionSite {
  std::span<const float> fn;
  std::span<const float> base;
  std::span<const float> scale;
};

// Per token of a call: pre [rows][H], post [rows][H], comb [rows][H][H]
// (comb[a][b]: input stream a to output stream b).
struct HyperConnectionMix {
  std::vector<float> pre, post, comb;
};

// The mix of every token of x [rows][H][d]. Errors: InvalidArgument for a
// shape out of range or a parameter span of the wrong length (named: fn,
// base, scale), before anything is written.
absl::Status ComputeHyperConnectionMix(const HyperConnectionShape& shape,
                                       const HyperConnectionSite& site, const float* x,
                                       int64_t rows, HyperConnectionMix* mix);

// out [rows][d] = Σ_j pre[row][j]·x[row][j] (streams in order).
void CollapseStreams(const HyperConnectionShape& shape, const float* pre, const float* x,
                     int64_t rows, float* out);

// x [rows][H][d] (R on entry) becomes post[b]·y + Σ_a comb[a][b]·R[a]
// (a in order, the post term first). y [rows][d].
void ExpandStreams(const HyperConnectionShape& shape, const HyperConnectionMix& mix,
                   const float* y, int64_t rows, float* x);

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_HYPER_CONNECTIONS_H_
