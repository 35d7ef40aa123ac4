// The avx2 target's two INT4 layers alone (int4.h), for tests/hal/test_avx_vnni_emulated.py: the
// rest of the library has no code that AVX-VNNI changes, and leaving it out halves the build.
#include <torch/csrc/utils/pybind.h>

#include "int4.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(__AVXVNNI__)
  m.attr("AVX_VNNI") = true;
#else
  m.attr("AVX_VNNI") = false;
#endif
  m.def("int4_linear", &pagedserve::int4_linear);
  m.def("int4_int8_linear", &pagedserve::int4_int8_linear);
}
