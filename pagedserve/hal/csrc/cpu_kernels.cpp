// Native CPU kernels for the `cpu` and `kunlun-emu` backends: what a decode step spends its time
// on, written for AVX-512 with BF16 and VNNI dot products (Zen 4, Sapphire Rapids, Cooper Lake).
//
//   linear.h          INT4 GEMM over tiles of 16 rows (bf16 or int8 activations); a dense bf16
//                     GEMV for a few rows
//   elementwise.h     RMSNorm (+ residual add), SiLU-and-mul, rotary + KV-cache write, argmax
//   attention.h       paged attention for decoding rows, straight from the pages
//   decoder_layer.h   one GLM-4 decoder layer for a decode step, in one call
//   vec.h             the AVX-512 helpers they share
//
// Each kernel has a plain-PyTorch reference (pagedserve/hal/kernels.py, int4.py) and the tests hold
// it to that reference. pagedserve/hal/native.py builds this file once per machine (cached on disk)
// and falls back to eager PyTorch where there is no compiler or no AVX-512 BF16.

#include <torch/extension.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define PAGEDSERVE_NATIVE 1
#include "decoder_layer.h"
#else
#define PAGEDSERVE_NATIVE 0
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("available") = bool(PAGEDSERVE_NATIVE);
#if PAGEDSERVE_NATIVE
  using namespace pagedserve;
  m.attr("FEW_ROWS") = kFewRows;
  m.def("int4_linear", &int4_linear);
  m.def("int4_int8_linear", &int4_int8_linear);
  m.def("bf16_linear_few_rows", &bf16_linear_few_rows);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_and_write_kv", &rotary_and_write_kv);
  m.def("paged_attention_decode", &paged_attention_decode);
  m.def("argmax_rows", &argmax_rows);

  pybind11::class_<NativeLinear>(m, "NativeLinear")
      .def(pybind11::init([](c10::optional<at::Tensor> packed,
                             c10::optional<at::Tensor> scales_zeros, int64_t group_size,
                             bool int8_activations, c10::optional<at::Tensor> weight,
                             c10::optional<at::Tensor> bias) {
             return NativeLinear{packed.value_or(at::Tensor()), scales_zeros.value_or(at::Tensor()),
                                 group_size, int8_activations, weight.value_or(at::Tensor()), bias};
           }),
           pybind11::arg("packed"), pybind11::arg("scales_zeros"), pybind11::arg("group_size"),
           pybind11::arg("int8_activations"), pybind11::arg("weight"), pybind11::arg("bias"));
  pybind11::class_<GlmDecoderLayer>(m, "GlmDecoderLayer")
      .def(pybind11::init<NativeLinear, NativeLinear, NativeLinear, NativeLinear, at::Tensor,
                          at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          int64_t, int64_t, int64_t, double, double>(),
           pybind11::arg("qkv_proj"), pybind11::arg("o_proj"), pybind11::arg("gate_up_proj"),
           pybind11::arg("down_proj"), pybind11::arg("input_layernorm"),
           pybind11::arg("post_attention_layernorm"), pybind11::arg("post_self_attn_layernorm"),
           pybind11::arg("post_mlp_layernorm"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"),
           pybind11::arg("scale"))
      .def("forward", &GlmDecoderLayer::forward);
#endif
}
