// AVX-VNNI's two instructions as the avx2 target uses them, emulated exactly with AVX2, so that a
// CPU without AVX-VNNI (a Zen 3) runs the target's VNNI branch: the build of
// tests/hal/test_avx_vnni_emulated.py includes this file first (-include), which makes every
// `#if defined(__AVXVNNI__)` take that branch and its two intrinsics call the functions below.
// Both are exact, wrap-around included: each product fits its intermediate, and the sums wrap
// modulo 2^32 as the instructions' do.
#pragma once

#include <immintrin.h>

#define __AVXVNNI__ 1

// vpdpbusd: src + the 4 products of a's unsigned bytes and b's signed bytes in each 32-bit lane.
// (vpmaddubsw would saturate pairs of such products; the bytes widened to int16 do not.)
static inline __m256i pagedserve_emulated_dpbusd(__m256i src, __m256i a, __m256i b) {
  const __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0x00FF));
  const __m256i a_odd = _mm256_srli_epi16(a, 8);
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
  const __m256i b_odd = _mm256_srai_epi16(b, 8);
  return _mm256_add_epi32(src, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even),
                                                _mm256_madd_epi16(a_odd, b_odd)));
}

// vpdpwssd: src + the 2 products of a's and b's int16 values in each 32-bit lane.
static inline __m256i pagedserve_emulated_dpwssd(__m256i src, __m256i a, __m256i b) {
  return _mm256_add_epi32(src, _mm256_madd_epi16(a, b));
}

#define _mm256_dpbusd_avx_epi32 pagedserve_emulated_dpbusd
#define _mm256_dpwssd_avx_epi32 pagedserve_emulated_dpwssd
