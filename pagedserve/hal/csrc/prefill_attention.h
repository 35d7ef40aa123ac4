// Paged causal attention for the query rows of prefill chunks (a prompt, or a part of one after
// its cached prefix), straight from the pages; written once against the vector API.
//
// A task is one (sequence, KV head, block of query positions): the block's positions times the
// KV head's group of query heads make one matrix of query vectors that reads each key and value
// of the KV head once (GQA's reuse). Keys come in blocks of kKeyBlock, which each call packs once
// for all its tasks (pack_block; in rounds of sequences, at most kPackBytes a round): transposed
// into fp32 columns, or bf16 pairs along the head dim (kPairedScores), with the values then as
// pairs of keys. The scores of every query vector with a block are a small GEMM (register tiles
// of rows x 4 vectors of keys), an online softmax keeps each row's running maximum and sum
// (FlashAttention's), and the weighted values add into fp32 outputs (register tiles of rows x up
// to 8 vectors of the head). Row i of a chunk of L rows in a context of C tokens sees keys
// 0 .. C - L + i. Threads take the tasks, longest context first.
#pragma once

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "attention.h"  // DecodeHeadDims, kv_row_width, token_offsets, rows_rejects

namespace pagedserve {

constexpr int kKeyBlock = 4 * kLanes;  // a score tile's width: 4 vectors
constexpr int64_t kPrefillRows = 16;   // query positions a task takes
// The most bytes of packed keys and values a call holds at once (paged_attention_prefill's
// rounds), beyond one sequence's: GLM-4-9B's two KV heads of a 128K-token context in bf16 take
// 128 MiB.
constexpr int64_t kPackBytes = int64_t{256} << 20;

// What paged_attention_prefill takes: the head dims decode attention is compiled for, queries in
// an activation dtype. The kernel checks its input with it, and the Python dispatch (CpuDevice)
// asks it when a model loads.
inline std::string paged_attention_prefill_rejects(int64_t head_dim, at::ScalarType dtype) {
  return paged_attention_decode_rejects(head_dim, dtype);
}

// The per-thread scratch of one task.
struct PrefillScratch {
  std::vector<float> q, scores, out, row_max, row_sum, rescale;
  std::vector<BFloat16> q_pairs, weights;  // bf16 queries and softmax weights, where paired
  std::vector<int64_t> offsets, seen;
};

// Whether a task's scores are bf16 dot products of pairs along the head dim (one vdpbf16ps for
// two fp32 FMAs): bf16 queries (a bf16 layer's output, so nothing is rounded) and keys, on a
// target whose dot_pairs is one instruction. The products are exact, as the FMAs' are; the sums
// are fp32 in another order, as decode attention's (score_block) are. Its weighted values are
// then dot products of pairs of keys, the softmax weights rounded to bf16 for them, as PyTorch's
// CPU flash attention rounds them for its bf16 GEMM of weights and values (the sum that divides
// them stays fp32 in both).
template <typename T, typename KT>
constexpr bool kPairedScores =
    vec::kNativePairs && std::is_same_v<T, BFloat16> && std::is_same_v<KT, BFloat16>;
// pack_block writes the pairs as 32-bit words.
static_assert(!vec::kNativePairs || (vec::pair_slot(1, 0) == 2 && vec::pair_slot(1, 1) == 3),
              "a native pair is one 32-bit word, its first value in the low half");

// scores[r][0 .. kKeyBlock) = q[r] . keys[:, j] for R query vectors (q: [R][D], scaled; keys: the
// block transposed, [D][kKeyBlock]), RB rows at a time in registers.
template <int D>
inline void block_scores(const float* q, int64_t R, const float* keys, float* scores) {
  constexpr int RB = std::max(1, (vec::kRegisters * 3 / 4 - 4) / 4);  // beside the 4 keys
  int64_t r = 0;
  for (; r + RB <= R; r += RB) {
    Vec acc[RB][4];
    for (int i = 0; i < RB; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = vec::zero();
    for (int d = 0; d < D; ++d) {
      Vec k[4];
      for (int v = 0; v < 4; ++v) k[v] = vec::load(keys + d * kKeyBlock + v * kLanes);
      for (int i = 0; i < RB; ++i) {
        const Vec qv = vec::set1(q[(r + i) * D + d]);
        for (int v = 0; v < 4; ++v) acc[i][v] = vec::fmadd(qv, k[v], acc[i][v]);
      }
    }
    for (int i = 0; i < RB; ++i)
      for (int v = 0; v < 4; ++v) vec::store(scores + (r + i) * kKeyBlock + v * kLanes, acc[i][v]);
  }
  for (; r < R; ++r) {
    Vec acc[4] = {vec::zero(), vec::zero(), vec::zero(), vec::zero()};
    for (int d = 0; d < D; ++d) {
      const Vec qv = vec::set1(q[r * D + d]);
      for (int v = 0; v < 4; ++v)
        acc[v] = vec::fmadd(qv, vec::load(keys + d * kKeyBlock + v * kLanes), acc[v]);
    }
    for (int v = 0; v < 4; ++v) vec::store(scores + r * kKeyBlock + v * kLanes, acc[v]);
  }
}

// scores[r][0 .. kKeyBlock) = scale * (q[r] . keys[:, j]) for R bf16 query vectors (q: [R][D])
// and the block's keys as pairs along the head dim (key_pairs: for each of the D / 2 pairs, the
// 4 vectors of keys as load_pairs reads them), RB rows at a time in registers.
template <int D>
inline void block_scores_pairs(const BFloat16* q, int64_t R, const BFloat16* key_pairs,
                               float scale, float* scores) {
  constexpr int RB = std::max(1, (vec::kRegisters * 3 / 4 - 4) / 4);  // beside the 4 key vectors
  const auto rows = [&](int64_t r, auto rb) {
    constexpr int B = decltype(rb)::value;
    Vec acc[B][4];
    for (int i = 0; i < B; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = vec::zero();
    for (int d = 0; d < D / 2; ++d) {
      vec::Bf16Pairs k[4];
      for (int v = 0; v < 4; ++v) k[v] = vec::load_pairs(key_pairs + (d * 4 + v) * 2 * kLanes);
      for (int i = 0; i < B; ++i) {
        const vec::Bf16Pairs qp = vec::set1_pair(q + (r + i) * D + 2 * d);
        for (int v = 0; v < 4; ++v) acc[i][v] = vec::dot_pairs(acc[i][v], qp, k[v]);
      }
    }
    for (int i = 0; i < B; ++i)
      for (int v = 0; v < 4; ++v)
        vec::store(scores + (r + i) * kKeyBlock + v * kLanes, vec::mul(acc[i][v], vec::set1(scale)));
  };
  int64_t r = 0;
  for (; r + RB <= R; r += RB) rows(r, std::integral_constant<int, RB>{});
  for (; r < R; ++r) rows(r, std::integral_constant<int, 1>{});
}

// The weighted values' register tiles: kValueTileRows rows x kValueTileDims vectors of the head,
// within three quarters of the target's registers beside a key's kValueTileDims values.
template <int D>
constexpr int kValueTileDims = largest_divisor_at_most(D / kLanes, vec::kRegisters / 4);
template <int D>
constexpr int kValueTileRows =
    std::max(1, (vec::kRegisters * 3 / 4 - kValueTileDims<D>) / kValueTileDims<D>);

// out[r] = out[r] * rescale[r] + (the block's weighted values of row r) for R rows [R][D], a tile
// at a time: add_block(acc, r0, rows, d0) adds the block's products for rows r0 .. r0 + rows - 1
// and the tile's vectors from d0 into acc [kValueTileRows][kValueTileDims].
template <int D, typename AddBlock>
inline void add_to_value_tiles(const float* rescale, int64_t R, float* out,
                               const AddBlock& add_block) {
  constexpr int DV = D / kLanes, DC = kValueTileDims<D>, RB = kValueTileRows<D>;
  for (int d0 = 0; d0 < DV; d0 += DC) {
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const int64_t rows = std::min<int64_t>(RB, R - r0);
      Vec acc[RB][DC];
      for (int i = 0; i < RB; ++i) {
        if (i >= rows) break;
        const Vec c = vec::set1(rescale[r0 + i]);
        for (int d = 0; d < DC; ++d)
          acc[i][d] = vec::mul(vec::load(out + (r0 + i) * D + (d0 + d) * kLanes), c);
      }
      add_block(acc, r0, rows, d0);
      for (int i = 0; i < RB; ++i) {
        if (i >= rows) break;
        for (int d = 0; d < DC; ++d) vec::store(out + (r0 + i) * D + (d0 + d) * kLanes, acc[i][d]);
      }
    }
  }
}

// out[r] = out[r] * rescale[r] + sum_j p[r][j] v_j for R rows, over the n <= kKeyBlock values of
// the block (value j at v_cache + offsets[j], a scale per row from an INT8 cache folded into p).
template <typename KT, int D>
inline void add_weighted_values(const float* p, const float* rescale, int64_t R, const KT* v_cache,
                                const int64_t* offsets, int64_t n, float* out) {
  constexpr int DC = kValueTileDims<D>, RB = kValueTileRows<D>;
  add_to_value_tiles<D>(rescale, R, out, [&](Vec (&acc)[RB][DC], int64_t r0, int64_t rows, int d0) {
    for (int64_t j = 0; j < n; ++j) {
      Vec vv[DC];
      for (int d = 0; d < DC; ++d) vv[d] = vec::load(v_cache + offsets[j] + (d0 + d) * kLanes);
      for (int i = 0; i < RB; ++i) {
        if (i >= rows) break;
        const Vec w = vec::set1(p[(r0 + i) * kKeyBlock + j]);
        for (int d = 0; d < DC; ++d) acc[i][d] = vec::fmadd(w, vv[d], acc[i][d]);
      }
    }
  });
}

// One block of the online softmax of R rows: scores [R][kKeyBlock], of which row r sees the first
// seen[r] (overwritten past them). Each row's running maximum and sum take the block in; rescale[r]
// is what the row's weighted values so far are to be multiplied by, and weights [R][kKeyBlock]
// (fp32, which may be the scores, or bf16) get exp(score - maximum), zero past seen[r]. The
// corrections exp(old - new maximum) are computed kLanes rows at a time, and each row's sum is
// reduced once (a scalar exp and a reduction per vector, a row, took 7-17% more time).
template <typename W>
inline void online_softmax(float* scores, int64_t R, const int64_t* seen, float* row_max,
                           float* row_sum, float* rescale, W* weights) {
  for (int64_t r = 0; r < R; ++r) {  // the new maxima, in rescale for now
    float* sr = scores + r * kKeyBlock;
    std::fill(sr + std::max<int64_t>(seen[r], 0), sr + kKeyBlock, -INFINITY);
    Vec block_max = vec::set1(row_max[r]);
    for (int64_t j = 0; j < kKeyBlock; j += kLanes)
      block_max = vec::max(block_max, vec::load(sr + j));
    rescale[r] = vec::reduce_max(block_max);
  }
  for (int64_t r = 0; r < R; r += kLanes) {  // (every row sees key 0: each maximum is finite)
    const int left = int(std::min<int64_t>(kLanes, R - r));
    const Vec old_max = vec::load_first(row_max + r, left);
    const Vec new_max = vec::load_first(rescale + r, left);
    vec::store_first(rescale + r, vec::exp(vec::sub(old_max, new_max)), left);
    vec::store_first(row_max + r, new_max, left);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* sr = scores + r * kKeyBlock;
    W* wr = weights + r * kKeyBlock;
    const Vec m = vec::set1(row_max[r]);
    Vec sum = vec::zero();
    for (int64_t j = 0; j < kKeyBlock; j += kLanes) {
      const int64_t lanes = std::clamp<int64_t>(seen[r] - j, 0, kLanes);
      if (lanes == 0) {  // past the row's last key (a block on the diagonal)
        vec::store(wr + j, vec::zero());
        continue;
      }
      const Vec e = vec::keep_first(vec::exp(vec::sub(vec::load(sr + j), m)), int(lanes));
      vec::store(wr + j, e);
      sum = vec::add(sum, e);
    }
    row_sum[r] = row_sum[r] * rescale[r] + vec::reduce_add(sum);
  }
}

// out[r] = out[r] * rescale[r] + sum_j p[r][j] v_j for R rows, over the n <= kKeyBlock values of
// the block, all bf16 and in pairs of keys: p [R][kKeyBlock] (zeros past each row's keys), the
// block's values as pack_block lays them out (zeros past the context), one dot_pairs for two keys.
template <int D>
inline void add_weighted_value_pairs(const BFloat16* p, const float* rescale, int64_t R,
                                     const BFloat16* value_pairs, int64_t n, float* out) {
  constexpr int DV = D / kLanes, DC = kValueTileDims<D>, RB = kValueTileRows<D>;
  add_to_value_tiles<D>(rescale, R, out, [&](Vec (&acc)[RB][DC], int64_t r0, int64_t rows, int d0) {
    for (int64_t j = 0; j < n; j += 2) {
      vec::Bf16Pairs vv[DC];
      for (int d = 0; d < DC; ++d)
        vv[d] = vec::load_pairs(value_pairs + (j / 2 * DV + d0 + d) * 2 * kLanes);
      for (int i = 0; i < RB; ++i) {
        if (i >= rows) break;
        const vec::Bf16Pairs w = vec::set1_pair(p + (r0 + i) * kKeyBlock + j);
        for (int d = 0; d < DC; ++d) acc[i][d] = vec::dot_pairs(acc[i][d], w, vv[d]);
      }
    }
  });
}

// One block of a KV head's keys as every task of the call reads it (each task once transposed its
// own copy of every block it read: the blocks early in a prompt, which every later task sees,
// were transposed over and over, 11-15% of a 512-token prompt's attention), from the n <=
// kKeyBlock cache rows at `rows` (zeros past them):
// - paired scores: keys in pairs along the head dim (for each of the D / 2 pairs, the block's 4
//   vectors of keys as load_pairs reads them), and values in pairs of keys (for each of the
//   kKeyBlock / 2 pairs, the D / kLanes vectors of the head), D * kKeyBlock bf16 each;
// - otherwise: keys as fp32 columns [D][kKeyBlock], an INT8 row's scale applied (the values are
//   read from the cache).
template <typename T, typename KT, int D>
void pack_block(const KT* k_cache, const KT* v_cache, const int64_t* rows, int64_t n, void* keys,
                BFloat16* value_pairs) {
  if constexpr (kPairedScores<T, KT>) {
    // a pair is one 32-bit word (asserted beside kPairedScores): keys [D / 2][kKeyBlock] words,
    // values [kKeyBlock / 2][D]
    const auto word = [](BFloat16 first, BFloat16 second) {
      return uint32_t(first.x) | uint32_t(second.x) << 16;
    };
    static const BFloat16 kZeros[D] = {};
    auto* key_words = static_cast<uint32_t*>(keys);
    auto* value_words = reinterpret_cast<uint32_t*>(value_pairs);
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const BFloat16* kj = j < n ? k_cache + rows[j] : kZeros;
      for (int d = 0; d < D / 2; ++d) key_words[d * kKeyBlock + j] = word(kj[2 * d], kj[2 * d + 1]);
    }
    for (int64_t j = 0; j < kKeyBlock; j += 2) {
      const BFloat16* v0 = j < n ? v_cache + rows[j] : kZeros;
      const BFloat16* v1 = j + 1 < n ? v_cache + rows[j + 1] : kZeros;
      for (int d = 0; d < D; ++d) value_words[j / 2 * D + d] = word(v0[d], v1[d]);
    }
  } else {
    auto* columns = static_cast<float*>(keys);
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const KT* kj = j < n ? k_cache + rows[j] : nullptr;
      const float ks = kj && std::is_same_v<KT, int8_t> ? kv_row_scale(
          reinterpret_cast<const int8_t*>(kj), D) : 1.f;
      for (int d = 0; d < D; ++d) columns[d * kKeyBlock + j] = kj ? float(kj[d]) * ks : 0.f;
    }
  }
}

// A (sequence, KV head)'s packed blocks: block b's keys at keys + b * D * kKeyBlock (bf16 pairs or
// fp32 columns), its value pairs (paired scores only) at value_pairs + b * D * kKeyBlock.
struct PackedBlocks {
  void* keys;
  BFloat16* value_pairs;
};

// One task: `rows` query positions from chunk row `row0` of a sequence whose chunk of `chunk`
// rows ends its context of seq_len tokens, times the `group` query heads of KV head kv_head.
// q and out: the chunk's first row, `stride` elements a row (all heads).
template <typename T, typename KT, int D>
void prefill_attention_task(const T* q, T* out, int64_t stride, int64_t row0, int64_t rows,
                            int64_t chunk, const PackedBlocks& blocks, const KT* v_cache,
                            const int64_t* pages, int64_t seq_len, int64_t block_size,
                            int64_t num_kv_heads, int64_t kv_head, int64_t group, float scale,
                            PrefillScratch& s) {
  constexpr bool kPairs = kPairedScores<T, KT>;
  constexpr int64_t kBlockValues = D * kKeyBlock;
  const int64_t R = rows * group, first_pos = seq_len - chunk + row0;
  const int64_t visible = first_pos + rows;  // the last row's keys: 0 .. visible - 1
  s.out.assign(R * D, 0.f), s.scores.resize(R * kKeyBlock), s.rescale.resize(R), s.seen.resize(R);
  s.row_max.assign(R, -INFINITY), s.row_sum.assign(R, 0.f);
  // query vector r: position row0 + r / group, head kv_head * group + r % group
  const auto query = [&](int64_t r) {
    return q + (row0 + r / group) * stride + (kv_head * group + r % group) * D;
  };
  if constexpr (kPairs) {
    s.q_pairs.resize(R * D), s.weights.resize(R * kKeyBlock);
    for (int64_t r = 0; r < R; ++r) std::copy(query(r), query(r) + D, s.q_pairs.data() + r * D);
  } else {
    // where the values are in the cache (and an INT8 cache's scales)
    token_offsets(pages, visible, block_size, num_kv_heads, kv_head, kv_row_width<KT>(D),
                  s.offsets);
    s.q.resize(R * D);
    for (int64_t r = 0; r < R; ++r)
      for (int d = 0; d < D; d += kLanes)
        vec::store(s.q.data() + r * D + d, vec::mul(vec::load(query(r) + d), vec::set1(scale)));
  }
  for (int64_t k0 = 0; k0 < visible; k0 += kKeyBlock) {
    const int64_t n = std::min<int64_t>(kKeyBlock, visible - k0);
    const int64_t block = k0 / kKeyBlock;
    if constexpr (kPairs)
      block_scores_pairs<D>(s.q_pairs.data(), R,
                            static_cast<const BFloat16*>(blocks.keys) + block * kBlockValues,
                            scale, s.scores.data());
    else
      block_scores<D>(s.q.data(), R, static_cast<const float*>(blocks.keys) + block * kBlockValues,
                      s.scores.data());
    // each row's keys in the block (causal, and the block's): position i's group of rows sees
    // first_pos + i + 1 - k0
    for (int64_t i = 0, r = 0; i < rows; ++i)
      for (int64_t h = 0; h < group; ++h, ++r) s.seen[r] = std::min(n, first_pos + i + 1 - k0);
    if constexpr (kPairs) {
      online_softmax(s.scores.data(), R, s.seen.data(), s.row_max.data(), s.row_sum.data(),
                     s.rescale.data(), s.weights.data());
    } else {
      online_softmax(s.scores.data(), R, s.seen.data(), s.row_max.data(), s.row_sum.data(),
                     s.rescale.data(), s.scores.data());
      if constexpr (std::is_same_v<KT, int8_t>)  // each value row's scale, into its weight
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < s.seen[r]; ++j)
            s.scores[r * kKeyBlock + j] *= kv_row_scale(v_cache + s.offsets[k0 + j], D);
    }
    if constexpr (kPairs)
      add_weighted_value_pairs<D>(s.weights.data(), s.rescale.data(), R,
                                  blocks.value_pairs + block * kBlockValues, n, s.out.data());
    else
      add_weighted_values<KT, D>(s.scores.data(), s.rescale.data(), R, v_cache,
                                 s.offsets.data() + k0, n, s.out.data());
  }
  for (int64_t r = 0; r < R; ++r) {
    T* o = out + (row0 + r / group) * stride + (kv_head * group + r % group) * D;
    const Vec inv = vec::set1(1.f / s.row_sum[r]);
    for (int d = 0; d < D; d += kLanes) vec::store(o + d, vec::mul(vec::load(s.out.data() + r * D + d), inv));
  }
}

// A head dim's kernels: packing a block, and a task.
template <typename T, typename KT>
struct PrefillKernels {
  void (*pack)(const KT*, const KT*, const int64_t*, int64_t, void*, BFloat16*);
  void (*task)(const T*, T*, int64_t, int64_t, int64_t, int64_t, const PackedBlocks&, const KT*,
               const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
               PrefillScratch&);
};

template <typename T, typename KT, int... Ds>
PrefillKernels<T, KT> prefill_kernels_for(int64_t D, std::integer_sequence<int, Ds...>) {
  PrefillKernels<T, KT> kernels{nullptr, nullptr};
  ((D == Ds ? kernels = {pack_block<T, KT, Ds>, prefill_attention_task<T, KT, Ds>} : kernels),
   ...);
  return kernels;
}

// q [T, H, D]: sequence b's query rows are query_start_loc[b] .. query_start_loc[b + 1], the last
// positions of its context of seq_lens[b] tokens (all of them a prefill chunk's). The caches are
// in q's dtype, or INT8 rows (codes and scale) read as they are. pack_bytes: the most bytes of
// packed blocks held at once (kPackBytes; a test asks for less, to run a call in rounds).
at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                   double scale,
                                   int64_t pack_bytes = kPackBytes);  // (attention.cpp)

}  // namespace pagedserve
