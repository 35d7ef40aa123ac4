// LoRA for a flat batch, each row with its own adapter (Punica's BGMV, on the CPU): for every row t
// whose slot s = slots[t] is not -1,
//
//   h = x[t] @ a[s]                                   (shrink: [K] x [K, P*r] -> [P*r], fp32)
//   y[t, col_p : col_p + N_p] += h[p*r : (p+1)*r] @ b_p[s]     (expand, for each part p)
//
// with the parts' columns side by side in y (q, k and v of a fused qkv layer: P = 3, each part
// reading only its own r values of h). The reference is pagedserve/lora/ops.py's
// add_lora_reference. h stays fp32 and each output is rounded once, when it is stored; the rows of
// one slot sit together in the engine's batch, so an adapter's weights come from the cache after
// its first row. Written once against the vector API: the shrink holds a row's h in registers,
// lanes along h, one broadcast of x[k] a step; the expand holds a stretch of y's columns, lanes
// along the columns, one broadcast of h[j] a step; both keep several independent sums in flight.
#pragma once

#include <string>
#include <vector>

#include "vec.h"

namespace pagedserve {

constexpr int64_t kLoraMaxRanks = 1536;  // P * r: three parts of rank 512 (vLLM's largest)

// What lora_add takes: h of at most kLoraMaxRanks values a row (it lives on the stack).
inline std::string lora_add_rejects(int64_t ranks) {
  if (ranks <= kLoraMaxRanks) return "";
  return "parts x rank " + std::to_string(ranks) + " exceeds " + std::to_string(kLoraMaxRanks);
}

// A vector at p: a whole one, or (kTail) the n < kLanes values of a row's last one.
template <bool kTail, typename T>
inline Vec load_at(const T* p, int64_t n) {
  if constexpr (kTail) return load_n(p, n);
  return vec::load(p);
}
template <bool kTail, typename T>
inline void store_at(T* p, Vec v, int64_t n) {
  if constexpr (kTail) return store_n(p, v, n);
  vec::store(p, v);
}

// h[c0, c0 + V vectors) of x [K] @ a [K, R], each vector summed in 4 chains over k (k mod 4) so
// that the fmadds do not wait on each other. V is a constant, so the sums stay in registers.
template <int V, bool kTail, typename T>
void lora_shrink_vectors(const T* x, const T* a, int64_t K, int64_t R, int64_t c0, float* h) {
  constexpr int kChains = 4;
  const int64_t n = kTail ? R - c0 : kLanes;
  Vec acc[kChains][V];
  for (auto& chain : acc)
    for (auto& v : chain) v = vec::zero();
  int64_t k = 0;
  for (; k + kChains <= K; k += kChains) {
    for (int u = 0; u < kChains; ++u) {
      const Vec xk = vec::set1(static_cast<float>(x[k + u]));
      const T* row = a + (k + u) * R + c0;
      for (int v = 0; v < V; ++v) {
        acc[u][v] = vec::fmadd(xk, load_at<kTail>(row + v * kLanes, n), acc[u][v]);
      }
    }
  }
  for (; k < K; ++k) {
    const Vec xk = vec::set1(static_cast<float>(x[k]));
    for (int v = 0; v < V; ++v) {
      acc[0][v] = vec::fmadd(xk, load_at<kTail>(a + k * R + c0 + v * kLanes, n), acc[0][v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const Vec sum = vec::add(vec::add(acc[0][v], acc[1][v]), vec::add(acc[2][v], acc[3][v]));
    store_at<kTail>(h + c0 + v * kLanes, sum, n);
  }
}

// h [R] = x [K] @ a [K, R]: 4 whole vectors at a time, then the rest, then a tail.
template <typename T>
void lora_shrink_row(const T* x, const T* a, int64_t K, int64_t R, float* h) {
  int64_t c0 = 0;
  for (; c0 + 4 * kLanes <= R; c0 += 4 * kLanes) lora_shrink_vectors<4, false>(x, a, K, R, c0, h);
  switch ((R - c0) / kLanes) {
    case 3: lora_shrink_vectors<3, false>(x, a, K, R, c0, h); break;
    case 2: lora_shrink_vectors<2, false>(x, a, K, R, c0, h); break;
    case 1: lora_shrink_vectors<1, false>(x, a, K, R, c0, h); break;
  }
  c0 += (R - c0) / kLanes * kLanes;
  if (c0 < R) lora_shrink_vectors<1, true>(x, a, K, R, c0, h);
}

// y[n0, n0 + V vectors) += h [r] @ b [r, N] there: V independent chains over j.
template <int V, bool kTail, typename T>
void lora_expand_vectors(const float* h, const T* b, int64_t r, int64_t N, int64_t n0, T* y) {
  const int64_t n = kTail ? N - n0 : kLanes;
  Vec acc[V];
  for (int v = 0; v < V; ++v) acc[v] = load_at<kTail>(y + n0 + v * kLanes, n);
  for (int64_t j = 0; j < r; ++j) {
    const Vec hj = vec::set1(h[j]);
    const T* row = b + j * N + n0;
    for (int v = 0; v < V; ++v) {
      acc[v] = vec::fmadd(hj, load_at<kTail>(row + v * kLanes, n), acc[v]);
    }
  }
  for (int v = 0; v < V; ++v) store_at<kTail>(y + n0 + v * kLanes, acc[v], n);
}

// y [N] += h [r] @ b [r, N]: 8 whole vectors of columns at a time, then one at a time, then a tail.
template <typename T>
void lora_expand_row(const float* h, const T* b, int64_t r, int64_t N, T* y) {
  int64_t n0 = 0;
  for (; n0 + 8 * kLanes <= N; n0 += 8 * kLanes) lora_expand_vectors<8, false>(h, b, r, N, n0, y);
  for (; n0 + kLanes <= N; n0 += kLanes) lora_expand_vectors<1, false>(h, b, r, N, n0, y);
  if (n0 < N) lora_expand_vectors<1, true>(h, b, r, N, n0, y);
}

// y [T, sum N_p] += the adapters' products for the rows with a slot; y is changed in place.
inline void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                     const std::vector<at::Tensor>& b, const at::Tensor& slots) {
  const int64_t T = x.size(0), K = x.size(1), R = a.size(2), P = b.size(), Y = y.size(1);
  TORCH_CHECK(P > 0 && R % P == 0, "lora_add: a's columns are the parts' ranks side by side");
  const std::string why = lora_add_rejects(R);
  TORCH_CHECK(why.empty(), "lora_add: ", why);
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous(), "lora_add: contiguous");
  TORCH_CHECK(y.size(0) == T && a.size(1) == K && slots.numel() == T, "lora_add: shapes");
  TORCH_CHECK(slots.scalar_type() == at::kInt, "lora_add: slots are int32");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type(),
              "lora_add: x, y and the adapters in one dtype");
  const int64_t r = R / P;
  std::vector<int64_t> cols(P + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(b[p].is_contiguous() && b[p].scalar_type() == y.scalar_type() &&
                    b[p].size(1) == r && b[p].size(0) == a.size(0),
                "lora_add: part ", p, " is [slots, ", r, ", out], contiguous, in y's dtype");
    cols[p + 1] = cols[p] + b[p].size(2);
  }
  TORCH_CHECK(cols[P] == Y, "lora_add: the parts' columns fill y");
  const int32_t* slot = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] < a.size(0), "lora_add: row ", t, "'s slot ", slot[t], " past the ",
                a.size(0), " slots");
  }
  DISPATCH_ACTIVATION_TYPES(y.scalar_type(), "lora_add", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* as = a.data_ptr<scalar_t>();
    scalar_t* ys = y.data_ptr<scalar_t>();
    std::vector<const scalar_t*> bs(P);
    for (int64_t p = 0; p < P; ++p) bs[p] = b[p].data_ptr<scalar_t>();
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      alignas(64) float h[kLoraMaxRanks];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t s = slot[t];
        if (s < 0) continue;
        lora_shrink_row(xs + t * K, as + s * K * R, K, R, h);
        for (int64_t p = 0; p < P; ++p) {
          const int64_t N = cols[p + 1] - cols[p];
          lora_expand_row(h + p * r, bs[p] + s * r * N, r, N, ys + t * Y + cols[p]);
        }
      }
    });
  });
}

}  // namespace pagedserve
