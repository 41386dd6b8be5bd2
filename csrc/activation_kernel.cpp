// mlxserve: the activation kernels, compiled once per instruction set (see
// attention_kernel.cpp for why each build has its own namespace).
//
// silu_mul is mlx-lm's swiglu, nn.silu(gate) * x = (gate * sigmoid(gate)) * x,
// with MLX's own sigmoid and exp (mlx_math.h), so its results are bit-identical
// to MLX's on the CPU backend, at SIMD width.

#include "activation_kernel.h"
#include "mlx_math.h"

namespace mlxserve {
namespace MLXSERVE_ISA {

void silu_mul(const float* __restrict gate, const float* __restrict x, float* __restrict out,
              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = (g * mlx_sigmoid(g)) * x[i];
  }
}

}  // namespace MLXSERVE_ISA
}  // namespace mlxserve
