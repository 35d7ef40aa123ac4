// AVX-512 helpers shared by the native kernels: loads and stores that convert between fp32
// registers and the activation dtypes, PyTorch's rounding between ops, exp and a 16-way reduction.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

// The activation dtypes a model runs in: float32, bfloat16, float16.
#define DISPATCH_ACTIVATION_TYPES(TYPE, NAME, ...)                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)         \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)              \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace pagedserve {

using at::BFloat16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// Rounds through the storage dtype, as PyTorch does between two ops (no-op for float).
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

// An fp32 result into the output dtype; PyTorch adds a bias to the rounded product.
template <typename T>
inline void store_output(T* out, __m512 v, const T* bias) {
  if (bias) v = _mm512_add_ps(round_to<T>(v), load16(bias));
  store16(out, v);
}

// exp for the softmax: Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp in fp32.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}


// Lane i of the result is the sum of the 16 lanes of v[i]: a transpose-and-add tree (about 3
// instructions per input instead of a full horizontal reduction each).
inline __m512 sum_lanes16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 from v[2i], 8-15 from v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: 4 partial sums of v[4i + L]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane L: 2 partials of v[8i + L], then 2 of v[8i + 4 + L]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // lane L, element j: the sum of v[4j + L]
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                    _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}


}  // namespace pagedserve
