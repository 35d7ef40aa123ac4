// The 16-bit activation types every target reads and writes (PyTorch's, so that tensors' data
// pointers need no cast).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace pagedserve {
using BFloat16 = c10::BFloat16;
using Half = c10::Half;
}  // namespace pagedserve
