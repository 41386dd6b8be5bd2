// mlxserve: the ragged paged attention op: validation, the MLX primitive, and
// the plan of one call (which tasks, which long rows split over keys).

#include "attention_op.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_kernel.h"
#include "isa.h"
#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"

namespace mlxserve {

namespace {

struct Kernel {
  void (*run)(const AttentionArgs&, const AttentionTask&);
  void (*merge)(const AttentionArgs&, int, int, const float*, int, int64_t);
};

const Kernel& kernel() {
  static const Kernel k{MLXSERVE_PICK_ISA(run_task), MLXSERVE_PICK_ISA(merge_partials)};
  return k;
}

// Keys below which a row is not split: a split must leave each piece enough
// keys to pay for its partial state and merge.
constexpr int kMinSplitKeys = 256;
// Tasks per thread to aim for, so the atomic hand-out balances uneven rows.
constexpr int kTasksPerThread = 4;

struct Run {
  int slot_row, key_count, key_start, q_start, q_len, q_first;
};

// Run b of the call, checked: its queries and its slots row must exist.
Run run_meta(const AttentionArgs& a, int b) {
  const int32_t* m = a.meta + kMetaFields * b;
  Run r{m[kMetaSlotRow], m[kMetaKeyCount], m[kMetaKeyStart],
        m[kMetaQStart],  m[kMetaQLen],     m[kMetaQFirst]};
  const int64_t n = static_cast<int64_t>(a.B) * a.L;
  if (r.slot_row < 0 || r.slot_row >= a.T || r.q_len < 0 || r.q_first < 0 ||
      r.q_first + static_cast<int64_t>(r.q_len) > n || r.key_count < 0 || r.key_count > a.S) {
    throw std::out_of_range("ragged_attention: run " + std::to_string(b) +
                            " names queries, keys or a slots row outside its inputs");
  }
  return r;
}

// The key columns [lo, hi] query l of a run sees (hi < lo: none).
std::pair<int, int> visible(const AttentionArgs& a, const Run& r, int l) {
  const int p = r.q_start + l;
  const int hi = std::min(p - r.key_start, r.key_count - 1);
  const int lo = a.window > 0 ? std::max(0, p - a.window + 1 - r.key_start) : 0;
  return {lo, hi};
}

struct SplitBlock {
  int b, h, l0, l1, count;
  size_t offset;  // into the scratch buffer
};

struct Plan {
  const AttentionArgs* args;
  std::vector<AttentionTask> tasks;
  std::vector<SplitBlock> splits;
  std::vector<float> scratch;
};

void run_one_task(void* ctx, int i) {
  auto* plan = static_cast<Plan*>(ctx);
  kernel().run(*plan->args, plan->tasks[i]);
}

void merge_one_block(void* ctx, int i) {
  auto* plan = static_cast<Plan*>(ctx);
  const AttentionArgs& a = *plan->args;
  const SplitBlock& s = plan->splits[i];
  const int G = a.Hq / a.Hkv;
  const int Q = (s.l1 - s.l0) * G;
  const int64_t entry = a.Dv + 2;
  const float* base = plan->scratch.data() + s.offset;
  const int q_first = a.meta[kMetaFields * s.b + kMetaQFirst];
  for (int r = 0; r < Q; ++r) {
    kernel().merge(
        a, q_first + s.l0 + r / G, s.h * G + r % G, base + r * entry, s.count, Q * entry);
  }
}

void run_attention(const AttentionArgs& a) {
  const int G = a.Hq / a.Hkv;
  const int width = std::max(a.Dk, a.Dv);
  const int block = std::max(1, std::min(kMaxTaskQueries / G, 8192 / (G * width)));
  const int64_t row_floats = static_cast<int64_t>(a.Hq) * a.Dv;

  struct Block {
    int b, l0, l1, lo, hi;
  };
  std::vector<Block> blocks;
  int64_t total_cost = 0;
  const int64_t queries = static_cast<int64_t>(a.B) * a.L;
  std::vector<char> covered(queries, 0);
  for (int b = 0; b < a.R; ++b) {
    const Run r = run_meta(a, b);
    std::memset(covered.data() + r.q_first, 1, r.q_len);
    if (r.q_len == 0) {
      continue;
    }
    // Every slot a query of this run can read must lie inside the pool.
    const auto [lo0, hi0] = visible(a, r, 0);
    const auto [lo1, hi1] = visible(a, r, r.q_len - 1);
    const int32_t* slots = a.slots + static_cast<int64_t>(r.slot_row) * a.slots_row;
    for (int c = std::max(0, std::min(lo0, lo1)); c <= std::max(hi0, hi1); ++c) {
      if (slots[c] < 0 || slots[c] >= a.rows_per_head) {
        throw std::out_of_range(
            "ragged_attention: slot " + std::to_string(slots[c]) + " of row " +
            std::to_string(b) + " is outside the pool of " +
            std::to_string(a.rows_per_head) + " rows per head");
      }
    }
    for (int l0 = 0; l0 < r.q_len; l0 += block) {
      const int l1 = std::min(l0 + block, r.q_len);
      const int lo = visible(a, r, l0).first;
      const int hi = visible(a, r, l1 - 1).second;
      blocks.push_back({b, l0, l1, lo, hi});
      total_cost += static_cast<int64_t>(std::max(hi - lo + 1, 1)) * (l1 - l0) * G * a.Hkv;
    }
  }
  // Padding queries (no run covers them) come out as zeros.
  for (int64_t n = 0; n < queries; ++n) {
    if (!covered[n]) {
      std::memset(a.out + n * row_floats, 0, sizeof(float) * row_floats);
    }
  }

  Plan plan;
  plan.args = &a;
  const int threads = ThreadPool::instance().threads();
  const int64_t target = std::max<int64_t>(1, total_cost / (threads * kTasksPerThread));
  // Long rows are split over keys into pieces that each leave a partial
  // softmax state in the scratch buffer; a second pass merges the pieces.
  std::vector<int> pieces(blocks.size(), 1);
  size_t scratch = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& bl = blocks[i];
    const int cols = bl.hi - bl.lo + 1;
    const int Q = (bl.l1 - bl.l0) * G;
    const int64_t cost = static_cast<int64_t>(std::max(cols, 1)) * Q;
    if (threads > 1 && cols >= 2 * kMinSplitKeys && cost > target) {
      pieces[i] = static_cast<int>(
          std::min<int64_t>(cols / kMinSplitKeys, (cost + target - 1) / target));
      scratch += static_cast<size_t>(a.Hkv) * pieces[i] * Q * (a.Dv + 2);
    }
  }
  plan.scratch.resize(scratch);
  size_t offset = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& bl = blocks[i];
    const int Q = (bl.l1 - bl.l0) * G;
    const int n = pieces[i];
    const int step = (bl.hi - bl.lo + 1 + n - 1) / n;
    for (int h = 0; h < a.Hkv; ++h) {
      if (n == 1) {
        plan.tasks.push_back({bl.b, h, bl.l0, bl.l1, 0, a.S, nullptr});
        continue;
      }
      plan.splits.push_back({bl.b, h, bl.l0, bl.l1, n, offset});
      for (int p = 0; p < n; ++p) {
        const int c0 = bl.lo + p * step;
        const int c1 = std::min(bl.hi + 1, c0 + step);
        float* partial = plan.scratch.data() + offset + static_cast<size_t>(p) * Q * (a.Dv + 2);
        plan.tasks.push_back({bl.b, h, bl.l0, bl.l1, c0, c1, partial});
      }
      offset += static_cast<size_t>(n) * Q * (a.Dv + 2);
    }
  }
  // Biggest tasks first: the atomic hand-out then ends with small ones.
  auto cost = [&](const AttentionTask& t) {
    const Run r = run_meta(a, t.b);
    const int lo = std::max(t.c0, visible(a, r, t.l0).first);
    const int hi = std::min(t.c1 - 1, visible(a, r, t.l1 - 1).second);
    return static_cast<int64_t>(std::max(hi - lo + 1, 1)) * (t.l1 - t.l0);
  };
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(),
                   [&](const AttentionTask& x, const AttentionTask& y) {
                     return cost(x) > cost(y);
                   });
  ThreadPool& pool = ThreadPool::instance();
  pool.parallel_for(static_cast<int>(plan.tasks.size()), run_one_task, &plan);
  pool.parallel_for(static_cast<int>(plan.splits.size()), merge_one_block, &plan);
}

void require(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("ragged_attention: " + what);
  }
}

// uint32 words of one packed row of dim values (float32 scales and biases).
int64_t packed_row_words(int64_t dim, int bits, int group_size) {
  return (dim * bits / 8 + 2 * 4 * (dim / group_size)) / 4;
}

}  // namespace

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
    int bits,
    int group_size,
    mx::StreamOrDevice s) {
  require(queries.ndim() == 4, "queries must be [B, Hq, L, D]");
  require(k_pool.ndim() == 2 && v_pool.ndim() == 2, "pools must be [Hkv * rows, D]");
  require(queries.dtype() == mx::float32, "queries must be float32");
  require(slots.dtype() == mx::int32 && meta.dtype() == mx::int32,
          "slots and meta must be int32");
  const int B = queries.shape(0), Hq = queries.shape(1), Dk = queries.shape(3);
  int Dv = v_pool.shape(1);
  if (bits == 0) {
    require(k_pool.dtype() == mx::float32 && v_pool.dtype() == mx::float32,
            "pools must be float32 (or packed uint32 rows with bits 8 or 4)");
    require(k_pool.shape(1) == Dk, "queries and keys must have the same head dim");
  } else {
    require(bits == 8 || bits == 4, "bits must be 8 or 4 (0: float32 pools)");
    require(group_size == 32 || group_size == 64 || group_size == 128,
            "group_size must be 32, 64 or 128");
    require(k_pool.dtype() == mx::uint32 && v_pool.dtype() == mx::uint32,
            "quantized pools must be uint32 packed rows");
    require(Dk % group_size == 0, "the group size must divide the key head dim");
    require(k_pool.shape(1) == packed_row_words(Dk, bits, group_size),
            "key pool rows are not packed rows of the queries' head dim");
    // A packed row of Dv values is Dv * (bits * group + 64) / (32 * group) words.
    const int64_t words = v_pool.shape(1);
    const int64_t per = bits * group_size + 64;
    require(words * 32 * group_size % per == 0, "value pool rows are not packed rows");
    Dv = static_cast<int>(words * 32 * group_size / per);
    require(Dv > 0 && Dv % group_size == 0 &&
                packed_row_words(Dv, bits, group_size) == words,
            "value pool rows are not packed rows");
  }
  require(kv_heads > 0 && Hq % kv_heads == 0, "query heads must be a multiple of KV heads");
  require(rows_per_head > 0 && k_pool.shape(0) == kv_heads * rows_per_head &&
              v_pool.shape(0) == k_pool.shape(0),
          "pools must hold kv_heads * rows_per_head rows");
  require(Dk <= kMaxHeadDim && Dv <= kMaxHeadDim, "head dim above the kernel's limit");
  const int G = Hq / kv_heads;
  require(G <= kMaxTaskQueries && G * std::max(Dk, Dv) <= 8192,
          "too many query heads per KV head for the kernel's buffers");
  require(slots.ndim() == 2 && slots.shape(1) >= 1, "slots must be [T, S]");
  require(slots.shape(0) >= 1, "slots must have a row");
  require(meta.ndim() == 2 && meta.shape(1) == kMetaFields, "meta must be [R, 6]");
  std::vector<mx::array> inputs = {queries, k_pool, v_pool, slots, meta};
  if (sinks.has_value()) {
    require(sinks->ndim() == 1 && sinks->shape(0) == Hq, "sinks must be [Hq]");
    inputs.push_back(mx::astype(*sinks, mx::float32, s));
  }
  const mx::Stream stream = mx::to_stream(s);
  require(stream.device == mx::Device::cpu, "ragged_attention runs on the CPU only");
  auto out = mx::array(
      {B, queries.shape(2), Hq, Dv},
      mx::float32,
      std::make_shared<RaggedAttention>(
          stream, scale, window, kv_heads, rows_per_head, sinks.has_value(), bits, group_size,
          Dv),
      inputs);
  return mx::transpose(out, {0, 2, 1, 3}, s);
}

void RaggedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& q = inputs[0];
  const mx::array& k = inputs[1];
  const mx::array& v = inputs[2];
  const mx::array& slots = inputs[3];
  const mx::array& meta = inputs[4];
  require(k.shape(1) == 1 || k.strides(1) == 1, "key pool columns must be contiguous");
  require(v.shape(1) == 1 || v.strides(1) == 1, "value pool columns must be contiguous");
  require(slots.shape(1) == 1 || slots.strides(1) == 1, "slot columns must be contiguous");
  require(meta.flags().row_contiguous, "meta must be row-contiguous");
  out.set_data(mx::allocator::malloc(out.nbytes()));

  AttentionArgs a{};
  a.q = q.data<float>();
  for (int i = 0; i < 4; ++i) {
    a.q_stride[i] = q.strides(i);
  }
  if (bits_ == 0) {
    a.k = k.data<float>();
    a.k_row = k.strides(0);
    a.v = v.data<float>();
    a.v_row = v.strides(0);
  } else {
    // Packed rows are read as bytes; their strides are in uint32 words.
    a.k_packed = reinterpret_cast<const unsigned char*>(k.data<uint32_t>());
    a.k_packed_row = k.strides(0) * 4;
    a.v_packed = reinterpret_cast<const unsigned char*>(v.data<uint32_t>());
    a.v_packed_row = v.strides(0) * 4;
    a.bits = bits_;
    a.group_size = group_size_;
  }
  a.slots = slots.data<int32_t>();
  a.slots_row = slots.strides(0);
  a.meta = meta.data<int32_t>();
  a.sinks = has_sinks_ ? inputs[5].data<float>() : nullptr;
  a.out = out.data<float>();
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.L = q.shape(2);
  a.Dk = q.shape(3);
  a.Hkv = kv_heads_;
  a.Dv = value_dim_;
  a.S = slots.shape(1);
  a.T = slots.shape(0);
  a.R = meta.shape(0);
  a.rows_per_head = rows_per_head_;
  a.scale = scale_;
  a.window = window_;

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  encoder.dispatch([a]() { run_attention(a); });
}

void RaggedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("ragged_attention has no GPU implementation");
}

std::vector<mx::Shape> RaggedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& q = inputs[0];
  return {{q.shape(0), q.shape(2), q.shape(1), value_dim_}};
}

bool RaggedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RaggedAttention&>(other);
  return scale_ == o.scale_ && window_ == o.window_ && kv_heads_ == o.kv_heads_ &&
      rows_per_head_ == o.rows_per_head_ && has_sinks_ == o.has_sinks_ && bits_ == o.bits_ &&
      group_size_ == o.group_size_ && value_dim_ == o.value_dim_;
}

}  // namespace mlxserve
