// mlxserve: the quantized-weight kernels, compiled once per instruction set (see
// attention_kernel.cpp for why each build has its own namespace).
//
// The sums contract into fused multiply-adds where the instruction set has them
// (AVX2/FMA, NEON); the dequantization never does (a multiply, then an add), so
// the dequantized weights equal mx.dequantize's. Vectors are GCC's vector
// extensions, eight floats wide (one AVX2 register, two SSE/NEON ones).
//
// qmm_rows, for a block of R (<= 3) W rows and each block of up to 4 x rows i:
//
//   acc[i][r] += x[i, k:k+8] * W[n0 + r, k:k+8]             (k = 0, 8, 16, ...)
//   out[i, n0 + r] = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
//
// With at most 4 x rows (a decode step of a few sequences) the W vectors are
// dequantized in registers as the sum goes; with more, each W row is dequantized
// once into scratch and every x block reads it from there. Either way an output
// is the same sum in the same order, whatever the number of x rows.
// 4 x 3 accumulators, 3 weight vectors and one x vector fill AVX2's 16 registers.

#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "qmm_kernel.h"

#ifndef MLXSERVE_ISA
#error "MLXSERVE_ISA must name the instruction-set namespace"
#endif

namespace mlxserve {
namespace MLXSERVE_ISA {
namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));

constexpr int kRowsX = 4;

inline v8f load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, v8f v) {
  std::memcpy(p, &v, sizeof(v));
}

// The 8 codes of W row `words` at columns [k, k + 8), k a multiple of 8.
inline v8f codes(const uint32_t* words, int64_t k, int bits) {
  v8u q;
  if (bits == 4) {
    const uint32_t w = words[k / 8];
    q = (v8u){w, w, w, w, w, w, w, w} >> (v8u){0, 4, 8, 12, 16, 20, 24, 28};
    q &= 15u;
  } else {
    // Value j of a word is its byte j (little-endian): 8 bytes widened in one step.
#if defined(__AVX2__)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(words + k / 4));
    q = reinterpret_cast<v8u>(_mm256_cvtepu8_epi32(bytes));
#else
    v8b bytes;
    std::memcpy(&bytes, words + k / 4, sizeof(bytes));
    q = __builtin_convertvector(bytes, v8u);
#endif
  }
  return __builtin_convertvector(reinterpret_cast<v8i&>(q), v8f);
}

// scale * codes + bias, rounded after the multiply as mx.dequantize computes it:
// the empty asm keeps the compiler from fusing the two into one multiply-add.
inline v8f dequantize8(v8f scale, v8f codes8, v8f bias) {
  v8f product = scale * codes8;
#if defined(__AVX__)
  asm("" : "+x"(product));  // one ymm register
#else
  asm("" : "+m"(product));  // two SSE or NEON registers: through memory
#endif
  return product + bias;
}

void dequantize_row(const QuantizedWeight& w, int64_t n, float* out) {
  const int64_t words_per_row = w.k * w.bits / 32;
  const int64_t groups = w.k / w.group_size;
  const uint32_t* words = w.words + n * words_per_row;
  const float* scales = w.scales + n * groups;
  const float* biases = w.biases + n * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const v8f scale = v8f{} + scales[g];
    const v8f bias = v8f{} + biases[g];
    const int64_t end = (g + 1) * w.group_size;
    for (int64_t k = g * w.group_size; k < end; k += 8) {
      store(out + k, dequantize8(scale, codes(words, k, w.bits), bias));
    }
  }
}

inline float sum8(v8f a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#if defined(__AVX2__)
// sum8 of n <= 8 accumulators at once: for each, lo + hi halves give t_j = a_j + a_(j+4),
// then (t0 + t2) and (t1 + t3), then their sum: sum8's additions in sum8's order (only
// the operands of an addition commute), so the sums are bit-identical to sum8's.
inline void sum8_many(const v8f* acc, int n, float* sums) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = i < n ? reinterpret_cast<const __m256&>(acc[i]) : _mm256_setzero_ps();
  }
  __m256 t[4];
  for (int p = 0; p < 4; ++p) {
    const __m256 halves = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                                        _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
    t[p] = _mm256_permute_ps(halves, _MM_SHUFFLE(3, 1, 2, 0));  // t0, t2, t1, t3 per half
  }
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
  // pairs holds the sums of accumulators 0, 2, 4, 6 | 1, 3, 5, 7.
  _mm256_storeu_ps(sums,
                   _mm256_permutevar8x32_ps(pairs, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

// out[i * ld_out + r] = sum8(acc[i][r]); eight at a time where AVX2 has the shuffles
// (one scalar sum8 is ~20 dependent instructions, a tenth of a 576-long block's time).
template <int X, int R>
inline void store_sums(const v8f (&acc)[X][R], float* __restrict out, int64_t ld_out) {
#if defined(__AVX2__)
  float sums[X * R + 8];
  const v8f* flat = &acc[0][0];
  for (int c = 0; c < X * R; c += 8) {
    sum8_many(flat + c, X * R - c < 8 ? X * R - c : 8, sums + c);
  }
  for (int i = 0; i < X; ++i) {
    for (int r = 0; r < R; ++r) {
      out[i * ld_out + r] = sums[i * R + r];
    }
  }
#else
  for (int i = 0; i < X; ++i) {
    for (int r = 0; r < R; ++r) {
      out[i * ld_out + r] = sum8(acc[i][r]);
    }
  }
#endif
}

// out[i, r] for i < X, r < R: x rows (stride k) times the R dequantized rows of wd.
template <int X, int R>
void block(const float* __restrict x, const float* __restrict wd, int64_t k,
           float* __restrict out, int64_t ld_out) {
  v8f acc[X][R] = {};
  for (int64_t j = 0; j < k; j += 8) {
    v8f wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = load(wd + r * k + j);
    }
    for (int i = 0; i < X; ++i) {
      const v8f xv = load(x + i * k + j);
      for (int r = 0; r < R; ++r) {
        acc[i][r] = acc[i][r] + xv * wv[r];
      }
    }
  }
  store_sums<X, R>(acc, out, ld_out);
}

// The same sums as block<X, R>, dequantizing W rows n .. n + R in registers.
template <int X, int R>
void fused_block(const float* __restrict x, const QuantizedWeight& w, int64_t n,
                 float* __restrict out, int64_t ld_out) {
  const int64_t k = w.k;
  const int64_t words_per_row = k * w.bits / 32;
  const int64_t groups = k / w.group_size;
  v8f acc[X][R] = {};
  for (int64_t g = 0; g < groups; ++g) {
    v8f scale[R], bias[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = v8f{} + w.scales[(n + r) * groups + g];
      bias[r] = v8f{} + w.biases[(n + r) * groups + g];
    }
    const int64_t end = (g + 1) * w.group_size;
    for (int64_t j = g * w.group_size; j < end; j += 8) {
      v8f wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = dequantize8(scale[r], codes(w.words + (n + r) * words_per_row, j, w.bits),
                            bias[r]);
      }
      for (int i = 0; i < X; ++i) {
        const v8f xv = load(x + i * k + j);
        for (int r = 0; r < R; ++r) {
          acc[i][r] = acc[i][r] + xv * wv[r];
        }
      }
    }
  }
  store_sums<X, R>(acc, out, ld_out);
}

template <int R>
void fused_rows(const float* x, int64_t rows, const QuantizedWeight& w, int64_t n, float* out,
                int64_t ld_out) {
  switch (rows) {
    case 4:
      fused_block<4, R>(x, w, n, out, ld_out);
      break;
    case 3:
      fused_block<3, R>(x, w, n, out, ld_out);
      break;
    case 2:
      fused_block<2, R>(x, w, n, out, ld_out);
      break;
    default:
      fused_block<1, R>(x, w, n, out, ld_out);
      break;
  }
}

template <int R>
void block_rows(const float* x, int64_t rows, const float* wd, int64_t k, float* out,
                int64_t ld_out) {
  int64_t i = 0;
  for (; i + kRowsX <= rows; i += kRowsX) {
    block<kRowsX, R>(x + i * k, wd, k, out + i * ld_out, ld_out);
  }
  switch (rows - i) {
    case 3:
      block<3, R>(x + i * k, wd, k, out + i * ld_out, ld_out);
      break;
    case 2:
      block<2, R>(x + i * k, wd, k, out + i * ld_out, ld_out);
      break;
    case 1:
      block<1, R>(x + i * k, wd, k, out + i * ld_out, ld_out);
      break;
    default:
      break;
  }
}

}  // namespace

void qmm_rows(const float* x, int64_t rows, const QuantizedWeight& w, int64_t n0, int64_t n1,
              float* out, int64_t ld_out, float* scratch) {
  if (rows <= 0) {
    return;
  }
  for (int64_t n = n0; n < n1; n += kQmmRowBlock) {
    const int r = static_cast<int>(n1 - n < kQmmRowBlock ? n1 - n : kQmmRowBlock);
    if (rows <= kRowsX) {
      if (r == 3) {
        fused_rows<3>(x, rows, w, n, out + n, ld_out);
      } else if (r == 2) {
        fused_rows<2>(x, rows, w, n, out + n, ld_out);
      } else {
        fused_rows<1>(x, rows, w, n, out + n, ld_out);
      }
      continue;
    }
    for (int j = 0; j < r; ++j) {
      dequantize_row(w, n + j, scratch + j * w.k);
    }
    if (r == 3) {
      block_rows<3>(x, rows, scratch, w.k, out + n, ld_out);
    } else if (r == 2) {
      block_rows<2>(x, rows, scratch, w.k, out + n, ld_out);
    } else {
      block_rows<1>(x, rows, scratch, w.k, out + n, ld_out);
    }
  }
}

void dequantize_rows(const QuantizedWeight& w, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_row(w, n, out + (n - n0) * w.k);
  }
}

}  // namespace MLXSERVE_ISA
}  // namespace mlxserve
