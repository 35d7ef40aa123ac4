// The AVX-512 target's INT4 GEMMs over tiles of 16 output rows, both with integer products,
// walked over an [M, N] product by int4_gemm.h: W4A16 with int16 activations through VNNI's
// vpdpwssd, W4A8 with int8 activations per block of 32 values (llama.cpp's Q8_0) through vpdpbusd.
// On a CPU with the AMX tile unit, W4A16 takes its bf16 tiles instead (below).
//
// The INT4 layout, "tiles of 16": an [N, K] layer is N/16 tiles of 16 output rows. A tile stores
// K/8 chunks of 64 bytes, each holding k = 8c .. 8c+7 of its 16 rows as four k-pairs (see
// pack_tiles16 in int4.py for the byte order). Splitting a chunk's nibbles and interleaving each
// byte with a zero byte (vpunpck{l,h}bw) gives four vectors of 16 int32 lanes, lane r holding row
// r's two codes of one k-pair as int16; less the row's zero point, one vpdpwssd with a broadcast
// activation pair adds two products (q - z) * x to each of the 16 rows, with no horizontal sum.
// (The tile unit's pass interleaves them with 0x43 instead, which makes each code the bf16 number
// 128 + q.) Layout "tiles16_a8" (W4A8, pack_tiles16_a8): byte 4r + j of chunk c holds row r,
// k = 8c + j in its low nibble and k = 8c + 4 + j in its high one, so each 32-bit lane of a
// vpdpbusd sums four products of row r, of the unsigned codes: the zero point comes in once per
// group, times the activations' sum.
// Per tile and group: 16 fp16 scales then 16 one-byte zero points.
#pragma once

#include "amx.h"
#include "int4_gemm.h"
#include "int4_limits.h"
#include "vec.h"

namespace pagedserve {

// The INT4 layouts this target packs (int4.py): W4A16 and W4A8.
constexpr const char* kInt4Layout = "tiles16";
constexpr const char* kInt4A8Layout = "tiles16_a8";
constexpr int kTileRows = 16;
// Activation rows a pass over a tile serves: their sums and accumulators beside the unpacked codes
// in the 32 zmm registers (W4A16: 4 code vectors, W4A8: 2; 2 registers a row).
constexpr int kInt16RowsPerPass = 8;
constexpr int kInt8RowsPerPass = 8;

// A tile's 16 fp16 scales and 16 one-byte zero points of group g (48 bytes a group): (scale,
// zero, scale * zero).
constexpr int64_t kGroupBytes = 3 * kTileRows;
struct GroupScales {
  __m512 scale, zero, scaled_zero;
};
// The group's 16 zero points, one int32 lane a row.
inline __m512i group_zeros(const uint8_t* sz, int64_t g) {
  return _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * kGroupBytes + 2 * kTileRows)));
}
inline GroupScales group_scales(const uint8_t* sz, int64_t g) {
  const __m512 scale = vec::load(reinterpret_cast<const Half*>(sz + g * kGroupBytes)).v;
  const __m512 zero = _mm512_cvtepi32_ps(group_zeros(sz, g));
  return {scale, zero, _mm512_mul_ps(scale, zero)};
}

// Group g's 16 zero points as int16 pairs, lane r holding row r's twice: what a chunk's unpacked
// code pairs lose to become the signed q - z.
inline __m512i group_zero_pairs(const uint8_t* sz, int64_t g) {
  const __m512i zero = group_zeros(sz, g);
  return _mm512_or_si512(zero, _mm512_slli_epi32(zero, 16));
}

// How far ahead of the chunk being multiplied its thread asks for weight bytes (int4_avx2.h has
// why). Each tile's codes are read from memory by its first pass of rows and from cache by the
// others: with the hardware prefetchers alone, that first pass waited on memory at every 4 KiB
// page, and an 8-row pass over a ~1B layer's tiles ran at half the speed of the same pass from
// cache. 4 KiB ahead measured fastest of 512 B to 16 KiB, at 1 to 512 rows (Zen 5).
constexpr int64_t kPrefetchBytes = 4096;

// A vpdpwssd or vpdpbusd takes several cycles to finish (vpdpwssd on Zen 5: 4, two a cycle; 8
// chains of sums in flight keep it busy only when nothing else waits), so a row's products go
// into more than one chain where the registers allow, and the next product need not wait for the
// last (the sums are integers: the split changes no bit). W4A16: two a row up to 8 rows of one
// tile, 16 in all (two tiles a pass have 16 chains, one a row and tile). W4A8, with half the
// products a chunk: two for one or two rows (more ran slower).
template <int MB, int Tiles = 1>
constexpr int kInt16Chains = Tiles == 1 && MB <= 8 ? 2 : 1;
template <int MB>
constexpr int kInt8Chains = MB <= 2 ? 2 : 1;

// W4A16 passes of many rows take two tiles at once: each broadcast activation pair then feeds 32
// output rows, not 16 (the unpacking is per tile either way). In-process A/B on the same codes
// (outputs identical), Zen 5, 2 threads: 512 rows 1.02-1.05x (~1B layers), 1.05-1.08x (~122M),
// 64-128 rows 1.00-1.06x. Where a tile's first pass, which reads its codes from memory, weighs
// more, two streams of codes wait longer than one: 16-48 rows ran at 0.84-1.00x, and so did
// lm_head's 32,000 rows at 64-512 rows (0.90-0.98x on ~122M, 6 MiB of codes a thread, which the
// caches do not keep from one panel of rows to the next; 0.98-1.00x on ~1B, 16 MiB).
constexpr int64_t kInt16TilePairsFromRows = 64;
constexpr int64_t kInt16TilePairsMaxBytesPerThread = int64_t{4} << 20;

inline bool int16_tile_pairs(int64_t M, int64_t N, int64_t K) {
  return M >= kInt16TilePairsFromRows &&
         N * K / 2 / at::get_num_threads() <= kInt16TilePairsMaxBytesPerThread;
}

// acc += the products, in acc's own register. Given the intrinsics (which return a new sum), GCC
// kept each chain's sum in two registers, copying it across on every chunk (seen in the code it
// generated for one chain a row), and two chains a row at 8 rows ran 12% slower than one; with
// these they run 5% faster (W4A16, 32 to 512 rows, ~1B layers). W4A8's chains gain 2-4%.
inline void dpwssd_in_place(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}
inline void dpbusd_in_place(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// ---- W4A16: 16-bit integer activations (int4_avx2.h has why), integer products -------------------

// Tiles (1 or 2) tiles of 16 output rows from tile t, for MB activation rows from row m0.
template <int MB, typename T, int Tiles>
struct Int4Tiles {
  static void run(const Int4Operands<T, int16_t>& op, int64_t t, int64_t m0) {
    with_steps_per_group<8>(op.G, [&](auto steps) {
      run_groups<decltype(steps)::value>(op, t, m0);
    });
  }

  // k-pairs unpacked at once: all four of a chunk for one tile; for two, one at a time (eight
  // would leave too few of the 32 registers for the 16 sums: 0.85x of one tile, spilled).
  static constexpr int kPairsAtOnce = Tiles == 1 ? 4 : 1;

  // A group's chunks of 8 k as a count known when compiled (0: read from op.G): 2-3% faster at
  // 32 and 512 rows than the count read at run time (~1B layers, same codes, in turn).
  template <int ChunksPerGroup>
  static void run_groups(const Int4Operands<T, int16_t>& op, int64_t t, int64_t m0) {
    constexpr int C = kInt16Chains<MB, Tiles>;
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F), zero_bytes = _mm512_setzero_si512();
    const int64_t K = op.K, num_groups = K / op.G;
    const int64_t chunks_per_group = ChunksPerGroup ? ChunksPerGroup : op.G / 8;
    const uint8_t* w[Tiles];
    const uint8_t* sz[Tiles];
    for (int j = 0; j < Tiles; ++j) {
      w[j] = op.tile_codes(t + j, kTileRows);
      sz[j] = op.tile_scales(t + j, kTileRows);
    }
    const int32_t* x = reinterpret_cast<const int32_t*>(op.x + m0 * K);  // int16 pairs
    __m512 acc[Tiles][MB];
    for (int j = 0; j < Tiles; ++j)
      for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < num_groups; ++g) {
      __m512i zeros[Tiles];
      for (int j = 0; j < Tiles; ++j) zeros[j] = group_zero_pairs(sz[j], g);
      __m512i dot[Tiles][MB][C];
      for (int j = 0; j < Tiles; ++j)
        for (int m = 0; m < MB; ++m)
          for (int c = 0; c < C; ++c) dot[j][m][c] = _mm512_setzero_si512();
      for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
        __m512i lo[Tiles], hi[Tiles];
        for (int j = 0; j < Tiles; ++j) {
          prefetch_weights(w[j] + c * 64, kPrefetchBytes);
          const __m512i codes = _mm512_loadu_si512(w[j] + c * 64);
          lo[j] = _mm512_and_si512(codes, low_nibbles);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low_nibbles);
        }
        // The chunk's four k-pairs as int16 less the zero points, kPairsAtOnce at a time, each
        // times every row's activation pair.
        for (int p0 = 0; p0 < 4; p0 += kPairsAtOnce) {
          __m512i pairs[Tiles][kPairsAtOnce];
          for (int j = 0; j < Tiles; ++j)
            for (int i = 0; i < kPairsAtOnce; ++i) {
              const int p = p0 + i;
              const __m512i nibbles = p < 2 ? lo[j] : hi[j];
              pairs[j][i] = _mm512_sub_epi16(p % 2 ? _mm512_unpackhi_epi8(nibbles, zero_bytes)
                                                   : _mm512_unpacklo_epi8(nibbles, zero_bytes),
                                             zeros[j]);
            }
          for (int m = 0; m < MB; ++m)
            for (int i = 0; i < kPairsAtOnce; ++i) {
              const __m512i xp = _mm512_set1_epi32(x[m * K / 2 + 4 * c + p0 + i]);
              for (int j = 0; j < Tiles; ++j)
                dpwssd_in_place(dot[j][m][(p0 + i) % C], pairs[j][i], xp);
            }
        }
      }
      for (int j = 0; j < Tiles; ++j) {
        const __m512 scale = group_scales(sz[j], g).scale;
        for (int m = 0; m < MB; ++m) {
          const __m512i d = C == 2 ? _mm512_add_epi32(dot[j][m][0], dot[j][m][1]) : dot[j][m][0];
          const int64_t i = (m0 + m) * num_groups + g;
          acc[j][m] = _mm512_fmadd_ps(_mm512_set1_ps(op.xscale[i]),
                                      _mm512_mul_ps(scale, _mm512_cvtepi32_ps(d)), acc[j][m]);
        }
      }
    }
    for (int j = 0; j < Tiles; ++j) {
      const T* bias = op.bias ? op.bias + (t + j) * kTileRows : nullptr;
      for (int m = 0; m < MB; ++m)
        store_output(op.out + (m0 + m) * op.N + (t + j) * kTileRows, Vec{acc[j][m]}, bias);
    }
  }
};
template <int MB, typename T>
using Int4Tile = Int4Tiles<MB, T, 1>;
template <int MB, typename T>
using Int4TilePair = Int4Tiles<MB, T, 2>;

// x rows [m0, m1) -> int16 per (row, group) with a power-of-two scale (as int4_avx2.h), and the
// scales. (No sums: the tiles take the zero points out of the codes.)
template <typename T>
void quantize_rows_int16(const T* x, int64_t m0, int64_t m1, int64_t K, int64_t group_size,
                         int16_t* xi, float* xscale) {
  const int64_t num_groups = K / group_size;
  const __m512 lim = _mm512_set1_ps(32767.f);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t k0 = m * K + g * group_size, k1 = k0 + group_size;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = k0; k < k1; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(vec::load(x + k).v));
      int e = 0;
      std::frexp(_mm512_reduce_max_ps(amax), &e);  // largest < 2^e (0 for an all-zero group)
      const __m512 inv = _mm512_set1_ps(std::ldexp(1.f, 15 - e));  // exact: a power of two
      for (int64_t k = k0; k < k1; k += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(vec::load(x + k).v, inv), _MM_FROUND_TO_NEAREST_INT);
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
        const __m512i qi = _mm512_cvtps_epi32(q);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xi + k), _mm512_cvtepi32_epi16(qi));
      }
      xscale[m * num_groups + g] = std::ldexp(1.f, e - 15);
    }
}

// ---- W4A8: int8 activations per block of 32 (int4_avx2.h has the scheme), VNNI ------------------

// One tile of 16 output rows for MB activation rows from row m0.
template <int MB, typename T>
struct Int4Int8Tile {
  static void run(const Int4Operands<T, int8_t>& op, int64_t t, int64_t m0) {
    constexpr int C = kInt8Chains<MB>;
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    const int64_t K = op.K, num_groups = K / op.G, blocks_per_group = op.G / 32;
    const uint8_t* w = op.tile_codes(t, kTileRows);
    const uint8_t* sz = op.tile_scales(t, kTileRows);
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < num_groups; ++g) {
      const GroupScales s = group_scales(sz, g);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        __m512i dot[MB][C];
        for (int m = 0; m < MB; ++m)
          for (int c = 0; c < C; ++c) dot[m][c] = _mm512_setzero_si512();
        for (int64_t c = 4 * b; c < 4 * b + 4; ++c) {
          prefetch_weights(w + c * 64, kPrefetchBytes);
          const __m512i codes = _mm512_loadu_si512(w + c * 64);
          const __m512i lo = _mm512_and_si512(codes, low_nibbles);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low_nibbles);
          for (int m = 0; m < MB; ++m) {
            const int32_t* xm = reinterpret_cast<const int32_t*>(op.x + (m0 + m) * K + 8 * c);
            dpbusd_in_place(dot[m][0], lo, _mm512_set1_epi32(xm[0]));
            dpbusd_in_place(dot[m][C - 1], hi, _mm512_set1_epi32(xm[1]));
          }
        }
        for (int m = 0; m < MB; ++m) {
          const __m512i d = C == 2 ? _mm512_add_epi32(dot[m][0], dot[m][1]) : dot[m][0];
          const __m512 scale = _mm512_mul_ps(s.scale, _mm512_set1_ps(op.xscale[(m0 + m) * K / 32 + b]));
          acc[m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(d), acc[m]);
        }
      }
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_fnmadd_ps(s.scaled_zero, _mm512_set1_ps(op.xsum[(m0 + m) * num_groups + g]),
                                  acc[m]);
    }
    const T* bias = op.bias ? op.bias + t * kTileRows : nullptr;
    for (int m = 0; m < MB; ++m)
      store_output(op.out + (m0 + m) * op.N + t * kTileRows, Vec{acc[m]}, bias);
  }
};

// x rows [m0, m1) -> int8 per block of 32 (as int4.quantize_activations_int8), each block's
// scale, and per group the sum over its blocks of scale * sum(int8).
template <typename T>
void quantize_rows_int8(const T* x, int64_t m0, int64_t m1, int64_t K, int64_t group_size,
                        int8_t* xq, float* xscale, float* xsum) {
  const int64_t blocks = K / 32, blocks_per_group = group_size / 32;
  const __m512 lim = _mm512_set1_ps(127.f);
  for (int64_t m = m0; m < m1; ++m) {
    float group_sum = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = m * K + 32 * b;
      const __m512 v[2] = {vec::load(x + k0).v, vec::load(x + k0 + 16).v};
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      const __m512 s = _mm512_set1_ps(std::max(amax, 1e-8f) / 127.f);
      __m512i sum = _mm512_setzero_si512();
      for (int i = 0; i < 2; ++i) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v[i], s), _MM_FROUND_TO_NEAREST_INT);
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
        const __m512i qi = _mm512_cvtps_epi32(q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k0 + 16 * i), _mm512_cvtepi32_epi8(qi));
        sum = _mm512_add_epi32(sum, qi);
      }
      const float scale = std::max(amax, 1e-8f) / 127.f;
      xscale[m * blocks + b] = scale;
      group_sum += scale * float(_mm512_reduce_add_epi32(sum));
      if ((b + 1) % blocks_per_group == 0) {
        xsum[m * (K / group_size) + b / blocks_per_group] = group_sum;
        group_sum = 0.f;
      }
    }
  }
}

// ---- W4A16 on the AMX tile unit ------------------------------------------------------------------

// x [M, K] -> bf16 and per-group sums of the rounded values, for the tile unit's pass.
template <typename T>
void prepare_activations(const T* x, int64_t M, int64_t K, int64_t group_size, BFloat16* xb,
                         float* xsum) {
  const int64_t num_groups = K / group_size;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = m * K + g * group_size; k < m * K + (g + 1) * group_size; k += 16) {
        const Vec rounded = round_to<BFloat16>(vec::load(x + k));
        vec::store(xb + k, rounded);
        sum = _mm512_add_ps(sum, rounded.v);
      }
      xsum[m * num_groups + g] = _mm512_reduce_add_ps(sum);
    }
}

// W4A16 on the AMX tile unit (amx.h) for up to 16 activation rows at once, over tiles [t0, t1).
// The unpacked codes of the four chunks of 32 values of K (bf16 numbers 128 + q, as int4_tile
// makes them) are already tile B's layout: 16 pairs along K, each holding the 16 output rows'
// pairs. The bf16 rows of x are tile A as they are (row stride K), and tile C's M x 16 sums of a
// group get the group's scale and zero as int4_tile applies them. One TDPBF16PS replaces the
// M x 16 vdpbf16ps of int4_tile, so extra rows cost little (16 rows of 1408 x 256 in 50 us
// against 181 us, 2 threads).
template <typename T>
__attribute__((target("amx-tile,amx-bf16"))) void int4_tiles_amx(
    const uint8_t* w, const uint8_t* sz, const BFloat16* xb, int64_t K, const float* xsum,
    int64_t num_groups, int64_t group_size, int64_t M, int64_t t0, int64_t t1, const T* bias,
    T* out, int64_t N) {
  amx::TileConfig config;
  config.rows[0] = M, config.colsb[0] = 64;   // C: M rows x 16 outputs, fp32
  config.rows[1] = M, config.colsb[1] = 64;   // A: M rows x 32 bf16 of x
  config.rows[2] = 16, config.colsb[2] = 64;  // B: 16 pairs along K x 16 outputs
  _tile_loadconfig(&config);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), bf16_128 = _mm512_set1_epi8(0x43);
  // A tile load of data just stored waits for the stores, and so does a read of a tile just
  // stored: the codes of the next 32 values are unpacked while the tile unit takes the last, and
  // a group's sums are scaled after the next group's products are issued (two buffers each).
  alignas(64) uint8_t codes_tile[2][1024];
  alignas(64) float sums[2][amx::kMaxRows * 16];
  __m512 acc[amx::kMaxRows];
  const auto unpack = [&](const uint8_t* wt, int64_t k, uint8_t* tile) {
    for (int q = 0; q < 4; ++q) {  // chunk k / 8 + q: pairs 4q .. 4q + 3 of tile B
      const __m512i codes = _mm512_loadu_si512(wt + (k / 8 + q) * 64);
      const __m512i lo = _mm512_and_si512(codes, low_nibbles);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low_nibbles);
      uint8_t* row = tile + q * 4 * 64;
      _mm512_store_si512(row, _mm512_unpacklo_epi8(lo, bf16_128));
      _mm512_store_si512(row + 64, _mm512_unpackhi_epi8(lo, bf16_128));
      _mm512_store_si512(row + 128, _mm512_unpacklo_epi8(hi, bf16_128));
      _mm512_store_si512(row + 192, _mm512_unpackhi_epi8(hi, bf16_128));
    }
  };
  const auto scale_group = [&](const uint8_t* szt, int64_t g, const float* s) {
    const GroupScales group = group_scales(szt, g);
    // the tile unit's codes are the bf16 numbers 128 + q
    const __m512 scale = group.scale, zero128 = _mm512_add_ps(group.zero, _mm512_set1_ps(128.f));
    for (int64_t m = 0; m < M; ++m) {
      const __m512 xs = _mm512_set1_ps(xsum[m * num_groups + g]);
      const __m512 d = _mm512_load_ps(s + m * 16);
      acc[m] = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero128, xs, d), acc[m]);
    }
  };
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * (K / 8) * 64;
    const uint8_t* szt = sz + t * num_groups * kGroupBytes;
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    unpack(wt, 0, codes_tile[0]);
    for (int64_t g = 0; g < num_groups; ++g) {
      _tile_zero(0);
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 32) {
        const int64_t step = k / 32;
        if (k + 32 < K) unpack(wt, k + 32, codes_tile[(step + 1) & 1]);
        _tile_loadd(1, xb + k, K * sizeof(BFloat16));
        _tile_loadd(2, codes_tile[step & 1], 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sums[g & 1], 64);
      if (g > 0) scale_group(szt, g - 1, sums[(g - 1) & 1]);
    }
    scale_group(szt, num_groups - 1, sums[(num_groups - 1) & 1]);
    for (int64_t m = 0; m < M; ++m)
      store_output(out + m * N + t * 16, Vec{acc[m]}, bias ? bias + t * 16 : nullptr);
  }
  _tile_release();
}

inline at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scales_zeros, int64_t group_size,
                               const c10::optional<at::Tensor>& bias) {
  // On the tile unit: every count of rows, one row too, so that a row's sums do not depend on
  // the rows beside it (the vector pass rounds its activations otherwise): a decode row and the
  // same position verified beside drafts, or batched with other requests, get the same bits. One
  // row costs more there than in a vector pass, where the codes' unpacking is the work and tile
  // B's round trip through memory only adds to it (1408 x 256 in cache: 31 us against 18 us, 2
  // threads; a whole demo-model step streams its weights from L3, and loses less). A prompt's
  // rows take the same kernel 16 rows at a time: each thread walks its output tiles four at a
  // time, their codes in L1, over a panel of rows that stays in L2. Up to 16 rows, one call
  // takes all of the thread's tiles.
  const int64_t M = x.size(0), K = x.size(1);
  if (!(amx::usable(std::min(M, amx::kMaxRows), K) && group_size % 32 == 0))
    return int4_gemm<kTileRows, int16_t, Int4Tile, kInt16RowsPerPass, Int4TilePair>(
        "int4_linear", x, packed, scales_zeros, group_size, bias, K / group_size,
        [](const auto* xp, int64_t m0, int64_t m1, int64_t K, int64_t G, int16_t* xq,
           float* xscale, float* /*xsum*/) { quantize_rows_int16(xp, m0, m1, K, G, xq, xscale); },
        int16_tile_pairs(M, packed.size(0) * kTileRows, K));
  check_int4("int4_linear", x, packed, scales_zeros, group_size, kTileRows);
  const int64_t N = packed.size(0) * kTileRows, num_groups = K / group_size;
  thread_local std::vector<BFloat16> xb;
  thread_local std::vector<float> xsum;
  xb.resize(M * K);
  xsum.resize(M * num_groups);
  auto out = at::empty({M, N}, x.options());
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "int4_linear", [&] {
    prepare_activations(x.data_ptr<scalar_t>(), M, K, group_size, xb.data(), xsum.data());
    const auto* w = packed.data_ptr<uint8_t>();
    const auto* sz = scales_zeros.data_ptr<uint8_t>();
    // (the buffers are this thread's: the workers get plain pointers)
    const float* xs = xsum.data();
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    const int64_t tiles_at_once = M <= amx::kMaxRows ? N / 16 : 4;
    const BFloat16* xrows = xb.data();
    at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t p0 = 0; p0 < M; p0 += amx::kPanelRows)
        for (int64_t c0 = t0; c0 < t1; c0 += tiles_at_once)
          for (int64_t m0 = p0; m0 < std::min(M, p0 + amx::kPanelRows); m0 += amx::kMaxRows)
            int4_tiles_amx(w, sz, xrows + m0 * K, K, xs + m0 * num_groups, num_groups,
                           group_size, std::min(amx::kMaxRows, M - m0), c0,
                           std::min(t1, c0 + tiles_at_once), b, o + m0 * N, N);
    });
  });
  return out;
}

inline at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales_zeros, int64_t group_size,
                              const c10::optional<at::Tensor>& bias) {
  return int4_gemm<kTileRows, int8_t, Int4Int8Tile, kInt8RowsPerPass>(
      "int4_int8_linear", x, packed, scales_zeros, group_size, bias, x.size(1) / 32,
      [](const auto* xp, auto... args) { quantize_rows_int8(xp, args...); });
}

}  // namespace pagedserve
