// kernels/cpu/attend_row_inl.h — the one body of every AttendRow variant
// (attend_row.h), included by each ISA's translation unit and compiled there
// with -ffp-contract=off. The arithmetic is written on 16-lane vectors (GCC
// vector extensions): each ISA splits them into its own registers, but every
// lane's operations and every reduction are the same, so the results are too.
// Not a public header.
#ifndef EXL3SERVE_KERNELS_CPU_ATTEND_ROW_INL_H_
#define EXL3SERVE_KERNELS_CPU_ATTEND_ROW_INL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace exl3serve::kernels::cpu::internal {
// Internal linkage: each ISA's translation unit keeps its own copy (an inline
// function shared by name would be merged across them by the linker, and a
// variant would run another ISA's code).
namespace {

typedef float AttendV16 __attribute__((vector_size(64)));

inline AttendV16 AttendLoad16(const float* p) {
  AttendV16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// IEEE half bits to float: exact (every half is a float), so the fp16 rows'
// arithmetic is that of their fp32 copies.
inline float AttendHalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int shift = -1;
      do {
        ++shift;
        mantissa <<= 1;
      } while ((mantissa & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline AttendV16 AttendLoad16(const uint16_t* p) {
  AttendV16 v;
#if defined(__AVX512F__)
  // (GCC 12's _mm512_cvtph_ps starts from _mm512_undefined_ps(): a false
  // maybe-uninitialized warning.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#pragma GCC diagnostic pop
  std::memcpy(&v, &x, sizeof(v));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
#else
  for (int l = 0; l < 16; ++l) v[l] = AttendHalfToFloat(p[l]);
#endif
  return v;
}

inline float AttendAt(const float* p, int64_t i) { return p[i]; }
inline float AttendAt(const uint16_t* p, int64_t i) { return AttendHalfToFloat(p[i]); }

// Where row j lies: contiguous rows at a stride, or a row per pointer (a
// paged cache read in place) plus an offset in elements.
template <typename E>
struct AttendStridedRows {
  using Element = E;
  const E* base;
  int64_t stride;
  const E* operator[](int64_t j) const { return base + j * stride; }
};
template <typename E>
struct AttendPointerRows {
  using Element = E;
  const void* const* rows;
  int64_t offset;
  const E* operator[](int64_t j) const { return static_cast<const E*>(rows[j]) + offset; }
};

// lane[0] + ... + lane[15] as the tree (l, l+8), (l, l+4), (l, l+2), (l, l+1).
inline float AttendReduce16(AttendV16 a) {
  a = a + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  a = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  a = a + __builtin_shufflevector(a, a, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  a = a + __builtin_shufflevector(a, a, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return a[0];
}

// The dot products of q with `keys` (<= 4) rows j0 .. j0 + keys − 1: 16 lane
// sums over the blocks of 16, reduced as a tree, then the tail in order.
template <int kKeys, typename Rows>
inline void AttendDots(const float* q, const Rows& k, int64_t j0, int64_t head_dim, float scale,
                       float* scores) {
  const int64_t full = head_dim - head_dim % 16;
  const typename Rows::Element* rows[kKeys];
  for (int u = 0; u < kKeys; ++u) rows[u] = k[j0 + u];
  AttendV16 acc[kKeys];
  for (int u = 0; u < kKeys; ++u) acc[u] = AttendV16{};
  for (int64_t i = 0; i < full; i += 16) {
    const AttendV16 qi = AttendLoad16(q + i);
    for (int u = 0; u < kKeys; ++u) acc[u] = acc[u] + qi * AttendLoad16(rows[u] + i);
  }
  for (int u = 0; u < kKeys; ++u) {
    float dot = AttendReduce16(acc[u]);
    for (int64_t i = full; i < head_dim; ++i) dot = dot + q[i] * AttendAt(rows[u], i);
    scores[u] = dot * scale;
  }
}

// out[h][i] = Σ_j w[h][j]·v_j[i] for `heads` (<= 8) heads at once, ascending
// j per lane: each value row is loaded once for all of them. kVecs blocks of
// 16 lanes per pass (more independent chains when there are few heads). The
// rows go in tiles of kValueRowTile, every lane block over a tile before the
// next tile (the partial sums wait in `out`): a long context's value rows
// are then fetched from memory once, not once per lane block. Each lane's
// sum is the same sequence of additions either way.
inline constexpr int64_t kValueRowTile = 32;
template <int kHeads, int kVecs, typename Rows>
inline void AttendValueSums(const float* w, int64_t w_stride, const Rows& v, int64_t count,
                            int64_t head_dim, float* out, int64_t out_stride, int64_t* lane) {
  constexpr int64_t kLanes = 16 * kVecs;
  const int64_t first = *lane;
  const int64_t end = first + (head_dim - first) / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < count; j0 += kValueRowTile) {
    const int64_t j1 = std::min(count, j0 + kValueRowTile);
    for (int64_t i0 = first; i0 < end; i0 += kLanes) {
      AttendV16 acc[kHeads][kVecs];
      for (int h = 0; h < kHeads; ++h) {
        for (int r = 0; r < kVecs; ++r) {
          acc[h][r] = j0 == 0 ? AttendV16{} : AttendLoad16(out + h * out_stride + i0 + 16 * r);
        }
      }
      for (int64_t j = j0; j < j1; ++j) {
        const typename Rows::Element* vj = v[j] + i0;
        AttendV16 x[kVecs];
        for (int r = 0; r < kVecs; ++r) x[r] = AttendLoad16(vj + 16 * r);
        for (int h = 0; h < kHeads; ++h) {
          const AttendV16 wj = AttendV16{} + w[h * w_stride + j];
          for (int r = 0; r < kVecs; ++r) acc[h][r] = acc[h][r] + wj * x[r];
        }
      }
      for (int h = 0; h < kHeads; ++h) {
        for (int r = 0; r < kVecs; ++r) std::memcpy(out + h * out_stride + i0 + 16 * r, &acc[h][r], 64);
      }
    }
  }
  *lane = end;
}

template <int kHeads, typename Rows>
inline void AttendValueSumsAllLanes(const float* w, int64_t w_stride, const Rows& v, int64_t count,
                                    int64_t head_dim, float* out, int64_t out_stride) {
  int64_t lane = 0;
  if constexpr (kHeads < 4) {
    AttendValueSums<kHeads, 4>(w, w_stride, v, count, head_dim, out, out_stride, &lane);
  }
  AttendValueSums<kHeads, 1>(w, w_stride, v, count, head_dim, out, out_stride, &lane);
  if (lane < head_dim) {  // the last head_dim % 16 lanes
    const int64_t lanes = head_dim - lane;
    for (int h = 0; h < kHeads; ++h) {
      float tail[16] = {};
      for (int64_t j = 0; j < count; ++j) {
        const typename Rows::Element* vj = v[j] + lane;
        const float wj = w[h * w_stride + j];
        for (int64_t l = 0; l < lanes; ++l) tail[l] = tail[l] + wj * AttendAt(vj, l);
      }
      for (int64_t l = 0; l < lanes; ++l) out[h * out_stride + lane + l] = tail[l];
    }
  }
}

// `heads` query heads (rows q + h·q_stride) over the same keys and values:
// each head's output (out + h·out_stride) is exactly AttendRow's for it;
// `scores` is scratch of heads·count floats.
template <typename Rows>
inline void AttendGroupRows(const float* q, int64_t q_stride, int64_t heads, const Rows& k,
                            const Rows& v, int64_t count, int64_t head_dim, float scale,
                            float* scores, float* out, int64_t out_stride) {
  // Scores: a block of 4 keys stays in L1 while every head takes its dots.
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    for (int64_t h = 0; h < heads; ++h) {
      AttendDots<4>(q + h * q_stride, k, j, head_dim, scale, scores + h * count + j);
    }
  }
  for (; j < count; ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      AttendDots<1>(q + h * q_stride, k, j, head_dim, scale, scores + h * count + j);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * count;
    float max_score = -INFINITY;
    for (j = 0; j < count; ++j) max_score = std::max(max_score, s[j]);
    float sum = 0.0f;
    for (j = 0; j < count; ++j) {
      s[j] = std::exp(s[j] - max_score);
      sum += s[j];
    }
    for (j = 0; j < count; ++j) s[j] /= sum;  // the weights w_j
  }
  // Values, up to 8 heads per pass over the rows.
  for (int64_t h0 = 0; h0 < heads; h0 += 8) {
    const float* w = scores + h0 * count;
    float* o = out + h0 * out_stride;
    switch (std::min<int64_t>(8, heads - h0)) {
      case 8: AttendValueSumsAllLanes<8>(w, count, v, count, head_dim, o, out_stride); break;
      case 7: AttendValueSumsAllLanes<7>(w, count, v, count, head_dim, o, out_stride); break;
      case 6: AttendValueSumsAllLanes<6>(w, count, v, count, head_dim, o, out_stride); break;
      case 5: AttendValueSumsAllLanes<5>(w, count, v, count, head_dim, o, out_stride); break;
      case 4: AttendValueSumsAllLanes<4>(w, count, v, count, head_dim, o, out_stride); break;
      case 3: AttendValueSumsAllLanes<3>(w, count, v, count, head_dim, o, out_stride); break;
      case 2: AttendValueSumsAllLanes<2>(w, count, v, count, head_dim, o, out_stride); break;
      default: AttendValueSumsAllLanes<1>(w, count, v, count, head_dim, o, out_stride); break;
    }
  }
}

inline void AttendGroupBody(const float* q, int64_t q_stride, int64_t heads, const float* k,
                            const float* v, int64_t count, int64_t row_stride, int64_t head_dim,
                            float scale, float* scores, float* out, int64_t out_stride) {
  AttendGroupRows(q, q_stride, heads, AttendStridedRows<float>{k, row_stride},
                  AttendStridedRows<float>{v, row_stride}, count, head_dim, scale, scores, out,
                  out_stride);
}

inline void AttendGroupPagedBody(const float* q, int64_t q_stride, int64_t heads,
                                 const void* const* k_rows, const void* const* v_rows,
                                 int64_t offset, bool fp16, int64_t count, int64_t head_dim,
                                 float scale, float* scores, float* out, int64_t out_stride) {
  if (fp16) {
    AttendGroupRows(q, q_stride, heads, AttendPointerRows<uint16_t>{k_rows, offset},
                    AttendPointerRows<uint16_t>{v_rows, offset}, count, head_dim, scale, scores,
                    out, out_stride);
  } else {
    AttendGroupRows(q, q_stride, heads, AttendPointerRows<float>{k_rows, offset},
                    AttendPointerRows<float>{v_rows, offset}, count, head_dim, scale, scores, out,
                    out_stride);
  }
}

inline void AttendRowBody(const float* q, const float* k, const float* v, int64_t count,
                          int64_t row_stride, int64_t head_dim, float scale, float* scores,
                          float* out) {
  AttendGroupBody(q, head_dim, 1, k, v, count, row_stride, head_dim, scale, scores, out, head_dim);
}

}  // namespace
}  // namespace exl3serve::kernels::cpu::internal

// The functions of one variant (attend_row.h), in namespace
// exl3serve::kernels::cpu::<isa>: each ISA's file is this line.
#define EXL3_ATTEND_ROW_DEFINE_VARIANT(isa)                                                       \
  namespace exl3serve::kernels::cpu::isa {                                                        \
  void AttendRow(const float* q, const float* k, const float* v, int64_t count,                   \
                 int64_t row_stride, int64_t head_dim, float scale, float* scores, float* out) {  \
    internal::AttendRowBody(q, k, v, count, row_stride, head_dim, scale, scores, out);            \
  }                                                                                               \
  void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k,               \
                   const float* v, int64_t count, int64_t row_stride, int64_t head_dim,           \
                   float scale, float* scores, float* out, int64_t out_stride) {                  \
    internal::AttendGroupBody(q, q_stride, heads, k, v, count, row_stride, head_dim, scale,       \
                              scores, out, out_stride);                                           \
  }                                                                                               \
  void AttendGroupPaged(const float* q, int64_t q_stride, int64_t heads,                          \
                        const void* const* k_rows, const void* const* v_rows, int64_t offset,     \
                        bool fp16, int64_t count, int64_t head_dim, float scale, float* scores,   \
                        float* out, int64_t out_stride) {                                         \
    internal::AttendGroupPagedBody(q, q_stride, heads, k_rows, v_rows, offset, fp16, count,       \
                                   head_dim, scale, scores, out, out_stride);                     \
  }                                                                                               \
  }

#endif  // EXL3SERVE_KERNELS_CPU_ATTEND_ROW_INL_H_
