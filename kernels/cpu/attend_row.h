// kernels/cpu/attend_row.h — the variants of kernels::AttendRow (ops.h), one
// query head's softmax attention over `count` key/value rows. Every variant
// (scalar, AVX2, AVX-512; runtime dispatch through cpu_features.h) is the
// same source (attend_row_inl.h) built without multiply-add contraction, with
// every sum in a fixed order, so all give bit-identical outputs — a rank on
// an AVX2 box and one on an AVX-512 box agree, as tensor parallelism and
// replay need. The order is the contract in ops.h.
#ifndef EXL3SERVE_KERNELS_CPU_ATTEND_ROW_H_
#define EXL3SERVE_KERNELS_CPU_ATTEND_ROW_H_

#include <cstdint>

namespace exl3serve::kernels::cpu {

// Called by kernels::AttendRow; tests call them directly (calling one the
// CPU lacks is undefined).
namespace scalar {
void AttendRow(const float* q, const float* k, const float* v, int64_t count, int64_t row_stride,
               int64_t head_dim, float scale, float* scores, float* out);
void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k, const float* v,
                 int64_t count, int64_t row_stride, int64_t head_dim, float scale, float* scores,
                 float* out, int64_t out_stride);
}
namespace avx2 {
void AttendRow(const float* q, const float* k, const float* v, int64_t count, int64_t row_stride,
               int64_t head_dim, float scale, float* scores, float* out);
void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k, const float* v,
                 int64_t count, int64_t row_stride, int64_t head_dim, float scale, float* scores,
                 float* out, int64_t out_stride);
}
namespace avx512 {
void AttendRow(const float* q, const float* k, const float* v, int64_t count, int64_t row_stride,
               int64_t head_dim, float scale, float* scores, float* out);
void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k, const float* v,
                 int64_t count, int64_t row_stride, int64_t head_dim, float scale, float* scores,
                 float* out, int64_t out_stride);
}

}  // namespace exl3serve::kernels::cpu

#endif  // EXL3SERVE_KERNELS_CPU_ATTEND_ROW_H_
