// The avx2 variant of kernels::AttendRow (attend_row.h): the shared body
// compiled for this ISA (flags by file-name suffix, no contraction).
#include "kernels/cpu/attend_row.h"
#include "kernels/cpu/attend_row_inl.h"

namespace exl3serve::kernels::cpu::avx2 {

void AttendRow(const float* q, const float* k, const float* v, int64_t count, int64_t row_stride,
               int64_t head_dim, float scale, float* scores, float* out) {
  internal::AttendRowBody(q, k, v, count, row_stride, head_dim, scale, scores, out);
}

void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k, const float* v,
                 int64_t count, int64_t row_stride, int64_t head_dim, float scale, float* scores,
                 float* out, int64_t out_stride) {
  internal::AttendGroupBody(q, q_stride, heads, k, v, count, row_stride, head_dim, scale, scores,
                            out, out_stride);
}

void AttendGroupPaged(const float* q, int64_t q_stride, int64_t heads, const void* const* k_rows,
                      const void* const* v_rows, int64_t offset, bool fp16, int64_t count,
                      int64_t head_dim, float scale, float* scores, float* out,
                      int64_t out_stride) {
  internal::AttendGroupPagedBody(q, q_stride, heads, k_rows, v_rows, offset, fp16, count, head_dim,
                                 scale, scores, out, out_stride);
}

}  // namespace exl3serve::kernels::cpu::avx2
