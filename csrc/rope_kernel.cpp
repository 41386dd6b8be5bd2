// mlxserve: the rope kernel, compiled once per instruction set (see
// attention_kernel.cpp for why each build has its own namespace).
//
// MLX's CPU backend has no rope kernel: mx.fast.rope builds a graph of a dozen
// ops (mlx/fast.cpp, the fallback), which this reproduces operation for
// operation, with MLX's exp, sin and cos (mlx_math.h), so the results are
// bit-identical:
//
//   position  = (float(t) + float(offset)) * scale
//   inv_freq  = exp(-i * (log(base) / (dims / 2)))   or   1 / freqs[i]
//   theta     = position * inv_freq,   c = cos(theta),   s = sin(theta)
//   out_a     = x_a * c - x_b * s,     out_b = x_a * s + x_b * c
//
// where (x_a, x_b) is feature pair i: (i, i + dims / 2), or (2i, 2i + 1) when
// traditional; the features past dims are copied.

#include <cmath>

#include "mlx_math.h"
#include "rope_kernel.h"

namespace mlxserve {
namespace MLXSERVE_ISA {

void rope_rows(const RopeArgs& a, int64_t begin, int64_t end) {
  const int half = a.dims / 2;
  float inv[kMaxRopeDims / 2];
  if (a.freqs != nullptr) {
    for (int i = 0; i < half; ++i) {
      inv[i] = 1.0f / a.freqs[i];
    }
  } else {
    // fast.cpp: arange(0, -half, -1) * (std::log(base) / half), then exp.
    const float step = std::log(a.base) / static_cast<float>(half);
    for (int i = 0; i < half; ++i) {
      inv[i] = mlx_exp(static_cast<float>(-i) * step);
    }
  }
  float theta[kMaxRopeDims / 2];
  float c[kMaxRopeDims / 2];
  float s[kMaxRopeDims / 2];
  float gathered[kMaxRopeDims];
  const int64_t sB = a.x_stride[0], sN = a.x_stride[1], sT = a.x_stride[2], sD = a.x_stride[3];
  for (int64_t row = begin; row < end; ++row) {
    const int b = static_cast<int>(row / a.T);
    const int t = static_cast<int>(row % a.T);
    const float offset = static_cast<float>(a.offset[a.offset_count == 1 ? 0 : b]);
    const float position = (static_cast<float>(t) + offset) * a.scale;
    for (int i = 0; i < half; ++i) {
      theta[i] = position * inv[i];
      c[i] = mlx_sincos<false>(theta[i]);
      s[i] = mlx_sincos<true>(theta[i]);
    }
    // Past 2^23 MLX calls libm (mlx_sin, mlx_cos); kept out of the vectorized loop.
    for (int i = 0; i < half; ++i) {
      if (__builtin_fabsf(theta[i]) > 8388608.0f) {
        c[i] = mlx_cos(theta[i]);
        s[i] = mlx_sin(theta[i]);
      }
    }
    for (int n = 0; n < a.N; ++n) {
      const float* x = a.x + b * sB + n * sN + t * sT;
      if (sD != 1) {
        for (int j = 0; j < a.D && j < kMaxRopeDims; ++j) {
          gathered[j] = x[j * sD];
        }
        x = gathered;  // the op sends rows wider than kMaxRopeDims with unit stride
      }
      float* __restrict o = a.out + ((static_cast<int64_t>(b) * a.N + n) * a.T + t) * a.D;
      if (a.traditional) {
        for (int i = 0; i < half; ++i) {
          const float x1 = x[2 * i], x2 = x[2 * i + 1];
          o[2 * i] = x1 * c[i] - x2 * s[i];
          o[2 * i + 1] = x1 * s[i] + x2 * c[i];
        }
      } else {
        for (int i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          o[i] = x1 * c[i] - x2 * s[i];
          o[half + i] = x1 * s[i] + x2 * c[i];
        }
      }
      for (int j = a.dims; j < a.D; ++j) {
        o[j] = x[j];
      }
    }
  }
}

}  // namespace MLXSERVE_ISA
}  // namespace mlxserve
