// AMX (Intel Sapphire Rapids and later): the bf16 tile unit, behind the avx512 target. One
// TDPBF16PS multiplies a 16 x 32 tile by a 32 x 16 one: 8,192 products, where vdpbf16ps does 32
// (measured on a 2-core Xeon: about 1 TMAC/s a core, against 19 GMAC/s), so a few rows through a
// dense layer cost the weights' streaming, not their arithmetic.
//
// The few-rows GEMV computes C^T = W X^T: the weights, row-major as stored, are tile A (16 weight
// rows x 32 values, loaded with the row stride), the M <= 16 rows of x, packed once per call in
// pairs along K (the unit's VNNI layout), are tile B, and tile C holds 16 outputs x M rows in
// fp32. No weight is repacked. A row's sums do not depend on the other rows, so one row and a
// verification of drafts give it the same bits, as the vector GEMV does.
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

}  // namespace pagedserve::amx

#endif
