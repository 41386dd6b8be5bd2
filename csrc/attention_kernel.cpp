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

#include "attention_kernel.h"

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

inline float max_f(float a, float b) {
  return a > b ? a : b;
}

// exp(x) for x <= 0 (and -inf), after Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n by building the float's
// exponent bits. Relative error ~2 ulp; below -87.3 (where the float would be
// denormal) the result is 0, and exp(-inf) is exactly 0.
inline float exp_neg(float x) {
  x = x < -88.0f ? -88.0f : x;
  float fn = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int n = static_cast<int>(fn) + 127;
  n = n < 0 ? 0 : n;
  float scale = __builtin_bit_cast(float, static_cast<unsigned>(n) << 23);
  return p * scale;
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

// The key columns query l of row b sees, clipped to [c0, c1).
RowBounds bounds(const AttentionArgs& a, int b, int l, int c0, int c1) {
  const int32_t* m = a.meta + 4 * b;
  const int key_count = m[0], key_start = m[1], q_start = m[2], q_len = m[3];
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

}  // namespace

void run_task(const AttentionArgs& a, const AttentionTask& t) {
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
      const float* src = a.q + t.b * a.q_stride[0] + hq * a.q_stride[1] +
          (t.l0 + li) * a.q_stride[2];
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

  const int32_t* slots = a.slots + t.b * a.slots_row;
  const int64_t k_base = static_cast<int64_t>(t.h) * a.rows_per_head;
  for (int cs = first; cs <= last; cs += kChunk) {
    const int n = last + 1 - cs < kChunk ? last + 1 - cs : kChunk;
    for (int j = 0; j < n; ++j) {
      const int64_t row = k_base + slots[cs + j];
      krow[j] = a.k + row * a.k_row;
      vrow[j] = a.v + row * a.v_row;
    }
    for (int j = 0; j < n; ++j) {
      const float* kp = krow[j];
      for (int r = 0; r < Q; ++r) {
        scores[r * kChunk + j] = dot(qbuf + r * Dk, kp, Dk);
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
      for (int j = 0; j < n; ++j) {
        axpy(ar, s[j], vrow[j], Dv);
      }
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
    const int l = t.l0 + li, hq = t.h * G + g;
    float* dst = a.out + ((static_cast<int64_t>(t.b) * a.L + l) * a.Hq + hq) * Dv;
    const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int d = 0; d < Dv; ++d) {
      dst[d] = ar[d] * inv;
    }
  }
}

void merge_partials(
    const AttentionArgs& a,
    int b,
    int l,
    int hq,
    const float* partials,
    int count,
    int64_t stride) {
  const int Dv = a.Dv;
  float m = a.sinks != nullptr ? a.sinks[hq] : kNegInf;
  for (int i = 0; i < count; ++i) {
    m = max_f(m, partials[i * stride]);
  }
  float* dst = a.out + ((static_cast<int64_t>(b) * a.L + l) * a.Hq + hq) * Dv;
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
