// mlxserve: RMS normalization as MLX's CPU path computes it.
//
// Shared by the op (norm_op.cpp, built once) and the kernel (norm_kernel.cpp,
// built once per instruction set): declarations only.

#pragma once

#include <cstdint>

namespace mlxserve {

// out[r, :] = (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) * weight for rows [begin,
// end) of contiguous float32 x [rows, D] (weight null: no product).
namespace isa_baseline {
void rms_norm_rows(const float* x, const float* weight, float* out, int64_t begin, int64_t end,
                   int D, float eps);
}  // namespace isa_baseline

#if defined(MLXSERVE_HAVE_X86_V3)
namespace isa_x86_v3 {
void rms_norm_rows(const float* x, const float* weight, float* out, int64_t begin, int64_t end,
                   int D, float eps);
}  // namespace isa_x86_v3
#endif

}  // namespace mlxserve
