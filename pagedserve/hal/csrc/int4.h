// The target's INT4 linear layers as the binding and the fused decoder layer call them: the two
// functions declared here, compiled in int4.cpp with the tile kernels (int4_<target>.h), a
// translation unit of its own that native.py's build compiles beside the others. The rest of the
// library calls only these, so that it instantiates no tile kernel of its own.
#pragma once

#include "vec.h"

#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
#include "int4_avx512.h"
#define PAGEDSERVE_HAS_INT4 1
#elif PAGEDSERVE_TARGET == PAGEDSERVE_AVX2
#include "int4_avx2.h"
#define PAGEDSERVE_HAS_INT4 1
#else
#define PAGEDSERVE_HAS_INT4 0
#endif

namespace pagedserve {

#if PAGEDSERVE_HAS_INT4
// x [M, K] times an INT4 layer of out_features rows in the target's packed layout (kInt4Layout:
// int16 activations, W4A16; kInt4A8Layout: int8 activations per block of 32, W4A8), + bias.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scales_zeros, int64_t group_size,
                       const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor int4_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_zeros, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, int64_t out_features);
#else
constexpr const char* kInt4Layout = "";  // no INT4 kernel of its own: PyTorch's ("aten")
constexpr const char* kInt4A8Layout = "";
#endif

}  // namespace pagedserve
