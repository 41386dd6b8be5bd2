// mlxserve: mx.fast.rms_norm's CPU computation as one MLX primitive (CPU only),
// bit-identical to the graph of ops MLX builds for it on the CPU (norm_kernel.cpp).

#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxserve {

namespace mx = mlx::core;

// x: float32 [..., D]; weight: float32 [D] or none. Returns x's shape.
mx::array rms_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    float eps,
    mx::StreamOrDevice s = {});

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps, bool has_weight)
      : mx::UnaryPrimitive(stream), eps_(eps), has_weight_(has_weight) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "MlxserveRmsNorm";
  }

 private:
  float eps_;
  bool has_weight_;
};

}  // namespace mlxserve
