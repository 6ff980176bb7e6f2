// kernels/hadamard.h — the 128-point block Hadamard transform of EXL3
// (exl3-format.md §5.1): B_d is block-diagonal with d/128 copies of
// H128/sqrt(128), H128[i][j] = (-1)^popcount(i & j) (Sylvester, natural order).
// B is symmetric and orthogonal, so it is its own inverse.
//
//   Hadamard128(v);                      // one aligned block of 128, in place
//   BlockHadamardRows(x, rows, d);       // x (rows x d) <- x · B_d
//   BlockHadamardColumns(w, k, n);       // w (k x n)    <- B_k · w
//
// Butterflies in natural bit order (h = 1, 2, ..., 64), then one scale by
// 1/sqrt(128), all in the argument's precision. Pure functions, no state.
// Requires: d, k multiples of 128.
#ifndef EXL3SERVE_KERNELS_HADAMARD_H_
#define EXL3SERVE_KERNELS_HADAMARD_H_

#include <cstdint>

namespace exl3serve::kernels {

inline constexpr int kHadamardSize = 128;  // fixed by the format (§5.1)
inline constexpr double kHadamardScale = 0.08838834764831844055;  // 1/sqrt(128)

void Hadamard128(float* v);
void Hadamard128(double* v);

// Each row of the row-major (rows x d) matrix x becomes x_row · B_d.
void BlockHadamardRows(float* x, int64_t rows, int64_t d);
void BlockHadamardRows(double* x, int64_t rows, int64_t d);

// The row-major (k x n) matrix w becomes B_k · w (mixes rows within aligned
// groups of 128 rows).
void BlockHadamardColumns(float* w, int64_t k, int64_t n);
void BlockHadamardColumns(double* w, int64_t k, int64_t n);

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_HADAMARD_H_
