// The small vector API every kernel is written against, one header per target (vec/*.h), picked
// by PAGEDSERVE_TARGET at compile time (native.py builds one library per target). Each target's
// Vec holds kLanes fp32 lanes; loads and stores convert from and to the activation dtypes.
//
//   zero set1 load store load_first store_first keep_first    fp32 lanes <-> memory (load also
//                                                              widens int8 codes)
//   add sub mul div max fmadd fnmadd exp                       lane-wise arithmetic
//   reduce_add reduce_max sum_lanes nan_lanes equal_lanes      across lanes
//   load_pairs dot_pairs set1_pair pair_slot kNativePairs      bf16 dot products (vdpbf16ps)
//
// and, for every target alike (below): load_n store_n, the n <= kLanes values at a pointer, so
// that a row of any length is whole vectors and one shorter tail.
#pragma once

// ATen's tensor with its methods and operators, dispatch, parallel_for, and only the free
// functions the kernels call: ATen/ATen.h declares every operator, which the compiler then parses
// for each target (with torch/extension.h, a third of a build: 76 s a target, 52 s without)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/round.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#define PAGEDSERVE_AVX512 1
#define PAGEDSERVE_AVX2 2
#define PAGEDSERVE_PORTABLE 3

#if PAGEDSERVE_TARGET == PAGEDSERVE_AVX512
#include "vec/avx512.h"
#elif PAGEDSERVE_TARGET == PAGEDSERVE_AVX2
#include "vec/avx2.h"
#elif PAGEDSERVE_TARGET == PAGEDSERVE_PORTABLE
#include "vec/portable.h"
#else
#error "PAGEDSERVE_TARGET must name a target (native.py sets it)"
#endif

// The activation dtypes a model runs in: float32, bfloat16, float16.
#define DISPATCH_ACTIVATION_TYPES(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)      \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace pagedserve {

using vec::Vec;
using vec::kLanes;

// The first n <= kLanes values at p as a vector (the other lanes zero), and a vector's first n
// lanes stored at p: a row's tail past its last whole vector. Through a buffer on the stack
// whose whole vector the target's own load and store convert, so every dtype and target rounds
// a tail exactly as it rounds the rest of the row.
template <typename T>
inline Vec load_n(const T* p, int64_t n) {
  if (n == kLanes) return vec::load(p);
  alignas(64) T buf[kLanes] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return vec::load(buf);
}
template <typename T>
inline void store_n(T* p, Vec v, int64_t n) {
  if (n == kLanes) return vec::store(p, v);
  alignas(64) T buf[kLanes];
  vec::store(buf, v);
  std::memcpy(p, buf, n * sizeof(T));
}

// The lanes of the vector that starts at i of a row of `len` values.
inline int64_t lanes_at(int64_t i, int64_t len) { return std::min<int64_t>(kLanes, len - i); }

// Rounds through the storage dtype, as PyTorch does between two ops (no-op for float).
template <typename T>
inline Vec round_to(Vec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[kLanes];
    vec::store(tmp, v);
    return vec::load(tmp);
  }
}

// An fp32 result into the output dtype; PyTorch adds a bias to the rounded product.
template <typename T>
inline void store_output(T* out, Vec v, const T* bias) {
  if (bias) v = vec::add(round_to<T>(v), vec::load(bias));
  vec::store(out, v);
}

}  // namespace pagedserve
