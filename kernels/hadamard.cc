#include "kernels/hadamard.h"

#include <vector>

namespace exl3serve::kernels {
namespace {

template <typename T>
void Hadamard128Impl(T* v) {
  for (int h = 1; h < kHadamardSize; h <<= 1) {
    for (int i = 0; i < kHadamardSize; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const T a = v[j];
        const T b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  const T scale = static_cast<T>(kHadamardScale);
  for (int i = 0; i < kHadamardSize; ++i) v[i] *= scale;
}

template <typename T>
void BlockHadamardRowsImpl(T* x, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < d; b += kHadamardSize) Hadamard128Impl(x + r * d + b);
  }
}

// Row mixing as butterflies over whole rows: same arithmetic per column as
// Hadamard128 applied to that column's 128-element group, vectorisable.
template <typename T>
void BlockHadamardColumnsImpl(T* w, int64_t k, int64_t n) {
  const T scale = static_cast<T>(kHadamardScale);
  for (int64_t base = 0; base < k; base += kHadamardSize) {
    T* block = w + base * n;
    for (int h = 1; h < kHadamardSize; h <<= 1) {
      for (int i = 0; i < kHadamardSize; i += 2 * h) {
        for (int j = i; j < i + h; ++j) {
          T* a = block + static_cast<int64_t>(j) * n;
          T* b = block + static_cast<int64_t>(j + h) * n;
          for (int64_t c = 0; c < n; ++c) {
            const T va = a[c];
            const T vb = b[c];
            a[c] = va + vb;
            b[c] = va - vb;
          }
        }
      }
    }
    for (int64_t i = 0; i < kHadamardSize * n; ++i) block[i] *= scale;
  }
}

}  // namespace

void Hadamard128(float* v) { Hadamard128Impl(v); }
void Hadamard128(double* v) { Hadamard128Impl(v); }
void BlockHadamardRows(float* x, int64_t rows, int64_t d) { BlockHadamardRowsImpl(x, rows, d); }
void BlockHadamardRows(double* x, int64_t rows, int64_t d) { BlockHadamardRowsImpl(x, rows, d); }
void BlockHadamardColumns(float* w, int64_t k, int64_t n) { BlockHadamardColumnsImpl(w, k, n); }
void BlockHadamardColumns(double* w, int64_t k, int64_t n) { BlockHadamardColumnsImpl(w, k, n); }

}  // namespace exl3serve::kernels
