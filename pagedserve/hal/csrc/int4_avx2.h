// The AVX2 target's INT4 GEMMs over tiles of 8 output rows, both with integer products of the
// unsigned codes and the zero point applied once per group (int4_gemm.h walks them over an
// [M, N] product): W4A16 with int16 activations through vpmaddwd, and W4A8 with int8 activations
// per block of 32 values (llama.cpp's Q8_0) through vpmaddubsw summed in int16, then vpmaddwd;
// vpdpbusd and vpdpwssd where the CPU has AVX-VNNI.
//
// Layout "tiles8" (W4A16, pack_tiles8 in int4.py): a tile's K/8 chunks of 32 bytes each hold
// k = 8c .. 8c+7 of its 8 rows; splitting a chunk's nibbles and interleaving each byte with a zero
// byte (vpunpck{l,h}bw, within 128-bit halves) gives four vectors of int16 code pairs in which
// 32-bit lane r is row r at two adjacent k, so one vpmaddwd with a broadcast activation pair adds
// two products to each of the 8 rows, with no horizontal sum.
// Layout "tiles8_a8" (W4A8, pack_tiles8_a8): byte 4r + j of chunk c holds row r, k = 8c + j in its
// low nibble and k = 8c + 4 + j in its high one, so each 32-bit lane sums four products of row r.
// Both: per tile and group, 8 fp16 scales then 8 one-byte zero points.
#pragma once

#include "int4_gemm.h"
#include "int4_limits.h"
#include "vec.h"

namespace pagedserve {

constexpr const char* kInt4Layout = "tiles8";
constexpr const char* kInt4A8Layout = "tiles8_a8";
constexpr int kTileRows = 8;
// Activation rows one pass over a tile serves, their sums and accumulators beside the unpacked
// codes in the 16 ymm registers (W4A16: 4 code vectors, 2 registers a row; W4A8: 2 code vectors,
// 2 registers a row).
constexpr int kInt16RowsPerPass = 4;
constexpr int kInt8RowsPerPass = 5;
// How far ahead of the chunk being multiplied its thread asks for weight bytes. A decode step
// streams every weight from memory once, and the hardware prefetchers stop at each 4 KiB page,
// so without this every page starts with a wait; 1 KiB ahead measured fastest of 256 B to 2 KiB at
// one and four rows on Zen 3 (a 64 B line is asked for twice, once per 32 B chunk: one more
// instruction per chunk costs less than a second counter).
constexpr int64_t kPrefetchBytes = 1024;

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// A tile's 8 fp16 scales and 8 one-byte zero points of group g (24 bytes a group): (scale,
// scale * zero).
constexpr int64_t kGroupBytes = 3 * kTileRows;
struct GroupScales {
  __m256 scale, scaled_zero;
};
inline GroupScales group_scales(const uint8_t* sz, int64_t g) {
  const uint8_t* group = sz + g * kGroupBytes;
  const __m256 scale = vec::load(reinterpret_cast<const Half*>(group)).v;
  const __m256 zero = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + 2 * kTileRows))));
  return {scale, _mm256_mul_ps(scale, zero)};
}

// ---- W4A16: 16-bit integer activations, integer products -----------------------------------------
//
// Each activation row is rounded per group (the weight's) to int16 with a power-of-two scale
// (2^(e - 15) for a group whose largest magnitude is below 2^e). A bf16 value within 2^7 of its
// group's largest is then exact, smaller ones are rounded at 2^-16 of that largest (never coarser
// than bf16's own rounding), and the products and their sums are exact integers: vpmaddwd
// multiplies 16 int16 pairs per instruction. Measured against fp32 FMAs on the same tiles (the
// 0x43 trick of the avx512 target): 25.7 vs 20.5 GB/s at one row on 2 Zen 3 cores, and no more
// rounding than FMAs with that offset have (benchmarks/linear_paths.py).

#if defined(__AVXVNNI__)
inline __m256i add_pair_products(__m256i dot, __m256i pairs, int32_t x) {
  return _mm256_dpwssd_avx_epi32(dot, pairs, _mm256_set1_epi32(x));
}
#else
inline __m256i add_pair_products(__m256i dot, __m256i pairs, int32_t x) {
  return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi32(x)));
}
#endif

// One tile of 8 output rows for MB activation rows from row m0.
template <int MB, typename T>
struct Int4Tile {
  static void run(const Int4Operands<T, int16_t>& op, int64_t t, int64_t m0) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F), zero_bytes = _mm256_setzero_si256();
    const int64_t K = op.K, num_groups = K / op.G, chunks_per_group = op.G / 8;
    const uint8_t* w = op.w + t * K * 4;
    const uint8_t* sz = op.sz + t * num_groups * kGroupBytes;
    // int16 pairs as int32
    const int32_t* x = reinterpret_cast<const int32_t*>(op.x + m0 * K);
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < num_groups; ++g) {
      __m256i dot[MB];
      for (int m = 0; m < MB; ++m) dot[m] = _mm256_setzero_si256();
      for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
        prefetch_weights(w + c * 32, kPrefetchBytes);
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
        const __m256i lo = _mm256_and_si256(codes, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_nibbles);
        // int16 codes, lane r of each: row r at k = 8c + (0, 1), (2, 3), (4, 5), (6, 7)
        const __m256i pairs[4] = {
            _mm256_unpacklo_epi8(lo, zero_bytes), _mm256_unpackhi_epi8(lo, zero_bytes),
            _mm256_unpacklo_epi8(hi, zero_bytes), _mm256_unpackhi_epi8(hi, zero_bytes)};
  #pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          const int32_t* xk = x + m * K / 2 + 4 * c;
          for (int p = 0; p < 4; ++p) dot[m] = add_pair_products(dot[m], pairs[p], xk[p]);
        }
      }
      const GroupScales s = group_scales(sz, g);
      for (int m = 0; m < MB; ++m) {
        const int64_t i = (m0 + m) * num_groups + g;
        const __m256 d = _mm256_fnmadd_ps(s.scaled_zero, _mm256_set1_ps(op.xsum[i]),
                                          _mm256_mul_ps(s.scale, _mm256_cvtepi32_ps(dot[m])));
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(op.xscale[i]), d, acc[m]);
      }
    }
    const T* bias = op.bias ? op.bias + t * kTileRows : nullptr;
    for (int m = 0; m < MB; ++m)
      store_output(op.out + (m0 + m) * op.N + t * kTileRows, Vec{acc[m]}, bias);
  }
};

// x rows [m0, m1) -> int16 per (row, group) with a power-of-two scale, the scales, and the
// per-group sums of the int16 values.
template <typename T>
void quantize_rows_int16(const T* x, int64_t m0, int64_t m1, int64_t K, int64_t group_size,
                         int16_t* xi, float* xscale, float* xsum) {
  const int64_t num_groups = K / group_size;
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(32767.f);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t k0 = m * K + g * group_size, k1 = k0 + group_size;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t k = k0; k < k1; k += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, vec::load(x + k).v));
      int e = 0;
      std::frexp(vec::reduce_max(Vec{amax}), &e);  // largest < 2^e (0 for an all-zero group)
      const float scale = std::ldexp(1.f, e - 15);
      const __m256 inv = _mm256_set1_ps(std::ldexp(1.f, 15 - e));  // exact: a power of two
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = k0; k < k1; k += 8) {
        __m256 q = _mm256_round_ps(_mm256_mul_ps(vec::load(x + k).v, inv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
        const __m256i qi = _mm256_cvtps_epi32(q);
        sum = _mm256_add_epi32(sum, qi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xi + k),
                         _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1)));
      }
      xscale[m * num_groups + g] = scale;
      xsum[m * num_groups + g] = float(hsum_epi32(sum));
    }
}

// ---- W4A8: int8 activations per block of 32, integer products -----------------------------------

// The integer dot products of one chunk (8 k of the tile's 8 rows) with broadcast int8
// activations. Without AVX-VNNI: vpmaddubsw multiplies the unsigned codes (0..15) with the signed
// activations and adds pairs into 16 int16 lanes; the eight of a block of 32 fit in int16
// (8 x 2 x 15 x 127 < 2^15) before vpmaddwd widens them to the 8 rows. With AVX-VNNI: vpdpbusd
// does all three steps into the 8 int32 lanes.
#if defined(__AVXVNNI__)
inline __m256i add_chunk_products(__m256i sums, __m256i lo, __m256i hi, const int32_t* x) {
  sums = _mm256_dpbusd_avx_epi32(sums, lo, _mm256_set1_epi32(x[0]));
  return _mm256_dpbusd_avx_epi32(sums, hi, _mm256_set1_epi32(x[1]));
}
inline __m256 block_sums_to_float(__m256i sums) { return _mm256_cvtepi32_ps(sums); }
#else
inline __m256i add_chunk_products(__m256i sums16, __m256i lo, __m256i hi, const int32_t* x) {
  sums16 = _mm256_add_epi16(sums16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[0])));
  return _mm256_add_epi16(sums16, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[1])));
}
inline __m256 block_sums_to_float(__m256i sums16) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums16, _mm256_set1_epi16(1)));
}
#endif

// One tile of 8 output rows for MB activation rows from row m0: per block of 32 values, each
// row's integer sums times the weights' scale and the block's; the zero point once per group, as
// scale * zero * (the group's scaled activation sum).
template <int MB, typename T>
struct Int4Int8Tile {
  static void run(const Int4Operands<T, int8_t>& op, int64_t t, int64_t m0) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    const int64_t K = op.K, num_groups = K / op.G, blocks_per_group = op.G / 32;
    const uint8_t* w = op.w + t * K * 4;
    const uint8_t* sz = op.sz + t * num_groups * kGroupBytes;
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < num_groups; ++g) {
      const GroupScales s = group_scales(sz, g);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        __m256i sums[MB];
        for (int m = 0; m < MB; ++m) sums[m] = _mm256_setzero_si256();
        for (int64_t c = 4 * b; c < 4 * b + 4; ++c) {
          prefetch_weights(w + c * 32, kPrefetchBytes);
          const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
          const __m256i lo = _mm256_and_si256(codes, low_nibbles);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_nibbles);
          for (int m = 0; m < MB; ++m)
            sums[m] = add_chunk_products(
                sums[m], lo, hi, reinterpret_cast<const int32_t*>(op.x + (m0 + m) * K + 8 * c));
        }
        for (int m = 0; m < MB; ++m) {
          const __m256 scale = _mm256_mul_ps(s.scale, _mm256_set1_ps(op.xscale[(m0 + m) * K / 32 + b]));
          acc[m] = _mm256_fmadd_ps(scale, block_sums_to_float(sums[m]), acc[m]);
        }
      }
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm256_fnmadd_ps(s.scaled_zero, _mm256_set1_ps(op.xsum[(m0 + m) * num_groups + g]),
                                  acc[m]);
    }
    const T* bias = op.bias ? op.bias + t * kTileRows : nullptr;
    for (int m = 0; m < MB; ++m)
      store_output(op.out + (m0 + m) * op.N + t * kTileRows, Vec{acc[m]}, bias);
  }
};

// x rows [m0, m1) -> int8 per block of 32 (round(x / scale), scale = max(amax, 1e-8) / 127, as
// int4.quantize_activations_int8), each block's scale, and per group the sum over its blocks of
// scale * sum(int8).
template <typename T>
void quantize_rows_int8(const T* x, int64_t m0, int64_t m1, int64_t K, int64_t group_size,
                        int8_t* xq, float* xscale, float* xsum) {
  const int64_t blocks = K / 32, blocks_per_group = group_size / 32;
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(127.f);
  for (int64_t m = m0; m < m1; ++m) {
    float group_sum = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = m * K + 32 * b;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = vec::load(x + k0 + 8 * i).v;
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      const float scale = std::max(vec::reduce_max(Vec{amax}), 1e-8f) / 127.f;
      const __m256 s = _mm256_set1_ps(scale);
      __m256i q32[4], sum = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(v[i], s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
        q32[i] = _mm256_cvtps_epi32(q);
        sum = _mm256_add_epi32(sum, q32[i]);
      }
      // 32 x int32 -> 32 x int8: the packs work within 128-bit halves; put the halves in order
      const __m256i w16 = _mm256_packs_epi32(q32[0], q32[1]), w16b = _mm256_packs_epi32(q32[2], q32[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + k0), bytes);
      xscale[m * blocks + b] = scale;
      group_sum += scale * float(hsum_epi32(sum));
      if ((b + 1) % blocks_per_group == 0) {
        xsum[m * (K / group_size) + b / blocks_per_group] = group_sum;
        group_sum = 0.f;
      }
    }
  }
}

// ---- the calls ----------------------------------------------------------------------------------

inline at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales_zeros, int64_t group_size,
                              const c10::optional<at::Tensor>& bias) {
  return int4_gemm<kTileRows, int16_t, Int4Tile, kInt16RowsPerPass>(
      "int4_linear", x, packed, scales_zeros, group_size, bias, x.size(1) / group_size,
      [](const auto* xp, auto... args) { quantize_rows_int16(xp, args...); });
}

inline at::Tensor int4_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                                   const at::Tensor& scales_zeros, int64_t group_size,
                                   const c10::optional<at::Tensor>& bias) {
  return int4_gemm<kTileRows, int8_t, Int4Int8Tile, kInt8RowsPerPass>(
      "int4_int8_linear", x, packed, scales_zeros, group_size, bias, x.size(1) / 32,
      [](const auto* xp, auto... args) { quantize_rows_int8(xp, args...); });
}

}  // namespace pagedserve
