// mlxserve: the pools' zero-filled arrays: huge-page advice, then the zeros
// written in blocks over the thread pool.

#include "pool_op.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"

namespace mlxserve {

namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
// Bytes per task: big enough that a task is mostly page faults and stores.
constexpr size_t kBlockBytes = size_t{8} << 20;

// Ask for huge pages over the whole 2 MiB pages inside [p, p + n). Advice only:
// where THP is off or the call fails, the zeros land on ordinary pages.
void advise_huge_pages(char* p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHugePage - 1);
  if (end > begin) {
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#else
  (void)p;
  (void)n;
#endif
}

void zero_fill(char* p, size_t n) {
  advise_huge_pages(p, n);
  const int64_t blocks = static_cast<int64_t>((n + kBlockBytes - 1) / kBlockBytes);
  parallel_blocks(blocks, [&](int64_t i) {
    const size_t begin = static_cast<size_t>(i) * kBlockBytes;
    std::memset(p + begin, 0, std::min(kBlockBytes, n - begin));
  });
}

}  // namespace

mx::array pool_zeros(const mx::Shape& shape, mx::Dtype dtype, mx::StreamOrDevice s) {
  const mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("pool_zeros runs on the CPU only");
  }
  for (const auto dim : shape) {
    if (dim < 0) {
      throw std::invalid_argument("pool_zeros: negative dimension");
    }
  }
  return mx::array(shape, dtype, std::make_shared<PoolZeros>(stream, shape), {});
}

std::vector<mx::Shape> PoolZeros::output_shapes(const std::vector<mx::array>&) {
  return {shape_};
}

void PoolZeros::eval_cpu(const std::vector<mx::array>&, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_output_array(out);
  char* p = out.data<char>();
  const size_t n = out.nbytes();
  encoder.dispatch([p, n]() { zero_fill(p, n); });
}

void PoolZeros::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("pool_zeros has no GPU implementation");
}

}  // namespace mlxserve
