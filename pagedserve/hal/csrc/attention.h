// Paged attention for decoding rows (one query per sequence, or a few with draft tokens),
// straight from the pages; written once against the vector API. On an AMX CPU (avx512), bf16
// queries over bf16 pages of whole 16-key tiles take the tile unit for the scores and for the
// weighted values, whose weights it takes rounded to bf16 (as a bf16 matmul of them would).
#pragma once

#include <string>
#include <utility>

#include "elementwise.h"  // rows_rejects; first, with vec.h: it defines the targets amx.h tests
#include "amx.h"

namespace pagedserve {

// An INT8 KV cache row (kernels.py): head_dim int8 codes, then their fp32 scale.
constexpr int64_t kKvScaleBytes = 4;
template <typename KT>
constexpr int64_t kv_row_width(int64_t D) {
  return std::is_same_v<KT, int8_t> ? D + kKvScaleBytes : D;
}
inline float kv_row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// Calls fn(k, v) with the caches' data as T (q's dtype) or as INT8 rows (codes and scale).
template <typename T, typename Fn>
void with_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const Fn& fn) {
  if (k_cache.scalar_type() == at::kChar)
    fn(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  else
    fn(k_cache.data_ptr<T>(), v_cache.data_ptr<T>());
}

// Where tokens first .. first + count - 1 of one KV head start in the caches (rows of `width`
// elements), page by page, into offsets[0 .. count).
inline void token_offsets(const int64_t* pages, int64_t first, int64_t count, int64_t block_size,
                          int64_t num_kv_heads, int64_t kv_head, int64_t width,
                          int64_t* offsets) {
  for (int64_t i = 0, b = first / block_size, in_page = first % block_size; i < count;
       ++b, in_page = 0)
    for (int64_t slot = pages[b] * block_size + in_page;
         slot < (pages[b] + 1) * block_size && i < count; ++slot, ++i)
      offsets[i] = (slot * num_kv_heads + kv_head) * width;
}
// ... of every token of a context of seq_len, into offsets (resized).
inline void token_offsets(const int64_t* pages, int64_t seq_len, int64_t block_size,
                          int64_t num_kv_heads, int64_t kv_head, int64_t width,
                          std::vector<int64_t>& offsets) {
  offsets.resize(seq_len);
  token_offsets(pages, 0, seq_len, block_size, num_kv_heads, kv_head, width, offsets.data());
}

// q . k for kLanes tokens at once (fewer at the end of the context: n). bf16: exact products of
// pairs (vdpbf16ps where the target has it), summed in fp32 (q comes out of a bf16 layer, so it
// is already bf16). fp32 and fp16: fp32 FMAs; an INT8 cache's codes widened, the dot product
// times each token's scale. D is a compile-time head dim so that the loops unroll into registers.
template <typename T, typename KT, int D>
inline Vec score_block(const T* q, const KT* k_cache, const int64_t* offsets, int64_t n) {
  constexpr bool kPairs =
      std::is_same_v<T, BFloat16> && std::is_same_v<KT, BFloat16> && D % (2 * kLanes) == 0;
  Vec partial[kLanes];
  if constexpr (kPairs) {
    constexpr int kVecs = D / (2 * kLanes);
    vec::Bf16Pairs qv[kVecs];
    for (int d = 0; d < kVecs; ++d) qv[d] = vec::load_pairs(q + d * 2 * kLanes);
    for (int j = 0; j < kLanes; ++j) {
      partial[j] = vec::zero();
      if (j >= n) continue;
      const KT* k = k_cache + offsets[j];
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
      const KT* k = k_cache + offsets[j];
      for (int d = 0; d < kVecs; ++d) partial[j] = vec::fmadd(qv[d], vec::load(k + d * kLanes), partial[j]);
    }
  }
  if constexpr (std::is_same_v<KT, int8_t>) {
    alignas(64) float scales[kLanes] = {};
    for (int j = 0; j < n; ++j) scales[j] = kv_row_scale(k_cache + offsets[j], D);
    return vec::mul(vec::sum_lanes(partial), vec::load(scales));
  } else {
    return vec::sum_lanes(partial);
  }
}

#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
// Whether the tile unit computes a task's scores: bf16 queries and keys, whole tiles of 16 keys
// in each page, the unit granted (amx.h).
template <typename T, typename KT, int D>
inline bool amx_scores_usable(int64_t block_size) {
  return std::is_same_v<T, BFloat16> && std::is_same_v<KT, BFloat16> && D % 32 == 0 &&
         block_size % 16 == 0 && amx::enabled();
}

// scale * (q . k) of M <= 16 query vectors (qv [M, D], contiguous) with every key of the
// context, on the tile unit: 16 keys of a page (cache rows, loaded with their token stride) are
// tile A, the query vectors packed in pairs along the head dim tile B, and tile C holds the 16 x
// M scores. A vector's scores do not depend on the vectors beside it, so one decode row and a
// verification's rows get the same. Keys past seq_len in the last page are read (the page is
// whole) and their scores are never used. The tiles are all stored before any is read back: a
// load right after a tile store waits for it (reading each C at once cost more than the dot
// products saved).
template <int D>
__attribute__((target("amx-tile,amx-bf16"))) void amx_scores(
    const BFloat16* qv, int64_t M, const BFloat16* k_cache, const int64_t* pages, int64_t seq_len,
    int64_t block_size, int64_t token_stride, float scale, float* scores, int64_t stride) {
  const std::vector<BFloat16> packed = amx::pack_rows(qv, M, D);
  thread_local std::vector<float> by_key;  // [key][vector], as the tiles store them
  by_key.resize(stride * M);
  amx::TileConfig config;
  config.rows[0] = 16, config.colsb[0] = M * 4;  // C: 16 keys x M vectors, fp32
  config.rows[1] = 16, config.colsb[1] = 64;     // A: 16 keys x 32 values of the head dim
  config.rows[2] = 16, config.colsb[2] = M * 4;  // B: 16 pairs along the head dim x M vectors
  _tile_loadconfig(&config);
  for (int64_t t0 = 0; t0 < seq_len; t0 += 16) {
    const BFloat16* k =
        k_cache + (pages[t0 / block_size] * block_size + t0 % block_size) * token_stride;
    _tile_zero(0);
    for (int d = 0; d < D; d += 32) {
      _tile_loadd(1, k + d, token_stride * sizeof(BFloat16));
      _tile_loadd(2, packed.data() + d * M, M * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, by_key.data() + t0 * M, M * 4);
  }
  _tile_release();
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(M));
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < M; ++j)  // vector j's scores: column j
    for (int64_t t0 = 0; t0 < seq_len; t0 += 16)
      _mm512_storeu_ps(scores + j * stride + t0,
                       _mm512_mul_ps(_mm512_i32gather_ps(column, by_key.data() + t0 * M + j, 4),
                                     scale_v));
}

// out = P V for M <= 16 query vectors, P their softmax weights (p: fp32 rows of `stride`, zero
// past each vector's visible keys; the first `last` keys are read), on the tile unit: the weights
// of 32 keys, rounded to bf16, are tile A (M x 32), and the 32 keys' value rows, interleaved in
// pairs of keys, are tile B of each 16 dims of the head; the C tiles hold M x 16 dims each, four
// at a time. Vector j's output goes to out + (j0 + j) / group * out_stride + (j0 + j) % group * D.
template <int D>
__attribute__((target("amx-tile,amx-bf16"))) void amx_weighted_values(
    const float* p, int64_t stride, int64_t M, const BFloat16* v_cache, const int64_t* offsets,
    int64_t last, int64_t j0, int64_t group, BFloat16* out, int64_t out_stride) {
  constexpr int kDimTiles = D / 16, kTilesAtOnce = 4;
  const int64_t keys = (last + 31) / 32 * 32;
  thread_local std::vector<BFloat16> weights;  // [M][keys], bf16 pairs of keys for tile A
  weights.assign(M * keys, BFloat16{});
  for (int64_t j = 0; j < M; ++j)
    for (int64_t t = 0; t < last; t += kLanes)  // whole vectors: keys is a multiple of 32
      vec::store(weights.data() + j * keys + t,
                 vec::load_first(p + j * stride + t, int(std::min<int64_t>(kLanes, last - t))));
  amx::TileConfig config;
  for (int c = 0; c < kTilesAtOnce; ++c) config.rows[c] = M, config.colsb[c] = 64;  // C: M x 16
  config.rows[4] = M, config.colsb[4] = 64;    // A: M vectors x 32 keys' weights
  config.rows[5] = 16, config.colsb[5] = 64;   // B: 16 pairs of keys x 16 dims
  _tile_loadconfig(&config);
  // tile B of each dim tile: pairs of keys; two sets, so that the next 32 keys' values are
  // interleaved while the tile unit takes the last (a tile load of data just stored waits)
  alignas(64) uint32_t values[2][kTilesAtOnce][16][16];
  alignas(64) float sums[kTilesAtOnce][amx::kMaxRows][16];
  const auto interleave = [&](int64_t t0, int d0, int n, uint32_t (*tiles)[16][16]) {
    for (int pair = 0; pair < 16; ++pair) {  // keys t0 + 2 pair (low word) and the next
      const int64_t t = t0 + 2 * pair;
      for (int d = 0; d < n; ++d) {
        const int64_t dim = (d0 + d) * 16;
        const auto row = [&](int64_t key) {
          return key < last ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(v_cache + offsets[key] + dim)))
                            : _mm512_setzero_si512();
        };
        _mm512_store_si512(tiles[d][pair], _mm512_or_si512(row(t), _mm512_slli_epi32(row(t + 1), 16)));
      }
    }
  };
  for (int d0 = 0; d0 < kDimTiles; d0 += kTilesAtOnce) {
    const int n = std::min(kTilesAtOnce, kDimTiles - d0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    interleave(0, d0, n, values[0]);
    for (int64_t t0 = 0, i = 0; t0 < keys; t0 += 32, ++i) {
      if (t0 + 32 < keys) interleave(t0 + 32, d0, n, values[(i + 1) & 1]);
      uint32_t(*tiles)[16][16] = values[i & 1];
      _tile_loadd(4, weights.data() + t0, keys * sizeof(BFloat16));
      // the tile numbers are immediates: a statement per C tile
      _tile_loadd(5, tiles[0], 64);
      _tile_dpbf16ps(0, 4, 5);
      if (n > 1) {
        _tile_loadd(5, tiles[1], 64);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (n > 2) {
        _tile_loadd(5, tiles[2], 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (n > 3) {
        _tile_loadd(5, tiles[3], 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, sums[0], 64);
    if (n > 1) {
      _tile_stored(1, sums[1], 64);
    }
    if (n > 2) {
      _tile_stored(2, sums[2], 64);
    }
    if (n > 3) {
      _tile_stored(3, sums[3], 64);
    }
    for (int d = 0; d < n; ++d)
      for (int64_t j = 0; j < M; ++j) {
        const int64_t v = j0 + j;
        vec::store(out + v / group * out_stride + v % group * D + (d0 + d) * 16,
                   vec::load(sums[d][j]));
      }
  }
  _tile_release();
}
#endif

inline void softmax_inplace(float* s, int64_t n) {
  // the maximum over whole vectors, then the tail (a scalar chain of max over every score cost
  // as much as the exponentials)
  Vec mv = vec::set1(-INFINITY);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) mv = vec::max(mv, vec::load(s + t));
  float mx = vec::reduce_max(mv);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  Vec sum = vec::zero();
  for (t = 0; t < n; t += kLanes) {
    const int left = int(std::min<int64_t>(kLanes, n - t));
    const Vec e = vec::exp(vec::sub(vec::load_first(s + t, left), vec::set1(mx)));
    vec::store_first(s + t, e, left);
    sum = vec::add(sum, vec::keep_first(e, left));
  }
  const Vec inv = vec::set1(1.f / vec::reduce_add(sum));
  for (t = 0; t < n; t += kLanes) {
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

// One (sequence, KV head): its `rows` query rows (the last `rows` positions of a context of
// `seq_len`: one when decoding, a few with draft tokens) times its `group` query heads read each key
// and value of the sequence once, straight from the pages (no gather), with an exact fp32
// softmax; row i attends to the first seq_len - rows + 1 + i positions (causal).
template <typename T, typename KT, int D>
void decode_attention_task(const T* q, int64_t q_stride, int64_t rows, const KT* k_cache,
                           const KT* v_cache, const int64_t* pages, int64_t seq_len,
                           int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
                           int64_t group, float scale, T* out, int64_t out_stride,
                           std::vector<float>& scores, std::vector<int64_t>& offsets) {
  const int64_t stride = (seq_len + kLanes - 1) / kLanes * kLanes, vectors = rows * group;
  scores.resize(vectors * stride);
  token_offsets(pages, seq_len, block_size, num_kv_heads, kv_head, kv_row_width<KT>(D), offsets);
  // query vector j: row j / group, head j % group
  const auto query = [&](int64_t j) { return q + (j / group) * q_stride + (j % group) * D; };
  bool scored = false;
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<KT, BFloat16>) {
    if (amx_scores_usable<T, KT, D>(block_size)) {
      alignas(64) BFloat16 qv[amx::kMaxRows * D];  // up to 16 query vectors, contiguous
      for (int64_t j0 = 0; j0 < vectors; j0 += amx::kMaxRows) {
        const int64_t m = std::min<int64_t>(amx::kMaxRows, vectors - j0);
        for (int64_t j = 0; j < m; ++j) std::memcpy(qv + j * D, query(j0 + j), D * sizeof(T));
        amx_scores<D>(qv, m, k_cache + kv_head * D, pages, seq_len, block_size,
                      num_kv_heads * D, scale, scores.data() + j0 * stride, stride);
      }
      scored = true;
    }
  }
#endif
  for (int64_t j = 0; j < vectors; ++j) {
    const int64_t visible = seq_len - rows + 1 + j / group;
    float* s = scores.data() + j * stride;
    for (int64_t t0 = 0; t0 < visible && !scored; t0 += kLanes) {
      const Vec block = score_block<T, KT, D>(query(j), k_cache, offsets.data() + t0,
                                          std::min<int64_t>(kLanes, visible - t0));
      vec::store(s + t0, vec::mul(block, vec::set1(scale)));
    }
    softmax_inplace(s, visible);
    std::fill(s + visible, s + seq_len, 0.f);  // the positions after this row's own
    if constexpr (std::is_same_v<KT, int8_t>)  // each value row's scale, into its weight
      for (int64_t t = 0; t < visible; ++t) s[t] *= kv_row_scale(v_cache + offsets[t], D);
  }
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<KT, BFloat16>) {
    if (scored) {  // the tile unit's pass for the weighted values too
      for (int64_t j0 = 0; j0 < vectors; j0 += amx::kMaxRows) {
        const int64_t m = std::min<int64_t>(amx::kMaxRows, vectors - j0);
        const int64_t last = seq_len - rows + 1 + (j0 + m - 1) / group;
        amx_weighted_values<D>(scores.data() + j0 * stride, stride, m, v_cache, offsets.data(),
                               last, j0, group, out, out_stride);
      }
      return;
    }
  }
#endif
  // softmax(scores) . V with the accumulators in registers: a pass covers kDims vectors of the
  // head dim for kHeads query vectors, within three quarters of the target's registers.
  constexpr int kBudget = vec::kRegisters * 3 / 4, DV = D / kLanes;
  constexpr int kDims = largest_divisor_at_most(DV, kBudget);
  constexpr int kHeads = kDims >= kBudget ? 1 : kBudget / kDims;
  for (int64_t j0 = 0; j0 < vectors; j0 += kHeads) {
    const int64_t hn = std::min<int64_t>(kHeads, vectors - j0);
    const int64_t last = seq_len - rows + 1 + (j0 + hn - 1) / group;  // what the last one sees
    for (int d0 = 0; d0 < DV; d0 += kDims) {
      Vec acc[kHeads][kDims];
      for (int h = 0; h < kHeads; ++h)
        for (int d = 0; d < kDims; ++d) acc[h][d] = vec::zero();
      for (int64_t t = 0; t < last; ++t) {
        const KT* v = v_cache + offsets[t] + d0 * kLanes;
        Vec vv[kDims];
        for (int d = 0; d < kDims; ++d) vv[d] = vec::load(v + d * kLanes);
        for (int h = 0; h < kHeads; ++h) {
          if (h >= hn) break;
          const Vec p = vec::set1(scores[(j0 + h) * stride + t]);
          for (int d = 0; d < kDims; ++d) acc[h][d] = vec::fmadd(p, vv[d], acc[h][d]);
        }
      }
      for (int64_t h = 0; h < hn; ++h) {
        const int64_t j = j0 + h;
        T* o = out + (j / group) * out_stride + (j % group) * D + d0 * kLanes;
        for (int d = 0; d < kDims; ++d) vec::store(o + d * kLanes, acc[h][d]);
      }
    }
  }
}

template <typename T, typename KT>
using DecodeTaskFn = void (*)(const T*, int64_t, int64_t, const KT*, const KT*, const int64_t*,
                              int64_t, int64_t, int64_t, int64_t, int64_t, float, T*, int64_t,
                              std::vector<float>&, std::vector<int64_t>&);

// The head dims the decode kernel is compiled for: its loops over a head unroll into registers.
using DecodeHeadDims = std::integer_sequence<int, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256>;

template <typename T, typename KT, int... Ds>
DecodeTaskFn<T, KT> decode_task_for(int64_t D, std::integer_sequence<int, Ds...>) {
  DecodeTaskFn<T, KT> task = nullptr;
  ((D == Ds ? task = decode_attention_task<T, KT, Ds> : task), ...);
  return task;
}

template <int... Ds>
std::string head_dims_text(std::integer_sequence<int, Ds...>) {
  std::string text;
  ((text += (text.empty() ? "" : ", ") + std::to_string(Ds)), ...);
  return text;
}

template <int... Ds>
constexpr bool is_one_of(int64_t head_dim, std::integer_sequence<int, Ds...>) {
  return ((head_dim == Ds) || ...);
}

// What paged_attention_decode takes: a compiled head dim, queries in an activation dtype (the
// caches in that dtype or INT8, as the engine allocates them). The kernel checks its input with
// it, and the Python dispatch (CpuDevice) asks it when a model loads.
inline std::string paged_attention_decode_rejects(int64_t head_dim, at::ScalarType dtype) {
  if (!is_one_of(head_dim, DecodeHeadDims{}))
    return "head_dim " + std::to_string(head_dim) + " is not one the kernel is compiled for (" +
           head_dims_text(DecodeHeadDims{}) + ")";
  return rows_rejects(dtype);
}

// The most query rows per sequence this kernel takes (a decode row and its draft tokens); longer
// chunks are prefills, which run SDPA over the gathered context.
constexpr int64_t kFewQueryRows = 8;

// q [T, H, D]: sequence b's query rows are query_start_loc[b] .. query_start_loc[b + 1], at the
// last positions of its context of seq_lens[b] tokens (one row each when decoding). The caches are
// in q's dtype, or INT8 rows (codes and scale) read as they are.
at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                  double scale);  // (attention.cpp)

}  // namespace pagedserve
