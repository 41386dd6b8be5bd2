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
//   q      [B, Hq, L, Dk]  any strides
//   k      [Hkv * rows_per_head, Dk]  row stride k_row, unit column stride
//   v      [Hkv * rows_per_head, Dv]  likewise
//   slots  [B, S]          the slot of key column c of row b (row stride slots_row)
//   meta   [B, 4]          per row: key_count, key_start, q_start, q_len
//   sinks  [Hq] or null    one extra logit per query head (gpt-oss)
//   out    [B, L, Hq, Dv]  contiguous; padded queries (l >= q_len) get zeros
//
// Key column c of row b sits at position key_start + c and is real for
// c < key_count. Query l sits at position p = q_start + l and sees the keys at
// positions j with j <= p (and j > p - window when window > 0).
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
  int B, L, Hq, Hkv, Dk, Dv, S;
  int64_t rows_per_head;
  float scale;
  int window;
};

// One unit of work: the queries [l0, l1) of row b on KV head h (all Hq / Hkv
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
    int b,
    int l,
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
    int b,
    int l,
    int hq,
    const float* partials,
    int count,
    int64_t stride);
}  // namespace isa_x86_v3
#endif

}  // namespace mlxserve
