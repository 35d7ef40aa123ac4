// A dense bf16 GEMV for a few rows, written once against the vector API: each weight vector is
// loaded once for up to kRowsPerPass rows (bf16 pairs: vdpbf16ps where the target has it, widened
// FMAs where not), one horizontal sum per output. More rows take several passes over a thread's
// slice of the weights, which stays in its cache between them.
#pragma once

#include "vec.h"

namespace pagedserve {

constexpr int kRowsPerPass = 4;
// Up to kFewRows rows this beats oneDNN's GEMM (benchmarks/linear_paths.py). On avx512 oneDNN
// multiplies bf16 with vdpbf16ps and wins from 5 rows on. On avx2 its bf16 is emulated, at about
// the same rate for any number of rows, a half or less of this kernel's up to 64 rows (the most
// measured), so the kernel keeps the rows a decode batch or a verification of drafts brings;
// longer prefills stay with oneDNN.
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX2
constexpr int64_t kFewRows = 64;
#else
constexpr int64_t kFewRows = 4;
#endif
// The portable target leaves dense layers to PyTorch: this GEMV is measured on x86 targets only.
constexpr bool kHasFewRowsGemv = PAGEDSERVE_TARGET != PAGEDSERVE_PORTABLE;

// out[m, n] = x[m] . w[n] for row-major bf16 w [N, K] and MB <= kRowsPerPass rows of x.
template <int MB>
void bf16_rows(const BFloat16* w, const BFloat16* x, int64_t K, int64_t n0, int64_t n1, int64_t N,
               float* acc) {
  constexpr int64_t kStep = 2 * kLanes;  // bf16 values in one Bf16Pairs
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t rows = std::min<int64_t>(4, n1 - n);
    Vec s[4][MB];
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < MB; ++m) s[r][m] = vec::zero();
    for (int64_t k = 0; k < K; k += kStep) {
      vec::Bf16Pairs xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = vec::load_pairs(x + m * K + k);
      for (int r = 0; r < rows; ++r) {
        const vec::Bf16Pairs wv = vec::load_pairs(w + (n + r) * K + k);
        for (int m = 0; m < MB; ++m) s[r][m] = vec::dot_pairs(s[r][m], wv, xv[m]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < MB; ++m) acc[m * N + n + r] = vec::reduce_add(s[r][m]);
  }
}

inline at::Tensor bf16_linear_few_rows(const at::Tensor& x, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_linear_few_rows: weight must be contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= kFewRows && K % 32 == 0,
              "bf16_linear_few_rows: 1 to kFewRows rows, K % 32 == 0");
  auto xb = x.to(at::kBFloat16).contiguous();
  auto out = at::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const BFloat16*>(weight.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const BFloat16*>(xb.data_ptr<at::BFloat16>());
  std::vector<float> acc(M * N);
  using RowsFn = void (*)(const BFloat16*, const BFloat16*, int64_t, int64_t, int64_t, int64_t,
                          float*);
  const RowsFn kernels[kRowsPerPass + 1] = {nullptr, bf16_rows<1>, bf16_rows<2>, bf16_rows<3>,
                                            bf16_rows<4>};
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t q0, int64_t q1) {
    for (int64_t m = 0; m < M; m += kRowsPerPass)
      kernels[std::min<int64_t>(kRowsPerPass, M - m)](w, xp + m * K, K, q0 * 4,
                                                       std::min(q1 * 4, N), N, acc.data() + m * N);
  });
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

}  // namespace pagedserve
