// Weight-only quantized matmul for CPUs: y[M, N] = x[M, K] @ W^T with fp32 activations and fp32
// accumulation, W stored as int4 (group-wise scale and min) or int8 (group-wise scale).
//
// torch's own packed kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) are vectorised for
// AVX-512 only; on AVX2 machines they run 5-400x slower than the fp32 GEMM they replace. These
// kernels have an AVX2+FMA path picked at run time (the CPU is asked, never assumed) and a portable
// scalar path for other CPUs.
//
// Layout, per output row n and per chunk of 32 consecutive input columns (GGUF's block layout, so
// Q4_0/Q4_1/Q8_0 blocks are copied, not re-encoded):
//   int4: 16 bytes; byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
//   int8: 32 signed bytes.
// scales and mins are [N, K / group] fp32 (group a multiple of 32); w = scale * q + min, and
// mins may be null (symmetric int8).
//
// Small M (decode) reads each weight once and dots it with every row of x, summing each 32-chunk
// before scaling it; larger M dequantises 16 output rows at a time into a k-major fp32 panel that a
// 6x16 register-blocked micro-kernel reuses across all rows of x.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "simd_avx2.h"

namespace {

using simd::hsum;

constexpr int64_t kChunk = 32;
constexpr int64_t kPanel = 16;
constexpr int64_t kMr = 6;
constexpr int64_t kGemvRows = 4;

struct Weights {
  const uint8_t* q;
  const float* scales;
  const float* mins;
  int64_t n;
  int64_t k;
  int64_t group;
  int bits;

  int64_t chunk_bytes() const { return bits == 4 ? kChunk / 2 : kChunk; }
  int64_t row_bytes() const { return k / kChunk * chunk_bytes(); }
  int64_t groups() const { return k / group; }
};

// ---------------------------------------------------------------- portable scalar path

void dequant_row_scalar(const Weights& w, int64_t row, float* out) {
  const uint8_t* q = w.q + row * w.row_bytes();
  const float* s = w.scales + row * w.groups();
  const float* m = w.mins ? w.mins + row * w.groups() : nullptr;
  for (int64_t c = 0; c < w.k / kChunk; ++c) {
    const int64_t g = c * kChunk / w.group;
    const float scale = s[g];
    const float min = m ? m[g] : 0.0f;
    const uint8_t* p = q + c * w.chunk_bytes();
    float* o = out + c * kChunk;
    if (w.bits == 4) {
      for (int j = 0; j < 16; ++j) {
        o[j] = scale * static_cast<float>(p[j] & 15) + min;
        o[j + 16] = scale * static_cast<float>(p[j] >> 4) + min;
      }
    } else {
      for (int j = 0; j < 32; ++j) o[j] = scale * static_cast<float>(static_cast<int8_t>(p[j])) + min;
    }
  }
}

void linear_scalar(const Weights& w, const float* x, int64_t m, float* y, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> row(w.k);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < w.n; ++n) {
      dequant_row_scalar(w, n, row.data());
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * w.k;
        float acc = 0.0f;
        for (int64_t i = 0; i < w.k; ++i) acc += xr[i] * row[i];
        y[r * w.n + n] = acc;
      }
    }
  }
}

// ---------------------------------------------------------------- AVX2 + FMA path

#define RQ_AVX2 __attribute__((target("avx2,fma")))

// The i-th run of 8 quantized values (i in 0..3) of the 32-value chunk at p, as floats.
RQ_AVX2 inline __m256 load_run(const uint8_t* p, int bits, int i) {
  if (bits == 8) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  }
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i nibbles = _mm_and_si128(i < 2 ? v : _mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  if (i & 1) nibbles = _mm_srli_si128(nibbles, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles));
}

// All four runs of a chunk; the int4 nibbles are split once.
RQ_AVX2 inline void load_chunk(const uint8_t* p, int bits, __m256 out[4]) {
  if (bits == 8) {
    for (int i = 0; i < 4; ++i) out[i] = load_run(p, 8, i);
    return;
  }
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(v, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

RQ_AVX2 inline float dot_avx2(const float* a, const float* b, int64_t len) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < len; ++i) s += a[i] * b[i];
  return s;
}

// Sum over 32 columns of one chunk times x, for one row of x.
RQ_AVX2 inline __m256 chunk_dot(const __m256 wv[4], const float* x) {
  __m256 a = _mm256_mul_ps(wv[0], _mm256_loadu_ps(x));
  __m256 b = _mm256_mul_ps(wv[1], _mm256_loadu_ps(x + 8));
  a = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(x + 16), a);
  b = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(x + 24), b);
  return _mm256_add_ps(a, b);
}

// Rows [n0, n1) of y for ROWS (1..4) rows of x: each chunk's dot product with the integer
// weights is scaled once, and the mins add min * sum(x over the group) from precomputed sums.
// Accumulators are named variables: GCC spills arrays of vectors to the stack every iteration.
template <int ROWS>
RQ_AVX2 void gemv_avx2(const Weights& w, const float* x, const float* xsum, int64_t n0, int64_t n1,
                       float* y) {
  const int64_t chunks_per_group = w.group / kChunk;
  const int64_t groups = w.groups();
  const int64_t k = w.k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = w.q + n * w.row_bytes();
    const float* s = w.scales + n * groups;
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    int64_t col = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 scale = _mm256_set1_ps(s[g]);
      for (int64_t c = 0; c < chunks_per_group; ++c, col += kChunk, q += w.chunk_bytes()) {
        __m256 wv[4];
        load_chunk(q, w.bits, wv);
        t0 = _mm256_fmadd_ps(scale, chunk_dot(wv, x + col), t0);
        if constexpr (ROWS > 1) t1 = _mm256_fmadd_ps(scale, chunk_dot(wv, x + k + col), t1);
        if constexpr (ROWS > 2) t2 = _mm256_fmadd_ps(scale, chunk_dot(wv, x + 2 * k + col), t2);
        if constexpr (ROWS > 3) t3 = _mm256_fmadd_ps(scale, chunk_dot(wv, x + 3 * k + col), t3);
      }
    }
    const __m256 totals[4] = {t0, t1, t2, t3};
    for (int r = 0; r < ROWS; ++r) {
      float v = hsum(totals[r]);
      if (w.mins) v += dot_avx2(w.mins + n * groups, xsum + r * groups, groups);
      y[r * w.n + n] = v;
    }
  }
}

// ---------------------------------------------------------------- AVX-512 row-dot path
//
// The decode GEMV is bound by the instructions that widen codes to floats, not by memory: 16 lanes
// halve them. Two accumulators per row alternate between chunks, so the chain of scaled adds does
// not wait on its own latency.

#define RQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

// The chunk's 32 codes as two 16-lane float vectors (columns 0-15, 16-31).
RQ_AVX512 inline void load_chunk16(const uint8_t* p, int bits, __m512& lo, __m512& hi) {
  if (bits == 8) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return;
  }
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
}

RQ_AVX512 inline __m512 chunk_dot16(__m512 lo, __m512 hi, const float* x) {
  return _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
}

template <int ROWS>
RQ_AVX512 void gemv_avx512(const Weights& w, const float* x, const float* xsum, int64_t n0, int64_t n1,
                           float* y) {
  const int64_t chunks_per_group = w.group / kChunk;
  const int64_t groups = w.groups();
  const int64_t k = w.k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = w.q + n * w.row_bytes();
    const float* s = w.scales + n * groups;
    const __m512 z = _mm512_setzero_ps();
    __m512 a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    int64_t col = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 scale = _mm512_set1_ps(s[g]);
      for (int64_t c = 0; c < chunks_per_group; ++c, col += kChunk, q += w.chunk_bytes()) {
        __m512 lo, hi;
        load_chunk16(q, w.bits, lo, hi);
        const bool odd = col & kChunk;
#define RQ_ACC512(i)                                                              \
  if constexpr (ROWS > i) {                                                       \
    const __m512 d = chunk_dot16(lo, hi, x + i * k + col);                         \
    if (odd) b##i = _mm512_fmadd_ps(scale, d, b##i); else a##i = _mm512_fmadd_ps(scale, d, a##i); \
  }
        RQ_ACC512(0) RQ_ACC512(1) RQ_ACC512(2) RQ_ACC512(3)
#undef RQ_ACC512
      }
    }
    const __m512 totals[4] = {_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1), _mm512_add_ps(a2, b2),
                              _mm512_add_ps(a3, b3)};
    for (int r = 0; r < ROWS; ++r) {
      float v = _mm512_reduce_add_ps(totals[r]);
      if (w.mins) v += dot_avx2(w.mins + n * groups, xsum + r * groups, groups);
      y[r * w.n + n] = v;
    }
  }
}

RQ_AVX2 inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Dequantises output rows [n0, n0 + valid) into panel[k * 16 + j] (missing rows read as zero),
// 8 rows x 8 columns at a time through a register transpose.
RQ_AVX2 void pack_panel_avx2(const Weights& w, int64_t n0, int64_t valid, float* panel) {
  const int64_t chunks = w.k / kChunk;
  const int64_t chunks_per_group = w.group / kChunk;
  const int64_t groups = w.groups();
  for (int64_t half = 0; half < kPanel; half += 8) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t g = c / chunks_per_group;
      for (int i = 0; i < 4; ++i) {
        __m256 r[8];
        for (int64_t j = 0; j < 8; ++j) {
          const int64_t row = half + j;
          if (row >= valid) {
            r[j] = _mm256_setzero_ps();
            continue;
          }
          const int64_t n = n0 + row;
          const __m256 scale = _mm256_set1_ps(w.scales[n * groups + g]);
          const __m256 min = _mm256_set1_ps(w.mins ? w.mins[n * groups + g] : 0.0f);
          const uint8_t* q = w.q + n * w.row_bytes() + c * w.chunk_bytes();
          r[j] = _mm256_fmadd_ps(load_run(q, w.bits, i), scale, min);
        }
        transpose8(r);
        float* dst = panel + (c * kChunk + 8 * i) * kPanel + half;
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + j * kPanel, r[j]);
      }
    }
  }
}

RQ_AVX2 inline void store_row(float* c, __m256 lo, __m256 hi, int64_t valid) {
  if (valid == kPanel) {
    _mm256_storeu_ps(c, lo);
    _mm256_storeu_ps(c + 8, hi);
    return;
  }
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  memcpy(c, tmp, valid * sizeof(float));
}

// MR (1..6) rows of x times one 16-column panel, 12 named accumulators.
template <int MR>
RQ_AVX2 void micro_avx2(const float* a, int64_t lda, const float* panel, int64_t k, float* c, int64_t ldc,
                        int64_t valid) {
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z,
         c51 = z;
  for (int64_t p = 0; p < k; ++p) {
    const __m256 b0 = _mm256_loadu_ps(panel + p * kPanel);
    const __m256 b1 = _mm256_loadu_ps(panel + p * kPanel + 8);
#define RQ_ROW(i)                                                 \
  if constexpr (MR > i) {                                         \
    const __m256 av = _mm256_broadcast_ss(a + i * lda + p);       \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);                   \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);                   \
  }
    RQ_ROW(0) RQ_ROW(1) RQ_ROW(2) RQ_ROW(3) RQ_ROW(4) RQ_ROW(5)
#undef RQ_ROW
  }
  store_row(c, c00, c01, valid);
  if constexpr (MR > 1) store_row(c + ldc, c10, c11, valid);
  if constexpr (MR > 2) store_row(c + 2 * ldc, c20, c21, valid);
  if constexpr (MR > 3) store_row(c + 3 * ldc, c30, c31, valid);
  if constexpr (MR > 4) store_row(c + 4 * ldc, c40, c41, valid);
  if constexpr (MR > 5) store_row(c + 5 * ldc, c50, c51, valid);
}

RQ_AVX2 void micro_dispatch(int64_t rows, const float* a, int64_t lda, const float* panel, int64_t k, float* c,
                            int64_t ldc, int64_t valid) {
  switch (rows) {
    case 1: micro_avx2<1>(a, lda, panel, k, c, ldc, valid); break;
    case 2: micro_avx2<2>(a, lda, panel, k, c, ldc, valid); break;
    case 3: micro_avx2<3>(a, lda, panel, k, c, ldc, valid); break;
    case 4: micro_avx2<4>(a, lda, panel, k, c, ldc, valid); break;
    case 5: micro_avx2<5>(a, lda, panel, k, c, ldc, valid); break;
    default: micro_avx2<6>(a, lda, panel, k, c, ldc, valid); break;
  }
}

RQ_AVX2 void gemm_avx2(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  const int64_t panels = (w.n + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(threads)
  {
    float* panel = static_cast<float*>(aligned_alloc(64, ((w.k * kPanel * sizeof(float) + 63) / 64) * 64));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanel;
      const int64_t valid = std::min(kPanel, w.n - n0);
      pack_panel_avx2(w, n0, valid, panel);
      for (int64_t r = 0; r < m; r += kMr) {
        micro_dispatch(std::min(kMr, m - r), x + r * w.k, w.k, panel, w.k, y + r * w.n + n0, w.n, valid);
      }
    }
    free(panel);
  }
}

// wide: the AVX-512 kernel (the caller checked the CPU has it).
RQ_AVX2 void gemv_dispatch(const Weights& w, const float* x, int64_t m, float* y, int threads, bool wide) {
  const int64_t groups = w.groups();
  std::vector<float> xsum(w.mins ? m * groups : 0);
  for (int64_t r = 0; r < static_cast<int64_t>(xsum.size()) / groups; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < w.group; ++i) s += x[r * w.k + g * w.group + i];
      xsum[r * groups + g] = s;
    }
  }
  // Blocks of 8 rows keep each thread's share of y on whole cache lines.
  const int64_t blocks = (w.n + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * 8;
    const int64_t n1 = std::min(w.n, n0 + 8);
    for (int64_t r = 0; r < m; r += kGemvRows) {
      const float* xr = x + r * w.k;
      const float* xs = xsum.empty() ? nullptr : xsum.data() + r * groups;
      float* yr = y + r * w.n;
      const int64_t rows = std::min(kGemvRows, m - r);
      if (wide) {
        switch (rows) {
          case 1: gemv_avx512<1>(w, xr, xs, n0, n1, yr); break;
          case 2: gemv_avx512<2>(w, xr, xs, n0, n1, yr); break;
          case 3: gemv_avx512<3>(w, xr, xs, n0, n1, yr); break;
          default: gemv_avx512<4>(w, xr, xs, n0, n1, yr); break;
        }
        continue;
      }
      switch (rows) {
        case 1: gemv_avx2<1>(w, xr, xs, n0, n1, yr); break;
        case 2: gemv_avx2<2>(w, xr, xs, n0, n1, yr); break;
        case 3: gemv_avx2<3>(w, xr, xs, n0, n1, yr); break;
        default: gemv_avx2<4>(w, xr, xs, n0, n1, yr); break;
      }
    }
  }
}

}  // namespace

extern "C" {

int rq_has_avx2_fma(void) { return simd::cpu_has_avx2_fma(); }

int rq_has_avx512(void) {
  __builtin_cpu_init();
  return rq_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// mode: 0 = scalar, 1 = AVX2 row-dot (decode), 2 = AVX2 panel GEMM, 3 = AVX-512 row-dot. The caller
// picks (see quant_kernels.py), so tests reach every path on one machine; a CPU without AVX2+FMA always
// runs 0, and one without AVX-512 runs 1 for 3.
void rq_linear(const float* x, int64_t m, int64_t k, const uint8_t* q, const float* scales, const float* mins,
               int64_t n, int64_t group, int bits, float* y, int mode, int threads) {
  const Weights w{q, scales, mins, n, k, group, bits};
  static const bool avx2 = rq_has_avx2_fma();
  static const bool wide = rq_has_avx512();
  if (mode == 0 || !avx2) {
    linear_scalar(w, x, m, y, threads);
  } else if (mode == 1 || mode == 3) {
    gemv_dispatch(w, x, m, y, threads, mode == 3 && wide);
  } else {
    gemm_avx2(w, x, m, y, threads);
  }
}

}  // extern "C"
