// mlxserve: the ragged paged attention op, an MLX primitive (CPU only).

#pragma once

#include <optional>
#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxserve {

namespace mx = mlx::core;

// Attention of queries [B, Hq, L, Dk] over the K/V that the slot ids of each
// row name in flat head-major pools [Hkv * rows_per_head, D], read in place.
// Returns [B, Hq, L, Dv] (a transposed view of a [B, L, Hq, Dv] buffer, so the
// model's own transpose back to [B, L, Hq * Dv] is free). See
// attention_kernel.h for the meaning of slots and meta.
//
// bits 0: float32 pools. bits 8 or 4: uint32 pools of packed rows (values,
// float32 scales and biases per group of group_size; attention_kernel.h), whose
// row width gives Dv.
mx::array ragged_attention(
    const mx::array& queries,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& slots,
    const mx::array& meta,
    const std::optional<mx::array>& sinks,
    float scale,
    int window,
    int kv_heads,
    int64_t rows_per_head,
    int bits = 0,
    int group_size = 0,
    mx::StreamOrDevice s = {});

class RaggedAttention : public mx::UnaryPrimitive {
 public:
  RaggedAttention(
      mx::Stream stream,
      float scale,
      int window,
      int kv_heads,
      int64_t rows_per_head,
      bool has_sinks,
      int bits,
      int group_size,
      int value_dim)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        window_(window),
        kv_heads_(kv_heads),
        rows_per_head_(rows_per_head),
        has_sinks_(has_sinks),
        bits_(bits),
        group_size_(group_size),
        value_dim_(value_dim) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "RaggedAttention";
  }

 private:
  float scale_;
  int window_;
  int kv_heads_;
  int64_t rows_per_head_;
  bool has_sinks_;
  int bits_;        // 0: float32 pools
  int group_size_;  // quantized pools only
  int value_dim_;   // Dv (a packed row's width in words is not it)
};

}  // namespace mlxserve
