// The vector API on AVX2 with FMA and F16C: 8 fp32 lanes in a ymm register. AMD Zen 1-3, Intel
// Haswell through Ice Lake without AVX-512, Alder Lake and later client chips, most cloud VMs.
#pragma once

#include <immintrin.h>

#include "../types.h"

namespace pagedserve::vec {

constexpr int kLanes = 8;
constexpr int kRegisters = 16;  // ymm0-15

struct Vec {
  __m256 v;
};

inline Vec zero() { return {_mm256_setzero_ps()}; }
inline Vec set1(float x) { return {_mm256_set1_ps(x)}; }

inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec load(const BFloat16* p) {  // bf16 is the top half of an fp32: widening is a shift
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline Vec load(const Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline Vec load(const int8_t* p) {  // an INT8 KV row's codes, widened
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v.v); }
// fp32 -> bf16 rounding to nearest even, NaN -> quiet NaN (0x7FC0): c10's round_to_nearest_even.
inline void store(BFloat16* p, Vec v) {
  const __m256i bits = _mm256_castps_si256(v.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // 8 x 32 -> 8 x 16 bits: packus works within 128-bit halves, so fix the order after
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store(Half* p, Vec v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT));
}

// The first n lanes (n < kLanes) of an fp32 array; the others are zero.
inline __m256i first(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load_first(const float* p, int n) { return {_mm256_maskload_ps(p, first(n))}; }
inline void store_first(float* p, Vec v, int n) { _mm256_maskstore_ps(p, first(n), v.v); }
inline Vec keep_first(Vec v, int n) {
  return {_mm256_and_ps(v.v, _mm256_castsi256_ps(first(n)))};
}

inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
// Each even lane and the odd one after it swapped (lanes 1, 0, 3, 2, ...).
inline Vec swap_pairs(Vec v) { return {_mm256_permute_ps(v.v, 0xB1)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline float reduce_add(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v.v), _mm256_extractf128_ps(v.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v.v), _mm256_extractf128_ps(v.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline uint32_t nan_lanes(Vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q)); }
inline uint32_t equal_lanes(Vec a, Vec b) {
  return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ));
}

// exp: the AVX-512 target's range reduction and polynomial; 2^n is built in the exponent bits
// (n stays within the normal range because x is clamped to [-87.3, 88.3]).
inline Vec exp(Vec xv) {
  __m256 x = _mm256_min_ps(_mm256_max_ps(xv.v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p, _mm256_castsi256_ps(pow2n))};
}

// Lane i of the result is the sum of the 8 lanes of v[i] (three levels of pairwise adds).
inline Vec sum_lanes(const Vec* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0].v, v[1].v), a1 = _mm256_hadd_ps(v[2].v, v[3].v);
  const __m256 a2 = _mm256_hadd_ps(v[4].v, v[5].v), a3 = _mm256_hadd_ps(v[6].v, v[7].v);
  // b0: [v0 v1 v2 v3 | v0 v1 v2 v3] partial sums of each half; b1 the same for v4..v7
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return {_mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31))};
}

// Products of bf16 pairs: no bf16 dot product here, so 2 kLanes values are widened to two fp32
// vectors (exact) and multiplied with two FMAs.
struct Bf16Pairs {
  Vec lo, hi;
};
inline Bf16Pairs load_pairs(const BFloat16* p) { return {vec::load(p), vec::load(p + kLanes)}; }
inline Vec dot_pairs(Vec acc, Bf16Pairs a, Bf16Pairs b) {
  return fmadd(a.hi, b.hi, fmadd(a.lo, b.lo, acc));
}
// Every lane's pair set to p[0], p[1]; where load_pairs finds lane's value half (0 or 1).
inline Bf16Pairs set1_pair(const BFloat16* p) { return {set1(float(p[0])), set1(float(p[1]))}; }
constexpr int pair_slot(int lane, int half) { return half * kLanes + lane; }
constexpr bool kNativePairs = false;  // dot_pairs is two FMAs

}  // namespace pagedserve::vec
