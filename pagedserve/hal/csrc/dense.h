// A dense bf16 GEMV for a few rows, written once against the vector API: each weight vector is
// loaded once for up to kRowsPerPass rows (bf16 pairs: vdpbf16ps where the target has it, widened
// FMAs where not), and the sums of a block of outputs are reduced together. More rows take
// several passes over a thread's slice of the weights, which stays in its cache between them.
#pragma once

#include "amx.h"
#include "vec.h"

namespace pagedserve {

constexpr int kRowsPerPass = 4;
// The GEMV takes every row a decode batch or a verification of drafts brings (up to kFewRows), so
// a row's bits never depend on what else is in the step: the same seed gives the same tokens
// whatever the batch (README, SamplingParams). A row's sums run in one order for any number of
// rows (one accumulator per output and row, reduced by the same tree); oneDNN's GEMM would round
// differently. More rows take several passes, each over a block of weight rows that stays in
// the L2 cache between them (kCachedWeightBytes), so the weights stream from memory once. On avx2
// oneDNN's bf16 is emulated, at a half or less of this kernel's rate up to 64 rows (the most
// measured; benchmarks/linear_paths.py). On avx512 without AMX (a 2-core Zen 4, 1B and 122M
// models' layers) the GEMV beats oneDNN up to 16 rows (1.04-1.96x from 4 rows), and is 0.96-1.16x
// its speed at 32 rows and 0.86-1.07x at 64 (linear_paths_{1b,122m}_avx512_zen4_gemv.json): a
// small price for tokens that do not change with the batch.
constexpr int64_t kFewRows = 64;
constexpr int64_t kCachedWeightBytes = int64_t{256} << 10;

// Whether the tile unit computes the GEMV (amx.h; avx512 with AMX only): up to 16 rows.
inline bool amx_rows(int64_t M, int64_t K) {
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
  return amx::usable(M, K);
#else
  return false;
#endif
}

// The most rows the GEMV takes: kFewRows, or 16 on the tile unit (more take its GEMM, amx.h,
// which gives each row the same bits).
inline int64_t few_rows_max() { return amx_rows(16, 32) ? 16 : kFewRows; }

// Whether M rows through an N x K bf16 matrix take the GEMV.
inline bool few_rows(int64_t M, int64_t /*N*/, int64_t /*K*/) { return M <= few_rows_max(); }
// The portable target leaves dense layers to PyTorch: this GEMV is measured on x86 targets only.
constexpr bool kHasFewRowsGemv = PAGEDSERVE_TARGET != PAGEDSERVE_PORTABLE;

// out[m, n + r] = x[m] . w[n + r] for NR rows of the row-major bf16 w [N, K] and MB rows of x:
// each weight vector is loaded once for the MB rows, and the NR x MB accumulators stay in
// registers (NR and MB are compile-time, so the loops unroll). From 3 rows on, each weight load
// asks for the same place in the next block's rows: NR streams of a page or so each are more
// than the hardware prefetchers keep ahead of once several rows' products slow the loads (4 rows
// ran 1.1-1.6x faster with it, 8 rows 1.1-1.5x, on avx512 and avx2 on a Zen 5); one and two rows
// stream near the read bandwidth without it, and lost up to a tenth with it.
template <int NR, int MB>
inline void bf16_block(const BFloat16* w, const BFloat16* x, int64_t K, int64_t n, int64_t N,
                       float* acc) {
  constexpr int64_t kStep = 2 * kLanes;  // bf16 values in one Bf16Pairs
  Vec s[NR * MB];
  for (Vec& v : s) v = vec::zero();
  for (int64_t k = 0; k < K; k += kStep) {
    vec::Bf16Pairs xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = vec::load_pairs(x + m * K + k);
    for (int r = 0; r < NR; ++r) {
      if constexpr (MB > 2) __builtin_prefetch(w + (n + r + NR) * K + k, 0, 3);
      const vec::Bf16Pairs wv = vec::load_pairs(w + (n + r) * K + k);
      for (int m = 0; m < MB; ++m) s[r * MB + m] = vec::dot_pairs(s[r * MB + m], wv, xv[m]);
    }
  }
  // the dot products, kLanes at a time through one transpose-and-add tree (vec::sum_lanes)
  // rather than a horizontal sum each: at the K of a small model's layers the sums cost as much
  // as the products
  constexpr int kSums = NR * MB, kPadded = (kSums + kLanes - 1) / kLanes * kLanes;
  Vec all[kPadded];
  for (int i = 0; i < kPadded; ++i) all[i] = i < kSums ? s[i] : vec::zero();
  float sums[kPadded];
  for (int g = 0; g < kPadded; g += kLanes) vec::store(sums + g, vec::sum_lanes(all + g));
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[m * N + n + r] = sums[r * MB + m];
}

// Weight rows per block, a power of two so that blocks tile a thread's kLanes-aligned range of
// outputs. avx512: up to kLanes dot products, reduced by one sum_lanes, with their accumulators,
// the rows of x and a weight vector in its 32 registers. avx2 (16 registers, a Bf16Pairs held as
// two vectors): 4 weight rows for any number of rows of x, which measured faster than fewer.
template <int MB>
constexpr int kBlockRows = vec::kRegisters < 32 ? 4
                           : MB == 1           ? kLanes
                           : MB == 2           ? kLanes / 2
                                               : kLanes / 4;

// out[m, n] = x[m] . w[n] for n in [n0, n1) and MB <= kRowsPerPass rows of x.
template <int MB>
void bf16_rows(const BFloat16* w, const BFloat16* x, int64_t K, int64_t n0, int64_t n1, int64_t N,
               float* acc) {
  constexpr int NR = kBlockRows<MB>;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) bf16_block<NR, MB>(w, x, K, n, N, acc);
  for (; n < n1; ++n) bf16_block<1, MB>(w, x, K, n, N, acc);
}

inline at::Tensor bf16_linear_few_rows(const at::Tensor& x, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_linear_few_rows: weight must be contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= few_rows_max() && K % 32 == 0,
              "bf16_linear_few_rows: 1 to few_rows_max() rows, K % 32 == 0");
  auto xb = x.to(at::kBFloat16).contiguous();
  auto out = at::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const BFloat16*>(weight.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const BFloat16*>(xb.data_ptr<at::BFloat16>());
  std::vector<float> acc(M * N);
  using RowsFn = void (*)(const BFloat16*, const BFloat16*, int64_t, int64_t, int64_t, int64_t,
                          float*);
  const RowsFn kernels[kRowsPerPass + 1] = {nullptr, bf16_rows<1>, bf16_rows<2>, bf16_rows<3>,
                                            bf16_rows<4>};
  // a block of whole kLanes outputs whose weights fit kCachedWeightBytes, for all passes of rows
  const int64_t block = std::max<int64_t>(kLanes, kCachedWeightBytes / (2 * K) / kLanes * kLanes);
  const auto vector_rows = [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += block)
      for (int64_t m = 0; m < M; m += kRowsPerPass)
        kernels[std::min<int64_t>(kRowsPerPass, M - m)](w, xp + m * K, K, b, std::min(b + block, n1),
                                                         N, acc.data() + m * N);
  };
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
  if (amx_rows(M, K)) {  // whole blocks of 16 outputs on the tile unit, the rest as vectors
    const std::vector<BFloat16> packed = amx::pack_rows(xp, M, K);
    at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
      amx::bf16_rows(w, packed.data(), M, K, b0 * 16, b1 * 16, N, acc.data());
    });
    if (N % 16) vector_rows(N / 16 * 16, N);
  } else
#endif
  {
    // in units of kLanes outputs (whole blocks for any number of rows), 64 outputs at the least
    at::parallel_for(0, (N + kLanes - 1) / kLanes, 64 / kLanes, [&](int64_t b0, int64_t b1) {
      vector_rows(b0 * kLanes, std::min(b1 * kLanes, N));
    });
  }
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "bf16_linear", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m) {
      int64_t n = 0;
      for (; n + kLanes <= N; n += kLanes)
        store_output(o + m * N + n, vec::load(acc.data() + m * N + n), b ? b + n : nullptr);
      for (; n < N; ++n) {
        float v = acc[m * N + n];
        if (b) v = float(scalar_t(v)) + float(b[n]);
        o[m * N + n] = scalar_t(v);
      }
    }
  });
  return out;
}

#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
// A prompt's rows through a bf16 layer on the tile unit (amx::bf16_gemm), where amx::gemm_usable.
inline at::Tensor bf16_linear_many_rows(const at::Tensor& x, const at::Tensor& weight,
                                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  x.scalar_type() == at::kBFloat16,
              "bf16_linear_many_rows: bf16 x and a contiguous bf16 weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(amx::gemm_usable(M, N, K), "bf16_linear_many_rows: not a shape amx::gemm_usable takes");
  const at::Tensor xb = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* b = bias.has_value() ? reinterpret_cast<const BFloat16*>(bias->data_ptr<at::BFloat16>())
                                   : nullptr;
  amx::bf16_gemm(reinterpret_cast<const BFloat16*>(weight.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const BFloat16*>(xb.data_ptr<at::BFloat16>()), M, K, N, b,
                 reinterpret_cast<BFloat16*>(out.data_ptr<at::BFloat16>()));
  return out;
}
#endif

}  // namespace pagedserve
