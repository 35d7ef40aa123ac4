// Row-wise kernels, written once against the vector API: RMSNorm (with the residual add fused),
// SiLU-and-mul, rotary + KV-cache write, and the greedy argmax.
#pragma once

#include "vec.h"

namespace pagedserve {

// ---- RMSNorm, with the residual add fused -------------------------------------------------------

// y = w * (x * rsqrt(mean(x^2) + eps)) with HF's rounding: normalise in fp32, round, then scale.
template <typename T>
void rms_norm_row(const T* x, const T* w, int64_t H, float eps, T* y) {
  Vec ss = vec::zero();
  for (int64_t i = 0; i < H; i += kLanes) {
    const Vec v = vec::load(x + i);
    ss = vec::fmadd(v, v, ss);
  }
  const Vec r = vec::set1(1.f / std::sqrt(vec::reduce_add(ss) / H + eps));
  for (int64_t i = 0; i < H; i += kLanes)
    vec::store(y + i, vec::mul(vec::load(w + i), round_to<T>(vec::mul(vec::load(x + i), r))));
}

inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  TORCH_CHECK(H % 16 == 0 && x.is_contiguous(), "rms_norm: contiguous rows of a multiple of 16");
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
  TORCH_CHECK(H % 16 == 0 && x.is_contiguous() && residual.is_contiguous(),
              "add_rms_norm: contiguous rows of a multiple of 16");
  auto y = at::empty_like(x);
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    auto* rp = residual.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t i = 0; i < H; i += kLanes)
          vec::store(rp + t * H + i, vec::add(vec::load(xp + t * H + i), vec::load(rp + t * H + i)));
        rms_norm_row(rp + t * H, wp, H, float(eps), yp + t * H);
      }
    });
  });
  return y;
}

// ---- SiLU and multiply --------------------------------------------------------------------------

// [T, 2I] -> [T, I]: silu(gate) * up, each op rounded to the dtype as PyTorch's two ops are.
inline at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t I = gate_up.size(-1) / 2, T_ = gate_up.numel() / (2 * I);
  TORCH_CHECK(I % 16 == 0 && gate_up.is_contiguous(), "silu_and_mul: contiguous, I % 16 == 0");
  auto out = at::empty({T_, I}, gate_up.options());
  DISPATCH_ACTIVATION_TYPES(gate_up.scalar_type(), "silu", [&] {
    const auto* gp = gate_up.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
      const Vec one = vec::set1(1.f);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t i = 0; i < I; i += kLanes) {
          const Vec g = vec::load(gp + t * 2 * I + i);
          const Vec silu = vec::div(g, vec::add(one, vec::exp(vec::sub(vec::zero(), g))));
          vec::store(op + t * I + i,
                     vec::mul(round_to<scalar_t>(silu), vec::load(gp + t * 2 * I + I + i)));
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
  TORCH_CHECK(qkv.is_contiguous() && qkv.numel() == T_ * row, "rotary_and_write_kv: qkv shape");
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

// The first index of each row's largest value (of its first NaN, if any), as torch.argmax.
inline int64_t argmax_row(const float* x, int64_t n) {
  Vec mx = vec::set1(-INFINITY);
  uint32_t nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = vec::load(x + i);
    nan |= vec::nan_lanes(v);
    mx = vec::max(mx, v);
  }
  float best = vec::reduce_max(mx);
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) nan = 1;
    best = std::max(best, x[j]);
  }
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

}  // namespace pagedserve
