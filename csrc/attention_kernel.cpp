// mlxserve: the ragged attention kernel, compiled once per instruction set.
//
// CMake builds this file several times (x86-64-v2 baseline, x86-64-v3 with
// AVX2/FMA; once on arm64) with MLXSERVE_ISA naming the namespace. Everything
// but the two entry points has internal linkage and no standard-library
// template is used, so no weak symbol compiled for one instruction set can
// stand in for another's.
//
// One task covers the queries [l0, l1) of one row on one KV head: every query
// head of that KV head (GQA/MQA) reads each K/V row once. Keys are visited in
// chunks of kChunk columns with an online softmax:
//
//   s[r, j] = (q_r . k_j) * scale     (-inf where the mask hides key j)
//   m'      = max(m, max_j s[r, j])
//   p[r, j] = exp(s[r, j] - m')        (a branch-free polynomial, vectorized)
//   sum     = sum * exp(m - m') + sum_j p[r, j]
//   acc     = acc * exp(m - m') + sum_j p[r, j] * v_j
//
// and the result is acc / sum (with the sink logit, if any, counted in sum).
//
// Over quantized pools (args.bits > 0) each chunk's K and V rows are first
// dequantized (code * scale + bias per group) into per-task float buffers, and
// the same loops run on those: the float32 path is the same code as before.

#include "attention_kernel.h"
#include "fast_exp.h"

#ifndef MLXSERVE_ISA
#error "MLXSERVE_ISA must name the instruction-set namespace"
#endif

namespace mlxserve {
namespace MLXSERVE_ISA {
namespace {

constexpr int kChunk = 64;
constexpr float kNegInf = -__builtin_inff();
// Per-task stack buffers, in floats: queries and accumulators of every query row.
constexpr int kTaskFloats = 8192;
// Query rows from which the scores are computed against a transposed K chunk.
constexpr int kTransposeRows = 8;

inline float max_f(float a, float b) {
  return a > b ? a : b;
}

// A dot product with eight independent partial sums (one SIMD register on
// AVX2, two on SSE/NEON), added in a fixed order: no -ffast-math needed.
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      acc[j] += a[i + j] * b[i + j];
    }
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
      ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) {
    s += a[i] * b[i];
  }
  return s;
}

inline float sum(const float* __restrict a, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      acc[j] += a[i + j];
    }
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
      ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) {
    s += a[i];
  }
  return s;
}

// Eight floats as one value: one AVX register on x86-64-v3, two SSE/NEON
// registers elsewhere (GCC vector extensions, no intrinsics per ISA).
typedef float f8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, f8 v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

inline f8 splat8(float x) {
  return f8{x, x, x, x, x, x, x, x};
}

// Scores of one query row against a chunk of kChunk keys stored transposed
// (kt[d * kChunk + j]): eight vector accumulators, one broadcast per dim, no
// horizontal sums. Used when a task has enough query rows to pay for the
// transpose (prefill).
void scores_transposed(const float* __restrict q, const float* __restrict kt, int dim,
                       float* __restrict out) {
  f8 a0 = splat8(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int d = 0; d < dim; ++d) {
    const f8 qd = splat8(q[d]);
    const float* k = kt + d * kChunk;
    a0 += qd * load8(k);
    a1 += qd * load8(k + 8);
    a2 += qd * load8(k + 16);
    a3 += qd * load8(k + 24);
    a4 += qd * load8(k + 32);
    a5 += qd * load8(k + 40);
    a6 += qd * load8(k + 48);
    a7 += qd * load8(k + 56);
  }
  store8(out, a0);
  store8(out + 8, a1);
  store8(out + 16, a2);
  store8(out + 24, a3);
  store8(out + 32, a4);
  store8(out + 40, a5);
  store8(out + 48, a6);
  store8(out + 56, a7);
}

// acc[0, 8 * NV) += sum_j p[j] * v[j][0, 8 * NV): the accumulators stay in
// registers over the chunk's keys.
template <int NV>
void weighted_rows(float* __restrict acc, const float* __restrict p, const float* const* v,
                   int offset, int n) {
  f8 a[NV];
  for (int i = 0; i < NV; ++i) {
    a[i] = load8(acc + 8 * i);
  }
  for (int j = 0; j < n; ++j) {
    const f8 pj = splat8(p[j]);
    const float* vj = v[j] + offset;
    for (int i = 0; i < NV; ++i) {
      a[i] += pj * load8(vj + 8 * i);
    }
  }
  for (int i = 0; i < NV; ++i) {
    store8(acc + 8 * i, a[i]);
  }
}

// acc[0, dim) += sum_j p[j] * v[j][0, dim), in register tiles of 64 floats.
void weighted_sum(float* __restrict acc, const float* __restrict p, const float* const* v,
                  int n, int dim) {
  int d = 0;
  for (; d + 64 <= dim; d += 64) {
    weighted_rows<8>(acc + d, p, v, d, n);
  }
  for (; d + 32 <= dim; d += 32) {
    weighted_rows<4>(acc + d, p, v, d, n);
  }
  for (; d + 8 <= dim; d += 8) {
    weighted_rows<1>(acc + d, p, v, d, n);
  }
  for (; d < dim; ++d) {
    float x = acc[d];
    for (int j = 0; j < n; ++j) {
      x += p[j] * v[j][d];
    }
    acc[d] = x;
  }
}

// acc += p * v over n floats.
inline void axpy(float* __restrict acc, float p, const float* __restrict v, int n) {
  for (int i = 0; i < n; ++i) {
    acc[i] += p * v[i];
  }
}

inline void scale_in_place(float* __restrict a, float s, int n) {
  for (int i = 0; i < n; ++i) {
    a[i] *= s;
  }
}

struct RowBounds {
  int lo;  // first visible key column (inclusive)
  int hi;  // last visible key column (inclusive); hi < lo: no key visible
};

// The key columns query l of run b sees, clipped to [c0, c1).
RowBounds bounds(const AttentionArgs& a, int b, int l, int c0, int c1) {
  const int32_t* m = a.meta + kMetaFields * b;
  const int key_count = m[kMetaKeyCount], key_start = m[kMetaKeyStart];
  const int q_start = m[kMetaQStart], q_len = m[kMetaQLen];
  if (l >= q_len) {
    return {0, -1};
  }
  const int p = q_start + l;
  int hi = p - key_start;
  hi = hi < key_count - 1 ? hi : key_count - 1;
  int lo = 0;
  if (a.window > 0) {
    const int first = p - a.window + 1 - key_start;
    lo = first > 0 ? first : 0;
  }
  lo = lo > c0 ? lo : c0;
  hi = hi < c1 - 1 ? hi : c1 - 1;
  return {lo, hi};
}

// Bytes of one packed row of dim values (attention_kernel.h).
inline int64_t packed_row_bytes(int dim, int bits, int group) {
  return static_cast<int64_t>(dim) * bits / 8 + 2 * 4 * static_cast<int64_t>(dim / group);
}

// The most groups a row may have (head dim 512 in groups of 32).
constexpr int kMaxGroups = kMaxHeadDim / 32;

// One packed row (attention_kernel.h) of dim values into out[0, dim): code *
// scale + bias per group. The scales and biases are copied out first: the row
// is bytes, so they may not be read through a float pointer.
void dequantize_row(const unsigned char* __restrict row, int dim, int bits, int group,
                    float* __restrict out) {
  const int groups = dim / group;
  float scales[kMaxGroups];
  float biases[kMaxGroups];
  const unsigned char* side = row + dim * bits / 8;
  __builtin_memcpy(scales, side, sizeof(float) * groups);
  __builtin_memcpy(biases, side + sizeof(float) * groups, sizeof(float) * groups);
  if (bits == 8) {
    for (int g = 0; g < groups; ++g) {
      const unsigned char* __restrict c = row + g * group;
      float* __restrict o = out + g * group;
      const float s = scales[g], b = biases[g];
      for (int i = 0; i < group; ++i) {
        o[i] = static_cast<float>(c[i]) * s + b;
      }
    }
    return;
  }
  // 4 bits: byte i holds elements 2i (low nibble) and 2i + 1 (high nibble).
  const int half = group / 2;
  for (int g = 0; g < groups; ++g) {
    const unsigned char* __restrict c = row + g * half;
    float* __restrict o = out + g * group;
    const float s = scales[g], b = biases[g];
    for (int i = 0; i < half; ++i) {
      o[2 * i] = static_cast<float>(c[i] & 15) * s + b;
      o[2 * i + 1] = static_cast<float>(c[i] >> 4) * s + b;
    }
  }
}

// run_task over float32 pools (kQuantized false: exactly the float kernel) or
// over packed rows dequantized chunk by chunk into this task's buffers.
template <bool kQuantized>
void run_task_on(const AttentionArgs& a, const AttentionTask& t) {
  const int G = a.Hq / a.Hkv;
  const int nl = t.l1 - t.l0;
  const int Q = nl * G;
  const int Dk = a.Dk, Dv = a.Dv;

  float qbuf[kTaskFloats];
  float acc[kTaskFloats];
  float scores[kMaxTaskQueries * kChunk];
  float m[kMaxTaskQueries];
  float total[kMaxTaskQueries];
  RowBounds rb[kMaxTaskQueries];
  const float* krow[kChunk];
  const float* vrow[kChunk];

  // Query row r = (l - l0) * G + g is query head h * G + g at query l.
  int first = t.c1, last = t.c0 - 1;
  for (int li = 0; li < nl; ++li) {
    const RowBounds lb = bounds(a, t.b, t.l0 + li, t.c0, t.c1);
    if (lb.lo <= lb.hi) {
      first = lb.lo < first ? lb.lo : first;
      last = lb.hi > last ? lb.hi : last;
    }
    for (int g = 0; g < G; ++g) {
      const int r = li * G + g;
      const int hq = t.h * G + g;
      rb[r] = lb;
      const int n = a.meta[kMetaFields * t.b + kMetaQFirst] + t.l0 + li;
      const float* src = a.q + static_cast<int64_t>(n / a.L) * a.q_stride[0] +
          hq * a.q_stride[1] + static_cast<int64_t>(n % a.L) * a.q_stride[2];
      for (int d = 0; d < Dk; ++d) {
        qbuf[r * Dk + d] = src[d * a.q_stride[3]] * a.scale;
      }
      const bool sink = a.sinks != nullptr && t.partial == nullptr;
      m[r] = sink ? a.sinks[hq] : kNegInf;
      total[r] = sink ? 1.0f : 0.0f;
      for (int d = 0; d < Dv; ++d) {
        acc[r * Dv + d] = 0.0f;
      }
    }
  }

  const int32_t* slots = a.slots + a.meta[kMetaFields * t.b + kMetaSlotRow] * a.slots_row;
  const int64_t k_base = static_cast<int64_t>(t.h) * a.rows_per_head;
  const bool transpose = Q >= kTransposeRows;
  float kt[kChunk * kMaxHeadDim];  // the chunk of K, transposed (prefill only)
  // Quantized pools: the chunk's K and V rows dequantized, Dk / Dv floats apart.
  constexpr int kDequantFloats = kQuantized ? kChunk * kMaxHeadDim : 1;
  [[maybe_unused]] float kdq[kDequantFloats];
  [[maybe_unused]] float vdq[kDequantFloats];
  const int64_t k_bytes = kQuantized ? packed_row_bytes(Dk, a.bits, a.group_size) : Dk * 4;
  const int64_t v_bytes = kQuantized ? packed_row_bytes(Dv, a.bits, a.group_size) : Dv * 4;
  for (int cs = first; cs <= last; cs += kChunk) {
    const int n = last + 1 - cs < kChunk ? last + 1 - cs : kChunk;
    for (int j = 0; j < n; ++j) {
      const int64_t row = k_base + slots[cs + j];
      if constexpr (kQuantized) {
        dequantize_row(a.k_packed + row * a.k_packed_row, Dk, a.bits, a.group_size,
                       kdq + j * Dk);
        dequantize_row(a.v_packed + row * a.v_packed_row, Dv, a.bits, a.group_size,
                       vdq + j * Dv);
        krow[j] = kdq + j * Dk;
        vrow[j] = vdq + j * Dv;
      } else {
        krow[j] = a.k + row * a.k_row;
        vrow[j] = a.v + row * a.v_row;
      }
    }
    // The next chunk's rows are scattered over the pool: ask for them now.
    const int next_n = last + 1 - (cs + kChunk) < kChunk ? last + 1 - (cs + kChunk) : kChunk;
    for (int j = 0; j < next_n; ++j) {
      const int64_t row = k_base + slots[cs + kChunk + j];
      const char* kp;
      const char* vp;
      if constexpr (kQuantized) {
        kp = reinterpret_cast<const char*>(a.k_packed + row * a.k_packed_row);
        vp = reinterpret_cast<const char*>(a.v_packed + row * a.v_packed_row);
      } else {
        kp = reinterpret_cast<const char*>(a.k + row * a.k_row);
        vp = reinterpret_cast<const char*>(a.v + row * a.v_row);
      }
      for (int64_t byte = 0; byte < k_bytes; byte += 64) {
        __builtin_prefetch(kp + byte);
      }
      for (int64_t byte = 0; byte < v_bytes; byte += 64) {
        __builtin_prefetch(vp + byte);
      }
    }
    if (transpose) {
      for (int j = 0; j < n; ++j) {
        for (int d = 0; d < Dk; ++d) {
          kt[d * kChunk + j] = krow[j][d];
        }
      }
      for (int j = n; j < kChunk; ++j) {
        for (int d = 0; d < Dk; ++d) {
          kt[d * kChunk + j] = 0.0f;
        }
      }
      for (int r = 0; r < Q; ++r) {
        scores_transposed(qbuf + r * Dk, kt, Dk, scores + r * kChunk);
      }
    } else {
      for (int j = 0; j < n; ++j) {
        const float* kp = krow[j];
        for (int r = 0; r < Q; ++r) {
          scores[r * kChunk + j] = dot(qbuf + r * Dk, kp, Dk);
        }
      }
    }
    for (int r = 0; r < Q; ++r) {
      float* s = scores + r * kChunk;
      const int lo = rb[r].lo - cs, hi = rb[r].hi - cs;
      if (lo >= n || hi < 0 || lo > hi) {
        continue;  // this query sees no key of the chunk
      }
      if (lo > 0 || hi < n - 1) {
        for (int j = 0; j < n; ++j) {
          s[j] = (j < lo || j > hi) ? kNegInf : s[j];
        }
      }
      float mx = kNegInf;
      for (int j = 0; j < n; ++j) {
        mx = max_f(mx, s[j]);
      }
      const float m_new = max_f(m[r], mx);
      const float corr = exp_neg(m[r] - m_new);
      for (int j = 0; j < n; ++j) {
        s[j] = exp_neg(s[j] - m_new);
      }
      total[r] = total[r] * corr + sum(s, n);
      float* ar = acc + r * Dv;
      if (corr != 1.0f) {
        scale_in_place(ar, corr, Dv);
      }
      weighted_sum(ar, s, vrow, n, Dv);
      m[r] = m_new;
    }
  }

  for (int r = 0; r < Q; ++r) {
    const int li = r / G, g = r % G;
    const float* ar = acc + r * Dv;
    if (t.partial != nullptr) {
      float* dst = t.partial + static_cast<int64_t>(r) * (Dv + 2);
      dst[0] = m[r];
      dst[1] = total[r];
      for (int d = 0; d < Dv; ++d) {
        dst[2 + d] = ar[d];
      }
      continue;
    }
    const int n = a.meta[kMetaFields * t.b + kMetaQFirst] + t.l0 + li;
    const int hq = t.h * G + g;
    float* dst = a.out + (static_cast<int64_t>(n) * a.Hq + hq) * Dv;
    const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int d = 0; d < Dv; ++d) {
      dst[d] = ar[d] * inv;
    }
  }
}

}  // namespace

void run_task(const AttentionArgs& a, const AttentionTask& t) {
  if (a.bits > 0) {
    run_task_on<true>(a, t);
  } else {
    run_task_on<false>(a, t);
  }
}

void merge_partials(
    const AttentionArgs& a,
    int n,
    int hq,
    const float* partials,
    int count,
    int64_t stride) {
  const int Dv = a.Dv;
  float m = a.sinks != nullptr ? a.sinks[hq] : kNegInf;
  for (int i = 0; i < count; ++i) {
    m = max_f(m, partials[i * stride]);
  }
  float* dst = a.out + (static_cast<int64_t>(n) * a.Hq + hq) * Dv;
  for (int d = 0; d < Dv; ++d) {
    dst[d] = 0.0f;
  }
  float total = a.sinks != nullptr ? exp_neg(a.sinks[hq] - m) : 0.0f;
  for (int i = 0; i < count; ++i) {
    const float* p = partials + i * stride;
    if (p[1] == 0.0f) {
      continue;
    }
    const float w = exp_neg(p[0] - m);
    total += p[1] * w;
    axpy(dst, w, p + 2, Dv);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  scale_in_place(dst, inv, Dv);
}

}  // namespace MLXSERVE_ISA
}  // namespace mlxserve
