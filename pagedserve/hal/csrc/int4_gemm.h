// How the targets' INT4 kernels (int4_<target>.h) walk an [M, N] product, one rule for a decode
// row and a 512-token prompt alike: tiles of kTileRows output rows (the packed layout's unit: one
// int32 or fp32 lane per row, no horizontal sums) times passes of up to MB activation rows, the
// tile's codes unpacked once per pass and the pass's accumulators in registers.
//
// Threads split the tiles. Each thread walks the activation rows in panels that stay in its L2
// cache, and within a panel its tiles one after the other (or two at a time, where a target has
// kernels that take two and the product enough rows): a tile's codes (K / 2 bytes, in L1) serve
// every pass of the panel before the next tile's are read, and the panel serves every tile of the
// thread before the next panel's rows are read. A decode step is one panel of one pass a tile:
// the weights stream from memory once.
//
// Each row's sums are integers (W4A16: int16 activations, W4A8: int8), and its float steps run in
// one order whatever the pass it shares, so a row's result does not depend on the rows beside it.
#pragma once

#include <ATen/ops/cat.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "int4_limits.h"
#include "vec.h"

namespace pagedserve {

// The activation rows a thread keeps in its L2 cache while it sweeps its tiles (half of a 512 KiB
// L2: Zen 3's; the weights' tile and the outputs take little).
constexpr int64_t kPanelBytes = int64_t{192} << 10;

// Asks for the weight bytes ``ahead`` past the chunk a tile kernel is about to multiply, into L1
// (each target's kPrefetchBytes says how far ahead, and why).
inline void prefetch_weights(const uint8_t* chunk, int64_t ahead) {
  __builtin_prefetch(chunk + ahead, /*for reading*/ 0, /*into L1*/ 3);
}

// Calls pass(tile, tiles, first_row, rows) for every (tiles tiles from tile, pass of at most
// max_rows activation rows) of an [M, N] product whose activation rows take row_bytes each, as
// described above: each thread's tiles in steps of tiles_per_pass (its last step may hold fewer).
template <typename Pass>
void for_each_tile_pass(int64_t M, int64_t N, int64_t tile_rows, int64_t max_rows,
                        int64_t row_bytes, int64_t tiles_per_pass, const Pass& pass) {
  const int64_t panel =
      std::max(max_rows, kPanelBytes / std::max<int64_t>(row_bytes, 1) / max_rows * max_rows);
  at::parallel_for(0, N / tile_rows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t p0 = 0; p0 < M; p0 += panel)
      for (int64_t t = t0; t < t1; t += tiles_per_pass)
        for (int64_t m = p0; m < std::min(M, p0 + panel); m += max_rows)
          pass(t, std::min(tiles_per_pass, t1 - t), m, std::min(max_rows, M - m));
  });
}

// Rows [0, M) of the activations prepared for a kernel (quantized per group), split between the
// threads: prepare(m0, m1) takes rows m0 .. m1 - 1.
template <typename Prepare>
void for_row_ranges(int64_t M, int64_t K, const Prepare& prepare) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), prepare);
}

// A tile kernel's instances for 1 .. sizeof(Rows) rows a pass, by_rows[rows] (a loop over a
// runtime count would keep the rows' accumulators out of registers).
template <template <int, typename> class Kernel, typename T, int... Rows>
constexpr auto tile_kernels(std::integer_sequence<int, Rows...>) {
  using Fn = decltype(&Kernel<1, T>::run);
  return std::array<Fn, sizeof...(Rows) + 1>{nullptr, &Kernel<Rows + 1, T>::run...};
}

// Calls run with the count of Unit-value steps in a group of G values (chunks of 8, blocks of 32)
// as a constant known when compiled, std::integral_constant<int, G / Unit>, for the group sizes the
// quantizers write (32, 64, 128), and as std::integral_constant<int, 0> for others, whose count a
// tile kernel then reads from G at run time.
template <int Unit, typename Run>
void with_steps_per_group(int64_t G, const Run& run) {
  switch (G) {
    case 32: return run(std::integral_constant<int, 32 / Unit>{});
    case 64: return run(std::integral_constant<int, 64 / Unit>{});
    case 128: return run(std::integral_constant<int, 128 / Unit>{});
    default: return run(std::integral_constant<int, 0>{});
  }
}

// One call's operands as the tile kernels read them. Activations: W4A16 int16 per (row, group)
// with a power-of-two scale and the group's sum (which the avx512 tiles, taking the zero points
// out of the codes, do without); W4A8 int8 per (row, block of 32) with its scale, and per (row,
// group) the sum of scale * sum(int8) over the group's blocks.
template <typename T, typename X>
struct Int4Operands {
  const uint8_t* w;  // tile t's codes: tile_codes
  const uint8_t* sz;  // tile t's scales and zeros: tile_scales
  const X* x;        // [M, K]
  const float* xscale;  // W4A16 [M, K / G]; W4A8 [M, K / 32]
  const float* xsum;    // [M, K / G]
  int64_t K, G;
  const T* bias;
  T* out;  // [M, N]
  int64_t N;

  // Tile t of the packed layout, tiles of tile_rows rows: its codes (K values of each row, two a
  // byte), and per group its fp16 scales then one-byte zero points (3 bytes a row).
  const uint8_t* tile_codes(int64_t t, int64_t tile_rows) const {
    return w + t * K * tile_rows / 2;
  }
  const uint8_t* tile_scales(int64_t t, int64_t tile_rows) const {
    return sz + t * (K / G) * 3 * tile_rows;
  }
};

// An [M, K] x [N, K]^T INT4 product with the activations quantized by Quantize into X, tiles by
// Kernel (1 .. RowsPerPass rows a pass); with tile_pairs (where the target has such a kernel),
// two tiles a pass by PairKernel, which must sum each row as Kernel does.
template <int TileRows, typename X, template <int, typename> class Kernel, int RowsPerPass,
          template <int, typename> class PairKernel = Kernel, typename Quantize>
at::Tensor int4_gemm(const char* op, const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scales_zeros, int64_t group_size,
                     const c10::optional<at::Tensor>& bias, int64_t scale_width,
                     const Quantize& quantize, bool tile_pairs = false) {
  check_int4(op, x, packed, scales_zeros, group_size, TileRows);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * TileRows;
  const int64_t num_groups = K / group_size;
  thread_local std::vector<X> xq;
  thread_local std::vector<float> xscale, xsum;
  xq.resize(M * K);
  xscale.resize(M * scale_width);
  xsum.resize(M * num_groups);
  auto out = at::empty({M, N}, x.options());
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "int4_gemm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    // (the buffers are this thread's: the workers get plain pointers)
    X* q = xq.data();
    float *qs = xscale.data(), *qsum = xsum.data();
    for_row_ranges(M, K, [&](int64_t m0, int64_t m1) {
      quantize(xp, m0, m1, K, group_size, q, qs, qsum);
    });
    const Int4Operands<scalar_t, X> operands{
        packed.data_ptr<uint8_t>(),
        scales_zeros.data_ptr<uint8_t>(),
        q, qs, qsum, K, group_size,
        bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr,
        out.data_ptr<scalar_t>(), N};
    static constexpr auto by_rows =
        tile_kernels<Kernel, scalar_t>(std::make_integer_sequence<int, RowsPerPass>{});
    static constexpr auto pairs_by_rows =
        tile_kernels<PairKernel, scalar_t>(std::make_integer_sequence<int, RowsPerPass>{});
    for_each_tile_pass(M, N, TileRows, RowsPerPass, K * int64_t(sizeof(X)),
                       tile_pairs ? 2 : 1,
                       [&](int64_t t, int64_t tiles, int64_t m, int64_t rows) {
                         (tiles == 2 ? pairs_by_rows : by_rows)[rows](operands, t, m);
                       });
  });
  return out;
}

// A layer of out_features rows, which its packing padded to whole tiles of tile_rows: the
// kernel's output over the padded rows (with a bias padded alike), cut to out_features. Only
// such layers (pruned models' odd sizes) pay the copies.
template <typename Kernel>
at::Tensor with_padded_rows(const Kernel& kernel, const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_zeros, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, int64_t out_features,
                            int64_t tile_rows) {
  const int64_t padded = packed.size(0) * tile_rows;
  TORCH_CHECK(out_features <= padded && out_features > padded - tile_rows,
              "INT4 layer of ", out_features, " rows packed for ", padded);
  if (out_features == padded) return kernel(x, packed, scales_zeros, group_size, bias);
  c10::optional<at::Tensor> padded_bias;
  if (bias) padded_bias = at::cat({*bias, bias->new_zeros({padded - out_features})});
  return kernel(x, packed, scales_zeros, group_size, padded_bias)
      .narrow(1, 0, out_features)
      .contiguous();
}

}  // namespace pagedserve
