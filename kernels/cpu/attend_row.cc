// The scalar (x86-64 baseline) variant of kernels::AttendRow (attend_row.h);
// the dispatcher is kernels::AttendRow in ops.cc.
#include "kernels/cpu/attend_row.h"

#include "kernels/cpu/attend_row_inl.h"
#include "kernels/cpu/cpu_features.h"

EXL3_ATTEND_ROW_DEFINE_VARIANT(scalar)

namespace exl3serve::kernels::cpu {

void AttendGroupPaged(const float* q, int64_t q_stride, int64_t heads, const void* const* k_rows,
                      const void* const* v_rows, int64_t offset, bool fp16, int64_t count,
                      int64_t head_dim, float scale, float* scores, float* out,
                      int64_t out_stride) {
  auto* fn = &scalar::AttendGroupPaged;
  switch (ActiveCpuIsa()) {
    case CpuIsa::kAvx512: fn = &avx512::AttendGroupPaged; break;
    case CpuIsa::kAvx2: fn = &avx2::AttendGroupPaged; break;
    case CpuIsa::kScalar: break;
  }
  fn(q, q_stride, heads, k_rows, v_rows, offset, fp16, count, head_dim, scale, scores, out,
     out_stride);
}

}  // namespace exl3serve::kernels::cpu
