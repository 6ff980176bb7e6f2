// The avx512 variant of kernels::AttendRow / AttendGroup / AttendGroupPaged
// (attend_row.h): the shared body compiled for this ISA (flags by file-name
// suffix, no contraction).
#include "kernels/cpu/attend_row.h"
#include "kernels/cpu/attend_row_inl.h"

EXL3_ATTEND_ROW_DEFINE_VARIANT(avx512)
