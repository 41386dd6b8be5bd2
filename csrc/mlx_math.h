// mlxserve: MLX's CPU exp, sin and cos (mlx/backend/cpu/simd/math.h, MLX 0.32),
// operation for operation, so that a kernel built on them gives bit-identical
// results to the MLX graph it replaces.
//
// MLX's own build runs these one element at a time with its fused multiply-adds
// in libm; written here with __builtin_fmaf (exact, as std::fma) in loops the
// compiler vectorizes. Any file that includes this must be compiled with
// -ffp-contract=off (CMakeLists.txt), so that no multiply and add MLX keeps
// apart is fused. Include it from a per-ISA kernel file only: it opens that
// build's MLXSERVE_ISA namespace and an anonymous one (internal linkage).

#pragma once

#include <cmath>
#include <cstdint>

#ifndef MLXSERVE_ISA
#error "MLXSERVE_ISA must name the instruction-set namespace"
#endif

namespace mlxserve {
namespace MLXSERVE_ISA {
namespace {

// simd::exp for float.
inline float mlx_exp(float x_init) {
  float x = x_init * 1.442695f;  // log2(e)
  const float ipart = __builtin_floorf(x + 0.5f);
  const float fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = __builtin_fmaf(x, fpart, 1.339887440266574e-3f);
  x = __builtin_fmaf(x, fpart, 9.618437357674640e-3f);
  x = __builtin_fmaf(x, fpart, 5.550332471162809e-2f);
  x = __builtin_fmaf(x, fpart, 2.402264791363012e-1f);
  x = __builtin_fmaf(x, fpart, 6.931472028550421e-1f);
  x = __builtin_fmaf(x, fpart, 1.000000000000000f);
  // 2^ipart from the exponent bits; out of range for |x_init| > 88, where the
  // selects below replace it (unsigned: the shift of a wrapped value is defined).
  const unsigned epart = (static_cast<unsigned>(static_cast<int>(ipart)) + 127u) << 23;
  float result = __builtin_bit_cast(float, epart) * x;
  result = x_init != x_init ? x_init : result;
  result = x_init > 88.0f ? __builtin_inff() : result;
  result = x_init < -88.0f ? 0.0f : result;
  return result;
}

// simd::sincos<Sine> for float: Cephes' reduction by pi / 4 and two polynomials.
template <bool Sine>
inline float mlx_sincos(float in) {
  bool sign_mask_sin = in < 0.0f;
  in = __builtin_fabsf(in);
  float x = in;
  float y = x * 1.27323954473516f;  // 4 / pi
  uint32_t emm2 = static_cast<uint32_t>(y);
  emm2 = emm2 + 1;
  emm2 = emm2 & ~1u;
  y = static_cast<float>(emm2);
  const bool poly_mask = (emm2 & 2) != 0;
  x = __builtin_fmaf(y, -0.78515625f, x);
  x = __builtin_fmaf(y, -2.4187564849853515625e-4f, x);
  x = __builtin_fmaf(y, -3.77489497744594108e-8f, x);
  sign_mask_sin = sign_mask_sin ^ ((emm2 & 4) != 0);
  const bool sign_mask_cos = ((emm2 - 2) & 4) != 0;
  const float z = x * x;
  float y1 = __builtin_fmaf(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float y2 = __builtin_fmaf(z, -1.9515295891e-4f, 8.3321608736e-3f);
  y1 = __builtin_fmaf(y1, z, 4.166664568298827e-2f);
  y2 = __builtin_fmaf(y2, z, -1.6666654611e-1f);
  y1 = y1 * z;
  y2 = y2 * z;
  y1 = y1 * z;
  y2 = __builtin_fmaf(x, y2, x);
  y1 = __builtin_fmaf(z, -0.5f, y1);
  y1 = y1 + 1.0f;
  if constexpr (Sine) {
    const float ys = poly_mask ? y1 : y2;
    return sign_mask_sin ? -ys : ys;
  } else {
    const float yc = poly_mask ? y2 : y1;
    return sign_mask_cos ? yc : -yc;
  }
}

// simd::sin / simd::cos: past 2^23 the reduction is inexact and MLX calls libm.
inline float mlx_sin(float x) {
  return __builtin_fabsf(x) > 8388608.0f ? std::sin(x) : mlx_sincos<true>(x);
}

inline float mlx_cos(float x) {
  return __builtin_fabsf(x) > 8388608.0f ? std::cos(x) : mlx_sincos<false>(x);
}

// MLX's Sigmoid (mlx/backend/cpu/unary_ops.h).
inline float mlx_sigmoid(float x) {
  const float y = 1.0f / (1.0f + mlx_exp(__builtin_fabsf(x)));
  return x < 0.0f ? y : 1.0f - y;
}

}  // namespace
}  // namespace MLXSERVE_ISA
}  // namespace mlxserve
