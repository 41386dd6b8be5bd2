// mlxserve: the quantized-weight ops: validation, the MLX primitives, and the
// split of one call over the thread pool (by blocks of W rows: each task
// dequantizes its rows once for every x row).

#include "qmm_op.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "isa.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm_kernel.h"
#include "thread_pool.h"

namespace mlxserve {

namespace {

// W rows per task: at least this many (a multiple of kQmmRowBlock), and about
// kTasks tasks per call, so the pool's threads balance without a task per block.
constexpr int64_t kMinTaskRows = 8 * kQmmRowBlock;
constexpr int64_t kTasks = 16;

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("quantized_matmul: " + what);
  }
}

// The packed weight's shape checked against the scales' and biases': K = columns.
int64_t check_weight(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  require(bits == 4 || bits == 8, "bits must be 4 or 8");
  require(group_size == 32 || group_size == 64 || group_size == 128,
          "group_size must be 32, 64 or 128");
  require(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be uint32 [N, K * bits / 32]");
  require(scales.dtype() == mx::float32 && biases.dtype() == mx::float32,
          "scales and biases must be float32");
  const int64_t n = w.shape(0);
  const int64_t k = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  require(scales.shape() == mx::Shape{static_cast<int>(n), static_cast<int>(k / group_size)} &&
              biases.shape() == scales.shape() && k % group_size == 0,
          "scales and biases must be [N, K / group_size]");
  return k;
}

QuantizedWeight view(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits) {
  const int64_t k = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  return {w.data<uint32_t>(), scales.data<float>(), biases.data<float>(), k, bits, group_size};
}

int64_t task_rows(int64_t n) {
  const int64_t rows = std::max(kMinTaskRows, (n + kTasks - 1) / kTasks);
  return (rows + kQmmRowBlock - 1) / kQmmRowBlock * kQmmRowBlock;
}

// A float buffer that starts on a cache line, grown as needed, one per thread.
class LineAlignedBuffer {
 public:
  float* get(size_t floats) {
    if (floats > capacity_) {
      const size_t bytes = (floats * sizeof(float) + kCacheLine - 1) / kCacheLine * kCacheLine;
      data_.reset(static_cast<float*>(std::aligned_alloc(kCacheLine, bytes)));
      if (!data_) {
        throw std::bad_alloc();
      }
      capacity_ = bytes / sizeof(float);
    }
    return data_.get();
  }

 private:
  static constexpr size_t kCacheLine = 64;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  size_t capacity_ = 0;
};

// MLX's CPU buffers start 8 bytes past a 16-byte boundary (its allocator's header), so every
// other 32-byte load of an x row splits two lines; the kernels load each x vector once
// per block of W rows and run ~5% faster from a line-aligned copy (a copy of x is ~1% of
// the product's time). The copy, like the aligned scratch, changes no value.
const float* line_aligned(const float* x, size_t floats) {
  if (floats == 0 || reinterpret_cast<uintptr_t>(x) % 64 == 0) {
    return x;
  }
  thread_local LineAlignedBuffer copy;
  float* aligned = copy.get(floats);
  std::memcpy(aligned, x, floats * sizeof(float));
  return aligned;
}

void run_qmm(const float* x, int64_t rows, QuantizedWeight w, int64_t n, float* out) {
  static const auto kernel = MLXSERVE_PICK_ISA(qmm_rows);
  const int64_t per_task = task_rows(n);
  x = line_aligned(x, static_cast<size_t>(rows * w.k));
  parallel_blocks((n + per_task - 1) / per_task, [&](int64_t t) {
    thread_local LineAlignedBuffer scratch;
    const int64_t n0 = t * per_task;
    kernel(x, rows, w, n0, std::min(n, n0 + per_task), out, n,
           scratch.get(static_cast<size_t>(kQmmRowBlock * w.k)));
  });
}

void run_dequantize(QuantizedWeight w, int64_t n, float* out) {
  static const auto kernel = MLXSERVE_PICK_ISA(dequantize_rows);
  const int64_t per_task = task_rows(n);
  parallel_blocks((n + per_task - 1) / per_task, [&](int64_t t) {
    const int64_t n0 = t * per_task;
    kernel(w, n0, std::min(n, n0 + per_task), out + n0 * w.k);
  });
}

std::vector<mx::array> contiguous_inputs(std::vector<mx::array> inputs, mx::Stream stream) {
  // The kernels read flat buffers; contiguous() shares a row-contiguous buffer and
  // copies anything else (a transposed or broadcast view).
  for (auto& a : inputs) {
    a = mx::contiguous(a, false, stream);
  }
  return inputs;
}

void set_inputs_and_output(mx::cpu::CommandEncoder& encoder, const std::vector<mx::array>& in,
                           mx::array& out) {
  for (const auto& a : in) {
    require(a.flags().row_contiguous, "inputs must be row-contiguous");
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
}

}  // namespace

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits,
                           mx::StreamOrDevice s) {
  const int64_t k = check_weight(w, scales, biases, group_size, bits);
  require(x.dtype() == mx::float32 && x.ndim() >= 1, "x must be float32 [..., K]");
  require(x.shape(-1) == k, "x's last dimension must be the weight's K");
  const mx::Stream stream = mx::to_stream(s);
  require(stream.device == mx::Device::cpu, "quantized_matmul runs on the CPU only");
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32,
                   std::make_shared<QuantizedMatmul>(stream, group_size, bits),
                   contiguous_inputs({x, w, scales, biases}, stream));
}

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits, mx::StreamOrDevice s) {
  const int64_t k = check_weight(w, scales, biases, group_size, bits);
  const mx::Stream stream = mx::to_stream(s);
  require(stream.device == mx::Device::cpu, "dequantize runs on the CPU only");
  return mx::array({w.shape(0), static_cast<int>(k)}, mx::float32,
                   std::make_shared<Dequantize>(stream, group_size, bits),
                   contiguous_inputs({w, scales, biases}, stream));
}

bool QuantizedWeightPrimitive::is_equivalent(const mx::Primitive& other) const {
  // MLX compares primitives of one dynamic type only (compile checks typeid first).
  const auto& o = static_cast<const QuantizedWeightPrimitive&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

void QuantizedWeightPrimitive::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(std::string(name()) + " has no GPU implementation");
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  set_inputs_and_output(encoder, inputs, out);
  const QuantizedWeight w = view(inputs[1], inputs[2], inputs[3], group_size_, bits_);
  const float* x = inputs[0].data<float>();
  const int64_t n = inputs[1].shape(0);
  const int64_t rows = n == 0 ? 0 : static_cast<int64_t>(out.size()) / n;
  float* o = out.data<float>();
  encoder.dispatch([x, rows, w, n, o]() { run_qmm(x, rows, w, n, o); });
}

std::vector<mx::Shape> Dequantize::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1) * 32 / bits_}};
}

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  set_inputs_and_output(encoder, inputs, out);
  const QuantizedWeight w = view(inputs[0], inputs[1], inputs[2], group_size_, bits_);
  const int64_t n = inputs[0].shape(0);
  float* o = out.data<float>();
  encoder.dispatch([w, n, o]() { run_dequantize(w, n, o); });
}

}  // namespace mlxserve
