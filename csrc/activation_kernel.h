// mlxserve: elementwise activations whose MLX CPU versions are bound by exp.
//
// Shared by the op (activation_op.cpp, built once) and the kernel
// (activation_kernel.cpp, built once per instruction set, like the attention
// kernel): declarations only, so the per-ISA objects share no weak symbols.

#pragma once

#include <cstdint>

namespace mlxserve {

// out[i] = silu(gate[i]) * x[i] = gate[i] * sigmoid(gate[i]) * x[i] for i < n:
// mlx-lm's swiglu. All three contiguous float32; out may alias neither input.
namespace isa_baseline {
void silu_mul(const float* gate, const float* x, float* out, int64_t n);
}  // namespace isa_baseline

#if defined(MLXSERVE_HAVE_X86_V3)
namespace isa_x86_v3 {
void silu_mul(const float* gate, const float* x, float* out, int64_t n);
}  // namespace isa_x86_v3
#endif

}  // namespace mlxserve
