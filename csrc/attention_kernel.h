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
//          (bits > 0: k and v are null and k_packed / v_packed hold the pools)
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
//
// Quantized pools (bits 8 or 4, mlx_backend/kv/quantization.py): a pool row is
// the bytes of what mx.quantize makes of one token's head, side by side:
//
//   [0, D * bits / 8)          values; element i in bits [bits * i, bits * (i + 1))
//                              (8 bits: one byte each; 4 bits: low nibble first)
//   [.., + 4 * D / group)      float32 scales, one per group of group_size values
//   [.., + 4 * D / group)      float32 biases: value = code * scale + bias
//
// with row strides k_packed_row / v_packed_row in bytes. The kernel dequantizes
// each chunk's rows into a per-task float buffer and runs the float loops on it.
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
  // Quantized pools (bits > 0; 0: float32 pools k and v).
  const unsigned char* k_packed;
  int64_t k_packed_row;
  const unsigned char* v_packed;
  int64_t v_packed_row;
  int bits;
  int group_size;
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
