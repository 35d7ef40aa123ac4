// The two paged attention ops (attention.h: decode rows, prefill_attention.h: prefill chunks),
// compiled in a translation unit of their own (their kernels' instances over every head dim and
// dtype make it the longest of a target's units), which native.py's build runs beside the others.
#include "prefill_attention.h"  // and attention.h

namespace pagedserve {

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                  double scale) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), B = seq_lens.size(0);
  const int64_t block_size = k_cache.size(1), KV = k_cache.size(2);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const std::string why = paged_attention_decode_rejects(D, q.scalar_type());
  TORCH_CHECK(why.empty(), "paged_attention_decode: ", why);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong && query_start_loc.numel() == B + 1,
              "paged_attention_decode: block_tables, seq_lens, query_start_loc [B + 1]: int64");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D &&
                  (int8_cache || q.scalar_type() == k_cache.scalar_type()) &&
                  k_cache.size(3) == (int8_cache ? D + kKvScaleBytes : D),
              "paged_attention_decode: q rows of contiguous heads, caches in q's dtype or INT8");
  const int64_t q_stride = q.stride(0);
  auto out = at::empty({T_, H, D}, q.options());
  const auto* tables = block_tables.data_ptr<int64_t>();
  const auto* lens = seq_lens.data_ptr<int64_t>();
  const auto* starts = query_start_loc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(starts[b + 1] - starts[b] >= 1 && starts[b + 1] - starts[b] <= kFewQueryRows &&
                    starts[b + 1] - starts[b] <= lens[b],
                "paged_attention_decode: 1 to ", kFewQueryRows, " query rows per sequence");
  const int64_t max_blocks = block_tables.size(1), group = H / KV;
  DISPATCH_ACTIVATION_TYPES(q.scalar_type(), "decode_attn", [&] {
    with_kv_caches<scalar_t>(k_cache, v_cache, [&](const auto* kc, const auto* vc) {
      using KT = std::remove_cv_t<std::remove_pointer_t<decltype(kc)>>;
      const auto* qp = q.data_ptr<scalar_t>();
      auto* op = out.data_ptr<scalar_t>();
      const auto task = decode_task_for<scalar_t, KT>(D, DecodeHeadDims{});
      at::parallel_for(0, B * KV, 1, [&](int64_t i0, int64_t i1) {
        thread_local std::vector<float> scores;
        thread_local std::vector<int64_t> offsets;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / KV, kvh = i % KV, start = starts[b];
          task(qp + start * q_stride + kvh * group * D, q_stride, starts[b + 1] - start, kc, vc,
               tables + b * max_blocks, lens[b], block_size, KV, kvh, group, float(scale),
               op + (start * H + kvh * group) * D, H * D, scores, offsets);
        }
      });
    });
  });
  return out;
}

at::Tensor paged_attention_prefill(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                   double scale, int64_t pack_bytes) {
  const int64_t H = q.size(1), D = q.size(2), B = seq_lens.size(0);
  const int64_t block_size = k_cache.size(1), KV = k_cache.size(2);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const std::string why = paged_attention_prefill_rejects(D, q.scalar_type());
  TORCH_CHECK(why.empty(), "paged_attention_prefill: ", why);
  TORCH_CHECK(q.is_contiguous() && (int8_cache || q.scalar_type() == k_cache.scalar_type()) &&
                  k_cache.size(3) == (int8_cache ? D + kKvScaleBytes : D),
              "paged_attention_prefill: contiguous q, caches in q's dtype or INT8");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong && query_start_loc.numel() == B + 1,
              "paged_attention_prefill: block_tables, seq_lens, query_start_loc [B + 1]: int64");
  const auto* tables = block_tables.data_ptr<int64_t>();
  const auto* lens = seq_lens.data_ptr<int64_t>();
  const auto* starts = query_start_loc.data_ptr<int64_t>();
  // the tasks, longest context first (the threads take them in order: the long ones start early)
  struct Task {
    int64_t b, kv_head, row0, rows, keys;
  };
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t chunk = starts[b + 1] - starts[b];
    TORCH_CHECK(chunk >= 1 && chunk <= lens[b], "paged_attention_prefill: 1 to seq_len rows");
    for (int64_t row0 = 0; row0 < chunk; row0 += kPrefillRows)
      for (int64_t h = 0; h < KV; ++h)
        tasks.push_back({b, h, row0, std::min(kPrefillRows, chunk - row0),
                         lens[b] - chunk + std::min(kPrefillRows, chunk - row0) + row0});
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.keys > b.keys; });
  auto out = at::empty_like(q);
  const int64_t max_blocks = block_tables.size(1), group = H / KV;
  const int64_t block_values = D * kKeyBlock;
  // the sequences in the order of their longest task
  std::vector<int64_t> sequences;
  std::vector<bool> listed(B, false);
  for (const Task& t : tasks)
    if (!listed[t.b]) listed[t.b] = true, sequences.push_back(t.b);
  DISPATCH_ACTIVATION_TYPES(q.scalar_type(), "prefill_attn", [&] {
    with_kv_caches<scalar_t>(k_cache, v_cache, [&](const auto* kc, const auto* vc) {
      using KT = std::remove_cv_t<std::remove_pointer_t<decltype(kc)>>;
      constexpr bool kPairs = kPairedScores<scalar_t, KT>;
      const auto kernels = prefill_kernels_for<scalar_t, KT>(D, DecodeHeadDims{});
      const int64_t width = kv_row_width<KT>(D);
      const int64_t key_bytes = kPairs ? sizeof(BFloat16) : sizeof(float);
      const int64_t block_bytes = block_values * (kPairs ? 2 * sizeof(BFloat16) : sizeof(float));
      const auto blocks_of = [&](int64_t b) {  // a sequence's blocks, of all its KV heads
        return KV * ((lens[b] + kKeyBlock - 1) / kKeyBlock);
      };
      const auto* qp = q.data_ptr<scalar_t>();
      auto* op = out.data_ptr<scalar_t>();
      // Rounds of sequences: each packs its sequences' blocks (every KV head's of a sequence
      // after the last's), then runs their tasks. A round packs at most pack_bytes, or one
      // sequence's blocks: without rounds, a call over many long contexts would hold a copy of a
      // layer's keys and values of them all.
      std::vector<int64_t> round, first_block, slot(B), round_of(B, -1);
      for (size_t next = 0, rounds = 0; next < sequences.size(); ++rounds) {
        round.assign(1, sequences[next++]);
        int64_t packed = blocks_of(round[0]);
        while (next < sequences.size() &&
               (packed + blocks_of(sequences[next])) * block_bytes <= pack_bytes)
          packed += blocks_of(sequences[next]), round.push_back(sequences[next++]);
        first_block.assign(1, 0);
        for (const int64_t b : round) {
          slot[b] = first_block.back(), round_of[b] = int64_t(rounds);
          first_block.push_back(first_block.back() + blocks_of(b));
        }
        const at::Tensor keys =
            at::empty({packed * block_values * key_bytes}, q.options().dtype(at::kByte));
        const at::Tensor value_pairs =
            at::empty({kPairs ? packed * block_values : 0}, q.options().dtype(at::kBFloat16));
        const auto blocks_at = [&](int64_t block) {  // the round's packed blocks from this one on
          return PackedBlocks{
              keys.data_ptr<uint8_t>() + block * block_values * key_bytes,
              kPairs ? value_pairs.data_ptr<BFloat16>() + block * block_values : nullptr};
        };
        at::parallel_for(0, packed, 1, [&](int64_t u0, int64_t u1) {
          int64_t rows[kKeyBlock];
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t i = std::upper_bound(first_block.begin(), first_block.end(), u) -
                              first_block.begin() - 1;
            const int64_t b = round[i], per_head = blocks_of(b) / KV;
            const int64_t h = (u - first_block[i]) / per_head;
            const int64_t k0 = (u - first_block[i]) % per_head * kKeyBlock;
            const int64_t n = std::min<int64_t>(kKeyBlock, lens[b] - k0);
            token_offsets(tables + b * max_blocks, k0, n, block_size, KV, h, width, rows);
            const PackedBlocks to = blocks_at(u);
            kernels.pack(kc, vc, rows, n, to.keys, to.value_pairs);
          }
        });
        std::vector<const Task*> round_tasks;  // (longest first, as the call's)
        for (const Task& t : tasks)
          if (round_of[t.b] == int64_t(rounds)) round_tasks.push_back(&t);
        std::atomic<int64_t> next_task{0};  // each thread takes the next task when it is done
        at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
          thread_local PrefillScratch scratch;
          for (int64_t i; (i = next_task++) < int64_t(round_tasks.size());) {
            const Task& t = *round_tasks[i];
            const int64_t start = starts[t.b], chunk = starts[t.b + 1] - start;
            kernels.task(qp + start * H * D, op + start * H * D, H * D, t.row0, t.rows, chunk,
                         blocks_at(slot[t.b] + t.kv_head * blocks_of(t.b) / KV), vc,
                         tables + t.b * max_blocks, lens[t.b], block_size, KV, t.kv_head, group,
                         float(scale), scratch);
          }
        });
      }
    });
  });
  return out;
}

}  // namespace pagedserve
