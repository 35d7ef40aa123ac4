// AMX (Intel Sapphire Rapids and later): the bf16 tile unit, behind the avx512 target. One
// TDPBF16PS multiplies a 16 x 32 tile by a 32 x 16 one: 8,192 products, where vdpbf16ps does 32
// (measured on a 2-core Xeon: about 1 TMAC/s a core, against 19 GMAC/s), so a few rows through a
// dense layer cost the weights' streaming, not their arithmetic.
//
// The few-rows GEMV computes C^T = W X^T: the weights, row-major as stored, are tile A (16 weight
// rows x 32 values, loaded with the row stride), the M <= 16 rows of x, packed once per call in
// pairs along K (the unit's VNNI layout), are tile B, and tile C holds 16 outputs x M rows in
// fp32. No weight is repacked. A row's sums do not depend on the other rows, so one row and a
// verification of drafts give it the same bits, as the vector GEMV does. A prompt's rows take
// the same tiles in a GEMM (bf16_gemm, below), so a prefilled row gets those bits too; so do
// INT4's, which int4_avx512.h runs through its W4A16 tile kernel 16 at a time (on the panels of
// kPanelRows below).
//
// Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM), and each
// thread loads its tile configuration before use: enable() asks once; native.py calls it where
// the CPU flags name amx_bf16 and amx_tile.
#pragma once

#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "vec.h"

namespace pagedserve::amx {

constexpr int64_t kMaxRows = 16;  // tile B's 64 bytes a row: 16 rows of x, a pair of bf16 each

inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{false};
  return on;
}

// Ask Linux for the tile state; true (and the GEMV uses the unit) when granted. false turns the
// unit off again (the tests hold both paths to the reference on one machine).
inline bool enable(bool on) {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  enabled() = on && granted;
  return enabled();
}

inline bool usable(int64_t M, int64_t K) { return enabled() && M <= kMaxRows && K % 32 == 0; }

// x [M, K] as tile B wants it: for each 32 values of K, 16 rows (pairs along K) of M pairs.
inline std::vector<BFloat16> pack_rows(const BFloat16* x, int64_t M, int64_t K) {
  std::vector<BFloat16> packed(M * K);
  for (int64_t k = 0; k < K; k += 32)
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t m = 0; m < M; ++m) {
        BFloat16* dst = packed.data() + k * M + (p * M + m) * 2;
        dst[0] = x[m * K + k + 2 * p];
        dst[1] = x[m * K + k + 2 * p + 1];
      }
  return packed;
}

struct TileConfig {  // the unit's 64-byte configuration (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// acc[m * N + n] = x[m] . w[n] for n in [n0, n1), a multiple of 16 outputs, from xb = pack_rows(x).
__attribute__((target("amx-tile,amx-bf16"))) inline void bf16_rows(
    const BFloat16* w, const BFloat16* xb, int64_t M, int64_t K, int64_t n0, int64_t n1,
    int64_t N, float* acc) {
  TileConfig config;
  config.rows[0] = 16, config.colsb[0] = M * 4;  // C: 16 outputs x M rows, fp32
  config.rows[1] = 16, config.colsb[1] = 64;     // A: 16 weight rows x 32 bf16
  config.rows[2] = 16, config.colsb[2] = M * 4;  // B: 16 pairs along K x M rows
  _tile_loadconfig(&config);
  // a read of a tile just stored waits for the store: a block's sums are copied out after the
  // next block's products are issued (two buffers)
  alignas(64) float c[2][16 * kMaxRows];
  // row m's 16 sums are column m of the stored tile (a stride of M floats): one gather each
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(M));
  const auto copy_out = [&](int64_t n, const float* sums) {
    for (int64_t m = 0; m < M; ++m)
      _mm512_storeu_ps(acc + m * N + n, _mm512_i32gather_ps(column, sums + m, 4));
  };
  for (int64_t n = n0, i = 0; n < n1; n += 16, ++i) {
    _tile_zero(0);
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(1, w + n * K + k, K * sizeof(BFloat16));
      _tile_loadd(2, xb + k * M, M * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c[i & 1], M * 4);
    if (n > n0) copy_out(n - 16, c[(i - 1) & 1]);
  }
  if (n1 > n0) copy_out(n1 - 16, c[((n1 - n0) / 16 - 1) & 1]);
  _tile_release();
}

// ---- many rows (a prompt's): a GEMM on the tile unit ---------------------------------------------
//
// Past 16 rows, x is cut in blocks of 16 rows and the unit computes 2 x 2 accumulator tiles at a
// time, (2 blocks of 16 outputs) x (2 blocks of 16 rows), so that each weight tile and each x tile
// it loads serves two products. The tiles are the GEMV's (weights as A, as stored; x's pairs as
// B), so an output's sum runs through the same products in the same order along K as there: a
// prompt's row gets the bits a decode step gives it. Up to kGemmMaxRows rows: the x panel a
// thread walks (kPanelRows at a time) stays in L2 and the weights are streamed once a panel;
// beyond that, oneDNN's own blocking takes over.
constexpr int64_t kGemmMaxRows = 512, kPanelRows = 128;

inline bool gemm_usable(int64_t M, int64_t N, int64_t K) {
  return enabled() && M > kMaxRows && M <= kGemmMaxRows && N % 16 == 0 && K % 32 == 0;
}

// A 16 x 16 block of 32-bit values, transposed in registers: pairs of rows interleaved by 32
// and then by 64 bits (r[4j + c] lane L: rows 4j to 4j + 3 of column 4L + c), then the 128-bit
// lanes of each group of four transposed.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int j = 0; j < 8; ++j) {
    t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 4; ++j) {
    r[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    r[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// x [M, K] as tile B, a block of 16 rows and a step of 32 along K at a time (256 pairs of bf16:
// 16 pairs along K x 16 rows), in an even count of blocks (the rows past M are zero).
inline std::vector<uint32_t> pack_row_blocks(const BFloat16* x, int64_t M, int64_t K) {
  const int64_t blocks = (M + 31) / 32 * 2, steps = K / 32;
  std::vector<uint32_t> packed(blocks * steps * 256);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t s = 0; s < steps; ++s) {
      __m512i r[16];
      for (int64_t m = 0; m < 16; ++m)
        r[m] = b * 16 + m < M ? _mm512_loadu_si512(x + (b * 16 + m) * K + s * 32)
                              : _mm512_setzero_si512();
      transpose16(r);
      for (int p = 0; p < 16; ++p)
        _mm512_storeu_si512(packed.data() + (b * steps + s) * 256 + p * 16, r[p]);
    }
  return packed;
}

// Tiles 0 to 3: C for (row block r, output block c) at 2 r + c; 4 and 5: the weights of output
// blocks n and n + 16; 6 and 7: row blocks x0 and x1. NC: the output blocks (1 at an odd tail).
template <int NC>
__attribute__((target("amx-tile,amx-bf16"))) inline void gemm_unit(
    const BFloat16* w, const uint32_t* x0, const uint32_t* x1, int64_t K, int64_t n, float* c) {
  const int64_t stride = K * sizeof(BFloat16);
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NC > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < K / 32; ++s) {
    _tile_loadd(4, w + n * K + s * 32, stride);
    if constexpr (NC > 1) _tile_loadd(5, w + (n + 16) * K + s * 32, stride);
    _tile_loadd(6, x0 + s * 256, 64);
    _tile_loadd(7, x1 + s * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if constexpr (NC > 1) {
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(2, c + 2 * 256, 64);
  if constexpr (NC > 1) {
    _tile_stored(1, c + 256, 64);
    _tile_stored(3, c + 3 * 256, 64);
  }
}

// Output units u0 to u1 (pairs of blocks of 16 outputs) for every row of x, packed as
// pack_row_blocks leaves it, into out [M, N] (+ bias, added as store_output does).
template <typename T>
__attribute__((target("amx-tile,amx-bf16"))) void gemm_units(
    const BFloat16* w, const uint32_t* packed, int64_t M, int64_t K, int64_t N, const T* bias,
    T* out, int64_t u0, int64_t u1) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  const int64_t steps = K / 32, row_pairs = (M + 31) / 32;
  // the products of a unit's tiles are copied out while the unit computes the next unit's
  alignas(64) float c[2][4 * 256];
  int64_t pending_row0 = -1, pending_n = 0, pending_nc = 0;
  const auto copy_out = [&](const float* tiles, int64_t row0, int64_t n, int64_t nc) {
    for (int64_t t = 0; t < 4; ++t) {  // tile t: rows row0 + 16 (t / 2), outputs n + 16 (t % 2)
      if (t % 2 >= nc) continue;
      __m512i r[16];  // [16 outputs][16 rows] -> [16 rows][16 outputs]
      for (int o = 0; o < 16; ++o) r[o] = _mm512_load_si512(tiles + t * 256 + o * 16);
      transpose16(r);
      const int64_t row = row0 + 16 * (t / 2), col = n + 16 * (t % 2);
      for (int64_t m = 0; m < 16 && row + m < M; ++m)
        store_output(out + (row + m) * N + col, Vec{_mm512_castsi512_ps(r[m])},
                     bias ? bias + col : nullptr);
    }
  };
  int64_t i = 0;
  for (int64_t p0 = 0; p0 < row_pairs; p0 += kPanelRows / 32)
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n = u * 32, nc = std::min<int64_t>(2, N / 16 - 2 * u);
      for (int64_t p = p0; p < std::min(row_pairs, p0 + kPanelRows / 32); ++p, ++i) {
        const uint32_t* x0 = packed + 2 * p * steps * 256;
        float* tiles = c[i & 1];
        if (nc == 2) gemm_unit<2>(w, x0, x0 + steps * 256, K, n, tiles);
        else gemm_unit<1>(w, x0, x0 + steps * 256, K, n, tiles);
        if (pending_row0 >= 0) copy_out(c[(i - 1) & 1], pending_row0, pending_n, pending_nc);
        pending_row0 = 32 * p, pending_n = n, pending_nc = nc;
      }
    }
  if (pending_row0 >= 0) copy_out(c[(i - 1) & 1], pending_row0, pending_n, pending_nc);
  _tile_release();
}

// out [M, N] = x W^T (+ bias) for gemm_usable shapes, the output units split among the threads.
template <typename T>
void bf16_gemm(const BFloat16* w, const BFloat16* x, int64_t M, int64_t K, int64_t N,
               const T* bias, T* out) {
  const std::vector<uint32_t> packed = pack_row_blocks(x, M, K);
  at::parallel_for(0, (N / 16 + 1) / 2, 1, [&](int64_t u0, int64_t u1) {
    gemm_units(w, packed.data(), M, K, N, bias, out, u0, u1);
  });
}

}  // namespace pagedserve::amx

#endif
