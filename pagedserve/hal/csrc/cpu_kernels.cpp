// Native CPU kernels for the `cpu` and `kunlun-emu` backends: what one decode step spends its time
// on, written for AVX-512 with BF16 dot products (Zen 4, Sapphire Rapids, Cooper Lake).
//
// Each kernel has a plain-PyTorch reference (pagedserve/hal/kernels.py, int4.py) and the tests hold
// it to that reference. pagedserve/hal/native.py builds this file once per machine (cached on disk)
// and falls back to eager PyTorch where there is no compiler or no AVX-512 BF16.
//
// Layouts:
//   int4 weights, "tiles of 16": an [N, K] layer is N/16 tiles of 16 output rows. A tile stores K/8
//   chunks of 64 bytes, each holding k = 8c .. 8c+7 of its 16 rows as four k-pairs (see
//   pack_tiles16 in int4.py for the byte order). Splitting a chunk's nibbles and interleaving each
//   byte with 0x43 (vpunpck{l,h}bw) gives four vectors of 32 bf16 words in which word j is the
//   pair element (row j/2, j%2) that one vdpbf16ps lane multiplies with a broadcast activation
//   pair: the 16 lanes of the accumulator are the tile's 16 output rows, with no horizontal sum.
//   Per tile and group: 16 fp16 scales then 16 fp16 (zero + 128); see int4_linear.
//   dense bf16 weights: row-major [N, K] as PyTorch keeps them.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGEDSERVE_NATIVE 1
#include <immintrin.h>
#else
#define PAGEDSERVE_NATIVE 0
#endif

// The activation dtypes a model runs in: float32, bfloat16, float16.
#define DISPATCH_ACTIVATION_TYPES(TYPE, NAME, ...)                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)         \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)              \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

using at::BFloat16;

#if PAGEDSERVE_NATIVE

// ---- vector helpers -----------------------------------------------------------------------------

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// Rounds through the storage dtype, as PyTorch does between two ops (no-op for float).
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

// An fp32 result into the output dtype; PyTorch adds a bias to the rounded product.
template <typename T>
inline void store_output(T* out, __m512 v, const T* bias) {
  if (bias) v = _mm512_add_ps(round_to<T>(v), load16(bias));
  store16(out, v);
}

// exp for the softmax: Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp in fp32.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// ---- int4 weight-only linear (W4A16) ------------------------------------------------------------

// One tile of 16 output rows for MB activation rows. x holds bf16 pairs as uint32; xsum the sum of
// each activation row's bf16 values per group. A code q becomes the bf16 number 128 + q when its
// byte gets 0x43 as the high byte (exact: bf16 steps by 1 in [128, 256)), so the products are
// exact and the kernel subtracts (zero + 128) * sum(x) per group instead of converting each code.
template <int MB, typename T>
inline void int4_tile(const uint8_t* w, const at::Half* sz, const uint32_t* x, int64_t x_stride,
                      const float* xsum, int64_t num_groups, int64_t group_size, const T* bias,
                      T* out, int64_t out_stride) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i bf16_128 = _mm512_set1_epi8(0x43);
  const int64_t chunks_per_group = group_size / 8;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 dot[MB];
    for (int m = 0; m < MB; ++m) dot[m] = _mm512_setzero_ps();
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
          dot[m] = _mm512_dpbf16_ps(dot[m], pairs[p], (__m512bh)_mm512_set1_epi32(xm[p]));
      }
    }
    const __m512 scale = load16(sz + g * 32);
    const __m512 zero128 = load16(sz + g * 32 + 16);
    for (int m = 0; m < MB; ++m) {
      const __m512 xs = _mm512_set1_ps(xsum[m * num_groups + g]);
      acc[m] = _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(zero128, xs, dot[m]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) store_output(out + m * out_stride, acc[m], bias);
}

// Pointers to int4_tile<1..8, T>: one pass over a tile serves up to 8 activation rows (2 x 8
// accumulators and the unpacked codes stay in the 32 zmm registers).
constexpr int kMaxRowsPerPass = 8;
template <typename T>
struct Int4Tiles {
  using Fn = void (*)(const uint8_t*, const at::Half*, const uint32_t*, int64_t, const float*,
                      int64_t, int64_t, const T*, T*, int64_t);
  static constexpr Fn by_rows[kMaxRowsPerPass + 1] = {
      nullptr,           int4_tile<1, T>, int4_tile<2, T>, int4_tile<3, T>, int4_tile<4, T>,
      int4_tile<5, T>, int4_tile<6, T>, int4_tile<7, T>, int4_tile<8, T>};
};

// x [M, K] -> bf16 pairs and per-group sums of the rounded values (group_size % 16 == 0).
template <typename T>
void prepare_activations(const T* x, int64_t M, int64_t K, int64_t group_size, BFloat16* xb,
                         float* xsum) {
  const int64_t num_groups = K / group_size;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = m * K + g * group_size; k < m * K + (g + 1) * group_size; k += 16) {
        const __m512 rounded = round_to<BFloat16>(load16(x + k));
        store16(xb + k, rounded);
        sum = _mm512_add_ps(sum, rounded);
      }
      xsum[m * num_groups + g] = _mm512_reduce_add_ps(sum);
    }
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales_zeros, int64_t group_size,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_linear: x must be a contiguous [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 8 == K, "int4_linear: packed weight is for K=", packed.size(1) * 8,
              ", x has K=", K);
  const int64_t num_groups = K / group_size;
  thread_local std::vector<BFloat16> xb;
  thread_local std::vector<float> xsum;
  xb.resize(M * K);
  xsum.resize(M * num_groups);
  auto out = torch::empty({M, N}, x.options());
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "int4_linear", [&] {
    prepare_activations(x.data_ptr<scalar_t>(), M, K, group_size, xb.data(), xsum.data());
    const auto* w = packed.data_ptr<uint8_t>();
    const auto* sz = scales_zeros.data_ptr<at::Half>();
    const auto* xp = reinterpret_cast<const uint32_t*>(xb.data());
    const float* xs = xsum.data();
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t m = 0; m < M; m += kMaxRowsPerPass) {
          const int64_t rows = std::min<int64_t>(kMaxRowsPerPass, M - m);
          Int4Tiles<scalar_t>::by_rows[rows](
              w + t * (K / 8) * 64, sz + t * num_groups * 32, xp + m * K / 2, K / 2,
              xs + m * num_groups, num_groups, group_size, b ? b + t * 16 : nullptr,
              o + m * N + t * 16, N);
        }
    });
  });
  return out;
}

// ---- dense bf16 linear for a few rows -----------------------------------------------------------

// out[m, n] = x[m] . w[n] for row-major bf16 w [N, K] and MB <= 4 rows of x: each weight vector is
// loaded once for all rows (32 products per vdpbf16ps), one horizontal sum per output.
template <int MB>
void bf16_rows(const BFloat16* w, const BFloat16* x, int64_t K, int64_t n0, int64_t n1,
               int64_t N, float* acc) {
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t rows = std::min<int64_t>(4, n1 - n);
    __m512 s[4][MB];
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < MB; ++m) s[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < rows; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
        for (int m = 0; m < MB; ++m) s[r][m] = _mm512_dpbf16_ps(s[r][m], wv, xv[m]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < MB; ++m) acc[m * N + n + r] = _mm512_reduce_add_ps(s[r][m]);
  }
}

torch::Tensor bf16_linear_few_rows(const torch::Tensor& x, const torch::Tensor& weight,
                                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_linear_few_rows: weight must be contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= 4 && K % 32 == 0, "bf16_linear_few_rows: 1-4 rows, K % 32 == 0");
  auto xb = x.to(at::kBFloat16).contiguous();
  auto out = torch::empty({M, N}, x.options());
  const auto* w = weight.data_ptr<BFloat16>();
  const auto* xp = xb.data_ptr<BFloat16>();
  std::vector<float> acc(M * N);
  using RowsFn = void (*)(const BFloat16*, const BFloat16*, int64_t, int64_t, int64_t, int64_t,
                          float*);
  const RowsFn kernels[5] = {nullptr, bf16_rows<1>, bf16_rows<2>, bf16_rows<3>, bf16_rows<4>};
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t q0, int64_t q1) {
    kernels[M](w, xp, K, q0 * 4, std::min(q1 * 4, N), N, acc.data());
  });
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "bf16_linear", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    auto* o = out.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m) {
      int64_t n = 0;
      for (; n + 16 <= N; n += 16)
        store_output(o + m * N + n, _mm512_loadu_ps(acc.data() + m * N + n), b ? b + n : nullptr);
      for (; n < N; ++n) {
        float v = acc[m * N + n];
        if (b) v = float(scalar_t(v)) + float(b[n]);
        o[m * N + n] = scalar_t(v);
      }
    }
  });
  return out;
}

// ---- RMSNorm, with the residual add fused -------------------------------------------------------

// y = w * (x * rsqrt(mean(x^2) + eps)) with HF's rounding: normalise in fp32, round, then scale.
template <typename T>
void rms_norm_row(const T* x, const T* w, int64_t H, float eps, T* y) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 v = load16(x + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / H + eps));
  for (int64_t i = 0; i < H; i += 16)
    store16(y + i, _mm512_mul_ps(load16(w + i), round_to<T>(_mm512_mul_ps(load16(x + i), r))));
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  TORCH_CHECK(H % 16 == 0 && x.is_contiguous(), "rms_norm: contiguous rows of a multiple of 16");
  auto y = torch::empty_like(x);
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) rms_norm_row(xp + t * H, wp, H, float(eps), yp + t * H);
    });
  });
  return y;
}

// residual += x (rounded to the dtype, as a PyTorch add is); returns rms_norm(residual).
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual,
                           const torch::Tensor& weight, double eps) {
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  TORCH_CHECK(H % 16 == 0 && x.is_contiguous() && residual.is_contiguous(),
              "add_rms_norm: contiguous rows of a multiple of 16");
  auto y = torch::empty_like(x);
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    auto* rp = residual.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t i = 0; i < H; i += 16)
          store16(rp + t * H + i, _mm512_add_ps(load16(xp + t * H + i), load16(rp + t * H + i)));
        rms_norm_row(rp + t * H, wp, H, float(eps), yp + t * H);
      }
    });
  });
  return y;
}

// ---- SiLU and multiply --------------------------------------------------------------------------

// [T, 2I] -> [T, I]: silu(gate) * up, each op rounded to the dtype as PyTorch's two ops are.
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  const int64_t I = gate_up.size(-1) / 2, T_ = gate_up.numel() / (2 * I);
  TORCH_CHECK(I % 16 == 0 && gate_up.is_contiguous(), "silu_and_mul: contiguous, I % 16 == 0");
  auto out = torch::empty({T_, I}, gate_up.options());
  DISPATCH_ACTIVATION_TYPES(gate_up.scalar_type(), "silu", [&] {
    const auto* gp = gate_up.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t i = 0; i < I; i += 16) {
          const __m512 g = load16(gp + t * 2 * I + i);
          const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                             exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
          store16(op + t * I + i, _mm512_mul_ps(round_to<scalar_t>(silu), load16(gp + t * 2 * I + I + i)));
        }
    });
  });
  return out;
}

// ---- rotary embedding and the KV-cache write ----------------------------------------------------

// qkv [T, (H + 2 KV) * D]: rotates the first `rot` dims of every q and k head in place (GPT-J
// style, adjacent pairs, fp32 math as the reference), then stores k and v at their slots of the
// [pages, block_size, KV, D] caches.
void rotary_and_write_kv(torch::Tensor& qkv, const torch::Tensor& positions,
                         const torch::Tensor& cos_sin, torch::Tensor& k_cache,
                         torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t T_ = qkv.size(0), rot = cos_sin.size(1), half = rot / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  TORCH_CHECK(qkv.is_contiguous() && qkv.numel() == T_ * row, "rotary_and_write_kv: qkv shape");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type(), "rotary_and_write_kv: cache dtype");
  const auto* pos = positions.data_ptr<int64_t>();
  const auto* slots = slot_mapping.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t kv_row = num_kv_heads * head_dim;
  DISPATCH_ACTIVATION_TYPES(qkv.scalar_type(), "rotary", [&] {
    auto* x = qkv.data_ptr<scalar_t>();
    auto* kc = k_cache.data_ptr<scalar_t>();
    auto* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* cos = cs + pos[t] * rot;
        const float* sin = cos + half;
        scalar_t* xt = x + t * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          scalar_t* head = xt + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float a = float(head[2 * i]), b = float(head[2 * i + 1]);
            head[2 * i] = scalar_t(a * cos[i] - b * sin[i]);
            head[2 * i + 1] = scalar_t(b * cos[i] + a * sin[i]);
          }
        }
        const int64_t slot = slots[t];
        std::memcpy(kc + slot * kv_row, xt + num_heads * head_dim, kv_row * sizeof(scalar_t));
        std::memcpy(vc + slot * kv_row, xt + (num_heads + num_kv_heads) * head_dim,
                    kv_row * sizeof(scalar_t));
      }
    });
  });
}

// ---- paged attention, one query per sequence ----------------------------------------------------

// Lane i of the result is the sum of the 16 lanes of v[i]: a transpose-and-add tree (about 3
// instructions per input instead of a full horizontal reduction each).
inline __m512 sum_lanes16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 from v[2i], 8-15 from v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: 4 partial sums of v[4i + L]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane L: 2 partials of v[8i + L], then 2 of v[8i + 4 + L]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // lane L, element j: the sum of v[4j + L]
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                    _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// Where each token's key (and value) of one KV head starts in the caches, page by page.
inline void token_offsets(const int64_t* pages, int64_t seq_len, int64_t block_size,
                          int64_t num_kv_heads, int64_t kv_head, int64_t D,
                          std::vector<int64_t>& offsets) {
  offsets.resize(seq_len);
  for (int64_t t = 0, b = 0; t < seq_len; ++b)
    for (int64_t slot = pages[b] * block_size; slot < (pages[b] + 1) * block_size && t < seq_len;
         ++slot, ++t)
      offsets[t] = (slot * num_kv_heads + kv_head) * D;
}

// q . k for 16 tokens at once. bf16: 32 exact products per vdpbf16ps, summed in fp32 (q comes out
// of a bf16 layer, so it is already bf16). fp32 and fp16: fp32 FMAs.
template <typename T>
inline __m512 scores16(const T* q, const T* k_cache, const int64_t* offsets, int64_t n, int64_t D) {
  __m512 partial[16];
  for (int64_t j = 0; j < 16; ++j) {
    partial[j] = _mm512_setzero_ps();
    if (j >= n) continue;
    const T* k = k_cache + offsets[j];
    int64_t d = 0;
    if constexpr (std::is_same_v<T, BFloat16>) {
      for (; d + 32 <= D; d += 32)
        partial[j] = _mm512_dpbf16_ps(partial[j], (__m512bh)_mm512_loadu_si512(q + d),
                                      (__m512bh)_mm512_loadu_si512(k + d));
    }
    for (; d < D; d += 16) partial[j] = _mm512_fmadd_ps(load16(q + d), load16(k + d), partial[j]);
  }
  return sum_lanes16(partial);
}

inline void softmax_inplace(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), _mm512_set1_ps(mx)));
    _mm512_mask_storeu_ps(s + t, m, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
    _mm512_mask_storeu_ps(s + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
  }
}

// One (sequence, KV head): its `group` query heads read each key and value of the sequence once,
// straight from the pages (no gather), with an exact fp32 softmax.
template <typename T>
void decode_attention_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* pages,
                           int64_t seq_len, int64_t block_size, int64_t num_kv_heads,
                           int64_t kv_head, int64_t group, int64_t D, float scale, T* out,
                           std::vector<float>& scores, std::vector<int64_t>& offsets) {
  const int64_t stride = (seq_len + 15) / 16 * 16;
  scores.resize(group * stride);
  token_offsets(pages, seq_len, block_size, num_kv_heads, kv_head, D, offsets);
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t t0 = 0; t0 < seq_len; t0 += 16) {
      const __m512 s = scores16(q + h * D, k_cache, offsets.data() + t0,
                                std::min<int64_t>(16, seq_len - t0), D);
      _mm512_storeu_ps(scores.data() + h * stride + t0, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
    }
    softmax_inplace(scores.data() + h * stride, seq_len);
  }
  const int64_t DV = D / 16, heads_per_pass = std::max<int64_t>(1, 24 / DV);
  for (int64_t h0 = 0; h0 < group; h0 += heads_per_pass) {  // accumulators stay in registers
    const int64_t hn = std::min(heads_per_pass, group - h0);
    __m512 acc[24];
    for (int64_t i = 0; i < hn * DV; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < seq_len; ++t) {
      const T* v = v_cache + offsets[t];
      __m512 vv[8];
      for (int64_t d = 0; d < DV; ++d) vv[d] = load16(v + d * 16);
      for (int64_t h = 0; h < hn; ++h) {
        const __m512 p = _mm512_set1_ps(scores[(h0 + h) * stride + t]);
        for (int64_t d = 0; d < DV; ++d) acc[h * DV + d] = _mm512_fmadd_ps(p, vv[d], acc[h * DV + d]);
      }
    }
    for (int64_t h = 0; h < hn; ++h)
      for (int64_t d = 0; d < DV; ++d) store16(out + (h0 + h) * D + d * 16, acc[h * DV + d]);
  }
}

torch::Tensor paged_attention_decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= 128, "paged_attention_decode: head_dim must be 16..128, x16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_attention_decode: block_tables and seq_lens must be int64");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && q.scalar_type() == k_cache.scalar_type(),
              "paged_attention_decode: q rows of contiguous heads, in the cache's dtype");
  const int64_t q_stride = q.stride(0);
  auto out = torch::empty({B, H, D}, q.options());
  const auto* tables = block_tables.data_ptr<int64_t>();
  const auto* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), group = H / KV;
  DISPATCH_ACTIVATION_TYPES(q.scalar_type(), "decode_attn", [&] {
    const auto* qp = q.data_ptr<scalar_t>();
    const auto* kc = k_cache.data_ptr<scalar_t>();
    const auto* vc = v_cache.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * KV, 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> scores;
      thread_local std::vector<int64_t> offsets;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / KV, kvh = i % KV;
        decode_attention_task(qp + b * q_stride + kvh * group * D, kc, vc, tables + b * max_blocks,
                              lens[b], block_size, KV, kvh, group, D, float(scale),
                              op + (b * H + kvh * group) * D, scores, offsets);
      }
    });
  });
  return out;
}

// ---- greedy sampling ----------------------------------------------------------------------------

// The first index of each row's largest value (of its first NaN, if any), as torch.argmax.
int64_t argmax_row(const float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  float best = _mm512_reduce_max_ps(mx);
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) nan = 1;
    best = std::max(best, x[j]);
  }
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t j = 0; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  for (int64_t j = i; j < n; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == best) return j;
  return 0;
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: float32 [rows, vocab] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = torch::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) o[b] = argmax_row(x + b * logits.stride(0), V);
  });
  return out;
}

#endif  // PAGEDSERVE_NATIVE

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("available") = bool(PAGEDSERVE_NATIVE);
#if PAGEDSERVE_NATIVE
  m.def("int4_linear", &int4_linear);
  m.def("bf16_linear_few_rows", &bf16_linear_few_rows);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_and_write_kv", &rotary_and_write_kv);
  m.def("paged_attention_decode", &paged_attention_decode);
  m.def("argmax_rows", &argmax_rows);
#endif
}
