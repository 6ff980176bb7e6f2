// kernels/cpu/gated_delta_chunk_inl.h — the one body of every
// GatedDeltaChunked variant (gated_delta_chunk.h), included by each ISA's
// translation unit and compiled there with -ffp-contract=off. The arithmetic
// is written on 16-lane vectors (GCC vector extensions) along dv: each ISA
// splits them into its own registers, every lane's operations and every
// reduction are the same, so the results are too. Not a public header.
#ifndef EXL3SERVE_KERNELS_CPU_GATED_DELTA_CHUNK_INL_H_
#define EXL3SERVE_KERNELS_CPU_GATED_DELTA_CHUNK_INL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/gated_delta_chunk.h"

namespace exl3serve::kernels::cpu::internal {
// Internal linkage: each ISA's translation unit keeps its own copy (an inline
// function shared by name would be merged across them by the linker, and a
// variant would run another ISA's code).
namespace {

typedef float GdnV16 __attribute__((vector_size(64)));

inline GdnV16 GdnLoad(const float* p) {
  GdnV16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void GdnStore(float* p, GdnV16 v) { std::memcpy(p, &v, sizeof(v)); }

typedef double GdnV8d __attribute__((vector_size(64)));
typedef float GdnV8 __attribute__((vector_size(32)));

inline GdnV8d GdnWiden(const float* p) {
  GdnV8 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, GdnV8d);
}

// a·b over n in float64: 16 lane sums over the blocks of 16, reduced as the
// tree (l, l+8), (l, l+4), (l, l+2), (l, l+1), then the tail in order.
inline double GdnDot(const float* a, const float* b, int64_t n) {
  const int64_t full = n - n % 16;
  GdnV8d lo{}, hi{};
  for (int64_t i = 0; i < full; i += 16) {
    lo = lo + GdnWiden(a + i) * GdnWiden(b + i);
    hi = hi + GdnWiden(a + i + 8) * GdnWiden(b + i + 8);
  }
  GdnV8d acc = lo + hi;
  acc = acc + __builtin_shufflevector(acc, acc, 4, 5, 6, 7, 0, 0, 0, 0);
  acc = acc + __builtin_shufflevector(acc, acc, 2, 3, 0, 0, 0, 0, 0, 0);
  acc = acc + __builtin_shufflevector(acc, acc, 1, 0, 0, 0, 0, 0, 0, 0);
  double dot = acc[0];
  for (int64_t i = full; i < n; ++i) dot = dot + static_cast<double>(a[i]) * b[i];
  return dot;
}

// rk[t] = S₀ᵀk_t and rq[t] = S₀ᵀq_t for kTok tokens: per element of dv the
// rows in ascending order; each row of S₀ is loaded once for all of them.
template <int kTok>
inline void GdnProjectTokens(const float* s0, int64_t dk, int64_t dv, const float* k,
                             int64_t k_stride, const float* q, int64_t q_stride, float* rk,
                             float* rq) {
  int64_t lane = 0;
  for (; lane + 16 <= dv; lane += 16) {
    GdnV16 ak[kTok], aq[kTok];
    for (int t = 0; t < kTok; ++t) ak[t] = aq[t] = GdnV16{};
    for (int64_t r = 0; r < dk; ++r) {
      const GdnV16 s = GdnLoad(s0 + r * dv + lane);
      for (int t = 0; t < kTok; ++t) {
        ak[t] = ak[t] + s * k[t * k_stride + r];
        aq[t] = aq[t] + s * q[t * q_stride + r];
      }
    }
    for (int t = 0; t < kTok; ++t) {
      GdnStore(rk + t * dv + lane, ak[t]);
      GdnStore(rq + t * dv + lane, aq[t]);
    }
  }
  for (; lane < dv; ++lane) {  // the last dv % 16 elements
    for (int t = 0; t < kTok; ++t) {
      float ak = 0.0f, aq = 0.0f;
      for (int64_t r = 0; r < dk; ++r) {
        const float s = s0[r * dv + lane];
        ak = ak + s * k[t * k_stride + r];
        aq = aq + s * q[t * q_stride + r];
      }
      rk[t * dv + lane] = ak;
      rq[t * dv + lane] = aq;
    }
  }
}

// x[d] = x[d] + w·y[d] over n, in float64 (element-wise: the same in every variant).
inline void GdnAxpy(double* x, double w, const float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) x[d] = x[d] + w * static_cast<double>(y[d]);
}

// kBlock: tokens per pass of the S₀ᵀx products (registers: 2·kBlock
// accumulators of 16 lanes; the result does not depend on it).
template <int kBlock>
inline void GatedDeltaChunkedBody(int64_t position, int64_t tokens, int64_t dk, int64_t dv,
                                  const float* q, int64_t q_stride, const float* k,
                                  int64_t k_stride, const float* v, int64_t v_stride,
                                  const float* g, const float* beta, int64_t gb_stride,
                                  float* state, float* o, int64_t o_stride, float* history,
                                  int64_t history_stride) {
  constexpr int64_t kC = kGatedDeltaChunk;
  float* const s0 = state;
  float* const krows = s0 + dk * dv;              // [C−1][dk]
  float* const urows = krows + (kC - 1) * dk;     // [C−1][dv]
  float* const grows = urows + (kC - 1) * dv;     // [C−1]: each open row's g
  const int64_t head_floats = GatedDeltaHeadStateFloats(dk, dv);
  alignas(64) float rk[kC * kGatedDeltaChunkMaxDim];
  alignas(64) float rq[kC * kGatedDeltaChunkMaxDim];
  alignas(64) float u_last[kGatedDeltaChunkMaxDim];
  alignas(64) double ud[kGatedDeltaChunkMaxDim];
  alignas(64) double od[kGatedDeltaChunkMaxDim];
  double decay[kC];  // exp(Gᵢ − Gⱼ) of the token being computed
  alignas(64) float coef[kGatedDeltaChunkMaxDim * kC];  // the chunk's end: [r][j]

  int64_t t = 0;
  while (t < tokens) {
    const int64_t i0 = (position + t) % kC;
    const int64_t n = std::min(tokens - t, kC - i0);  // this call's tokens of the chunk
    // S₀ᵀk̂ and S₀ᵀq̂ of all n tokens (S₀ is fixed until the chunk's end).
    int64_t s = 0;
    for (; s + kBlock <= n; s += kBlock) {
      GdnProjectTokens<kBlock>(s0, dk, dv, k + (t + s) * k_stride, k_stride, q + (t + s) * q_stride,
                               q_stride, rk + s * dv, rq + s * dv);
    }
    if constexpr (kBlock > 4) {
      for (; s + 4 <= n; s += 4) {
        GdnProjectTokens<4>(s0, dk, dv, k + (t + s) * k_stride, k_stride, q + (t + s) * q_stride,
                            q_stride, rk + s * dv, rq + s * dv);
      }
    }
    for (; s < n; ++s) {
      GdnProjectTokens<1>(s0, dk, dv, k + (t + s) * k_stride, k_stride, q + (t + s) * q_stride,
                          q_stride, rk + s * dv, rq + s * dv);
    }
    for (s = 0; s < n; ++s, ++t) {
      const int64_t i = i0 + s;
      const float* kt = k + t * k_stride;
      const float* qt = q + t * q_stride;
      const float* vt = v + t * v_stride;
      const float gt = g[t * gb_stride];
      // exp(Gᵢ − Gⱼ) = exp(g_{j+1} + … + gᵢ) and γ = exp(g₀ + … + gᵢ), the
      // sums in float64 from the stored gates, latest first.
      double sum = 0.0;
      for (int64_t j = i; j >= 1; --j) {
        sum += j == i ? gt : grows[j];
        decay[j - 1] = std::exp(sum);
      }
      const double gamma = std::exp(sum + (i == 0 ? gt : grows[0]));
      // u = β(v − γ·S₀ᵀk̂) − Σ_{j<i} β·exp(Gᵢ−Gⱼ)(k̂·k̂ⱼ)·uⱼ, in float64, rounded once.
      const double bt = beta[t * gb_stride];
      const float* rkt = rk + s * dv;
      for (int64_t d = 0; d < dv; ++d) ud[d] = bt * (static_cast<double>(vt[d]) - gamma * rkt[d]);
      for (int64_t j = 0; j < i; ++j) {
        GdnAxpy(ud, -(bt * (decay[j] * GdnDot(kt, krows + j * dk, dk))), urows + j * dv, dv);
      }
      float* u = i < kC - 1 ? urows + i * dv : u_last;
      for (int64_t d = 0; d < dv; ++d) u[d] = static_cast<float>(ud[d]);
      // o = γ·S₀ᵀq̂ + Σ_{j≤i} exp(Gᵢ−Gⱼ)(q̂·k̂ⱼ)·uⱼ, in float64, rounded once.
      const float* rqt = rq + s * dv;
      for (int64_t d = 0; d < dv; ++d) od[d] = gamma * rqt[d];
      for (int64_t j = 0; j < i; ++j) {
        GdnAxpy(od, decay[j] * GdnDot(qt, krows + j * dk, dk), urows + j * dv, dv);
      }
      GdnAxpy(od, GdnDot(qt, kt, dk), u, dv);
      float* ot = o + t * o_stride;
      for (int64_t d = 0; d < dv; ++d) ot[d] = static_cast<float>(od[d]);
      if (i < kC - 1) {
        std::memcpy(krows + i * dk, kt, sizeof(float) * dk);
        grows[i] = gt;
      } else {
        // The chunk's end: S₀ ← γ·S₀ + Σⱼ (exp(G−Gⱼ)·k̂ⱼ[r])·uⱼ per row r,
        // j ascending, in float; the chunk's 16 u rows stay in registers per
        // 16 lanes.
        const float gamma_f = static_cast<float>(gamma);
        for (int64_t r = 0; r < dk; ++r) {
          for (int64_t j = 0; j < kC - 1; ++j) {
            coef[r * kC + j] = static_cast<float>(decay[j]) * krows[j * dk + r];
          }
          coef[r * kC + kC - 1] = kt[r];
        }
        int64_t d = 0;
        for (; d + 16 <= dv; d += 16) {
          GdnV16 ut[kC];
          for (int64_t j = 0; j < kC - 1; ++j) ut[j] = GdnLoad(urows + j * dv + d);
          ut[kC - 1] = GdnLoad(u_last + d);
          for (int64_t r = 0; r < dk; ++r) {
            float* row = s0 + r * dv + d;
            const float* c = coef + r * kC;
            GdnV16 acc = GdnLoad(row) * gamma_f;
            for (int64_t j = 0; j < kC; ++j) acc = acc + ut[j] * c[j];
            GdnStore(row, acc);
          }
        }
        for (; d < dv; ++d) {
          for (int64_t r = 0; r < dk; ++r) {
            const float* c = coef + r * kC;
            float acc = s0[r * dv + d] * gamma_f;
            for (int64_t j = 0; j < kC - 1; ++j) acc = acc + urows[j * dv + d] * c[j];
            s0[r * dv + d] = acc + u_last[d] * c[kC - 1];
          }
        }
        // No open rows now (the position says so); zero them so that a
        // state's bytes are a function of the tokens alone.
        std::fill(krows, krows + (kC - 1) * (dk + dv + 1), 0.0f);
      }
      if (history != nullptr) std::memcpy(history + t * history_stride, state, sizeof(float) * head_floats);
    }
  }
}

}  // namespace
}  // namespace exl3serve::kernels::cpu::internal

// GatedDeltaChunked of one variant (gated_delta_chunk.h) in namespace
// exl3serve::kernels::cpu::<isa>, kBlock tokens per S₀ᵀx pass (its
// registers allow): each ISA's file is this line.
#define EXL3_GATED_DELTA_CHUNKED_DEFINE_VARIANT(isa, block)                                       \
  namespace exl3serve::kernels::cpu::isa {                                                        \
  void GatedDeltaChunked(int64_t position, int64_t tokens, int64_t dk, int64_t dv,                \
                         const float* q, int64_t q_stride, const float* k, int64_t k_stride,      \
                         const float* v, int64_t v_stride, const float* g, const float* beta,     \
                         int64_t gb_stride, float* state, float* o, int64_t o_stride,             \
                         float* history, int64_t history_stride) {                                \
    internal::GatedDeltaChunkedBody<block>(position, tokens, dk, dv, q, q_stride, k, k_stride, v, \
                                           v_stride, g, beta, gb_stride, state, o, o_stride,      \
                                           history, history_stride);                              \
  }                                                                                               \
  }

#endif  // EXL3SERVE_KERNELS_CPU_GATED_DELTA_CHUNK_INL_H_
