// mlxserve: a branch-free exp the compiler vectorizes, for the per-ISA kernels.
//
// MLX's CPU exp costs ~21 ns per element on x86-64 (mlx[cpu] 0.32); this one
// runs at SIMD width inside each kernel's loops. Include it from a kernel file
// only, inside nothing: it opens the kernel's own MLXSERVE_ISA namespace and an
// anonymous one, so every instruction-set build has its own internal copy.

#pragma once

#ifndef MLXSERVE_ISA
#error "MLXSERVE_ISA must name the instruction-set namespace"
#endif

namespace mlxserve {
namespace MLXSERVE_ISA {
namespace {

// exp(x) for x <= 0 (and -inf), after Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n by building the float's
// exponent bits. Relative error ~2 ulp; below -87.3 (where the float would be
// denormal) the result is 0, and exp(-inf) is exactly 0.
inline float exp_neg(float x) {
  x = x < -88.0f ? -88.0f : x;
  float fn = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int n = static_cast<int>(fn) + 127;
  n = n < 0 ? 0 : n;
  float scale = __builtin_bit_cast(float, static_cast<unsigned>(n) << 23);
  return p * scale;
}

}  // namespace
}  // namespace MLXSERVE_ISA
}  // namespace mlxserve
