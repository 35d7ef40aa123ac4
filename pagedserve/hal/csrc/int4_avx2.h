// The AVX2 target's INT4 GEMMs over tiles of 8 output rows, both with integer products of the
// unsigned codes and the zero point applied once per group (int4_gemm.h walks them over an
// [M, N] product): W4A16 with int16 activations through vpmaddwd, and W4A8 with int8 activations
// per block of 32 values (llama.cpp's Q8_0) through vpmaddubsw summed in int16, then vpmaddwd;
// vpdpbusd and vpdpwssd where the CPU has AVX-VNNI (tests/hal/test_avx_vnni_emulated.py runs that
// branch on a CPU without it, the two instructions emulated).
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
// 2 registers a row). A pass over two tiles takes as many rows: its products' sums stay in
// registers, and the compiler keeps some of its float accumulators on the stack, which a pass
// touches once a block of 32 values.
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

// A pass's sums into out [M, N] (+ bias): Tiles tiles of 8 output rows from tile t, MB activation
// rows from row m0.
template <typename T, typename X, int Tiles, int MB>
void store_tiles(const Int4Operands<T, X>& op, int64_t t, int64_t m0,
                 const __m256 (&acc)[Tiles][MB]) {
  for (int j = 0; j < Tiles; ++j) {
    const T* bias = op.bias ? op.bias + (t + j) * kTileRows : nullptr;
    for (int m = 0; m < MB; ++m)
      store_output(op.out + (m0 + m) * op.N + (t + j) * kTileRows, Vec{acc[j][m]}, bias);
  }
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

// dot += the products of int16 code pairs with a broadcast activation pair, the add written in
// place as W4A8's is (add_products has why).
#if defined(__AVXVNNI__)
inline void add_pair_products(__m256i& dot, __m256i pairs, __m256i x) {
  dot = _mm256_dpwssd_avx_epi32(dot, pairs, x);
}
#else
inline void add_pair_products(__m256i& dot, __m256i pairs, __m256i x) {
  asm("vpaddd %1, %0, %0" : "+x"(dot) : "x"(_mm256_madd_epi16(pairs, x)));
}
#endif

// W4A16 passes of 8 rows and more take two tiles at once, as W4A8's do (kInt8TilePairsFromRows
// has why): with the add in place and the group size known when compiled, 1.10-1.17x the
// earlier one-tile kernel at 8 to 512 rows (~1B qkv and down, 2 threads, Zen 3, outputs
// identical), where one tile gains 1.02-1.11x.
constexpr int64_t kInt16TilePairsFromRows = 8;

// Tiles (1 or 2) tiles of 8 output rows from tile t, for MB activation rows from row m0.
template <int MB, typename T, int Tiles>
struct Int4Tiles {
  static void run(const Int4Operands<T, int16_t>& op, int64_t t, int64_t m0) {
    with_steps_per_group<8>(op.G, [&](auto steps) {
      run_groups<decltype(steps)::value>(op, t, m0);
    });
  }

  // k-pairs unpacked at once: all four of a chunk for one tile; for two, one at a time (the
  // registers then hold both tiles' codes and every row's sums).
  static constexpr int kPairsAtOnce = Tiles == 1 ? 4 : 1;

  // A group's chunks of 8 k as a count known when compiled (0: read from op.G).
  template <int ChunksPerGroup>
  static void run_groups(const Int4Operands<T, int16_t>& op, int64_t t, int64_t m0) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F), zero_bytes = _mm256_setzero_si256();
    const int64_t K = op.K, num_groups = K / op.G;
    const int64_t chunks_per_group = ChunksPerGroup ? ChunksPerGroup : op.G / 8;
    const uint8_t* w[Tiles];
    const uint8_t* sz[Tiles];
    for (int j = 0; j < Tiles; ++j) {
      w[j] = op.tile_codes(t + j, kTileRows);
      sz[j] = op.tile_scales(t + j, kTileRows);
    }
    // int16 pairs as int32
    const int32_t* x = reinterpret_cast<const int32_t*>(op.x + m0 * K);
    __m256 acc[Tiles][MB];
    for (int j = 0; j < Tiles; ++j)
      for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < num_groups; ++g) {
      __m256i dot[Tiles][MB];
      for (int j = 0; j < Tiles; ++j)
        for (int m = 0; m < MB; ++m) dot[j][m] = _mm256_setzero_si256();
      for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
        __m256i lo[Tiles], hi[Tiles];
        for (int j = 0; j < Tiles; ++j) {
          prefetch_weights(w[j] + c * 32, kPrefetchBytes);
          const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + c * 32));
          lo[j] = _mm256_and_si256(codes, low_nibbles);
          hi[j] = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_nibbles);
        }
        // int16 codes, lane r of pair p: row r at k = 8c + 2p, 8c + 2p + 1
        for (int p0 = 0; p0 < 4; p0 += kPairsAtOnce) {
          __m256i pairs[Tiles][kPairsAtOnce];
          for (int j = 0; j < Tiles; ++j)
            for (int i = 0; i < kPairsAtOnce; ++i) {
              const int p = p0 + i;
              const __m256i nibbles = p < 2 ? lo[j] : hi[j];
              pairs[j][i] = p % 2 ? _mm256_unpackhi_epi8(nibbles, zero_bytes)
                                  : _mm256_unpacklo_epi8(nibbles, zero_bytes);
            }
          for (int m = 0; m < MB; ++m)
            for (int i = 0; i < kPairsAtOnce; ++i) {
              const __m256i xp = _mm256_set1_epi32(x[m * K / 2 + 4 * c + p0 + i]);
              for (int j = 0; j < Tiles; ++j) add_pair_products(dot[j][m], pairs[j][i], xp);
            }
        }
      }
      for (int j = 0; j < Tiles; ++j) {
        const GroupScales s = group_scales(sz[j], g);
        for (int m = 0; m < MB; ++m) {
          const int64_t i = (m0 + m) * num_groups + g;
          const __m256 d = _mm256_fnmadd_ps(s.scaled_zero, _mm256_set1_ps(op.xsum[i]),
                                            _mm256_mul_ps(s.scale, _mm256_cvtepi32_ps(dot[j][m])));
          acc[j][m] = _mm256_fmadd_ps(_mm256_set1_ps(op.xscale[i]), d, acc[j][m]);
        }
      }
    }
    store_tiles(op, t, m0, acc);
  }
};
template <int MB, typename T>
using Int4Tile = Int4Tiles<MB, T, 1>;
template <int MB, typename T>
using Int4TilePair = Int4Tiles<MB, T, 2>;

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

// acc += the products of a chunk's codes (8 k of a tile's 8 rows, their low or high nibbles) with
// broadcast int8 activations. Without AVX-VNNI: vpmaddubsw multiplies the unsigned codes (0..15)
// with the signed activations and adds pairs into 16 int16 lanes; the eight of a block of 32 fit
// in int16 (8 x 2 x 15 x 127 < 2^15) before vpmaddwd widens them to the 8 rows. The add is
// written in place: given the intrinsic (which returns a new sum), GCC kept each row's sum in two
// registers and copied it across on every chunk (seen in the code it generated). With AVX-VNNI:
// vpdpbusd does all three steps into the 8 int32 lanes.
#if defined(__AVXVNNI__)
inline void add_products(__m256i& acc, __m256i codes, __m256i x) {
  acc = _mm256_dpbusd_avx_epi32(acc, codes, x);
}
inline __m256 block_sums_to_float(__m256i sums) { return _mm256_cvtepi32_ps(sums); }
#else
inline void add_products(__m256i& acc16, __m256i codes, __m256i x) {
  asm("vpaddw %1, %0, %0" : "+x"(acc16) : "x"(_mm256_maddubs_epi16(codes, x)));
}
inline __m256 block_sums_to_float(__m256i sums16) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums16, _mm256_set1_epi16(1)));
}
#endif

// W4A8 passes of 8 rows and more take two tiles at once, so that each broadcast activation feeds
// 16 output rows, not 8: on Zen 3 a vpbroadcastd from memory takes a vector pipe as the products
// do. With the add in place and the group size known when compiled: 1.19-1.38x the earlier
// one-tile kernel at 8 to 512 rows (~1B qkv and down, 2 threads, Zen 3, same codes in turn,
// outputs identical), where one tile gains 1.12-1.25x. At 8 rows two tiles ran 0.97-1.08x one;
// fewer rows keep one tile.
constexpr int64_t kInt8TilePairsFromRows = 8;

// Tiles (1 or 2) tiles of 8 output rows from tile t, for MB activation rows from row m0: per block
// of 32 values, each row's integer sums times the weights' scale and the block's; the zero point
// once per group, as scale * zero * (the group's scaled activation sum). A row's float steps are
// the same whatever the tiles and rows beside it.
template <int MB, typename T, int Tiles>
struct Int4Int8Tiles {
  static void run(const Int4Operands<T, int8_t>& op, int64_t t, int64_t m0) {
    with_steps_per_group<32>(op.G, [&](auto steps) {
      run_groups<decltype(steps)::value>(op, t, m0);
    });
  }

  // A group's blocks of 32 values as a count known when compiled (0: read from op.G): at group 32
  // the loop over one block is then no loop at all.
  template <int BlocksPerGroup>
  static void run_groups(const Int4Operands<T, int8_t>& op, int64_t t, int64_t m0) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    const int64_t K = op.K, num_groups = K / op.G;
    const int64_t blocks_per_group = BlocksPerGroup ? BlocksPerGroup : op.G / 32;
    const uint8_t* w[Tiles];
    const uint8_t* sz[Tiles];
    for (int j = 0; j < Tiles; ++j) {
      w[j] = op.tile_codes(t + j, kTileRows);
      sz[j] = op.tile_scales(t + j, kTileRows);
    }
    __m256 acc[Tiles][MB];
    for (int j = 0; j < Tiles; ++j)
      for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < num_groups; ++g) {
      GroupScales s[Tiles];
      for (int j = 0; j < Tiles; ++j) s[j] = group_scales(sz[j], g);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        __m256i sums[Tiles][MB];
        for (int j = 0; j < Tiles; ++j)
          for (int m = 0; m < MB; ++m) sums[j][m] = _mm256_setzero_si256();
        for (int64_t c = 4 * b; c < 4 * b + 4; ++c) {
          __m256i lo[Tiles], hi[Tiles];
          for (int j = 0; j < Tiles; ++j) {
            prefetch_weights(w[j] + c * 32, kPrefetchBytes);
            const __m256i codes =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + c * 32));
            lo[j] = _mm256_and_si256(codes, low_nibbles);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_nibbles);
          }
          for (int m = 0; m < MB; ++m) {
            // the row's 8 activations of the chunk: k 0..3 against the low nibbles, 4..7 the high
            const int32_t* x = reinterpret_cast<const int32_t*>(op.x + (m0 + m) * K + 8 * c);
            const __m256i x_lo = _mm256_set1_epi32(x[0]), x_hi = _mm256_set1_epi32(x[1]);
            for (int j = 0; j < Tiles; ++j) add_products(sums[j][m], lo[j], x_lo);
            for (int j = 0; j < Tiles; ++j) add_products(sums[j][m], hi[j], x_hi);
          }
        }
        for (int m = 0; m < MB; ++m) {
          const __m256 xscale = _mm256_set1_ps(op.xscale[(m0 + m) * K / 32 + b]);
          for (int j = 0; j < Tiles; ++j)
            acc[j][m] = _mm256_fmadd_ps(_mm256_mul_ps(s[j].scale, xscale),
                                        block_sums_to_float(sums[j][m]), acc[j][m]);
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 xsum = _mm256_set1_ps(op.xsum[(m0 + m) * num_groups + g]);
        for (int j = 0; j < Tiles; ++j)
          acc[j][m] = _mm256_fnmadd_ps(s[j].scaled_zero, xsum, acc[j][m]);
      }
    }
    store_tiles(op, t, m0, acc);
  }
};
template <int MB, typename T>
using Int4Int8Tile = Int4Int8Tiles<MB, T, 1>;
template <int MB, typename T>
using Int4Int8TilePair = Int4Int8Tiles<MB, T, 2>;

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

inline at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scales_zeros, int64_t group_size,
                               const c10::optional<at::Tensor>& bias) {
  return int4_gemm<kTileRows, int16_t, Int4Tile, kInt16RowsPerPass, Int4TilePair>(
      "int4_linear", x, packed, scales_zeros, group_size, bias, x.size(1) / group_size,
      [](const auto* xp, auto... args) { quantize_rows_int16(xp, args...); },
      x.size(0) >= kInt16TilePairsFromRows);
}

inline at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales_zeros, int64_t group_size,
                              const c10::optional<at::Tensor>& bias) {
  return int4_gemm<kTileRows, int8_t, Int4Int8Tile, kInt8RowsPerPass, Int4Int8TilePair>(
      "int4_int8_linear", x, packed, scales_zeros, group_size, bias, x.size(1) / 32,
      [](const auto* xp, auto... args) { quantize_rows_int8(xp, args...); },
      x.size(0) >= kInt8TilePairsFromRows);
}

}  // namespace pagedserve
