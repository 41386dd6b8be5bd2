// mlxserve: the rope op: validation, the MLX primitive, and the split of one
// call's (b, t) rows over the thread pool.

#include "rope_op.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "isa.h"
#include "rope_kernel.h"
#include "thread_pool.h"

namespace mlxserve {

namespace {

// Elements per task: a decode step's queries (batch x heads x head dim, tens of
// thousands) run on the calling thread; a prefill chunk's are split.
constexpr int64_t kBlockElements = 65536;

void run_rope(const RopeArgs& a) {
  static const auto kernel = MLXSERVE_PICK_ISA(rope_rows);
  const int64_t rows = static_cast<int64_t>(a.B) * a.T;
  const int64_t per =
      std::max<int64_t>(1, kBlockElements / std::max<int64_t>(1, static_cast<int64_t>(a.N) * a.D));
  parallel_blocks((rows + per - 1) / per, [&](int64_t i) {
    kernel(a, i * per, std::min(rows, (i + 1) * per));
  });
}

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("rope: " + what);
  }
}

}  // namespace

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs,
    mx::StreamOrDevice s) {
  require(x.ndim() == 4 && x.dtype() == mx::float32, "x must be float32 [B, N, T, D]");
  require(dims > 0 && dims % 2 == 0 && dims <= x.shape(3) && dims <= kMaxRopeDims,
          "dims must be even, positive and at most the head dim and 1024");
  require(offset.dtype() == mx::int32 && offset.ndim() <= 1 &&
              (offset.size() == 1 || offset.size() == static_cast<size_t>(x.shape(0))),
          "offset must be int32 with 1 or B elements");
  const mx::Stream stream = mx::to_stream(s);
  require(stream.device == mx::Device::cpu, "rope runs on the CPU only");
  // Rows wider than the kernel's gather buffer are read with unit stride.
  std::vector<mx::array> inputs = {
      x.shape(3) > kMaxRopeDims ? mx::contiguous(x, false, stream) : x,
      mx::contiguous(mx::reshape(offset, {-1}, stream), false, stream)};
  if (freqs.has_value()) {
    require(freqs->dtype() == mx::float32 && freqs->ndim() == 1 && freqs->shape(0) == dims / 2,
            "freqs must be float32 [dims / 2]");
    inputs.push_back(mx::contiguous(*freqs, false, stream));
  }
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<Rope>(stream, dims, traditional, base, scale, freqs.has_value()),
      std::move(inputs));
}

std::vector<mx::Shape> Rope::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
      scale_ == o.scale_ && has_freqs_ == o.has_freqs_;
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  RopeArgs a{};
  a.x = x.data<float>();
  for (int i = 0; i < 4; ++i) {
    a.x_stride[i] = x.strides(i);
  }
  a.out = out.data<float>();
  a.offset = inputs[1].data<int32_t>();
  a.offset_count = static_cast<int>(inputs[1].size());
  a.freqs = has_freqs_ ? inputs[2].data<float>() : nullptr;
  a.B = x.shape(0);
  a.N = x.shape(1);
  a.T = x.shape(2);
  a.D = x.shape(3);
  a.dims = dims_;
  a.base = base_;
  a.scale = scale_;
  a.traditional = traditional_;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  encoder.dispatch([a]() { run_rope(a); });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("rope has no GPU implementation");
}

}  // namespace mlxserve
