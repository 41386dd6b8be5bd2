// mlxserve: products with affine-quantized weights as MLX primitives (CPU only):
// mx.quantized_matmul(x, w, scales, biases, transpose=True) of float32 x, 4- or
// 8-bit weights and float32 scales and biases, without MLX's naive CPU kernel or
// a float32 copy of the weights; and mx.dequantize of the same weights.

#pragma once

#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxserve {

namespace mx = mlx::core;

// x [..., K] float32 times the dequantized w [N, K]^T: [..., N]. w uint32 [N, K * bits / 32],
// scales and biases float32 [N, K / group_size]; bits 4 or 8, group_size 32, 64 or 128.
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits,
                           mx::StreamOrDevice s = {});

// The dequantized w [N, K], float32, equal to mx.dequantize's.
mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits, mx::StreamOrDevice s = {});

// What both primitives share: the weights' group size and bits, and no GPU path.
class QuantizedWeightPrimitive : public mx::UnaryPrimitive {
 public:
  QuantizedWeightPrimitive(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  bool is_equivalent(const mx::Primitive& other) const override;

 protected:
  int group_size_;
  int bits_;
};

class QuantizedMatmul : public QuantizedWeightPrimitive {
 public:
  using QuantizedWeightPrimitive::QuantizedWeightPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "QuantizedMatmul";
  }
};

class Dequantize : public QuantizedWeightPrimitive {
 public:
  using QuantizedWeightPrimitive::QuantizedWeightPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "Dequantize";
  }
};

}  // namespace mlxserve
