// mlxserve: Python bindings of the native package (mlxserve.mlx_backend.attention._native).
//
// Built with nanobind in MLX's domain (NB_DOMAIN mlx), so mlx.core.array
// arguments and results cross without copies; the nanobind version must match
// the one mlx.core was built with (pyproject.toml's build requirements).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "activation_op.h"
#include "attention_op.h"
#include "isa.h"
#include "norm_op.h"
#include "pool_op.h"
#include "qmm_op.h"
#include "rope_op.h"
#include "mlx/version.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

#define MLXSERVE_STR_(x) #x
#define MLXSERVE_STR(x) MLXSERVE_STR_(x)

NB_MODULE(_native, m) {
  m.doc() = "mlxserve's native CPU kernels for MLX";

  m.def(
      "ragged_attention",
      &mlxserve::ragged_attention,
      "queries"_a,
      "k_pool"_a,
      "v_pool"_a,
      "slots"_a,
      "meta"_a,
      "sinks"_a = nb::none(),
      nb::kw_only(),
      "scale"_a,
      "window"_a,
      "kv_heads"_a,
      "rows_per_head"_a,
      "bits"_a = 0,
      "group_size"_a = 0,
      "stream"_a = nb::none(),
      "Attention of [B, Hq, L, D] queries over the pool rows their slots name "
      "(see csrc/attention_kernel.h): float32 pools (bits 0) or packed uint32 rows "
      "(bits 8 or 4, group_size 32, 64 or 128). Returns [B, Hq, L, Dv].");
  m.def(
      "silu_mul",
      &mlxserve::silu_mul,
      "gate"_a,
      "x"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "silu(gate) * x (mlx-lm's swiglu) of float32 arrays of one shape, on the CPU.");
  m.def(
      "rope",
      &mlxserve::rope,
      "x"_a,
      "dims"_a,
      nb::kw_only(),
      "traditional"_a,
      "base"_a,
      "scale"_a,
      "offset"_a,
      "freqs"_a = nb::none(),
      "stream"_a = nb::none(),
      "mx.fast.rope of float32 [B, N, T, D] on the CPU, as MLX's CPU graph computes it; "
      "offset int32 [1] or [B], freqs float32 [dims / 2] or None (then base).");
  m.def(
      "rms_norm",
      &mlxserve::rms_norm,
      "x"_a,
      "weight"_a,
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "mx.fast.rms_norm of float32 [..., D] on the CPU, as MLX's CPU graph computes it; "
      "weight float32 [D] or None.");
  m.def(
      "pool_zeros",
      [](const std::vector<int>& shape, mlx::core::Dtype dtype, mlx::core::StreamOrDevice s) {
        return mlxserve::pool_zeros(mlx::core::Shape(shape.begin(), shape.end()), dtype, s);
      },
      "shape"_a,
      "dtype"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "mx.zeros(shape, dtype) on the CPU for a KV pool: the zeros written from the thread "
      "pool, on transparent huge pages where the kernel offers them.");
  m.def(
      "quantized_matmul",
      &mlxserve::quantized_matmul,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "stream"_a = nb::none(),
      "mx.quantized_matmul(x, w, scales, biases, transpose=True) on the CPU: float32 x "
      "[..., K], uint32 w [N, K * bits / 32] (bits 4 or 8), float32 scales and biases "
      "[N, K / group_size] (32, 64 or 128). Returns [..., N].");
  m.def(
      "dequantize",
      &mlxserve::dequantize,
      "w"_a,
      "scales"_a,
      "biases"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "stream"_a = nb::none(),
      "mx.dequantize of the same weights on the CPU, float32 [N, K], equal to MLX's.");
  m.def(
      "set_threads",
      [](int n) { mlxserve::ThreadPool::instance().set_threads(n); },
      "n"_a,
      "Threads the kernel may use, the calling thread included.");
  m.def("threads", [] { return mlxserve::ThreadPool::instance().threads(); });
  m.def(
      "kernel_isa",
      [] { return std::string(MLXSERVE_ISA_NAME); },
      "The instruction-set build of the kernels this CPU runs (every op's).");
  m.def(
      "built_with_mlx",
      [] {
        return std::string(MLXSERVE_STR(MLX_VERSION_MAJOR) "." MLXSERVE_STR(
            MLX_VERSION_MINOR) "." MLXSERVE_STR(MLX_VERSION_PATCH));
      },
      "The MLX version whose headers this module was compiled against.");
}
