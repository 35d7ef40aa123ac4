// The vector API on AVX-512 (F, BW, VL, DQ) with BF16: 16 fp32 lanes in a zmm register.
// Zen 4 and 5, Sapphire Rapids and later, Cooper Lake.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "../types.h"

namespace pagedserve::vec {

constexpr int kLanes = 16;
constexpr int kRegisters = 32;  // zmm0-31: what a kernel may keep live in one loop

struct Vec {
  __m512 v;
};

inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float x) { return {_mm512_set1_ps(x)}; }

inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load(const BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline Vec load(const Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Vec load(const int8_t* p) {  // an INT8 KV row's codes, widened
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v.v); }
inline void store(BFloat16* p, Vec v) {  // round to nearest even, as PyTorch
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v.v));
}
inline void store(Half* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT));
}

// The first n lanes (n < kLanes) of an fp32 array; the others are zero.
inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
inline Vec load_first(const float* p, int n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline void store_first(float* p, Vec v, int n) { _mm512_mask_storeu_ps(p, first(n), v.v); }
inline Vec keep_first(Vec v, int n) { return {_mm512_maskz_mov_ps(first(n), v.v)}; }

inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
// Each even lane and the odd one after it swapped (lanes 1, 0, 3, 2, ...).
inline Vec swap_pairs(Vec v) { return {_mm512_permute_ps(v.v, 0xB1)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a b + c
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a b
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v.v); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v.v); }

// Bit i set where lane i is NaN / equals b.
inline uint32_t nan_lanes(Vec v) { return _mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q); }
inline uint32_t equal_lanes(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }

// exp for the softmax and SiLU: Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp.
inline Vec exp(Vec xv) {
  __m512 x = _mm512_max_ps(xv.v, _mm512_set1_ps(-87.3f));
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
  return {_mm512_scalef_ps(p, n)};
}

// Lane i of the result is the sum of the 16 lanes of v[i]: a transpose-and-add tree (about 3
// instructions per input instead of a full horizontal reduction each).
inline Vec sum_lanes(const Vec* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 from v[2i], 8-15 from v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0xEE));
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
  return {_mm512_permutexvar_ps(order, sums)};
}

// Products of bf16 pairs: 2 kLanes bf16 values held as they are, multiplied exactly and summed
// pairwise into fp32 lanes by one vdpbf16ps.
struct Bf16Pairs {
  __m512i v;
};
inline Bf16Pairs load_pairs(const BFloat16* p) { return {_mm512_loadu_si512(p)}; }
inline Vec dot_pairs(Vec acc, Bf16Pairs a, Bf16Pairs b) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)a.v, (__m512bh)b.v)};
}
// Every lane's pair set to p[0], p[1]; where load_pairs finds lane's value half (0 or 1).
inline Bf16Pairs set1_pair(const BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return {_mm512_set1_epi32(pair)};
}
constexpr int pair_slot(int lane, int half) { return 2 * lane + half; }
constexpr bool kNativePairs = true;  // dot_pairs is one instruction

}  // namespace pagedserve::vec
