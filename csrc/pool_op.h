// mlxserve: zero-filled arrays for the KV pools (CPU only), backed by transparent
// huge pages where the kernel offers them.
//
// A pool is one array of several hundred MB per layer that decode reads at
// scattered rows (the slots of each request). mx.zeros faults it in 4 KiB page by
// page (~1 GB/s here: 6-12 s at start-up for the 5.9 GB the default plan sizes
// on a 24 GB machine) and leaves every row read through its own TLB entry. This
// op asks for 2 MiB pages (madvise(MADV_HUGEPAGE); THP set to "madvise" or
// "always") before it writes the zeros, from the kernel thread pool.

#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxserve {

namespace mx = mlx::core;

// An array of `shape` and `dtype` whose bytes are all zero: what mx.zeros gives.
mx::array pool_zeros(const mx::Shape& shape, mx::Dtype dtype, mx::StreamOrDevice s = {});

class PoolZeros : public mx::UnaryPrimitive {
 public:
  PoolZeros(mx::Stream stream, mx::Shape shape)
      : mx::UnaryPrimitive(stream), shape_(std::move(shape)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // No is_equivalent: Primitive's (false) keeps every pool its own buffer; two pools of
  // one shape found equivalent could be merged by MLX's graph simplification.
  const char* name() const override {
    return "MlxservePoolZeros";
  }

 private:
  mx::Shape shape_;
};

}  // namespace mlxserve
