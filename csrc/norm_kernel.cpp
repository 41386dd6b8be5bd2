// mlxserve: the RMS norm kernel, compiled once per instruction set (see
// attention_kernel.cpp for why each build has its own namespace).
//
// MLX's CPU backend has no RMS norm kernel: mx.fast.rms_norm builds a graph
// (mlx/fast.cpp, the fallback) of square, sum, a product by float(1.0 / D), an
// add of eps, rsqrt (1 / sqrt) and two products, which this reproduces
// operation for operation, so the results are bit-identical. MLX's CPU sum
// adds one element at a time in order; here too, but eight rows at once (eight
// independent chains) so the adds' latency overlaps.

#include <cmath>

#include "norm_kernel.h"

#ifndef MLXSERVE_ISA
#error "MLXSERVE_ISA must name the instruction-set namespace"
#endif

namespace mlxserve {
namespace MLXSERVE_ISA {
namespace {

constexpr int kRows = 8;

inline void scale_row(const float* __restrict x, const float* __restrict weight,
                      float* __restrict out, int D, float r) {
  if (weight != nullptr) {
    for (int i = 0; i < D; ++i) {
      out[i] = (x[i] * r) * weight[i];
    }
  } else {
    for (int i = 0; i < D; ++i) {
      out[i] = x[i] * r;
    }
  }
}

}  // namespace

void rms_norm_rows(const float* x, const float* weight, float* out, int64_t begin, int64_t end,
                   int D, float eps) {
  const float normalizer = static_cast<float>(1.0 / D);  // ops.cpp: number_of_elements
  int64_t row = begin;
  for (; row + kRows <= end; row += kRows) {
    const float* xr = x + row * D;
    float acc[kRows] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < D; ++i) {
      for (int r = 0; r < kRows; ++r) {
        const float v = xr[r * static_cast<int64_t>(D) + i];
        const float square = v * v;
        acc[r] = acc[r] + square;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const float mean = (0.0f + acc[r]) * normalizer;
      const float inv = 1.0f / std::sqrt(mean + eps);
      scale_row(xr + r * static_cast<int64_t>(D), weight, out + (row + r) * D, D, inv);
    }
  }
  for (; row < end; ++row) {
    const float* xr = x + row * D;
    float acc = 0.0f;
    for (int i = 0; i < D; ++i) {
      const float square = xr[i] * xr[i];
      acc = acc + square;
    }
    const float mean = (0.0f + acc) * normalizer;
    scale_row(xr, weight, out + row * D, D, 1.0f / std::sqrt(mean + eps));
  }
}

}  // namespace MLXSERVE_ISA
}  // namespace mlxserve
