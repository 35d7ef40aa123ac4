// Paged attention for decoding rows (one query per sequence), straight from the pages.
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

// q . k for 16 tokens at once (fewer at the end of the context: n). bf16: 32 exact products per
// vdpbf16ps, summed in fp32 (q comes out of a bf16 layer, so it is already bf16). fp32 and fp16:
// fp32 FMAs. D is a compile-time head dim so that the loops unroll into registers.
template <typename T, int D>
inline __m512 scores16(const T* q, const T* k_cache, const int64_t* offsets, int64_t n) {
  constexpr bool kPairs = std::is_same_v<T, BFloat16> && D % 32 == 0;
  constexpr int kVecs = kPairs ? D / 32 : D / 16;
  __m512i qv[kVecs];
  for (int d = 0; d < kVecs; ++d)
    qv[d] = kPairs ? _mm512_loadu_si512(q + d * 32) : _mm512_castps_si512(load16(q + d * 16));
  __m512 partial[16];
  for (int j = 0; j < 16; ++j) {
    partial[j] = _mm512_setzero_ps();
    if (j >= n) continue;
    const T* k = k_cache + offsets[j];
    for (int d = 0; d < kVecs; ++d) {
      if constexpr (kPairs)
        partial[j] = _mm512_dpbf16_ps(partial[j], (__m512bh)qv[d],
                                      (__m512bh)_mm512_loadu_si512(k + d * 32));
      else
        partial[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(qv[d]), load16(k + d * 16), partial[j]);
    }
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
template <typename T, int D>
void decode_attention_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* pages,
                           int64_t seq_len, int64_t block_size, int64_t num_kv_heads,
                           int64_t kv_head, int64_t group, float scale, T* out,
                           std::vector<float>& scores, std::vector<int64_t>& offsets) {
  const int64_t stride = (seq_len + 15) / 16 * 16;
  scores.resize(group * stride);
  token_offsets(pages, seq_len, block_size, num_kv_heads, kv_head, D, offsets);
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t t0 = 0; t0 < seq_len; t0 += 16) {
      const __m512 s = scores16<T, D>(q + h * D, k_cache, offsets.data() + t0,
                                      std::min<int64_t>(16, seq_len - t0));
      _mm512_storeu_ps(scores.data() + h * stride + t0, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
    }
    softmax_inplace(scores.data() + h * stride, seq_len);
  }
  constexpr int DV = D / 16, kHeadsPerPass = DV >= 24 ? 1 : 24 / DV;
  for (int64_t h0 = 0; h0 < group; h0 += kHeadsPerPass) {  // accumulators stay in registers
    const int64_t hn = std::min<int64_t>(kHeadsPerPass, group - h0);
    __m512 acc[kHeadsPerPass][DV];
    for (int h = 0; h < kHeadsPerPass; ++h)
      for (int d = 0; d < DV; ++d) acc[h][d] = _mm512_setzero_ps();
    for (int64_t t = 0; t < seq_len; ++t) {
      const T* v = v_cache + offsets[t];
      __m512 vv[DV];
      for (int d = 0; d < DV; ++d) vv[d] = load16(v + d * 16);
      for (int h = 0; h < kHeadsPerPass; ++h) {
        if (h >= hn) break;
        const __m512 p = _mm512_set1_ps(scores[(h0 + h) * stride + t]);
        for (int d = 0; d < DV; ++d) acc[h][d] = _mm512_fmadd_ps(p, vv[d], acc[h][d]);
      }
    }
    for (int64_t h = 0; h < hn; ++h)
      for (int d = 0; d < DV; ++d) store16(out + (h0 + h) * D + d * 16, acc[h][d]);
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
