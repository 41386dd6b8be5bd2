// mlxserve: the RMS norm op: validation, the MLX primitive, and the split of
// one call's rows over the thread pool.

#include "norm_op.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "isa.h"
#include "norm_kernel.h"
#include "thread_pool.h"

namespace mlxserve {

namespace {

// Elements per task: a decode step's rows (batch x hidden size) run on the
// calling thread; a prefill chunk's are split.
constexpr int64_t kBlockElements = 65536;

struct Call {
  const float* x;
  const float* weight;
  float* out;
  int64_t rows;
  int D;
  float eps;
};

void run_norm(const Call& c) {
  static const auto kernel = MLXSERVE_PICK_ISA(rms_norm_rows);
  const int64_t per = std::max<int64_t>(1, kBlockElements / c.D);
  parallel_blocks((c.rows + per - 1) / per, [&](int64_t i) {
    kernel(c.x, c.weight, c.out, i * per, std::min(c.rows, (i + 1) * per), c.D, c.eps);
  });
}

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("rms_norm: " + what);
  }
}

}  // namespace

mx::array rms_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    float eps,
    mx::StreamOrDevice s) {
  require(x.ndim() >= 1 && x.dtype() == mx::float32 && x.shape(-1) > 0,
          "x must be float32 [..., D]");
  const mx::Stream stream = mx::to_stream(s);
  require(stream.device == mx::Device::cpu, "rms_norm runs on the CPU only");
  std::vector<mx::array> inputs = {mx::contiguous(x, false, stream)};
  if (weight.has_value()) {
    require(weight->dtype() == mx::float32 && weight->ndim() == 1 &&
                weight->shape(0) == x.shape(-1),
            "weight must be float32 [D]");
    inputs.push_back(mx::contiguous(*weight, false, stream));
  }
  return mx::array(
      x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps, weight.has_value()),
      std::move(inputs));
}

std::vector<mx::Shape> RmsNorm::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && has_weight_ == o.has_weight_;
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& x = inputs[0];
  require(x.flags().row_contiguous, "x must be row-contiguous");
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int D = x.shape(-1);
  const int64_t rows = static_cast<int64_t>(x.size()) / D;
  const Call c{x.data<float>(), has_weight_ ? inputs[1].data<float>() : nullptr,
               out.data<float>(), rows, D, eps_};
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  encoder.dispatch([c]() { run_norm(c); });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("rms_norm has no GPU implementation");
}

}  // namespace mlxserve
