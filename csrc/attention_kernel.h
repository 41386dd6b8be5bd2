// mlxserve: ragged paged attention over flat head-major K/V pools.
//
// This header is shared by the op (attention_op.cpp, built once) and the kernel
// (attention_kernel.cpp, built once per instruction set). It holds plain structs
// and function declarations only: no templates, no inline functions, so the
// per-ISA objects share no weak symbols the linker could pick the wrong copy of.

#pragma once

#include <cstdint>

namespace mlxserve {

// Everything one call of the kernel reads and writes. Pointers are to float32
// or int32 data; strides are in elements.
//
//   q      [B, Hq, L, Dk]  any strides; query n (of N = B * L) is q[n / L, :, n % L]
//   k      [Hkv * rows_per_head, Dk]  row stride k_row, unit column stride
//   v      [Hkv * rows_per_head, Dv]  likewise
//   slots  [T, S]          a table of key slots (row stride slots_row)
//   meta   [R, 6]          one run of queries per entry (kMeta* below)
//   sinks  [Hq] or null    one extra logit per query head (gpt-oss)
//   out    [B, L, Hq, Dv]  contiguous; queries no run covers get zeros
//
// A run is q_len consecutive queries n = q_first .. q_first + q_len - 1 of one
// sequence over the keys of slots row slot_row: key column c sits at position
// key_start + c and is real for c < key_count; query i sits at position
// p = q_start + i and sees the keys at positions j with j <= p (and
// j > p - window when window > 0). A padded [B, L] batch has one run per row
// (q_first = b * L); a packed batch of one-token rows has one run per
// sequence, whose queries are consecutive rows sharing one slots row.
enum MetaField {
  kMetaSlotRow = 0,
  kMetaKeyCount = 1,
  kMetaKeyStart = 2,
  kMetaQStart = 3,
  kMetaQLen = 4,
  kMetaQFirst = 5,
  kMetaFields = 6,
};

struct AttentionArgs {
  const float* q;
  int64_t q_stride[4];
  const float* k;
  int64_t k_row;
  const float* v;
  int64_t v_row;
  const int32_t* slots;
  int64_t slots_row;
  const int32_t* meta;
  const float* sinks;
  float* out;
  int B, L, Hq, Hkv, Dk, Dv, S, T, R;
  int64_t rows_per_head;
  float scale;
  int window;
};

// One unit of work: the queries [l0, l1) of run b on KV head h (all Hq / Hkv
// query heads of that KV head), over the key columns [c0, c1).
struct AttentionTask {
  int b, h, l0, l1, c0, c1;
  // Null: normalize into args.out. Otherwise the unnormalized partial state of
  // every query row of the task: (l1 - l0) * G entries of [max, sum, acc[Dv]].
  float* partial;
};

// The most query rows ((l1 - l0) * G) one task may hold.
constexpr int kMaxTaskQueries = 64;
// The most head dim the kernel takes (its per-task buffers are on the stack).
constexpr int kMaxHeadDim = 512;

namespace isa_baseline {
void run_task(const AttentionArgs& args, const AttentionTask& task);
void merge_partials(
    const AttentionArgs& args,
    int n,
    int hq,
    const float* partials,
    int count,
    int64_t stride);
}  // namespace isa_baseline

#if defined(MLXSERVE_HAVE_X86_V3)
namespace isa_x86_v3 {
void run_task(const AttentionArgs& args, const AttentionTask& task);
void merge_partials(
    const AttentionArgs& args,
    int n,
    int hq,
    const float* partials,
    int count,
    int64_t stride);
}  // namespace isa_x86_v3
#endif

}  // namespace mlxserve
