// One GLM-4 / GLM-4-0414 decoder layer for a batch of decoding sequences (each with one query row,
// or a few with draft tokens: kFewQueryRows), in one call: the same
// kernels, in the same order and with the same roundings, as GlmForCausalLM._decoder_layer runs
// them one HAL op at a time (the tests hold the two bit-identical), without a trip back to Python
// between ops. A decode step at batch 1 is a few milliseconds, and each Python round trip costs a
// few microseconds: about 40 of them per layer added up to a fifth of the step.
#pragma once

#include "attention.h"
#include "elementwise.h"
#include "linear.h"

namespace pagedserve {

struct GlmDecoderLayer {
  NativeLinear qkv_proj, o_proj, gate_up_proj, down_proj;
  at::Tensor input_layernorm, post_attention_layernorm;
  c10::optional<at::Tensor> post_self_attn_layernorm, post_mlp_layernorm;  // GLM-4-0414 only
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;

  // h [T, hidden]: the previous layer's output (T rows: every sequence's query rows); residual: the residual stream (None before the
  // first layer), updated in place. Returns this layer's output and the residual stream.
  std::tuple<at::Tensor, at::Tensor> forward(
      const at::Tensor& h, c10::optional<at::Tensor> residual, const at::Tensor& positions,
      const at::Tensor& cos_sin, at::Tensor& k_cache, at::Tensor& v_cache,
      const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
      const at::Tensor& query_start_loc) {
    const int64_t T_ = h.size(0);
    at::Tensor res = residual.has_value() ? *residual : h;
    at::Tensor x = residual.has_value() ? add_rms_norm(h, res, input_layernorm, eps)
                                        : rms_norm(h, input_layernorm, eps);
    at::Tensor qkv = qkv_proj(x);
    rotary_and_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads,
                        num_kv_heads, head_dim);
    at::Tensor q = qkv.view({T_, num_heads + 2 * num_kv_heads, head_dim}).narrow(1, 0, num_heads);
    at::Tensor o = paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                          query_start_loc, scale);
    at::Tensor attn = o_proj(o.view({T_, num_heads * head_dim}));
    if (post_self_attn_layernorm) attn = rms_norm(attn, *post_self_attn_layernorm, eps);
    x = add_rms_norm(attn, res, post_attention_layernorm, eps);
    at::Tensor mlp = down_proj(silu_and_mul(gate_up_proj(x)));
    if (post_mlp_layernorm) mlp = rms_norm(mlp, *post_mlp_layernorm, eps);
    return {mlp, res};
  }
};

}  // namespace pagedserve
