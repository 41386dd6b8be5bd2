// mlxserve: mx.fast.rope's CPU computation as one MLX primitive (CPU only),
// bit-identical to the graph of ops MLX builds for it on the CPU (rope_kernel.cpp).

#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxserve {

namespace mx = mlx::core;

// x: float32 [B, N, T, D]; offset: int32 [1] or [B]; freqs: float32 [dims / 2]
// or none (then base). Returns the rotated [B, N, T, D], as mx.fast.rope.
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs,
    mx::StreamOrDevice s = {});

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale, bool has_freqs)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale),
        has_freqs_(has_freqs) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "MlxserveRope";
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
  bool has_freqs_;
};

}  // namespace mlxserve
