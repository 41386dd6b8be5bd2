// mlxserve: the silu * mul op: validation, the MLX primitive, and the split of
// one call over the thread pool.

#include "activation_op.h"

#include <algorithm>
#include <stdexcept>

#include "activation_kernel.h"
#include "isa.h"
#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"

namespace mlxserve {

namespace {

// Elements per task. A decode step's activations (batch x intermediate size, a few
// tens of thousands) run on the calling thread; a prefill chunk's are split.
constexpr int64_t kBlock = 32768;

void run_silu_mul(const float* gate, const float* x, float* out, int64_t n) {
  static const auto kernel = MLXSERVE_PICK_ISA(silu_mul);
  parallel_blocks((n + kBlock - 1) / kBlock, [&](int64_t i) {
    const int64_t begin = i * kBlock;
    kernel(gate + begin, x + begin, out + begin, std::min(kBlock, n - begin));
  });
}

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("silu_mul: " + what);
  }
}

}  // namespace

mx::array silu_mul(const mx::array& gate, const mx::array& x, mx::StreamOrDevice s) {
  require(gate.dtype() == mx::float32 && x.dtype() == mx::float32, "inputs must be float32");
  require(gate.shape() == x.shape(), "gate and x must have the same shape");
  const mx::Stream stream = mx::to_stream(s);
  require(stream.device == mx::Device::cpu, "silu_mul runs on the CPU only");
  // The kernel reads flat buffers; contiguous() shares an already row-contiguous
  // buffer and copies anything else (a transposed or broadcast view).
  return mx::array(
      gate.shape(),
      mx::float32,
      std::make_shared<SiluMul>(stream),
      {mx::contiguous(gate, false, stream), mx::contiguous(x, false, stream)});
}

std::vector<mx::Shape> SiluMul::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& gate = inputs[0];
  const mx::array& x = inputs[1];
  require(gate.flags().row_contiguous && x.flags().row_contiguous,
          "inputs must be row-contiguous");
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const float* g = gate.data<float>();
  const float* xs = x.data<float>();
  float* o = out.data<float>();
  const int64_t n = static_cast<int64_t>(out.size());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(gate);
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([g, xs, o, n]() { run_silu_mul(g, xs, o, n); });
}

void SiluMul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("silu_mul has no GPU implementation");
}

}  // namespace mlxserve
