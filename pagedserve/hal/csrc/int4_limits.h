// What the targets' INT4 kernels (int4_linear, int4_int8_linear: int4.h; int4_<target>.h) take,
// stated once: groups of a multiple of 32 values that divide the input (any number of output rows:
// the packing pads them to whole tiles, int4_gemm.h's with_padded_rows cuts the padding off).
// The kernels check their weights with it, and CpuDevice.prepare_int4 asks it for each layer when
// a model loads (a layer it refuses runs PyTorch's kernel or the reference).
#pragma once

#include <string>

#include "elementwise.h"  // rows_rejects

namespace pagedserve {

inline std::string int4_linear_rejects(int64_t in_features, int64_t group_size) {
  if (group_size <= 0 || group_size % 32)
    return "group size " + std::to_string(group_size) + " is not a multiple of 32";
  if (in_features % group_size)
    return "in_features " + std::to_string(in_features) + " is not a multiple of the group size " +
           std::to_string(group_size);
  return "";
}

// An INT4 kernel's arguments against the statement above: x [M, K] contiguous in an activation
// dtype, the packed weight's K equal to x's, and the tiles' scales and zero points as bytes (per
// tile and group: tile_rows fp16 scales, then tile_rows one-byte zero points).
inline void check_int4(const char* op, const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scales_zeros, int64_t group_size, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.size(1) * 8 == K, op, ": the packed weight is for K=", packed.size(1) * 8,
              ", x has K=", K);
  TORCH_CHECK(scales_zeros.scalar_type() == at::kByte && scales_zeros.dim() == 3 &&
                  scales_zeros.size(2) == 3 * tile_rows && scales_zeros.is_contiguous(),
              op, ": scales_zeros must be contiguous uint8 [N / ", tile_rows, ", K / G, ",
              3 * tile_rows, "] (int4.py's _tile_scales_and_zeros)");
  std::string why = int4_linear_rejects(K, group_size);
  if (why.empty()) why = rows_rejects(x.scalar_type());
  TORCH_CHECK(why.empty(), op, ": ", why);
}

}  // namespace pagedserve
