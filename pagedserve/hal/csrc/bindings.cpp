// Native CPU kernels for the `cpu` and `kunlun-emu` backends: the PyTorch binding of one target.
// pagedserve/hal/native.py compiles this file with int4.cpp and attention.cpp (the INT4 GEMMs
// and the attention ops, whose instances took about half of a one-file build, as translation units
// of their own, compiled at once) into one library per instruction-set target the CPU can run,
// with PAGEDSERVE_TARGET naming it and only that target's compiler flags:
//
//   vec.h, vec/<target>.h   the vector API: avx512 (16 lanes), avx2 (8), portable (plain C++)
//   elementwise.h           RMSNorm (+ residual add), SiLU-and-mul, rotary + KV write, argmax,
//                           the random draw
//   attention.h             paged attention for decoding rows, straight from the pages
//   prefill_attention.h     paged causal attention for prefill chunks (online softmax)
//                           (both ops compiled in attention.cpp)
//   dense.h                 a bf16 GEMV for a few rows (amx.h: on the AMX tile unit, and
//                           there a GEMM for a prompt's rows)
//     (these are written once against the vector API)
//   int4_avx512.h           INT4 GEMMs per target, each with its own packed layout (int4.py)
//   int4_avx2.h
//   int4.h                  the target's INT4 layouts and layers, compiled in int4.cpp
//   int4_limits.h           what the INT4 kernels take (each op states its limits beside it:
//                           rows_rejects, paged_attention_decode_rejects, int4_linear_rejects)
//   linear.h                one linear layer: the target's INT4 kernel, PyTorch's, or dense
//   decoder_layer.h         one GLM-4 decoder layer for a decode step, in one call
//   lora.h                  LoRA adapters for a flat batch, each row its own (written once)
//
// Each kernel has a plain-PyTorch reference (pagedserve/hal/kernels.py, int4.py) and the tests hold
// every target the machine can run to it. An op a target lacks (no INT4 kernel on portable) is not
// bound here, and the backend runs PyTorch's for it.

// pybind11 with torch's tensor casters, not torch/extension.h: that one also brings in all of
// libtorch's C++ frontend, which this file does not use, and with ATen/ATen.h (see vec.h) it took
// a third of each target's build
#include <torch/csrc/utils/pybind.h>

#include "decoder_layer.h"
#include "lora.h"
#include "prefill_attention.h"

#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
#define PAGEDSERVE_TARGET_NAME "avx512"
#elif PAGEDSERVE_TARGET == PAGEDSERVE_AVX2
#define PAGEDSERVE_TARGET_NAME "avx2"
#else
#define PAGEDSERVE_TARGET_NAME "portable"
#endif

// Every target's library defines the same C++ names: each keeps its own (they are built with
// hidden visibility, and the classes are local to their module).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pagedserve;
  m.attr("TARGET") = PAGEDSERVE_TARGET_NAME;
#if defined(__AVXVNNI__)
  m.attr("AVX_VNNI") = true;
#else
  m.attr("AVX_VNNI") = false;
#endif
  // What each op takes (its own statement, next to it): "" where it takes these sizes, else why
  // not. CpuDevice asks before it runs an op natively; the kernels check their input with them.
  m.def("rows_rejects", &rows_rejects);
  m.def("paged_attention_decode_rejects", &paged_attention_decode_rejects);
  m.def("paged_attention_prefill_rejects", &paged_attention_prefill_rejects);
  m.def("lora_add_rejects", &lora_add_rejects);
#if PAGEDSERVE_HAS_INT4
  m.def("int4_linear_rejects", &int4_linear_rejects);
#endif
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_and_write_kv", &rotary_and_write_kv);
  m.attr("FEW_QUERY_ROWS") = kFewQueryRows;
  m.def("paged_attention_decode", &paged_attention_decode);
  m.def("paged_attention_prefill", &paged_attention_prefill, pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("query_start_loc"), pybind11::arg("scale"),
        pybind11::arg("pack_bytes") = kPackBytes);
  m.def("argmax_rows", &argmax_rows);
  m.def("categorical_rows", &categorical_rows);
#if PAGEDSERVE_HAS_INT4
  m.attr("INT4_LAYOUT") = kInt4Layout;
  m.attr("INT4_A8_LAYOUT") = kInt4A8Layout;
  m.attr("INT4_TILE_ROWS") = kTileRows;
  m.def("int4_linear", &int4_linear);
  m.def("int4_int8_linear", &int4_int8_linear);
#endif
  m.def("dense_linear", &dense_linear);
  m.def("lora_add", [](at::Tensor y, const at::Tensor& x, const at::Tensor& a,
                       const std::vector<at::Tensor>& b, const at::Tensor& slots) {
    lora_add(y, x, a, b, slots);
  });
  if constexpr (kHasFewRowsGemv) {
    m.def("few_rows_max", &few_rows_max);
    m.def("bf16_linear_few_rows", &bf16_linear_few_rows);
  }
#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
  m.def("amx_enable", &amx::enable, "use the AMX tile unit for the few-rows GEMV (if granted)");
  m.def("amx_enabled", [] { return amx::enabled().load(); });
#endif

  pybind11::class_<NativeLinear>(m, "NativeLinear", pybind11::module_local())
      .def(pybind11::init<const std::string&, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          int64_t, bool, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          int64_t>(),
           pybind11::arg("layout"), pybind11::arg("packed"), pybind11::arg("scales_zeros"),
           pybind11::arg("group_size"), pybind11::arg("int8_activations"),
           pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("out_features"));
  pybind11::class_<GlmDecoderLayer>(m, "GlmDecoderLayer", pybind11::module_local())
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
}
