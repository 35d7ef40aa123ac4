// The vector API in plain C++: 8 fp32 lanes in an array, for any CPU a C++17 compiler targets
// (ARM included). The compiler vectorises the lane loops for the baseline instruction set.
#pragma once

#include <algorithm>
#include <cmath>

#include "../types.h"

namespace pagedserve::vec {

constexpr int kLanes = 8;
constexpr int kRegisters = 16;

struct Vec {
  float v[kLanes];
};

#define PAGEDSERVE_LANES(expr)                            \
  Vec out;                                                \
  for (int i = 0; i < kLanes; ++i) out.v[i] = (expr);     \
  return out

inline Vec zero() { PAGEDSERVE_LANES(0.f); }
inline Vec set1(float x) { PAGEDSERVE_LANES(x); }

template <typename T>
inline Vec load(const T* p) { PAGEDSERVE_LANES(float(p[i])); }
template <typename T>
inline void store(T* p, Vec v) {  // c10's conversions: round to nearest even
  for (int i = 0; i < kLanes; ++i) p[i] = T(v.v[i]);
}

inline Vec load_first(const float* p, int n) { PAGEDSERVE_LANES(i < n ? p[i] : 0.f); }
inline void store_first(float* p, Vec v, int n) {
  for (int i = 0; i < n && i < kLanes; ++i) p[i] = v.v[i];
}
inline Vec keep_first(Vec v, int n) { PAGEDSERVE_LANES(i < n ? v.v[i] : 0.f); }

inline Vec add(Vec a, Vec b) { PAGEDSERVE_LANES(a.v[i] + b.v[i]); }
inline Vec sub(Vec a, Vec b) { PAGEDSERVE_LANES(a.v[i] - b.v[i]); }
inline Vec mul(Vec a, Vec b) { PAGEDSERVE_LANES(a.v[i] * b.v[i]); }
inline Vec div(Vec a, Vec b) { PAGEDSERVE_LANES(a.v[i] / b.v[i]); }
inline Vec max(Vec a, Vec b) { PAGEDSERVE_LANES(std::max(a.v[i], b.v[i])); }
// Each even lane and the odd one after it swapped (lanes 1, 0, 3, 2, ...).
inline Vec swap_pairs(Vec v) { PAGEDSERVE_LANES(v.v[i ^ 1]); }
inline Vec fmadd(Vec a, Vec b, Vec c) { PAGEDSERVE_LANES(std::fma(a.v[i], b.v[i], c.v[i])); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { PAGEDSERVE_LANES(std::fma(-a.v[i], b.v[i], c.v[i])); }
inline float reduce_add(Vec v) {
  float s = 0.f;
  for (float x : v.v) s += x;
  return s;
}
inline float reduce_max(Vec v) { return *std::max_element(v.v, v.v + kLanes); }

inline uint32_t nan_lanes(Vec v) {
  uint32_t m = 0;
  for (int i = 0; i < kLanes; ++i) m |= uint32_t(std::isnan(v.v[i])) << i;
  return m;
}
inline uint32_t equal_lanes(Vec a, Vec b) {
  uint32_t m = 0;
  for (int i = 0; i < kLanes; ++i) m |= uint32_t(a.v[i] == b.v[i]) << i;
  return m;
}

inline Vec exp(Vec x) { PAGEDSERVE_LANES(std::exp(std::max(x.v[i], -87.3f))); }

inline Vec sum_lanes(const Vec* v) { PAGEDSERVE_LANES(reduce_add(v[i])); }

struct Bf16Pairs {
  Vec lo, hi;
};
inline Bf16Pairs load_pairs(const BFloat16* p) { return {vec::load(p), vec::load(p + kLanes)}; }
inline Vec dot_pairs(Vec acc, Bf16Pairs a, Bf16Pairs b) {
  return fmadd(a.hi, b.hi, fmadd(a.lo, b.lo, acc));
}
// Every lane's pair set to p[0], p[1]; where load_pairs finds lane's value half (0 or 1).
inline Bf16Pairs set1_pair(const BFloat16* p) { return {set1(float(p[0])), set1(float(p[1]))}; }
constexpr int pair_slot(int lane, int half) { return half * kLanes + lane; }
constexpr bool kNativePairs = false;  // dot_pairs is two FMAs

#undef PAGEDSERVE_LANES

}  // namespace pagedserve::vec
