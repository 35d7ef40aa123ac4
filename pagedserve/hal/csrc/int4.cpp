// The target's INT4 GEMMs (int4.h), in a translation unit of their own.
#include "int4.h"

namespace pagedserve {

#if PAGEDSERVE_HAS_INT4
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scales_zeros, int64_t group_size,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return with_padded_rows(w4a16_linear, x, packed, scales_zeros, group_size, bias, out_features,
                          kTileRows);
}

at::Tensor int4_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_zeros, int64_t group_size,
                            const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return with_padded_rows(w4a8_linear, x, packed, scales_zeros, group_size, bias, out_features,
                          kTileRows);
}
#endif

}  // namespace pagedserve
