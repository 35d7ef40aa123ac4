// A linear layer as the native kernels hold it, and the one call that runs it: the target's own
// INT4 kernel where it has one (int4_<target>.h), PyTorch's INT4 kernel where it has none, or a
// dense weight. The choice is the one CpuDevice.linear makes, so a fused decoder layer computes
// exactly what the model's op-by-op path does.
#pragma once

#include <string>

#include "dense.h"
#include "int4.h"
#include "vec.h"

namespace pagedserve {

// W4A8's activations as PyTorch rounds them (int4.quantize_activations_int8): int8 per block of 32
// values of each row, then back to the input dtype (the INT4 layers' K is whole blocks).
inline at::Tensor quantize_activations_int8(const at::Tensor& x) {
  const at::Tensor blocks = x.to(at::kFloat).view({x.size(0), x.size(1) / 32, 32});
  const at::Tensor scale = blocks.abs().amax({-1}, true).clamp_min(1e-8) / 127.0;
  return (at::round(blocks / scale).clamp(-127, 127) * scale).view_as(x).to(x.scalar_type());
}

// A dense layer, by the one rule the fused decoder layer and CpuDevice.linear share: bf16 rows
// through the few-rows GEMV where it beats oneDNN (dense.h: few_rows), a prompt's rows through
// the tile unit's GEMM where the CPU has one (amx.h: gemm_usable; oneDNN re-lays the weights out
// at every call, and adds a bias in a pass of its own), more of them on avx2
// through oneDNN's fp32 GEMM on the widened (exact) values, since these CPUs have no bf16
// arithmetic and oneDNN's bf16 GEMM is emulated there (3 to 5 times slower from 64 rows on);
// anything else through at::linear.
inline at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16;
  if (bf16 && kHasFewRowsGemv && few_rows(x.size(0), weight.size(0), x.size(1)) &&
      x.size(1) % 32 == 0)
    return bf16_linear_few_rows(x, weight, bias);
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
  if (bf16 && amx::gemm_usable(x.size(0), weight.size(0), x.size(1)))
    return bf16_linear_many_rows(x, weight, bias);
#endif
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX2
  if (bf16) {
    c10::optional<at::Tensor> fp32_bias;
    if (bias) fp32_bias = bias->to(at::kFloat);
    return at::linear(x.to(at::kFloat), weight.to(at::kFloat), fp32_bias).to(x.scalar_type());
  }
#endif
  return at::linear(x, weight, bias);
}

struct NativeLinear {
  enum class Kind { kTargetInt4, kAtenInt4, kDense };
  Kind kind = Kind::kDense;
  at::Tensor packed, scales_zeros;  // INT4; undefined when dense
  int64_t group_size = 0;
  bool int8_activations = false;  // W4A8
  at::Tensor weight;              // dense [N, K]; undefined for an INT4 layer
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0;       // INT4: the layer's rows (its packing may pad them)

  // layout: Int4Linear.layout (this target's, or "aten") or "dense".
  NativeLinear(const std::string& layout, c10::optional<at::Tensor> packed_,
               c10::optional<at::Tensor> scales_zeros_, int64_t group_size_,
               bool int8_activations_, c10::optional<at::Tensor> weight_,
               c10::optional<at::Tensor> bias_, int64_t out_features_)
      : packed(packed_.value_or(at::Tensor())),
        scales_zeros(scales_zeros_.value_or(at::Tensor())),
        group_size(group_size_),
        int8_activations(int8_activations_),
        weight(weight_.value_or(at::Tensor())),
        bias(bias_),
        out_features(out_features_) {
    const bool target = PAGEDSERVE_HAS_INT4 &&
                        layout == (int8_activations ? kInt4A8Layout : kInt4Layout);
    if (target) kind = Kind::kTargetInt4;
    else if (layout == "aten") kind = Kind::kAtenInt4;
    else TORCH_CHECK(layout == "dense", "NativeLinear: layout ", layout, " is not this target's");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case Kind::kTargetInt4:
#if PAGEDSERVE_HAS_INT4
        return int8_activations
                   ? int4_int8_linear(x, packed, scales_zeros, group_size, bias, out_features)
                   : int4_linear(x, packed, scales_zeros, group_size, bias, out_features);
#endif
      case Kind::kAtenInt4: {
        const at::Tensor rows = int8_activations ? quantize_activations_int8(x) : x;
        at::Tensor out = at::_weight_int4pack_mm_for_cpu(rows.to(at::kBFloat16).contiguous(),
                                                         packed, group_size, scales_zeros);
        if (bias) out = out + bias->to(out.scalar_type());
        return out.to(x.scalar_type());
      }
      case Kind::kDense:
      default:
        return dense_linear(x, weight, bias);
    }
  }
};

}  // namespace pagedserve
