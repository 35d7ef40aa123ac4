// Row-wise kernels, written once against the vector API: RMSNorm (with the residual add fused),
// SiLU-and-mul, rotary + KV-cache write, the greedy argmax and the random draw.
#pragma once

#include <algorithm>
#include <string>

#include "vec.h"

namespace pagedserve {

// What the row-wise kernels (rms_norm, add_rms_norm, silu_and_mul, rotary_and_write_kv) take:
// rows of any length (whole vectors, then a shorter tail), in the activation dtypes. The kernels
// check their input with it, and the Python dispatch (CpuDevice) asks it when a model loads.
inline std::string rows_rejects(at::ScalarType dtype) {
  if (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) return "";
  const std::string name = dtype == at::kDouble ? "float64" : c10::toString(dtype);
  return "activations in " + name + " (the kernels take float32, bfloat16 and float16)";
}

inline void check_rows(const char* op, const at::Tensor& x) {
  const std::string why = rows_rejects(x.scalar_type());
  TORCH_CHECK(why.empty(), op, ": ", why);
  TORCH_CHECK(x.is_contiguous(), op, ": rows must be contiguous");
}

// ---- RMSNorm, with the residual add fused -------------------------------------------------------

// y = w * (x * rsqrt(mean(x^2) + eps)) with HF's rounding: normalise in fp32, round, then scale.
template <typename T>
void rms_norm_row(const T* x, const T* w, int64_t H, float eps, T* y) {
  Vec ss = vec::zero();
  for (int64_t i = 0; i < H; i += kLanes) {
    const Vec v = load_n(x + i, lanes_at(i, H));
    ss = vec::fmadd(v, v, ss);
  }
  const Vec r = vec::set1(1.f / std::sqrt(vec::reduce_add(ss) / H + eps));
  for (int64_t i = 0; i < H; i += kLanes) {
    const int64_t n = lanes_at(i, H);
    store_n(y + i, vec::mul(load_n(w + i, n), round_to<T>(vec::mul(load_n(x + i, n), r))), n);
  }
}

inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  check_rows("rms_norm", x);
  auto y = at::empty_like(x);
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
inline at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                               double eps) {
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  check_rows("add_rms_norm", x);
  check_rows("add_rms_norm", residual);
  auto y = at::empty_like(x);
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    auto* rp = residual.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t i = 0; i < H; i += kLanes) {
          const int64_t n = lanes_at(i, H);
          store_n(rp + t * H + i, vec::add(load_n(xp + t * H + i, n), load_n(rp + t * H + i, n)), n);
        }
        rms_norm_row(rp + t * H, wp, H, float(eps), yp + t * H);
      }
    });
  });
  return y;
}

// ---- SiLU and multiply --------------------------------------------------------------------------

// [T, 2I] -> [T, I]: silu(gate) * up, each op rounded to the dtype as PyTorch's two ops are. A
// thread takes at least kSiluValues outputs: a decode step of 16 rows through a small model's
// MLP (I = 2048) is split between the threads, a few rows are not.
constexpr int64_t kSiluValues = 8192;
inline at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t I = gate_up.size(-1) / 2, T_ = gate_up.numel() / (2 * I);
  check_rows("silu_and_mul", gate_up);
  auto out = at::empty({T_, I}, gate_up.options());
  DISPATCH_ACTIVATION_TYPES(gate_up.scalar_type(), "silu", [&] {
    const auto* gp = gate_up.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T_, std::max<int64_t>(1, kSiluValues / I), [&](int64_t t0, int64_t t1) {
      const Vec one = vec::set1(1.f);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t i = 0; i < I; i += kLanes) {
          const int64_t n = lanes_at(i, I);
          const Vec g = load_n(gp + t * 2 * I + i, n);
          const Vec silu = vec::div(g, vec::add(one, vec::exp(vec::sub(vec::zero(), g))));
          store_n(op + t * I + i,
                  vec::mul(round_to<scalar_t>(silu), load_n(gp + t * 2 * I + I + i, n)), n);
        }
    });
  });
  return out;
}

// ---- rotary embedding and the KV-cache write ----------------------------------------------------

// One head of an INT8 KV cache (kernels.quantize_kv): round(x / scale) in -127..127 with
// scale = max(amax, 1e-8) / 127, then the fp32 scale after the codes.
template <typename T>
void quantize_kv_row(const T* x, int64_t D, int8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(float(x[d])));
  const float scale = std::max(amax, 1e-8f) / 127.f;
  for (int64_t d = 0; d < D; ++d)
    row[d] = int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(float(x[d]) / scale))));
  std::memcpy(row + D, &scale, sizeof scale);
}

// qkv [T, (H + 2 KV) * D]: rotates the first `rot` dims of every q and k head in place (GPT-J
// style, adjacent pairs, fp32 math as the reference), then stores k and v at their slots of the
// [pages, block_size, KV, D] caches (in qkv's dtype), or of INT8 caches [.., D + 4].
inline void rotary_and_write_kv(at::Tensor& qkv, const at::Tensor& positions,
                                const at::Tensor& cos_sin, at::Tensor& k_cache,
                                at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t T_ = qkv.size(0), rot = cos_sin.size(1), half = rot / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  check_rows("rotary_and_write_kv", qkv);
  TORCH_CHECK(qkv.numel() == T_ * row, "rotary_and_write_kv: qkv shape");
  TORCH_CHECK(int8_cache || k_cache.scalar_type() == qkv.scalar_type(),
              "rotary_and_write_kv: the caches are in qkv's dtype or INT8");
  const auto* pos = positions.data_ptr<int64_t>();
  const auto* slots = slot_mapping.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t kv_row = num_kv_heads * head_dim;
  DISPATCH_ACTIVATION_TYPES(qkv.scalar_type(), "rotary", [&] {
    auto* x = qkv.data_ptr<scalar_t>();
    // (for an INT8 cache, these are its rows as bytes: only the write below differs)
    auto* kc = reinterpret_cast<scalar_t*>(k_cache.data_ptr());
    auto* vc = reinterpret_cast<scalar_t*>(v_cache.data_ptr());
    const int64_t vectorised = rot / kLanes * kLanes;
    at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
      // a row's factors by lane: pair i's cos in lanes 2i and 2i + 1, its sin negated in lane 2i
      thread_local std::vector<float> cos2, sin2;
      cos2.resize(rot), sin2.resize(rot);
      for (int64_t t = t0; t < t1; ++t) {
        const float* cos = cs + pos[t] * rot;
        const float* sin = cos + half;
        for (int64_t i = 0; i < half; ++i) {
          cos2[2 * i] = cos2[2 * i + 1] = cos[i];
          sin2[2 * i] = -sin[i], sin2[2 * i + 1] = sin[i];
        }
        scalar_t* xt = x + t * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          scalar_t* head = xt + h * head_dim;
          // (a, b) -> (a cos - b sin, b cos + a sin), rounded as the scalar products are: two
          // products and a sum, no fused multiply-add
          for (int64_t j = 0; j < vectorised; j += kLanes) {
            const Vec v = vec::load(head + j);
            vec::store(head + j, vec::add(vec::mul(v, vec::load(cos2.data() + j)),
                                          vec::mul(vec::swap_pairs(v), vec::load(sin2.data() + j))));
          }
          for (int64_t i = vectorised / 2; i < half; ++i) {
            const float a = float(head[2 * i]), b = float(head[2 * i + 1]);
            head[2 * i] = scalar_t(a * cos[i] - b * sin[i]);
            head[2 * i + 1] = scalar_t(b * cos[i] + a * sin[i]);
          }
        }
        const int64_t slot = slots[t];
        const scalar_t* k = xt + num_heads * head_dim;
        const scalar_t* v = xt + (num_heads + num_kv_heads) * head_dim;
        if (int8_cache) {
          const int64_t width = head_dim + 4;  // codes and scale: kernels.kv_row_width
          auto* krow = reinterpret_cast<int8_t*>(kc) + slot * num_kv_heads * width;
          auto* vrow = reinterpret_cast<int8_t*>(vc) + slot * num_kv_heads * width;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            quantize_kv_row(k + h * head_dim, head_dim, krow + h * width);
            quantize_kv_row(v + h * head_dim, head_dim, vrow + h * width);
          }
        } else {
          std::memcpy(kc + slot * kv_row, k, kv_row * sizeof(scalar_t));
          std::memcpy(vc + slot * kv_row, v, kv_row * sizeof(scalar_t));
        }
      }
    });
  });
}

// ---- greedy sampling ----------------------------------------------------------------------------

// A row's largest value, and whether it holds a NaN (which vec::max does not carry).
struct RowMax {
  float value;
  bool nan;
};

inline RowMax row_max(const float* x, int64_t n) {
  Vec mx = vec::set1(-INFINITY);
  uint32_t nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = vec::load(x + i);
    nan |= vec::nan_lanes(v);
    mx = vec::max(mx, v);
  }
  float best = vec::reduce_max(mx);
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = 1;
    best = std::max(best, x[i]);
  }
  return {best, nan != 0};
}

// The first index of each row's largest value (of its first NaN, if any), as torch.argmax.
inline int64_t argmax_row(const float* x, int64_t n) {
  const auto [best, nan] = row_max(x, n);
  const int64_t i = n / kLanes * kLanes;  // the tail past the last full vector
  const Vec target = vec::set1(best);
  for (int64_t j = 0; j + kLanes <= n; j += kLanes) {
    const Vec v = vec::load(x + j);
    const uint32_t hit = nan ? vec::nan_lanes(v) : vec::equal_lanes(v, target);
    if (hit) return j + __builtin_ctz(hit);
  }
  for (int64_t j = i; j < n; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == best) return j;
  return 0;
}

inline at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: float32 [rows, vocab] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) o[b] = argmax_row(x + b * logits.stride(0), V);
  });
  return out;
}

// ---- random sampling ---------------------------------------------------------------------------

// exp((x - max) * inv_t) for the lanes of x from i on (n - i of them when fewer than a vector);
// lanes past n and -inf logits weigh exactly 0 (vec::exp clamps its argument, so exp(-inf) alone
// would be 1e-38).
inline Vec softmax_weights(const float* x, int64_t i, int64_t n, Vec mx, Vec inv_t) {
  const int left = static_cast<int>(std::min<int64_t>(n - i, kLanes));
  const Vec v = left == kLanes ? vec::load(x + i) : vec::load_first(x + i, left);
  Vec w = vec::exp(vec::mul(vec::sub(v, mx), inv_t));
  if (const uint32_t masked = vec::equal_lanes(v, vec::set1(-INFINITY))) {
    alignas(64) float lanes[kLanes];
    vec::store(lanes, w);
    for (int l = 0; l < kLanes; ++l)
      if (masked >> l & 1) lanes[l] = 0.f;
    w = vec::load(lanes);
  }
  return left == kLanes ? w : vec::keep_first(w, left);
}

// sampler.draw for a row without top-k, top-p or min-p: the first index whose cumulative
// softmax(x / t) mass exceeds u times the whole (inverse CDF), in one call where PyTorch takes a
// dozen small ops. Passes: the row's max; the weights a vector at a time, whose running sums
// (kept in `sums`) are the CDF at vector boundaries; a binary search of those for u * total; the
// lanes of the one vector it lands in. A lane of weight 0 is never the answer: where rounding
// (the lanes summed in order against vec::reduce_add's tree) leaves the crossing past a vector's
// last lane, its last positive lane is. A row with a NaN, or all -inf, gives its argmax.
inline int64_t categorical_row(const float* x, int64_t n, float inv_t, float u,
                               std::vector<float>& sums) {
  const auto [m, nan] = row_max(x, n);
  if (nan || m == -INFINITY) return argmax_row(x, n);
  const Vec mx = vec::set1(m), it = vec::set1(inv_t);
  const int64_t chunks = (n + kLanes - 1) / kLanes;
  sums.resize(chunks);
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    total += vec::reduce_add(softmax_weights(x, c * kLanes, n, mx, it));
    sums[c] = total;
  }
  const float target = u * total;
  int64_t c = std::upper_bound(sums.begin(), sums.end(), target) - sums.begin();
  if (c == chunks)  // u * total rounded up to total: the last vector that adds weight
    c = std::lower_bound(sums.begin(), sums.end(), total) - sums.begin();
  alignas(64) float w[kLanes];
  vec::store(w, softmax_weights(x, c * kLanes, n, mx, it));
  float acc = c > 0 ? sums[c - 1] : 0.f;
  for (int l = 0; l < kLanes; ++l) {
    acc += w[l];
    if (acc > target && w[l] > 0.f) return c * kLanes + l;
  }
  for (int l = kLanes - 1; l >= 0; --l)
    if (w[l] > 0.f) return c * kLanes + l;
  return c * kLanes;  // not reached: the vector found adds weight
}

// One draw per row: logits float32 [rows, vocab] (contiguous rows), inv_temperature and u float32
// [rows], u uniform in [0, 1).
inline at::Tensor categorical_rows(const at::Tensor& logits, const at::Tensor& inv_temperature,
                                   const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "categorical_rows: float32 [rows, vocab] logits with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(inv_temperature.scalar_type() == at::kFloat && inv_temperature.numel() == B &&
                  inv_temperature.is_contiguous() && u.scalar_type() == at::kFloat &&
                  u.numel() == B && u.is_contiguous(),
              "categorical_rows: float32 inv_temperature and u, one per row");
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* t = inv_temperature.data_ptr<float>();
  const float* r = u.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums;
    for (int64_t b = b0; b < b1; ++b)
      o[b] = categorical_row(x + b * logits.stride(0), V, t[b], r[b], sums);
  });
  return out;
}

}  // namespace pagedserve
