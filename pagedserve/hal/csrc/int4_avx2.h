// The AVX2 target's INT4 GEMMs over tiles of 8 output rows, both with integer products of the
// unsigned codes and the zero point applied per group: W4A16 with int16 activations through
// vpmaddwd, and W4A8 with int8 activations through vpmaddubsw + vpmaddwd (llama.cpp's Q4_0 x Q8_0
// scheme), vpdpbusd where the CPU has AVX-VNNI.
//
// Layout "tiles8" (W4A16, pack_tiles8 in int4.py): a tile's K/8 chunks of 32 bytes each hold
// k = 8c .. 8c+7 of its 8 rows; splitting a chunk's nibbles and interleaving each byte with a zero
// byte (vpunpck{l,h}bw, within 128-bit halves) gives four vectors of int16 code pairs in which
// 32-bit lane r is row r at two adjacent k, so one vpmaddwd with a broadcast activation pair adds
// two products to each of the 8 rows, with no horizontal sum.
// Layout "tiles8_a8" (W4A8, pack_tiles8_a8): byte 4r + j of chunk c holds row r, k = 8c + j in its
// low nibble and k = 8c + 4 + j in its high one, so each 32-bit lane sums four products of row r.
// Both: per tile and group, 8 fp16 scales then 8 fp16 zero points plus 128.
#pragma once

#include "int4_limits.h"
#include "vec.h"

namespace pagedserve {

constexpr const char* kInt4Layout = "tiles8";
constexpr const char* kInt4A8Layout = "tiles8_a8";
constexpr int kTileRows = 8;
// Rows of activations one pass over a tile serves: their accumulators and the unpacked codes
// share the 16 ymm registers.
constexpr int kMaxRowsPerPass = 4;
// How far ahead of the chunk being multiplied its thread asks for weight bytes. A decode step
// streams every weight from memory once, and the hardware prefetchers stop at each 4 KiB page,
// so without this every page starts with a wait; 1 KiB ahead measured fastest of 256 B to 2 KiB at
// one and four rows on Zen 3 (a 64 B line is asked for twice, once per 32 B chunk: one more
// instruction per chunk costs less than a second counter).
constexpr int64_t kPrefetchBytes = 1024;

inline void prefetch_weights(const uint8_t* chunk) {
  _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes), _MM_HINT_T0);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Every (tile, pass of up to kMaxRowsPerPass activation rows) of an [M, N] product; the tiles are
// split between the threads.
template <typename Pass>
void for_each_tile_pass(int64_t M, int64_t N, const Pass& pass) {
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = 0; m < M; m += kMaxRowsPerPass)
        pass(t, m, std::min<int64_t>(kMaxRowsPerPass, M - m));
  });
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

// One tile of 8 output rows for MB activation rows: xi holds int16 pairs as int32 (row stride
// x_stride pairs), xscale and xsum each row's per-group scale and sum of its int16 values.
template <int MB, typename T>
inline void int4_tile(const uint8_t* w, const Half* sz, const int32_t* xi, int64_t x_stride,
                      const float* xscale, const float* xsum, int64_t num_groups,
                      int64_t group_size, const T* bias, T* out, int64_t out_stride) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), zero_bytes = _mm256_setzero_si256();
  const int64_t chunks_per_group = group_size / 8;
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256i dot[MB];
    for (int m = 0; m < MB; ++m) dot[m] = _mm256_setzero_si256();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      prefetch_weights(w + c * 32);
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
      const __m256i lo = _mm256_and_si256(codes, low_nibbles);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_nibbles);
      // int16 codes, lane r of each: row r at k = 8c + (0, 1), (2, 3), (4, 5), (6, 7)
      const __m256i pairs[4] = {
          _mm256_unpacklo_epi8(lo, zero_bytes), _mm256_unpackhi_epi8(lo, zero_bytes),
          _mm256_unpacklo_epi8(hi, zero_bytes), _mm256_unpackhi_epi8(hi, zero_bytes)};
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const int32_t* xk = xi + m * x_stride + 4 * c;
        for (int p = 0; p < 4; ++p)
          dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pairs[p], _mm256_set1_epi32(xk[p])));
      }
    }
    const __m256 scale = vec::load(sz + g * 16).v;
    const __m256 zero = _mm256_sub_ps(vec::load(sz + g * 16 + 8).v, _mm256_set1_ps(128.f));
    for (int m = 0; m < MB; ++m) {
      const int64_t i = m * num_groups + g;
      const __m256 d = _mm256_fnmadd_ps(zero, _mm256_set1_ps(xsum[i]), _mm256_cvtepi32_ps(dot[m]));
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xscale[i])), d, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) store_output(out + m * out_stride, Vec{acc[m]}, bias);
}

template <typename T>
struct Int4Tiles {
  using Fn = void (*)(const uint8_t*, const Half*, const int32_t*, int64_t, const float*,
                      const float*, int64_t, int64_t, const T*, T*, int64_t);
  static constexpr Fn by_rows[kMaxRowsPerPass + 1] = {nullptr, int4_tile<1, T>, int4_tile<2, T>,
                                                      int4_tile<3, T>, int4_tile<4, T>};
};

// x [M, K] -> int16 per (row, group) with a power-of-two scale, the scales, and the per-group
// sums of the int16 values.
template <typename T>
void quantize_rows_int16(const T* x, int64_t M, int64_t K, int64_t group_size, int16_t* xi,
                         float* xscale, float* xsum) {
  const int64_t num_groups = K / group_size;
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(32767.f);
  for (int64_t m = 0; m < M; ++m)
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

inline at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales_zeros, int64_t group_size,
                              const c10::optional<at::Tensor>& bias) {
  check_int4("int4_linear", x, packed, group_size, kTileRows);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kTileRows;
  const int64_t num_groups = K / group_size;
  thread_local std::vector<int16_t> xi;
  thread_local std::vector<float> xscale, xsum;
  xi.resize(M * K);
  xscale.resize(M * num_groups);
  xsum.resize(M * num_groups);
  auto out = at::empty({M, N}, x.options());
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "int4_linear", [&] {
    quantize_rows_int16(x.data_ptr<scalar_t>(), M, K, group_size, xi.data(), xscale.data(),
                        xsum.data());
    const auto* w = packed.data_ptr<uint8_t>();
    const auto* sz = reinterpret_cast<const Half*>(scales_zeros.data_ptr<at::Half>());
    // (the buffers are this thread's: the workers get plain pointers)
    const auto* xp = reinterpret_cast<const int32_t*>(xi.data());
    const float *xsc = xscale.data(), *xs = xsum.data();
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    for_each_tile_pass(M, N, [&](int64_t t, int64_t m, int64_t rows) {
      Int4Tiles<scalar_t>::by_rows[rows](w + t * K * 4, sz + t * num_groups * 16, xp + m * K / 2,
                                         K / 2, xsc + m * num_groups, xs + m * num_groups,
                                         num_groups, group_size, b ? b + t * kTileRows : nullptr,
                                         o + m * N + t * kTileRows, N);
    });
  });
  return out;
}

// ---- W4A8: int8 activations, integer products ---------------------------------------------------

// The integer dot products of one chunk (8 k of the tile's 8 rows) with broadcast int8
// activations. Without AVX-VNNI: vpmaddubsw multiplies the unsigned codes (0..15) with the signed
// activations and adds pairs into 16 int16 lanes, which cannot saturate (2 * 15 * 127 < 2^15);
// four chunks fit in int16 before vpmaddwd widens them to the 8 rows. With AVX-VNNI: vpdpbusd
// does all three steps into the 8 int32 lanes.
#if defined(__AVXVNNI__)
constexpr int kChunksPerFlush = 1 << 30;  // int32 lanes: no flush needed within a group
inline __m256i add_chunk_products(__m256i sums, __m256i lo, __m256i hi, const int32_t* x) {
  sums = _mm256_dpbusd_avx_epi32(sums, lo, _mm256_set1_epi32(x[0]));
  return _mm256_dpbusd_avx_epi32(sums, hi, _mm256_set1_epi32(x[1]));
}
inline __m256 chunk_sums_to_float(__m256i sums) { return _mm256_cvtepi32_ps(sums); }
#else
constexpr int kChunksPerFlush = 4;
inline __m256i add_chunk_products(__m256i sums16, __m256i lo, __m256i hi, const int32_t* x) {
  sums16 = _mm256_add_epi16(sums16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[0])));
  return _mm256_add_epi16(sums16, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[1])));
}
inline __m256 chunk_sums_to_float(__m256i sums16) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums16, _mm256_set1_epi16(1)));
}
#endif

template <int MB, typename T>
inline void int4_int8_tile(const uint8_t* w, const Half* sz, const int32_t* xq, int64_t x_stride,
                           const float* xqsum, const float* row_scale, int64_t num_groups,
                           int64_t group_size, const T* bias, T* out, int64_t out_stride) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const int64_t chunks_per_group = group_size / 8;
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m256 scale = vec::load(sz + g * 16).v;
    for (int64_t c0 = g * chunks_per_group; c0 < (g + 1) * chunks_per_group; c0 += kChunksPerFlush) {
      __m256i sums[MB];
      for (int m = 0; m < MB; ++m) sums[m] = _mm256_setzero_si256();
      for (int64_t c = c0; c < std::min<int64_t>(c0 + kChunksPerFlush, (g + 1) * chunks_per_group); ++c) {
        prefetch_weights(w + c * 32);
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
        const __m256i lo = _mm256_and_si256(codes, low_nibbles);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_nibbles);
        for (int m = 0; m < MB; ++m)
          sums[m] = add_chunk_products(sums[m], lo, hi, xq + m * x_stride + 2 * c);
      }
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm256_fmadd_ps(scale, chunk_sums_to_float(sums[m]), acc[m]);
      }
    }
    // the zero point, once per group: scale * zero * sum(x)
    const __m256 zero = _mm256_sub_ps(vec::load(sz + g * 16 + 8).v, _mm256_set1_ps(128.f));
    const __m256 scaled_zero = _mm256_mul_ps(scale, zero);
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm256_fnmadd_ps(scaled_zero, _mm256_set1_ps(xqsum[m * num_groups + g]), acc[m]);
  }
  for (int m = 0; m < MB; ++m)
    store_output(out + m * out_stride, Vec{_mm256_mul_ps(acc[m], _mm256_set1_ps(row_scale[m]))},
                 bias);
}

template <typename T>
struct Int4Int8Tiles {
  using Fn = void (*)(const uint8_t*, const Half*, const int32_t*, int64_t, const float*,
                      const float*, int64_t, int64_t, const T*, T*, int64_t);
  static constexpr Fn by_rows[kMaxRowsPerPass + 1] = {
      nullptr, int4_int8_tile<1, T>, int4_int8_tile<2, T>, int4_int8_tile<3, T>,
      int4_int8_tile<4, T>};
};

// x [M, K] -> int8 per row (round(x / scale), scale = max(amax, 1e-8) / 127, as
// quantize_activations_int8), the scales, and per-group sums of the int8 values.
template <typename T>
void quantize_rows_int8(const T* x, int64_t M, int64_t K, int64_t group_size, int8_t* xq,
                        float* row_scale, float* xqsum) {
  const int64_t num_groups = K / group_size;
  const __m256 sign = _mm256_set1_ps(-0.f), lim = _mm256_set1_ps(127.f);
  for (int64_t m = 0; m < M; ++m) {
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8)
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, vec::load(x + m * K + k).v));
    const float scale = std::max(vec::reduce_max(Vec{amax}), 1e-8f) / 127.f;
    row_scale[m] = scale;
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < num_groups; ++g) {
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = m * K + g * group_size; k < m * K + (g + 1) * group_size; k += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(vec::load(x + k).v, s),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim);
        const __m256i qi = _mm256_cvtps_epi32(q);
        sum = _mm256_add_epi32(sum, qi);
        // 8 x int32 -> 8 x int8 (the packs work within 128-bit halves)
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + k), _mm_packs_epi16(w16, w16));
      }
      xqsum[m * num_groups + g] = float(hsum_epi32(sum));
    }
  }
}

inline at::Tensor int4_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                                   const at::Tensor& scales_zeros, int64_t group_size,
                                   const c10::optional<at::Tensor>& bias) {
  check_int4("int4_int8_linear", x, packed, group_size, kTileRows);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kTileRows;
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
    const auto* sz = reinterpret_cast<const Half*>(scales_zeros.data_ptr<at::Half>());
    const auto* xp = reinterpret_cast<const int32_t*>(xq.data());
    const float* xs = xqsum.data();
    const float* rs = row_scale.data();
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    for_each_tile_pass(M, N, [&](int64_t t, int64_t m, int64_t rows) {
      Int4Int8Tiles<scalar_t>::by_rows[rows](w + t * K * 4, sz + t * num_groups * 16,
                                             xp + m * K / 4, K / 4, xs + m * num_groups, rs + m,
                                             num_groups, group_size,
                                             b ? b + t * kTileRows : nullptr,
                                             o + m * N + t * kTileRows, N);
    });
  });
  return out;
}

}  // namespace pagedserve
