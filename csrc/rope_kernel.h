// mlxserve: rotary position embeddings as MLX's CPU path computes them.
//
// Shared by the op (rope_op.cpp, built once) and the kernel (rope_kernel.cpp,
// built once per instruction set): plain structs and declarations only.

#pragma once

#include <cstdint>

namespace mlxserve {

// One call: x [B, N, T, D] (any strides, in elements) rotated into a contiguous
// out [B, N, T, D]. Position of x[b, :, t] is (t + offset[b or 0]) * scale;
// pair i of the first dims features turns by position / freqs[i] (freqs null:
// by position * base^(-i / (dims / 2)), as MLX computes it).
struct RopeArgs {
  const float* x;
  int64_t x_stride[4];
  float* out;
  const int32_t* offset;
  int offset_count;  // 1 or B
  const float* freqs;  // [dims / 2] or null
  int B, N, T, D, dims;
  float base;
  float scale;
  bool traditional;
};

// The most dims the kernel takes (its per-row tables are on the stack).
constexpr int kMaxRopeDims = 1024;

// Rotates rows [begin, end) of the B * T (b, t) rows, every one of their N heads.
namespace isa_baseline {
void rope_rows(const RopeArgs& args, int64_t begin, int64_t end);
}  // namespace isa_baseline

#if defined(MLXSERVE_HAVE_X86_V3)
namespace isa_x86_v3 {
void rope_rows(const RopeArgs& args, int64_t begin, int64_t end);
}  // namespace isa_x86_v3
#endif

}  // namespace mlxserve
