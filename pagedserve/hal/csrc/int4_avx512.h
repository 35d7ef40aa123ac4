// The AVX-512 target's INT4 GEMMs over tiles of 16 rows: W4A16 through vdpbf16ps, W4A8 through
// VNNI's vpdpbusd.
//
// The INT4 layout, "tiles of 16": an [N, K] layer is N/16 tiles of 16 output rows. A tile stores
// K/8 chunks of 64 bytes, each holding k = 8c .. 8c+7 of its 16 rows as four k-pairs (see
// pack_tiles16 in int4.py for the byte order). Splitting a chunk's nibbles and interleaving each
// byte with 0x43 (vpunpck{l,h}bw) gives four vectors of 32 bf16 words in which word j is the pair
// element (row j/2, j%2) that one vdpbf16ps lane multiplies with a broadcast activation pair: the
// 16 lanes of the accumulator are the tile's 16 output rows, with no horizontal sum. Per tile and
// group: 16 fp16 scales then 16 fp16 (zero + 128).
#pragma once

#include "amx.h"
#include "int4_limits.h"
#include "vec.h"

namespace pagedserve {

// The INT4 layouts this target packs (int4.py): W4A16 and W4A8.
constexpr const char* kInt4Layout = "tiles16";
constexpr const char* kInt4A8Layout = "tiles16_a8";
constexpr int kTileRows = 16;


// One tile of 16 output rows for MB activation rows. x holds bf16 pairs as uint32; xsum the sum of
// each activation row's bf16 values per group. A code q becomes the bf16 number 128 + q when its
// byte gets 0x43 as the high byte (exact: bf16 steps by 1 in [128, 256)), so the products are
// exact and the kernel subtracts (zero + 128) * sum(x) per group instead of converting each code.
template <int MB, typename T>
inline void int4_tile(const uint8_t* w, const at::Half* sz, const uint32_t* x, int64_t x_stride,
                      const float* xsum, int64_t num_groups, int64_t group_size, const T* bias,
                      T* out, int64_t out_stride) {
  // A vdpbf16ps takes several cycles to finish: each row sums into four independent chains (one
  // per k-pair slot) so that the next product need not wait for the last. The chains are the same
  // for any MB, so a row's bits do not depend on the rows beside it in a pass (fp32 sums round,
  // unlike W4A8's integer ones): a decode row, and the same row verified beside drafts or batched
  // with other requests, get the same bits, and a seed the same tokens.
  constexpr int kChains = 4;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i bf16_128 = _mm512_set1_epi8(0x43);
  const int64_t chunks_per_group = group_size / 8;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 dot[MB][kChains];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < kChains; ++c) dot[m][c] = _mm512_setzero_ps();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      const __m512i codes = _mm512_loadu_si512(w + c * 64);
      const __m512i lo = _mm512_and_si512(codes, low_nibbles);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low_nibbles);
      const __m512bh pairs[4] = {(__m512bh)_mm512_unpacklo_epi8(lo, bf16_128),
                                 (__m512bh)_mm512_unpackhi_epi8(lo, bf16_128),
                                 (__m512bh)_mm512_unpacklo_epi8(hi, bf16_128),
                                 (__m512bh)_mm512_unpackhi_epi8(hi, bf16_128)};
      for (int m = 0; m < MB; ++m) {
        const uint32_t* xm = x + m * x_stride + 4 * c;
        for (int p = 0; p < 4; ++p)
          dot[m][p % kChains] = _mm512_dpbf16_ps(dot[m][p % kChains], pairs[p],
                                                 (__m512bh)_mm512_set1_epi32(xm[p]));
      }
    }
    const __m512 scale = vec::load(sz + g * 32).v;
    const __m512 zero128 = vec::load(sz + g * 32 + 16).v;
    for (int m = 0; m < MB; ++m) {
      __m512 d = dot[m][0];
      for (int c = 1; c < kChains; ++c) d = _mm512_add_ps(d, dot[m][c]);
      const __m512 xs = _mm512_set1_ps(xsum[m * num_groups + g]);
      acc[m] = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero128, xs, d), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) store_output(out + m * out_stride, Vec{acc[m]}, bias);
}

// Pointers to int4_tile<1..4, T>: one pass over a tile serves up to 4 activation rows (4 x 4
// chains, 4 accumulators and the unpacked codes stay in the 32 zmm registers). Passes of 8 rows
// in one chain each unpacked the codes half as often, 5-15% less time at 8-64 rows on a 2-core
// Zen 4, but one row needs its four chains (one chain: 10-30% more time) and every count of rows
// the same order; we keep the decode row fast (linear_paths_1b_avx512_zen4_gemv.json).
constexpr int kInt4RowsPerPass = 4;
template <typename T>
struct Int4Tiles {
  using Fn = void (*)(const uint8_t*, const at::Half*, const uint32_t*, int64_t, const float*,
                      int64_t, int64_t, const T*, T*, int64_t);
  static constexpr int kMaxRows = kInt4RowsPerPass;
  static constexpr Fn by_rows[kMaxRows + 1] = {nullptr, int4_tile<1, T>, int4_tile<2, T>,
                                               int4_tile<3, T>, int4_tile<4, T>};
};

// Every (tile of 16 output rows, pass of up to Tiles::kMaxRows activation rows) of an [M, N]
// product; the tiles are split between the threads.
template <typename Tiles, typename Pass>
void for_each_tile_pass(int64_t M, int64_t N, const Pass& pass) {
  at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = 0; m < M; m += Tiles::kMaxRows)
        pass(t, m, std::min<int64_t>(Tiles::kMaxRows, M - m));
  });
}

// x [M, K] -> bf16 pairs and per-group sums of the rounded values (group_size % 16 == 0).
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
    const uint8_t* w, const at::Half* sz, const BFloat16* xb, int64_t K, const float* xsum,
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
  const auto scale_group = [&](const at::Half* szt, int64_t g, const float* s) {
    const __m512 scale = vec::load(szt + g * 32).v;
    const __m512 zero128 = vec::load(szt + g * 32 + 16).v;
    for (int64_t m = 0; m < M; ++m) {
      const __m512 xs = _mm512_set1_ps(xsum[m * num_groups + g]);
      const __m512 d = _mm512_load_ps(s + m * 16);
      acc[m] = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero128, xs, d), acc[m]);
    }
  };
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * (K / 8) * 64;
    const at::Half* szt = sz + t * num_groups * 32;
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

inline at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& scales_zeros, int64_t group_size,
                          const c10::optional<at::Tensor>& bias) {
  check_int4("int4_linear", x, packed, group_size, kTileRows);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  const int64_t num_groups = K / group_size;
  thread_local std::vector<BFloat16> xb;
  thread_local std::vector<float> xsum;
  xb.resize(M * K);
  xsum.resize(M * num_groups);
  auto out = at::empty({M, N}, x.options());
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "int4_linear", [&] {
    prepare_activations(x.data_ptr<scalar_t>(), M, K, group_size, xb.data(), xsum.data());
    const auto* w = packed.data_ptr<uint8_t>();
    const auto* sz = scales_zeros.data_ptr<at::Half>();
    // (the buffers are this thread's: the workers get plain pointers)
    const auto* xp = reinterpret_cast<const uint32_t*>(xb.data());
    const float* xs = xsum.data();
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    // every count of rows up to 16 on the tile unit, one row too, so that a row's sums do not
    // depend on the rows beside it (int4_tile sums in another order than the tile unit): a
    // decode row and the same position verified beside drafts, or batched with other requests,
    // get the same bits. One row costs more there than in int4_tile, where the codes' unpacking
    // is the work and tile B's round trip through memory only adds to it (1408 x 256 in cache:
    // 31 us against 18 us, 2 threads; a whole demo-model step streams its weights from L3, and
    // loses less).
    // A prompt's rows take the same kernel 16 rows at a time (so a row's bits are still those of
    // a decode step), where a pass of int4_tile takes 4 and its products cost 16 times as many
    // instructions: each thread walks its output tiles four at a time, their codes in L1, over a
    // panel of rows that stays in L2. Up to 16 rows, one call takes all of the thread's tiles.
    if (amx::usable(std::min(M, amx::kMaxRows), K) && group_size % 32 == 0) {
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
      return;
    }
    for_each_tile_pass<Int4Tiles<scalar_t>>(M, N, [&](int64_t t, int64_t m, int64_t rows) {
      Int4Tiles<scalar_t>::by_rows[rows](w + t * (K / 8) * 64, sz + t * num_groups * 32,
                                         xp + m * K / 2, K / 2, xs + m * num_groups, num_groups,
                                         group_size, b ? b + t * 16 : nullptr, o + m * N + t * 16,
                                         N);
    });
  });
  return out;
}

// ---- W4A8: INT4 weights x int8 activations (VNNI) ------------------------------------------------
//
// The W4A8 mode quantizes each activation row to int8 on the fly (symmetric, one scale per row:
// amax / 127), so the products can be integer: vpdpbusd multiplies 64 unsigned codes with 64
// signed activation bytes per instruction, twice the multiply-adds of vdpbf16ps, and needs no
// conversion of the codes beyond splitting the nibbles. Layout "tiles16_a8" (pack_tiles16_a8 in
// int4.py): byte 4r + j of chunk c holds row r of the tile, k = 8c + j in its low nibble and
// k = 8c + 4 + j in its high one, so each 32-bit lane sums four products of one row.

template <int MB, typename T>
inline void int4_int8_tile(const uint8_t* w, const at::Half* sz, const int32_t* xq,
                           int64_t x_stride, const float* xqsum, const float* row_scale,
                           int64_t num_groups, int64_t group_size, const T* bias, T* out,
                           int64_t out_stride) {
  constexpr int kChains = MB == 1 ? 2 : 1;  // independent sums while a vpdpbusd finishes
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const int64_t chunks_per_group = group_size / 8;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512i dot[MB][2];
    for (int m = 0; m < MB; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      const __m512i codes = _mm512_loadu_si512(w + c * 64);
      const __m512i lo = _mm512_and_si512(codes, low_nibbles);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low_nibbles);
      for (int m = 0; m < MB; ++m) {
        const int32_t* xm = xq + m * x_stride + 2 * c;
        dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], lo, _mm512_set1_epi32(xm[0]));
        dot[m][kChains - 1] =
            _mm512_dpbusd_epi32(dot[m][kChains - 1], hi, _mm512_set1_epi32(xm[1]));
      }
    }
    const __m512 scale = vec::load(sz + g * 32).v;
    const __m512 zero = _mm512_sub_ps(vec::load(sz + g * 32 + 16).v, _mm512_set1_ps(128.f));
    for (int m = 0; m < MB; ++m) {
      const __m512i d = kChains == 2 ? _mm512_add_epi32(dot[m][0], dot[m][1]) : dot[m][0];
      const __m512 xs = _mm512_set1_ps(xqsum[m * num_groups + g]);
      acc[m] = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero, xs, _mm512_cvtepi32_ps(d)), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    store_output(out + m * out_stride, Vec{_mm512_mul_ps(acc[m], _mm512_set1_ps(row_scale[m]))}, bias);
}

template <typename T>
struct Int4Int8Tiles {
  using Fn = void (*)(const uint8_t*, const at::Half*, const int32_t*, int64_t, const float*,
                      const float*, int64_t, int64_t, const T*, T*, int64_t);
  static constexpr int kMaxRows = 8;  // 8 x 2 integer chains, exact sums in any pass
  static constexpr Fn by_rows[kMaxRows + 1] = {
      nullptr,
      int4_int8_tile<1, T>, int4_int8_tile<2, T>, int4_int8_tile<3, T>, int4_int8_tile<4, T>,
      int4_int8_tile<5, T>, int4_int8_tile<6, T>, int4_int8_tile<7, T>, int4_int8_tile<8, T>};
};

// x [M, K] -> int8 per row (round(x / scale), scale = max(amax, 1e-8) / 127, as
// quantize_activations_int8), the scales, and per-group sums of the int8 values.
template <typename T>
void quantize_rows_int8(const T* x, int64_t M, int64_t K, int64_t group_size, int8_t* xq,
                        float* row_scale, float* xqsum) {
  const int64_t num_groups = K / group_size;
  for (int64_t m = 0; m < M; ++m) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(vec::load(x + m * K + k).v));
    const float scale = std::max(_mm512_reduce_max_ps(amax), 1e-8f) / 127.f;
    row_scale[m] = scale;
    const __m512 s = _mm512_set1_ps(scale), lim = _mm512_set1_ps(127.f);
    for (int64_t g = 0; g < num_groups; ++g) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = m * K + g * group_size; k < m * K + (g + 1) * group_size; k += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(vec::load(x + k).v, s), _MM_FROUND_TO_NEAREST_INT);
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
        const __m512i qi = _mm512_cvtps_epi32(q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtepi32_epi8(qi));
        sum = _mm512_add_epi32(sum, qi);
      }
      xqsum[m * num_groups + g] = float(_mm512_reduce_add_epi32(sum));
    }
  }
}

inline at::Tensor int4_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scales_zeros, int64_t group_size,
                               const c10::optional<at::Tensor>& bias) {
  check_int4("int4_int8_linear", x, packed, group_size, kTileRows);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  const int64_t num_groups = K / group_size;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> row_scale, xqsum;
  xq.resize(M * K);
  row_scale.resize(M);
  xqsum.resize(M * num_groups);
  auto out = at::empty({M, N}, x.options());
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "int4_int8_linear", [&] {
    quantize_rows_int8(x.data_ptr<scalar_t>(), M, K, group_size, xq.data(), row_scale.data(),
                       xqsum.data());
    const auto* w = packed.data_ptr<uint8_t>();
    const auto* sz = scales_zeros.data_ptr<at::Half>();
    // (the buffers are this thread's: the workers get plain pointers)
    const auto* xp = reinterpret_cast<const int32_t*>(xq.data());
    const float* xs = xqsum.data();
    const float* rs = row_scale.data();
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    for_each_tile_pass<Int4Int8Tiles<scalar_t>>(M, N, [&](int64_t t, int64_t m, int64_t rows) {
      Int4Int8Tiles<scalar_t>::by_rows[rows](w + t * (K / 8) * 64, sz + t * num_groups * 32,
                                             xp + m * K / 4, K / 4, xs + m * num_groups, rs + m,
                                             num_groups, group_size, b ? b + t * 16 : nullptr,
                                             o + m * N + t * 16, N);
    });
  });
  return out;
}

}  // namespace pagedserve
