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

// kernels::AttendGroup (ops.h) over rows read in place: key row j of the
// group at k_rows[j] + offset, value row j at v_rows[j] + offset (offset in
// elements), fp32 or IEEE fp16 (`fp16`) entries. Each head's output is bit
// for bit AttendGroup's over the same rows converted to fp32 (the conversion
// is exact). Dispatched to the running CPU's variant.
void AttendGroupPaged(const float* q, int64_t q_stride, int64_t heads, const void* const* k_rows,
                      const void* const* v_rows, int64_t offset, bool fp16, int64_t count,
                      int64_t head_dim, float scale, float* scores, float* out,
                      int64_t out_stride);

// Called by kernels::AttendRow; tests call them directly (calling one the
// CPU lacks is undefined). Each ISA's file defines them with
// EXL3_ATTEND_ROW_DEFINE_VARIANT (attend_row_inl.h).
#define EXL3_ATTEND_ROW_VARIANT_DECLARATIONS                                                      \
  void AttendGroupPaged(const float* q, int64_t q_stride, int64_t heads,                          \
                        const void* const* k_rows, const void* const* v_rows, int64_t offset,     \
                        bool fp16, int64_t count, int64_t head_dim, float scale, float* scores,   \
                        float* out, int64_t out_stride);                                          \
  void AttendRow(const float* q, const float* k, const float* v, int64_t count,                   \
                 int64_t row_stride, int64_t head_dim, float scale, float* scores, float* out);   \
  void AttendGroup(const float* q, int64_t q_stride, int64_t heads, const float* k,               \
                   const float* v, int64_t count, int64_t row_stride, int64_t head_dim,           \
                   float scale, float* scores, float* out, int64_t out_stride);
namespace scalar {
EXL3_ATTEND_ROW_VARIANT_DECLARATIONS
}
namespace avx2 {
EXL3_ATTEND_ROW_VARIANT_DECLARATIONS
}
namespace avx512 {
EXL3_ATTEND_ROW_VARIANT_DECLARATIONS
}
#undef EXL3_ATTEND_ROW_VARIANT_DECLARATIONS

}  // namespace exl3serve::kernels::cpu

#endif  // EXL3SERVE_KERNELS_CPU_ATTEND_ROW_H_
