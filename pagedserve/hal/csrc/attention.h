// Paged attention for decoding rows (one query per sequence), straight from the pages; written
// once against the vector API.
#pragma once

#include "vec.h"

namespace pagedserve {

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

// q . k for kLanes tokens at once (fewer at the end of the context: n). bf16: exact products of
// pairs (vdpbf16ps where the target has it), summed in fp32 (q comes out of a bf16 layer, so it
// is already bf16). fp32 and fp16: fp32 FMAs. D is a compile-time head dim so that the loops
// unroll into registers.
template <typename T, int D>
inline Vec score_block(const T* q, const T* k_cache, const int64_t* offsets, int64_t n) {
  constexpr bool kPairs = std::is_same_v<T, BFloat16> && D % (2 * kLanes) == 0;
  Vec partial[kLanes];
  if constexpr (kPairs) {
    constexpr int kVecs = D / (2 * kLanes);
    vec::Bf16Pairs qv[kVecs];
    for (int d = 0; d < kVecs; ++d) qv[d] = vec::load_pairs(q + d * 2 * kLanes);
    for (int j = 0; j < kLanes; ++j) {
      partial[j] = vec::zero();
      if (j >= n) continue;
      const T* k = k_cache + offsets[j];
      for (int d = 0; d < kVecs; ++d)
        partial[j] = vec::dot_pairs(partial[j], qv[d], vec::load_pairs(k + d * 2 * kLanes));
    }
  } else {
    constexpr int kVecs = D / kLanes;
    Vec qv[kVecs];
    for (int d = 0; d < kVecs; ++d) qv[d] = vec::load(q + d * kLanes);
    for (int j = 0; j < kLanes; ++j) {
      partial[j] = vec::zero();
      if (j >= n) continue;
      const T* k = k_cache + offsets[j];
      for (int d = 0; d < kVecs; ++d) partial[j] = vec::fmadd(qv[d], vec::load(k + d * kLanes), partial[j]);
    }
  }
  return vec::sum_lanes(partial);
}

inline void softmax_inplace(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  Vec sum = vec::zero();
  for (int64_t t = 0; t < n; t += kLanes) {
    const int left = int(std::min<int64_t>(kLanes, n - t));
    const Vec e = vec::exp(vec::sub(vec::load_first(s + t, left), vec::set1(mx)));
    vec::store_first(s + t, e, left);
    sum = vec::add(sum, vec::keep_first(e, left));
  }
  const Vec inv = vec::set1(1.f / vec::reduce_add(sum));
  for (int64_t t = 0; t < n; t += kLanes) {
    const int left = int(std::min<int64_t>(kLanes, n - t));
    vec::store_first(s + t, vec::mul(vec::load_first(s + t, left), inv), left);
  }
}

// The largest divisor of n that is at most limit (at least 1).
constexpr int largest_divisor_at_most(int n, int limit) {
  for (int d = limit < n ? limit : n; d > 1; --d)
    if (n % d == 0) return d;
  return 1;
}

// One (sequence, KV head): its `group` query heads read each key and value of the sequence once,
// straight from the pages (no gather), with an exact fp32 softmax.
template <typename T, int D>
void decode_attention_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* pages,
                           int64_t seq_len, int64_t block_size, int64_t num_kv_heads,
                           int64_t kv_head, int64_t group, float scale, T* out,
                           std::vector<float>& scores, std::vector<int64_t>& offsets) {
  const int64_t stride = (seq_len + kLanes - 1) / kLanes * kLanes;
  scores.resize(group * stride);
  token_offsets(pages, seq_len, block_size, num_kv_heads, kv_head, D, offsets);
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t t0 = 0; t0 < seq_len; t0 += kLanes) {
      const Vec s = score_block<T, D>(q + h * D, k_cache, offsets.data() + t0,
                                      std::min<int64_t>(kLanes, seq_len - t0));
      vec::store(scores.data() + h * stride + t0, vec::mul(s, vec::set1(scale)));
    }
    softmax_inplace(scores.data() + h * stride, seq_len);
  }
  // softmax(scores) . V with the accumulators in registers: a pass covers kDims vectors of the
  // head dim for kHeads query heads, within three quarters of the target's registers.
  constexpr int kBudget = vec::kRegisters * 3 / 4, DV = D / kLanes;
  constexpr int kDims = largest_divisor_at_most(DV, kBudget);
  constexpr int kHeads = kDims >= kBudget ? 1 : kBudget / kDims;
  for (int64_t h0 = 0; h0 < group; h0 += kHeads) {
    const int64_t hn = std::min<int64_t>(kHeads, group - h0);
    for (int d0 = 0; d0 < DV; d0 += kDims) {
      Vec acc[kHeads][kDims];
      for (int h = 0; h < kHeads; ++h)
        for (int d = 0; d < kDims; ++d) acc[h][d] = vec::zero();
      for (int64_t t = 0; t < seq_len; ++t) {
        const T* v = v_cache + offsets[t] + d0 * kLanes;
        Vec vv[kDims];
        for (int d = 0; d < kDims; ++d) vv[d] = vec::load(v + d * kLanes);
        for (int h = 0; h < kHeads; ++h) {
          if (h >= hn) break;
          const Vec p = vec::set1(scores[(h0 + h) * stride + t]);
          for (int d = 0; d < kDims; ++d) acc[h][d] = vec::fmadd(p, vv[d], acc[h][d]);
        }
      }
      for (int64_t h = 0; h < hn; ++h)
        for (int d = 0; d < kDims; ++d)
          vec::store(out + (h0 + h) * D + (d0 + d) * kLanes, acc[h][d]);
    }
  }
}

template <typename T>
using DecodeTaskFn = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, int64_t,
                              int64_t, int64_t, int64_t, float, T*, std::vector<float>&,
                              std::vector<int64_t>&);

template <typename T>
DecodeTaskFn<T> decode_task_for(int64_t D) {
  switch (D) {
    case 16: return decode_attention_task<T, 16>;
    case 32: return decode_attention_task<T, 32>;
    case 48: return decode_attention_task<T, 48>;
    case 64: return decode_attention_task<T, 64>;
    case 80: return decode_attention_task<T, 80>;
    case 96: return decode_attention_task<T, 96>;
    case 112: return decode_attention_task<T, 112>;
    default: return decode_attention_task<T, 128>;
  }
}

inline at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= 128, "paged_attention_decode: head_dim must be 16..128, x16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_attention_decode: block_tables and seq_lens must be int64");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && q.scalar_type() == k_cache.scalar_type(),
              "paged_attention_decode: q rows of contiguous heads, in the cache's dtype");
  const int64_t q_stride = q.stride(0);
  auto out = at::empty({B, H, D}, q.options());
  const auto* tables = block_tables.data_ptr<int64_t>();
  const auto* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), group = H / KV;
  DISPATCH_ACTIVATION_TYPES(q.scalar_type(), "decode_attn", [&] {
    const auto* qp = q.data_ptr<scalar_t>();
    const auto* kc = k_cache.data_ptr<scalar_t>();
    const auto* vc = v_cache.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    const auto task = decode_task_for<scalar_t>(D);
    at::parallel_for(0, B * KV, 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> scores;
      thread_local std::vector<int64_t> offsets;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / KV, kvh = i % KV;
        task(qp + b * q_stride + kvh * group * D, kc, vc, tables + b * max_blocks, lens[b],
             block_size, KV, kvh, group, float(scale), op + (b * H + kvh * group) * D, scores,
             offsets);
      }
    });
  });
  return out;
}

}  // namespace pagedserve
