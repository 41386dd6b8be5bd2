// mlxserve: products with affine-quantized weights (MLX's layout), per instruction set.
//
// MLX packs a quantized weight W [N, K] as uint32 words along K, value j of a word
// in bits [j * bits, (j + 1) * bits); each group of group_size values along K has a
// scale and a bias, and W[n, k] = scale * q + bias. Shared by the op (qmm_op.cpp,
// built once) and the kernel (qmm_kernel.cpp, built once per instruction set):
// declarations only, so the per-ISA objects share no weak symbols.

#pragma once

#include <cstdint>

namespace mlxserve {

// One weight matrix: N rows of K values packed in words, and its float32 scales
// and biases [N, K / group_size]. bits 4 or 8; group_size a multiple of 8.
struct QuantizedWeight {
  const uint32_t* words;
  const float* scales;
  const float* biases;
  int64_t k;
  int bits;
  int group_size;
};

// Rows per block of W the kernels dequantize at once (qmm_rows' blocks start at
// multiples of it, so every block but the last is whole).
constexpr int kQmmRowBlock = 3;

#define MLXSERVE_QMM_DECLS                                                              \
  /* out[m, n] = sum_k x[m, k] * W[n, k] for m < rows, n in [n0, n1): each W row is    \
   * dequantized once into scratch (kQmmRowBlock * k floats), then every x row is      \
   * multiplied by it with eight partial sums added in a fixed order, so an output    \
   * does not depend on how many rows x has or which of them it is. */                 \
  void qmm_rows(const float* x, int64_t rows, const QuantizedWeight& w, int64_t n0,      \
                int64_t n1, float* out, int64_t ld_out, float* scratch);                 \
  /* out[n - n0, :] = W[n, :] for n in [n0, n1): scale * q + bias, a multiply then an  \
   * add, as mx.dequantize computes it. */                                              \
  void dequantize_rows(const QuantizedWeight& w, int64_t n0, int64_t n1, float* out);

namespace isa_baseline {
MLXSERVE_QMM_DECLS
}  // namespace isa_baseline

#if defined(MLXSERVE_HAVE_X86_V3)
namespace isa_x86_v3 {
MLXSERVE_QMM_DECLS
}  // namespace isa_x86_v3
#endif

#undef MLXSERVE_QMM_DECLS

}  // namespace mlxserve
