// The CPU matmul of the linear layers: y[M, N] = x[M, K] @ W^T with fp32 activations and fp32
// accumulation, W stored as float32 panels or weight-only quantized as int4 (group-wise scale and min)
// or int8 (group-wise scale).
//
// float32 (bits 32): panels of 16 output rows, [ceil(N / 16)][K][16] (k-major within a panel, rows past
// N zero), the B operand of a register-blocked GEMM read exactly as stored. oneDNN's prepacked GEMM
// reads weights at ~16 GB/s at decode's 1-16 rows where these kernels stream them at ~32-40 (1.75x at one
// row, 1.15-1.35x at 16-32) and matches it from 64 rows on. Every output is one FMA chain over k
// in order, whatever the row count, blocking or SIMD width: batch-invariant, and the scalar, AVX2 and
// AVX-512 paths give the same bits.
//
// int4/int8: torch's own packed kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) are
// vectorised for AVX-512 only; on AVX2 machines they run 5-400x slower than the fp32 GEMM they replace.
// These kernels have an AVX2+FMA path picked at run time (the CPU is asked, never assumed) and a
// portable scalar path for other CPUs.
//
// Quantized layout, per output row n and per chunk of 32 consecutive input columns (GGUF's block
// layout, so Q4_0/Q4_1/Q8_0 blocks are copied, not re-encoded):
//   int4: 16 bytes; byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
//   int8: 32 signed bytes.
// scales and mins are [N, K / group] fp32 (group 16 or a multiple of 32); w = scale * q + min, and
// mins may be null (symmetric int8). Group 16 (GGUF Q6_K's sub-blocks) scales each half of a chunk
// on its own: the row-dot kernels then take a second scale per chunk (the HALF template argument),
// so the other groups run the same instructions as without it.
//
// Small M (decode) reads each quantized weight once and dots it with every row of x, summing each
// 32-chunk before scaling it; larger M dequantises 16 output rows at a time into a k-major fp32 panel
// (the float32 layout) that a 6x16 register-blocked micro-kernel reuses across all rows of x. The
// engine serves float32 arithmetic from the same numbers repacked k-major ("quantized panels" below),
// faster and with one kernel's bits at every row count; this layout serves bf16 arithmetic and weights
// whose columns are in another order.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "simd.h"

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
    // The groups of the chunk's two halves (one group unless the group is 16).
    const int64_t g0 = c * kChunk / w.group, g1 = (c * kChunk + kChunk / 2) / w.group;
    const float scale[2] = {s[g0], s[g1]};
    const float min[2] = {m ? m[g0] : 0.0f, m ? m[g1] : 0.0f};
    const uint8_t* p = q + c * w.chunk_bytes();
    float* o = out + c * kChunk;
    if (w.bits == 4) {
      for (int j = 0; j < 16; ++j) {
        o[j] = scale[0] * static_cast<float>(p[j] & 15) + min[0];
        o[j + 16] = scale[1] * static_cast<float>(p[j] >> 4) + min[1];
      }
    } else {
      for (int j = 0; j < 32; ++j) {
        o[j] = scale[j / 16] * static_cast<float>(static_cast<int8_t>(p[j])) + min[j / 16];
      }
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

// The i-th run of 8 quantized values (i in 0..3) of the 32-value chunk at p, as floats.
SIMD_AVX2 inline __m256 load_run(const uint8_t* p, int bits, int i) {
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
SIMD_AVX2 inline void load_chunk(const uint8_t* p, int bits, __m256 out[4]) {
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

SIMD_AVX2 inline float dot_avx2(const float* a, const float* b, int64_t len) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < len; ++i) s += a[i] * b[i];
  return s;
}

// Sum over 32 columns of one chunk times x, for one row of x.
SIMD_AVX2 inline __m256 chunk_dot(const __m256 wv[4], const float* x) {
  __m256 a = _mm256_mul_ps(wv[0], _mm256_loadu_ps(x));
  __m256 b = _mm256_mul_ps(wv[1], _mm256_loadu_ps(x + 8));
  a = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(x + 16), a);
  b = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(x + 24), b);
  return _mm256_add_ps(a, b);
}

// acc + the chunk's dot product with x, scaled by lo (HALF: lo for columns 0-15, hi for 16-31).
template <bool HALF>
SIMD_AVX2 inline __m256 scaled_chunk_dot(const __m256 wv[4], const float* x, __m256 lo, __m256 hi, __m256 acc) {
  if constexpr (HALF) {
    acc = _mm256_fmadd_ps(lo, _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(wv[0], _mm256_loadu_ps(x))),
                          acc);
    return _mm256_fmadd_ps(
        hi, _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(wv[2], _mm256_loadu_ps(x + 16))), acc);
  } else {
    return _mm256_fmadd_ps(lo, chunk_dot(wv, x), acc);
  }
}

// The row-dot kernels walk a row's scales `step` groups at a time, each step covering `chunks` chunks.
template <bool HALF>
struct GroupWalk {
  static constexpr int64_t step = HALF ? 2 : 1;
  static int64_t chunks(const Weights& w) { return HALF ? 1 : w.group / kChunk; }
};

// Rows [n0, n1) of y for ROWS (1..4) rows of x: each chunk's dot product with the integer
// weights is scaled once, and the mins add min * sum(x over the group) from precomputed sums.
// Accumulators are named variables: GCC spills arrays of vectors to the stack every iteration.
template <int ROWS, bool HALF>
SIMD_AVX2 void gemv_avx2(const Weights& w, const float* x, const float* xsum, int64_t n0, int64_t n1,
                         float* y) {
  using Walk = GroupWalk<HALF>;
  const int64_t chunks_per_step = Walk::chunks(w);
  const int64_t groups = w.groups();
  const int64_t k = w.k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = w.q + n * w.row_bytes();
    const float* s = w.scales + n * groups;
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    int64_t col = 0;
    for (int64_t g = 0; g < groups; g += Walk::step) {
      const __m256 lo = _mm256_set1_ps(s[g]);
      const __m256 hi = HALF ? _mm256_set1_ps(s[g + 1]) : lo;
      for (int64_t c = 0; c < chunks_per_step; ++c, col += kChunk, q += w.chunk_bytes()) {
        __m256 wv[4];
        load_chunk(q, w.bits, wv);
        t0 = scaled_chunk_dot<HALF>(wv, x + col, lo, hi, t0);
        if constexpr (ROWS > 1) t1 = scaled_chunk_dot<HALF>(wv, x + k + col, lo, hi, t1);
        if constexpr (ROWS > 2) t2 = scaled_chunk_dot<HALF>(wv, x + 2 * k + col, lo, hi, t2);
        if constexpr (ROWS > 3) t3 = scaled_chunk_dot<HALF>(wv, x + 3 * k + col, lo, hi, t3);
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

// The chunk's 32 codes as two 16-lane float vectors (columns 0-15, 16-31).
SIMD_AVX512 inline void load_chunk16(const uint8_t* p, int bits, __m512& lo, __m512& hi) {
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

SIMD_AVX512 inline __m512 chunk_dot16(__m512 lo, __m512 hi, const float* x) {
  return _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
}

// acc + the chunk's dot product with x, scaled by s_lo (HALF: s_lo for columns 0-15, s_hi for 16-31).
template <bool HALF>
SIMD_AVX512 inline __m512 scaled_chunk_dot16(__m512 lo, __m512 hi, const float* x, __m512 s_lo, __m512 s_hi,
                                             __m512 acc) {
  if constexpr (HALF) {
    acc = _mm512_fmadd_ps(s_lo, _mm512_mul_ps(lo, _mm512_loadu_ps(x)), acc);
    return _mm512_fmadd_ps(s_hi, _mm512_mul_ps(hi, _mm512_loadu_ps(x + 16)), acc);
  } else {
    return _mm512_fmadd_ps(s_lo, chunk_dot16(lo, hi, x), acc);
  }
}

template <int ROWS, bool HALF>
SIMD_AVX512 void gemv_avx512(const Weights& w, const float* x, const float* xsum, int64_t n0, int64_t n1,
                             float* y) {
  using Walk = GroupWalk<HALF>;
  const int64_t chunks_per_step = Walk::chunks(w);
  const int64_t groups = w.groups();
  const int64_t k = w.k;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = w.q + n * w.row_bytes();
    const float* s = w.scales + n * groups;
    const __m512 z = _mm512_setzero_ps();
    __m512 a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    int64_t col = 0;
    for (int64_t g = 0; g < groups; g += Walk::step) {
      const __m512 s_lo = _mm512_set1_ps(s[g]);
      const __m512 s_hi = HALF ? _mm512_set1_ps(s[g + 1]) : s_lo;
      for (int64_t c = 0; c < chunks_per_step; ++c, col += kChunk, q += w.chunk_bytes()) {
        __m512 lo, hi;
        load_chunk16(q, w.bits, lo, hi);
        const bool odd = col & kChunk;
#define RQ_ACC512(i)                                                                     \
  if constexpr (ROWS > i) {                                                              \
    const float* xi = x + i * k + col;                                                   \
    if (odd) b##i = scaled_chunk_dot16<HALF>(lo, hi, xi, s_lo, s_hi, b##i);              \
    else a##i = scaled_chunk_dot16<HALF>(lo, hi, xi, s_lo, s_hi, a##i);                  \
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

SIMD_AVX2 inline void transpose8(__m256 r[8]) {
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

// Dequantises output rows [n0, n0 + valid) into panel[k * 16 + j] (missing rows read as zero), 8 rows
// x 32 columns at a time: each row's chunk is loaded once and widened to four runs of 8 columns, and
// each run goes through a register transpose. Everything that varies per row is hoisted out of the
// chunk loop (row pointers; rows past N read zero codes, scales and mins), so the loop is straight-line
// code (with index arithmetic and branches per 8 columns, this pass cost as much as the GEMM it feeds
// at 16 rows). Every value is fma(code, scale, min).
template <int BITS, bool HALF>
SIMD_AVX2 void pack_rows8_avx2(const Weights& w, int64_t n0, int64_t rows, const uint8_t* zero_codes,
                               const float* zero_groups, float* panel) {
  constexpr int64_t chunk_bytes = BITS == 4 ? kChunk / 2 : kChunk;
  const int64_t chunks = w.k / kChunk;
  const int64_t groups = w.groups();
  const uint8_t* q[8];
  const float* sc[8];
  const float* mn[8];
  for (int j = 0; j < 8; ++j) {
    const bool real = j < rows;
    q[j] = real ? w.q + (n0 + j) * w.row_bytes() : zero_codes;
    sc[j] = real ? w.scales + (n0 + j) * groups : zero_groups;
    mn[j] = real && w.mins ? w.mins + (n0 + j) * groups : zero_groups;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    // Run i holds columns 8i..8i+7 of the chunk: one group, or with HALF the chunk's first or second.
    const int64_t g = HALF ? 2 * c : c * kChunk / w.group;
    __m256 r[4][8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256 runs[4];
      load_chunk(q[j] + c * chunk_bytes, BITS, runs);
      const __m256 s0 = _mm256_set1_ps(sc[j][g]), m0 = _mm256_set1_ps(mn[j][g]);
      const __m256 s1 = HALF ? _mm256_set1_ps(sc[j][g + 1]) : s0;
      const __m256 m1 = HALF ? _mm256_set1_ps(mn[j][g + 1]) : m0;
      r[0][j] = _mm256_fmadd_ps(runs[0], s0, m0);
      r[1][j] = _mm256_fmadd_ps(runs[1], s0, m0);
      r[2][j] = _mm256_fmadd_ps(runs[2], s1, m1);
      r[3][j] = _mm256_fmadd_ps(runs[3], s1, m1);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      transpose8(r[i]);
      float* dst = panel + (c * kChunk + 8 * i) * kPanel;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + j * kPanel, r[i][j]);
    }
  }
}

SIMD_AVX2 void pack_panel_avx2(const Weights& w, int64_t n0, int64_t valid, float* panel) {
  // Rows past N (the last panel only) read a row of zero codes, scales and mins, and symmetric weights
  // (no mins) zero mins: one zero buffer per thread, grown to the widest row seen.
  static thread_local std::vector<float> zeros;
  const size_t need = static_cast<size_t>(std::max(w.row_bytes(), w.groups() + 1));
  if (zeros.size() < need) zeros.assign(need, 0.0f);
  const uint8_t* zero_codes = reinterpret_cast<const uint8_t*>(zeros.data());
  const bool half = w.group == kChunk / 2;
  const auto pack = w.bits == 4 ? (half ? pack_rows8_avx2<4, true> : pack_rows8_avx2<4, false>)
                                : (half ? pack_rows8_avx2<8, true> : pack_rows8_avx2<8, false>);
  for (int64_t h = 0; h < kPanel; h += 8) {
    const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(8, valid - h));
    pack(w, n0 + h, rows, zero_codes, zeros.data(), panel + h);
  }
}

SIMD_AVX2 inline void store_row(float* c, __m256 lo, __m256 hi, int64_t valid) {
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
SIMD_AVX2 void micro_avx2(const float* a, int64_t lda, const float* panel, int64_t k, float* c, int64_t ldc,
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

SIMD_AVX2 void micro_dispatch(int64_t rows, const float* a, int64_t lda, const float* panel, int64_t k, float* c,
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

SIMD_AVX2 void gemm_avx2(const Weights& w, const float* x, int64_t m, float* y, int threads) {
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

// One block of output rows for `rows` (1..4) rows of x; wide: the AVX-512 kernel.
template <bool HALF>
SIMD_AVX2 void gemv_rows(const Weights& w, const float* x, const float* xs, int64_t n0, int64_t n1, float* y,
                         int64_t rows, bool wide) {
  if (wide) {
    switch (rows) {
      case 1: gemv_avx512<1, HALF>(w, x, xs, n0, n1, y); break;
      case 2: gemv_avx512<2, HALF>(w, x, xs, n0, n1, y); break;
      case 3: gemv_avx512<3, HALF>(w, x, xs, n0, n1, y); break;
      default: gemv_avx512<4, HALF>(w, x, xs, n0, n1, y); break;
    }
    return;
  }
  switch (rows) {
    case 1: gemv_avx2<1, HALF>(w, x, xs, n0, n1, y); break;
    case 2: gemv_avx2<2, HALF>(w, x, xs, n0, n1, y); break;
    case 3: gemv_avx2<3, HALF>(w, x, xs, n0, n1, y); break;
    default: gemv_avx2<4, HALF>(w, x, xs, n0, n1, y); break;
  }
}

// wide: the AVX-512 kernel (the caller checked the CPU has it).
SIMD_AVX2 void gemv_dispatch(const Weights& w, const float* x, int64_t m, float* y, int threads, bool wide) {
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
  const bool half = w.group == kChunk / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * 8;
    const int64_t n1 = std::min(w.n, n0 + 8);
    for (int64_t r = 0; r < m; r += kGemvRows) {
      const float* xr = x + r * w.k;
      const float* xs = xsum.empty() ? nullptr : xsum.data() + r * groups;
      float* yr = y + r * w.n;
      const int64_t rows = std::min(kGemvRows, m - r);
      if (half) gemv_rows<true>(w, xr, xs, n0, n1, yr, rows, wide);
      else gemv_rows<false>(w, xr, xs, n0, n1, yr, rows, wide);
    }
  }
}

// ---------------------------------------------------------------- float32 panels

const float* panels_of(const Weights& w) { return reinterpret_cast<const float*>(w.q); }

// The panels [p0, p1) of a thread's share, for the given kernel on a group of np panels.
template <typename Group>
void for_panel_share(const Weights& w, int threads, int64_t np, Group group) {
  const int64_t panels = (w.n + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(threads)
  {
    // Contiguous, equal shares (within a panel): each thread streams its weights front to back.
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t p = p0; p < p1; p += np) group(p, std::min(np, p1 - p));
  }
}

// Columns of panel p that are real output rows.
inline int64_t valid_columns(const Weights& w, int64_t p) { return std::min(kPanel, w.n - p * kPanel); }

void f32_linear_scalar(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  for_panel_share(w, threads, 1, [&](int64_t p, int64_t) {
    const float* panel = panels_of(w) + p * w.k * kPanel;
    for (int64_t j = 0; j < valid_columns(w, p); ++j) {
      for (int64_t r = 0; r < m; ++r) {
        float acc = 0.0f;
        for (int64_t i = 0; i < w.k; ++i) acc = std::fma(x[r * w.k + i], panel[i * kPanel + j], acc);
        y[r * w.n + p * kPanel + j] = acc;
      }
    }
  });
}

SIMD_AVX2 void f32_linear_avx2(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  for_panel_share(w, threads, 1, [&](int64_t p, int64_t) {
    const float* panel = panels_of(w) + p * w.k * kPanel;
    for (int64_t r = 0; r < m; r += kMr) {
      micro_dispatch(std::min(kMr, m - r), x + r * w.k, w.k, panel, w.k, y + r * w.n + p * kPanel, w.n,
                     valid_columns(w, p));
    }
  });
}

// An MR x NP tile of 16-float accumulators (MR rows of x, NP panels): zeroed, and stored row by row, the
// last panel's first `last_valid` columns only. Always inlined: a call keeps the tile in memory around
// it, which costs a short micro-kernel call (the int8-activation kernel's 18 chunks) several percent.
template <int MR, int NP>
SIMD_AVX512 __attribute__((always_inline)) inline void zero_tile512(__m512 (&acc)[MR][NP]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  }
}

template <int MR, int NP>
SIMD_AVX512 __attribute__((always_inline)) inline void store_tile512(const __m512 (&acc)[MR][NP], float* c, int64_t ldc, int64_t last_valid) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const int64_t valid = j == NP - 1 ? last_valid : kPanel;
      _mm512_mask_storeu_ps(c + i * ldc + j * kPanel, static_cast<__mmask16>((1u << valid) - 1), acc[i][j]);
    }
  }
}

// MR rows of x times NP consecutive panels: MR x NP accumulators (at most 24 of the 32 registers),
// per k NP panel loads and MR broadcasts. `last_valid`: real columns of the last panel.
template <int MR, int NP>
SIMD_AVX512 void micro_f32_512(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc,
                               int64_t last_valid) {
  static_assert(MR * NP <= 24, "accumulators must stay in registers");
  __m512 acc[MR][NP];
  zero_tile512(acc);
  const int64_t stride = k * kPanel;
  for (int64_t p = 0; p < k; ++p) {
    __m512 bv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) bv[j] = _mm512_loadu_ps(b + j * stride + p * kPanel);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + p]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  store_tile512(acc, c, ldc, last_valid);
}

template <int NP>
SIMD_AVX512 void micro_f32_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t k, float* c,
                                int64_t ldc, int64_t last_valid) {
  switch (rows) {
#define RQ_ROWS(R) \
  case R: micro_f32_512<R, NP>(a, lda, b, k, c, ldc, last_valid); break;
    RQ_ROWS(1) RQ_ROWS(2) RQ_ROWS(3) RQ_ROWS(4)
#undef RQ_ROWS
    default:
      if constexpr (NP <= 3) {
        switch (rows) {
          case 5: micro_f32_512<5, NP>(a, lda, b, k, c, ldc, last_valid); break;
          case 6: micro_f32_512<6, NP>(a, lda, b, k, c, ldc, last_valid); break;
          case 7: micro_f32_512<7, NP>(a, lda, b, k, c, ldc, last_valid); break;
          default: micro_f32_512<8, NP>(a, lda, b, k, c, ldc, last_valid); break;
        }
      }
  }
}

// Every row of x, mr at a time, times the `count` (1..4) panels from p: tile(np, rows, a, c, last_valid)
// per block of rows, np a std::integral_constant of count, a and c the block's rows of x and y.
template <typename Tile>
void panel_rows(const Weights& w, int64_t p, int64_t count, const float* x, int64_t m, int64_t mr, float* y,
                Tile tile) {
  const int64_t last_valid = valid_columns(w, p + count - 1);
  for (int64_t r = 0; r < m; r += mr) {
    const int64_t rows = std::min(mr, m - r);
    const float* a = x + r * w.k;
    float* c = y + r * w.n + p * kPanel;
    switch (count) {
      case 1: tile(std::integral_constant<int, 1>{}, rows, a, c, last_valid); break;
      case 2: tile(std::integral_constant<int, 2>{}, rows, a, c, last_valid); break;
      case 3: tile(std::integral_constant<int, 3>{}, rows, a, c, last_valid); break;
      default: tile(std::integral_constant<int, 4>{}, rows, a, c, last_valid); break;
    }
  }
}

// Every row of x times the `count` float32 panels at b (output panels p ...).
SIMD_AVX512 void f32_panel_rows(const Weights& w, const float* b, int64_t p, int64_t count, const float* x, int64_t m,
                                int64_t mr, float* y) {
  panel_rows(w, p, count, x, m, mr, y, [&](auto np, int64_t rows, const float* a, float* c, int64_t last_valid) {
    micro_f32_rows<decltype(np)::value>(rows, a, w.k, b, w.k, c, w.n, last_valid);
  });
}

// Up to 4 rows: 4 panels at a time (enough independent FMA chains to stream the weights at memory
// speed); more: blocks of 8 rows x 3 panels, the blocking that measured best from 5 rows to 2048.
SIMD_AVX512 void f32_linear_avx512(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  const int64_t np = m <= 4 ? 4 : 3;
  for_panel_share(w, threads, np, [&](int64_t p, int64_t count) {
    f32_panel_rows(w, panels_of(w) + p * w.k * kPanel, p, count, x, m, m <= 4 ? m : 8, y);
  });
}

// ---------------------------------------------------------------- quantized panels (float activations)
//
// An int4/int8 weight repacked for float activations (bits | kQuantPanels), k-major as the float32
// panels: per 16 output rows, the codes of each input column side by side. int4: [ceil(N / 16)][K / 2]
// [16] bytes, byte j holding row j's code of column 2i in its low nibble and of column 2i + 1 in its
// high one; int8: [ceil(N / 16)][K][16] signed bytes; scales and mins float32 [ceil(N / 16)][K / group]
// [16] (rows past N zero, mins null for symmetric weights; any even group dividing K).
//
// The kernel widens a column's 16 codes and dequantizes them in registers, fma(code, scale, min), then
// multiplies them into each of the up to 8 rows of x it holds: the dequantizing is shared by those
// rows, where the GGUF layout's row-dot kernels convert every code once per 4 rows and its panel GEMM
// writes a dequantized panel and reads it back. At the default model's shapes (30 layers, Zen 4, two
// threads) 1.3-1.5x the GGUF layout's kernels at 4-16 rows, at par at one. From kQuantPanelGemmRows
// rows on, where the dequantizing is amortized over enough rows anyway, panels are dequantized into a
// float32 buffer for the float32 panel kernels. Every output is one FMA chain over k in order of x times
// fma(code, scale, min), the float32 panels' arithmetic on the dequantized weight: every row count,
// SIMD width and blocking gives the same bits, and the same as the GGUF layout's panel GEMM.
//
// With kQuantPanelsHalf the scales and mins are float16 (GGUF's own d and m are, so they are exact
// there): at one row the kernel streams the weight at memory speed, and a Q4_1 block's 16 bytes of codes
// then carry 4 bytes of scale and min instead of 8. Widened to the same floats, they give the same bits.
// The kernels take BITS as the code width | kQuantPanelsHalf where the scales are float16.

constexpr int kQuantPanels = 0x200;
constexpr int kQuantPanelsHalf = 0x400;
constexpr int64_t kQuantPanelGemmRows = 20;

// float16 bits (IEEE binary16) as a float: exact, subnormals, infinities and NaNs included.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  memcpy(&bits, &v, 4);
  bits |= sign;
  memcpy(&v, &bits, 4);
  return v;
}

// Scales or mins held as float16 (Weights carries them as float pointers).
inline const uint16_t* as_halves(const float* values) { return reinterpret_cast<const uint16_t*>(values); }

// Scale or min f of a quantized panel weight (float16 where `half`).
inline float qp_scale(const float* values, int64_t f, bool half) {
  return half ? half_to_float(as_halves(values)[f]) : values[f];
}

// 16 (8) scales or mins from f on, as floats.
template <int BITS>
SIMD_AVX512 inline __m512 qp_scales16(const float* values, int64_t f) {
  if constexpr (BITS & kQuantPanelsHalf) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(as_halves(values) + f)));
  } else {
    return _mm512_loadu_ps(values + f);
  }
}

template <int BITS>
SIMD_AVX2 inline __m256 qp_scales8(const float* values, int64_t f) {
  if constexpr (BITS & kQuantPanelsHalf) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(as_halves(values) + f)));
  } else {
    return _mm256_loadu_ps(values + f);
  }
}

// Bytes of codes per panel and input column pair, and per panel.
inline int64_t qp_pair_bytes(const Weights& w) { return (w.bits & 0xFF) == 4 ? kPanel : 2 * kPanel; }
inline int64_t qp_panel_bytes(const Weights& w) { return w.k / 2 * qp_pair_bytes(w); }

// Row j's code of column c in panel p.
inline int32_t qp_code(const Weights& w, int64_t p, int64_t c, int64_t j) {
  const uint8_t* pair = w.q + p * qp_panel_bytes(w) + c / 2 * qp_pair_bytes(w);
  if ((w.bits & 0xFF) == 4) return c % 2 ? pair[j] >> 4 : pair[j] & 15;
  return static_cast<int8_t>(pair[(c % 2) * kPanel + j]);
}

// Row j's weight of column c in panel p: fma(code, scale, min), as every path computes it.
inline float qp_weight(const Weights& w, int64_t p, int64_t c, int64_t j) {
  const int64_t f = (p * (w.k / w.group) + c / w.group) * kPanel + j;
  const bool half = w.bits & kQuantPanelsHalf;
  return std::fma(static_cast<float>(qp_code(w, p, c, j)), qp_scale(w.scales, f, half),
                  w.mins ? qp_scale(w.mins, f, half) : 0.0f);
}

void qp_linear_scalar(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  for_panel_share(w, threads, 1, [&](int64_t p, int64_t) {
    for (int64_t j = 0; j < valid_columns(w, p); ++j) {
      for (int64_t r = 0; r < m; ++r) {
        float acc = 0.0f;
        for (int64_t c = 0; c < w.k; ++c) acc = std::fma(x[r * w.k + c], qp_weight(w, p, c, j), acc);
        y[r * w.n + p * kPanel + j] = acc;
      }
    }
  });
}

// The 16 codes of columns 2i and 2i + 1 (one pair's bytes at b) as int32 vectors.
template <int BITS>
SIMD_AVX512 inline void qp_codes16(const uint8_t* b, __m512i& even, __m512i& odd) {
  if constexpr ((BITS & 0xFF) == 4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    even = _mm512_and_si512(v, _mm512_set1_epi32(15));
    odd = _mm512_srli_epi32(v, 4);
  } else {
    even = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    odd = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kPanel)));
  }
}

// MR rows of x times NP consecutive panels, dequantizing each column pair of the NP panels once.
template <int MR, int NP, int BITS>
SIMD_AVX512 void qp_micro_512(const Weights& w, const float* a, int64_t p0, float* c, int64_t last_valid) {
  static_assert(MR * NP <= 16, "accumulators, weights, scales and mins must stay in registers");
  const int64_t groups = w.k / w.group, panel_bytes = qp_panel_bytes(w), pair_bytes = qp_pair_bytes(w);
  const uint8_t* b = w.q + p0 * panel_bytes;
  __m512 acc[MR][NP];
  zero_tile512(acc);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 sc[NP], mn[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const int64_t f = ((p0 + j) * groups + g) * kPanel;
      sc[j] = qp_scales16<BITS>(w.scales, f);
      mn[j] = w.mins ? qp_scales16<BITS>(w.mins, f) : _mm512_setzero_ps();
    }
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 2) {
      __m512 w0[NP], w1[NP];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        __m512i even, odd;
        qp_codes16<BITS>(b + j * panel_bytes + k / 2 * pair_bytes, even, odd);
        w0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), sc[j], mn[j]);
        w1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), sc[j], mn[j]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 x0 = _mm512_set1_ps(a[i * w.k + k]), x1 = _mm512_set1_ps(a[i * w.k + k + 1]);
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          acc[i][j] = _mm512_fmadd_ps(x0, w0[j], acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(x1, w1[j], acc[i][j]);
        }
      }
    }
  }
  store_tile512(acc, c, w.n, last_valid);
}

template <int NP, int BITS>
SIMD_AVX512 void qp_rows_512(int64_t rows, const Weights& w, const float* a, int64_t p0, float* c,
                             int64_t last_valid) {
  switch (rows) {
#define RQ_ROWS(R) \
  case R: qp_micro_512<R, NP, BITS>(w, a, p0, c, last_valid); break;
    RQ_ROWS(1) RQ_ROWS(2) RQ_ROWS(3) RQ_ROWS(4)
#undef RQ_ROWS
    default:
      if constexpr (NP <= 2) {
        switch (rows) {
          case 5: qp_micro_512<5, NP, BITS>(w, a, p0, c, last_valid); break;
          case 6: qp_micro_512<6, NP, BITS>(w, a, p0, c, last_valid); break;
          case 7: qp_micro_512<7, NP, BITS>(w, a, p0, c, last_valid); break;
          default: qp_micro_512<8, NP, BITS>(w, a, p0, c, last_valid); break;
        }
      }
  }
}

// The 16 codes of columns 2i and 2i + 1 (one pair's bytes at b), half h (rows 8h .. 8h + 7), as int32.
template <int BITS>
SIMD_AVX2 inline void qp_codes8(const uint8_t* b, int h, __m256i& even, __m256i& odd) {
  if constexpr ((BITS & 0xFF) == 4) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * h)));
    even = _mm256_and_si256(v, _mm256_set1_epi32(15));
    odd = _mm256_srli_epi32(v, 4);
  } else {
    even = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * h)));
    odd = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kPanel + 8 * h)));
  }
}

// Panel p's weights dequantized into the float32 panel layout (out[c * 16 + j]).
template <int BITS>
SIMD_AVX2 void qp_dequantize_avx2(const Weights& w, int64_t p, float* out) {
  const int64_t groups = w.k / w.group, pair_bytes = qp_pair_bytes(w);
  const uint8_t* b = w.q + p * qp_panel_bytes(w);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t f = (p * groups + g) * kPanel;
    __m256 sc[2], mn[2];
    for (int h = 0; h < 2; ++h) {
      sc[h] = qp_scales8<BITS>(w.scales, f + 8 * h);
      mn[h] = w.mins ? qp_scales8<BITS>(w.mins, f + 8 * h) : _mm256_setzero_ps();
    }
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 2) {
      for (int h = 0; h < 2; ++h) {
        __m256i even, odd;
        qp_codes8<BITS>(b + k / 2 * pair_bytes, h, even, odd);
        _mm256_storeu_ps(out + k * kPanel + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(even), sc[h], mn[h]));
        _mm256_storeu_ps(out + (k + 1) * kPanel + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd), sc[h], mn[h]));
      }
    }
  }
}

// A thread's buffer of `floats` dequantized weights (grown, never shrunk).
inline float* qp_buffer(int64_t floats) {
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// Up to 4 rows: 4 panels at a time (enough independent chains to stream the codes); 5 to
// kQuantPanelGemmRows - 1: blocks of up to 8 rows x 2 panels; more: 3 panels at a time dequantized for
// the float32 panel kernel's 8 x 3 blocks.
template <int BITS>
SIMD_AVX512 void qp_linear_avx512(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  if (m >= kQuantPanelGemmRows) {
    for_panel_share(w, threads, 3, [&](int64_t p, int64_t count) {
      float* panels = qp_buffer(3 * w.k * kPanel);
      for (int64_t j = 0; j < count; ++j) qp_dequantize_avx2<BITS>(w, p + j, panels + j * w.k * kPanel);
      f32_panel_rows(w, panels, p, count, x, m, 8, y);
    });
    return;
  }
  const int64_t np = m <= 4 ? 4 : 2;
  // Blocks of equal size: 12 rows run as 6 + 6, not 8 + 4.
  const int64_t blocks = (m + 7) / 8, mr = (m + blocks - 1) / blocks;
  for_panel_share(w, threads, np, [&](int64_t p, int64_t count) {
    panel_rows(w, p, count, x, m, mr, y, [&](auto np, int64_t rows, const float* a, float* c, int64_t last_valid) {
      qp_rows_512<decltype(np)::value, BITS>(rows, w, a, p, c, last_valid);
    });
  });
}

// MR rows of x times NP panels on 256-bit vectors (two per panel), a column pair at a time (one load
// of an int4 pair's bytes serves both columns); scales and mins are read from L1 where they do not fit
// the 16 registers. One row takes 4 panels (8 chains), more rows one panel.
template <int MR, int NP, int BITS>
SIMD_AVX2 void qp_micro_avx2(const Weights& w, const float* a, int64_t p0, float* c, int64_t last_valid) {
  static_assert(MR * NP <= 4, "accumulators within the 16 registers");
  const int64_t groups = w.k / w.group, panel_bytes = qp_panel_bytes(w), pair_bytes = qp_pair_bytes(w);
  const uint8_t* b = w.q + p0 * panel_bytes;
  __m256 acc[MR][NP][2];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t f0 = (p0 * groups + g) * kPanel;
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 2) {
      __m256 w0[NP][2], w1[NP][2];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i even, odd;
          qp_codes8<BITS>(b + j * panel_bytes + k / 2 * pair_bytes, h, even, odd);
          const int64_t f = f0 + j * groups * kPanel + 8 * h;
          const __m256 s = qp_scales8<BITS>(w.scales, f);
          const __m256 min = w.mins ? qp_scales8<BITS>(w.mins, f) : _mm256_setzero_ps();
          w0[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(even), s, min);
          w1[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd), s, min);
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const __m256 x0 = _mm256_broadcast_ss(a + i * w.k + k), x1 = _mm256_broadcast_ss(a + i * w.k + k + 1);
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            acc[i][j][h] = _mm256_fmadd_ps(x0, w0[j][h], acc[i][j][h]);
            acc[i][j][h] = _mm256_fmadd_ps(x1, w1[j][h], acc[i][j][h]);
          }
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      store_row(c + i * w.n + j * kPanel, acc[i][j][0], acc[i][j][1], j == NP - 1 ? last_valid : kPanel);
    }
  }
}

// The 256-bit path (CPUs without AVX-512, and mode 1): below kQuantPanelGemmRows rows one row x 4
// panels or up to 4 rows x 1 panel at a time, dequantizing in registers; from there each panel
// dequantized once for the 6 x 16 float32 micro-kernel.
template <int BITS>
SIMD_AVX2 void qp_linear_avx2(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  if (m >= kQuantPanelGemmRows) {
    for_panel_share(w, threads, 1, [&](int64_t p, int64_t) {
      float* panel = qp_buffer(w.k * kPanel);
      qp_dequantize_avx2<BITS>(w, p, panel);
      for (int64_t r = 0; r < m; r += kMr) {
        micro_dispatch(std::min(kMr, m - r), x + r * w.k, w.k, panel, w.k, y + r * w.n + p * kPanel, w.n,
                       valid_columns(w, p));
      }
    });
    return;
  }
  const int64_t np = m == 1 ? 4 : 1;
  for_panel_share(w, threads, np, [&](int64_t p, int64_t count) {
    float* c = y + p * kPanel;
    const int64_t last_valid = valid_columns(w, p + count - 1);
    if (count < np) {  // the share's last panels, one at a time
      for (int64_t j = 0; j < count; ++j) {
        for (int64_t r = 0; r < m; ++r) {
          qp_micro_avx2<1, 1, BITS>(w, x + r * w.k, p + j, c + r * w.n + j * kPanel, valid_columns(w, p + j));
        }
      }
      return;
    }
    if (np == 4) return qp_micro_avx2<1, 4, BITS>(w, x, p, c, last_valid);
    for (int64_t r = 0; r < m; r += 4) {
      switch (std::min<int64_t>(4, m - r)) {
        case 1: qp_micro_avx2<1, 1, BITS>(w, x + r * w.k, p, c + r * w.n, last_valid); break;
        case 2: qp_micro_avx2<2, 1, BITS>(w, x + r * w.k, p, c + r * w.n, last_valid); break;
        case 3: qp_micro_avx2<3, 1, BITS>(w, x + r * w.k, p, c + r * w.n, last_valid); break;
        default: qp_micro_avx2<4, 1, BITS>(w, x + r * w.k, p, c + r * w.n, last_valid); break;
      }
    }
  });
}

// mode 0: the portable loop; 1: the 256-bit kernels; other modes the widest this CPU has.
void qp_linear(const Weights& w, const float* x, int64_t m, float* y, int mode, int threads) {
  static const bool avx2 = simd::cpu_has_avx2_fma(), wide = simd::cpu_has_avx512();
  if (mode == 0 || !avx2) return qp_linear_scalar(w, x, m, y, threads);
  const bool use512 = mode != 1 && wide;
  auto run = [&](auto bits) {
    constexpr int kBits = decltype(bits)::value;
    use512 ? qp_linear_avx512<kBits>(w, x, m, y, threads) : qp_linear_avx2<kBits>(w, x, m, y, threads);
  };
  const bool half = w.bits & kQuantPanelsHalf;
  if ((w.bits & 0xFF) == 4) {
    half ? run(std::integral_constant<int, 4 | kQuantPanelsHalf>{}) : run(std::integral_constant<int, 4>{});
  } else {
    half ? run(std::integral_constant<int, 8 | kQuantPanelsHalf>{}) : run(std::integral_constant<int, 8>{});
  }
}

// ---------------------------------------------------------------- int8 row panels (AVX-512 VNNI)
//
// The decode GEMV of a wide int8 weight without mins (GGUF Q8_0; Gemma 3's 262144-row tied lm_head is
// 168 MB of codes, read once per token), where the row-dot kernel above runs at half the memory's speed:
// its cost is widening every code to a float. Here the codes stay integers. Output rows are interleaved
// 16 at a time per pair of input columns ([N / 16][K / 2][16][2]: one 32-byte load widened once holds
// 16 rows' pairs as int16), and x is split per 32-column chunk c into a fixed point X = x / e_c of 23
// bits (e_c = max |x| over the chunk / (2^22 - 1)), X = 4096 Xh + Xl with Xh signed and Xl in 0..4095,
// so vpdpwssd sums each half's 32 products of a chunk exactly in int32 (both below 2^24). The chunk's
// value 4096 Ph + Pl is rounded once to float and accumulated times scale * e_c. The fixed point moves an
// element by at most 2^-23 of its chunk's largest: the size of a float32 dot product's own rounding
// over the chunk, so the logits are float32-accurate on the file's own int8 weights. The scalar and
// AVX-512 paths run the same integer sums and the same float operations in the same order: the same
// bits.

constexpr int kFixedBits = 24;  // |X| <= 2^24 - 1
constexpr int kLowBits = 12;    // X = Xh * 2^12 + Xl
constexpr int64_t kPairsPerChunk = kChunk / 2;

// x's rows as the panel kernels read them: per pair of columns, Xh and Xl as two int16 in one int32
// (broadcast to every lane), and per chunk its step e_c.
struct FixedX {
  std::vector<int32_t> hi, lo;
  std::vector<float> step;
};

inline int32_t pack_pair(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint16_t>(a) | (static_cast<uint32_t>(static_cast<uint16_t>(b)) << 16));
}

void fix_x(const float* x, int64_t m, int64_t k, FixedX& f) {
  const int64_t chunks = k / kChunk;
  f.hi.resize(m * k / 2);
  f.lo.resize(m * k / 2);
  f.step.resize(m * chunks);
  const float top = static_cast<float>((1 << kFixedBits) - 1);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* xc = x + r * k + c * kChunk;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < kChunk; ++i) {
        finite = finite && std::isfinite(xc[i]);
        amax = std::max(amax, std::fabs(xc[i]));
      }
      // A NaN or infinity in x makes the chunk's step NaN, so its outputs are NaN as a float dot's are.
      f.step[r * chunks + c] = finite ? amax / top : NAN;
      const float inv = finite && amax > 0.0f ? top / amax : 0.0f;
      for (int64_t i = 0; i < kChunk; i += 2) {
        int32_t hl[2][2];
        for (int j = 0; j < 2; ++j) {
          const int32_t v = std::clamp(static_cast<int32_t>(std::lrint(xc[i + j] * inv)), -(1 << kFixedBits) + 1,
                                       (1 << kFixedBits) - 1);
          hl[0][j] = v >> kLowBits;  // arithmetic: floor, so the low part is 0..4095
          hl[1][j] = v - (hl[0][j] << kLowBits);
        }
        const int64_t at = (r * k + c * kChunk + i) / 2;
        f.hi[at] = pack_pair(hl[0][0], hl[0][1]);
        f.lo[at] = pack_pair(hl[1][0], hl[1][1]);
      }
    }
  }
}

// Panel p's outputs (16 rows) for one row of x, in plain C++.
void panel8_scalar(const int8_t* panels, const float* scales, const FixedX& f, int64_t r, int64_t k, int64_t p,
                   float out[kPanel]) {
  const int64_t pairs = k / 2, chunks = k / kChunk;
  const int8_t* w = panels + p * pairs * 2 * kPanel;
  const float* s = scales + p * chunks * kPanel;
  for (int64_t j = 0; j < kPanel; ++j) {
    float acc = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t hi = 0, lo = 0;
      for (int64_t t = c * kPairsPerChunk; t < (c + 1) * kPairsPerChunk; ++t) {
        const int8_t* wt = w + (t * kPanel + j) * 2;
        const int32_t h = f.hi[r * pairs + t], l = f.lo[r * pairs + t];
        hi += wt[0] * static_cast<int16_t>(h) + wt[1] * static_cast<int16_t>(h >> 16);
        lo += wt[0] * static_cast<int16_t>(l) + wt[1] * static_cast<int16_t>(l >> 16);
      }
      const float v = std::fma(static_cast<float>(hi), 4096.0f, static_cast<float>(lo));
      acc = std::fma(v, s[c * kPanel + j] * f.step[r * chunks + c], acc);
    }
    out[j] = acc;
  }
}

// A superset of SIMD_AVX512, as simd.h's targets are of each other.
#define SIMD_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return simd::cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
}

// Panel p's outputs for ROWS (1..4) rows of x from r0; each chunk's pairs alternate between two
// accumulators per half, so the vpdpwssd chains do not wait on their own latency.
template <int ROWS>
SIMD_VNNI void panel8_avx512(const int8_t* panels, const float* scales, const FixedX& f, int64_t r0, int64_t k,
                             int64_t p, __m512 out[ROWS]) {
  const int64_t pairs = k / 2, chunks = k / kChunk;
  const int8_t* w = panels + p * pairs * 2 * kPanel;
  const float* s = scales + p * chunks * kPanel;
  const int32_t* hi = f.hi.data() + r0 * pairs;
  const int32_t* lo = f.lo.data() + r0 * pairs;
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i h0[ROWS], h1[ROWS], l0[ROWS], l1[ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) h0[r] = h1[r] = l0[r] = l1[r] = _mm512_setzero_si512();
    for (int64_t t = c * kPairsPerChunk; t < (c + 1) * kPairsPerChunk; t += 2) {
      const __m512i wa = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * 32)));
      const __m512i wb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * 32 + 32)));
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        h0[r] = _mm512_dpwssd_epi32(h0[r], wa, _mm512_set1_epi32(hi[r * pairs + t]));
        l0[r] = _mm512_dpwssd_epi32(l0[r], wa, _mm512_set1_epi32(lo[r * pairs + t]));
        h1[r] = _mm512_dpwssd_epi32(h1[r], wb, _mm512_set1_epi32(hi[r * pairs + t + 1]));
        l1[r] = _mm512_dpwssd_epi32(l1[r], wb, _mm512_set1_epi32(lo[r * pairs + t + 1]));
      }
    }
    const __m512 sc = _mm512_loadu_ps(s + c * kPanel);
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0[r], h1[r])), _mm512_set1_ps(4096.0f),
                                       _mm512_cvtepi32_ps(_mm512_add_epi32(l0[r], l1[r])));
      const __m512 scale = _mm512_mul_ps(sc, _mm512_set1_ps(f.step[(r0 + r) * chunks + c]));
      out[r] = _mm512_fmadd_ps(v, scale, out[r]);
    }
  }
}

template <int ROWS>
SIMD_VNNI void panel8_rows(const int8_t* panels, const float* scales, const FixedX& f, int64_t r0, int64_t k,
                           int64_t n, int64_t p, float* y) {
  __m512 out[ROWS];
  panel8_avx512<ROWS>(panels, scales, f, r0, k, p, out);
  const int64_t valid = std::min(kPanel, n - p * kPanel);
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
    _mm512_mask_storeu_ps(y + (r0 + r) * n + p * kPanel, static_cast<__mmask16>((1u << valid) - 1), out[r]);
  }
}

SIMD_VNNI void panel8_dispatch(const int8_t* panels, const float* scales, const FixedX& f, int64_t r0,
                               int64_t rows, int64_t k, int64_t n, int64_t p, float* y) {
  switch (rows) {
    case 1: panel8_rows<1>(panels, scales, f, r0, k, n, p, y); break;
    case 2: panel8_rows<2>(panels, scales, f, r0, k, n, p, y); break;
    case 3: panel8_rows<3>(panels, scales, f, r0, k, n, p, y); break;
    default: panel8_rows<4>(panels, scales, f, r0, k, n, p, y); break;
  }
}

// ---------------------------------------------------------------- bf16 pair panels (AVX512-BF16)
//
// --dtype bfloat16 on CPUs with AVX512-BF16: weights as bf16 in pair panels, [ceil(N / 16)][K / 2][16][2]
// (16 output rows side by side per pair of input columns, so one 64-byte load is one vdpbf16ps operand),
// activations rounded to bf16 (nearest even) on entry, float32 accumulation. vdpbf16ps does 32
// multiply-adds where an fp32 FMA does 16, and the weights are half the bytes: twice the fp32 panels'
// peak, half their memory traffic. Each output is one chain of pair dot products over k in order, whatever
// the row count or blocking: batch-invariant as the fp32 panels are. Quantized weights (bits 4/8) take the
// same micro-kernel on large row counts, each 16-row panel dequantised to bf16 pairs first.
//
// The scalar path computes each pair as acc + hi product + lo product (Intel's pseudo-code: the products
// of two bf16 are exact in float32); CPUs round inside vdpbf16ps in their own way, so it is the reference
// for tests within a rounding, not bit for bit.

using simd::bf16_round;
using simd::cpu_has_avx512_bf16;

inline float float_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

const uint16_t* bf16_panels_of(const Weights& w) { return reinterpret_cast<const uint16_t*>(w.q); }

// count values of x as bf16 (nearest even) into out, 32 at a time.
SIMD_BF16 void round_rows_bf16_avx512(const float* x, int64_t count, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, reinterpret_cast<const __m512i&>(v));
  }
  for (; i < count; ++i) out[i] = bf16_round(x[i]);
}

// Values from which rows_as_bf16 rounds on `threads` threads: a prefill's x (a few MB), which one thread
// rounded while the others waited at the GEMM's start (3 % of a bf16 prefill, and as much again waiting).
constexpr int64_t kParallelRoundMin = 1 << 16;

// count values of x (rows of a [m, k] x) as bf16 into the calling thread's buffer (reused across calls),
// `zeros` more values after them, zero (the AMX path's whole 16-row tiles).
const uint16_t* rows_as_bf16(const float* x, int64_t count, bool vec, int threads, int64_t zeros = 0) {
  static thread_local std::vector<uint16_t> buf;
  if (static_cast<int64_t>(buf.size()) < count + zeros) buf.resize(count + zeros);
  uint16_t* out = buf.data();
  if (vec) {
    // Shares of whole 32-value vectors, so every value is rounded as one thread would round it.
    const int nt = count >= kParallelRoundMin ? threads : 1;
    const int64_t vectors = (count + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int t = 0; t < nt; ++t) {
      const int64_t begin = vectors * t / nt * 32, end = std::min(count, vectors * (t + 1) / nt * 32);
      round_rows_bf16_avx512(x + begin, end - begin, out + begin);
    }
  } else {
    for (int64_t i = 0; i < count; ++i) out[i] = bf16_round(x[i]);
  }
  std::fill_n(buf.data() + count, zeros, uint16_t{0});
  return buf.data();
}

// MR rows of x (bf16) times NP consecutive pair panels (`stride` bf16 values apart).
template <int MR, int NP>
SIMD_BF16 void micro_bf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t stride, int64_t k, float* c,
                          int64_t ldc, int64_t last_valid) {
  static_assert(MR * NP <= 24, "accumulators must stay in registers");
  __m512 acc[MR][NP];
  zero_tile512(acc);
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh bv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const __m512i v = _mm512_loadu_si512(b + j * stride + p * 2 * kPanel);
      bv[j] = reinterpret_cast<const __m512bh&>(v);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      memcpy(&pair, a + i * lda + 2 * p, 4);
      const __m512i av = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], reinterpret_cast<const __m512bh&>(av), bv[j]);
    }
  }
  store_tile512(acc, c, ldc, last_valid);
}

template <int NP>
SIMD_BF16 void micro_bf16_rows(int64_t rows, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t stride,
                               int64_t k, float* c, int64_t ldc, int64_t last_valid) {
  switch (rows) {
#define RQ_ROWS(R) \
  case R: micro_bf16<R, NP>(a, lda, b, stride, k, c, ldc, last_valid); break;
    RQ_ROWS(1) RQ_ROWS(2) RQ_ROWS(3) RQ_ROWS(4)
#undef RQ_ROWS
    default:
      if constexpr (NP <= 3) {
        switch (rows) {
          case 5: micro_bf16<5, NP>(a, lda, b, stride, k, c, ldc, last_valid); break;
          case 6: micro_bf16<6, NP>(a, lda, b, stride, k, c, ldc, last_valid); break;
          case 7: micro_bf16<7, NP>(a, lda, b, stride, k, c, ldc, last_valid); break;
          default: micro_bf16<8, NP>(a, lda, b, stride, k, c, ldc, last_valid); break;
        }
      }
  }
}

// All m rows of xb times `count` consecutive pair panels at b, with the fp32 panels' blocking.
SIMD_BF16 void bf16_panel_rows(const uint16_t* xb, int64_t m, int64_t k, const uint16_t* b, int64_t count,
                               int64_t last_valid, float* y, int64_t ldy) {
  const int64_t mr = m <= 4 ? m : 8;
  const int64_t stride = k * kPanel;
  for (int64_t r = 0; r < m; r += mr) {
    const int64_t rows = std::min(mr, m - r);
    const uint16_t* a = xb + r * k;
    float* c = y + r * ldy;
    switch (count) {
      case 1: micro_bf16_rows<1>(rows, a, k, b, stride, k, c, ldy, last_valid); break;
      case 2: micro_bf16_rows<2>(rows, a, k, b, stride, k, c, ldy, last_valid); break;
      case 3: micro_bf16_rows<3>(rows, a, k, b, stride, k, c, ldy, last_valid); break;
      default: micro_bf16_rows<4>(rows, a, k, b, stride, k, c, ldy, last_valid); break;
    }
  }
}

SIMD_BF16 void bf16_linear_avx512(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  const uint16_t* xb = rows_as_bf16(x, m * w.k, true, threads);
  const int64_t np = m <= 4 ? 4 : 3;
  for_panel_share(w, threads, np, [&](int64_t p, int64_t count) {
    bf16_panel_rows(xb, m, w.k, bf16_panels_of(w) + p * w.k * kPanel, count, valid_columns(w, p + count - 1),
                    y + p * kPanel, w.n);
  });
}

void bf16_linear_scalar(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  const uint16_t* xb = rows_as_bf16(x, m * w.k, false, 1);
  for_panel_share(w, threads, 1, [&](int64_t p, int64_t) {
    const uint16_t* panel = bf16_panels_of(w) + p * w.k * kPanel;
    for (int64_t j = 0; j < valid_columns(w, p); ++j) {
      for (int64_t r = 0; r < m; ++r) {
        float acc = 0.0f;
        // Each pair read as one uint32 (low half: the even column): GCC 12's -O3 vectorizer
        // miscompiles the same loop over two uint16 loads.
        for (int64_t t = 0; t < w.k / 2; ++t) {
          uint32_t pw, px;
          memcpy(&pw, panel + (t * kPanel + j) * 2, 4);
          memcpy(&px, xb + r * w.k + 2 * t, 4);
          const float hi = float_bits(px & 0xffff0000u) * float_bits(pw & 0xffff0000u);
          acc = (acc + hi) + float_bits(px << 16) * float_bits(pw << 16);
        }
        y[r * w.n + p * kPanel + j] = acc;
      }
    }
  });
}

// Panel n0's rows of a quantized weight as bf16 pairs: dequantised to a float32 panel (pack_panel_avx2),
// then each two k-rows interleaved and rounded.
SIMD_BF16 void pack_bf16_panel(const Weights& w, int64_t n0, int64_t valid, float* f32, uint16_t* out) {
  pack_panel_avx2(w, n0, valid, f32);
  const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t p = 0; p < w.k / 2; ++p) {
    const __m512 even = _mm512_loadu_ps(f32 + 2 * p * kPanel), odd = _mm512_loadu_ps(f32 + (2 * p + 1) * kPanel);
    const __m512 lo = _mm512_permutex2var_ps(even, lo_idx, odd), hi = _mm512_permutex2var_ps(even, hi_idx, odd);
    const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(out + p * 2 * kPanel, reinterpret_cast<const __m512i&>(v));
  }
}

// The AMX-BF16 path's parts (see "AMX (bf16)" below), which the quantized GEMM takes too.
constexpr int64_t kAmxBf16Cols = 32;  // input columns of one tile of x

constexpr int64_t kAmxBf16RowBlock = 512;  // rows of x a thread takes through its panels at once

SIMD_AMX_BF16 void amx_bf16_tiles(int64_t m);
SIMD_AMX_BF16 void amx_release();
SIMD_AMX_BF16 void amx_bf16_rows(const uint16_t* xb, int64_t m, int64_t k, const uint16_t* panel, int64_t count,
                                 int64_t last_valid, float* y, int64_t ldy, int64_t tile_rows);

// x [m, k] as bf16 for the AMX path: zero rows after the last up to a whole tile of 16 (fewer than 16
// rows make tiles of that many: amx_bf16_tiles).
const uint16_t* rows_as_bf16_tiles(const float* x, int64_t m, int64_t k, int threads) {
  return rows_as_bf16(x, m * k, true, threads, m < 16 ? 0 : ((m + 15) / 16 * 16 - m) * k);
}

// A quantized weight on the bf16 micro-kernel, or with `amx` on AMX tiles (not the same bits; see "AMX
// (bf16)" below): per thread, each 16-row panel dequantised once and multiplied with every row; on AMX
// two panels at a time, so the rows take blocks of two row tiles by two panels (each row tile's loads
// serving two tile products: 1.3x at 2,048 rows, the same at 512), each output the same chain of tile
// products.
SIMD_BF16 void quant_bf16_gemm(const Weights& w, const float* x, int64_t m, float* y, int threads, bool amx) {
  const uint16_t* xb = amx ? rows_as_bf16_tiles(x, m, w.k, threads) : rows_as_bf16(x, m * w.k, true, threads);
  const int64_t panels = (w.n + kPanel - 1) / kPanel, per_step = amx ? 2 : 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> f32(w.k * kPanel);
    std::vector<uint16_t> pairs(per_step * w.k * kPanel);
    if (amx) amx_bf16_tiles(m);
#pragma omp for schedule(static)
    for (int64_t s = 0; s < (panels + per_step - 1) / per_step; ++s) {
      const int64_t p = s * per_step, count = std::min(per_step, panels - p);
      int64_t valid = kPanel;
      for (int64_t i = 0; i < count; ++i) {
        valid = std::min(kPanel, w.n - (p + i) * kPanel);
        pack_bf16_panel(w, (p + i) * kPanel, valid, f32.data(), pairs.data() + i * w.k * kPanel);
      }
      if (amx) {
        amx_bf16_rows(xb, m, w.k, pairs.data(), count, valid, y + p * kPanel, w.n, std::min<int64_t>(m, 16));
      } else {
        bf16_panel_rows(xb, m, w.k, pairs.data(), 1, valid, y + p * kPanel, w.n);
      }
    }
    if (amx) amx_release();
  }
}

// ---------------------------------------------------------------- int8 activations (AVX-512 VNNI)
//
// --cpu-act-quant int8: the activations of a quantized weight quantized on the fly, per row and per
// 32-column chunk, to int8 with a scale (llama.cpp's Q8 blocks: dx = max |x| / 127, qx = round(x / dx)),
// and each chunk's dot product summed exactly in int32 by vpdpbusd (64 unsigned x signed byte products
// an instruction, 4x an fp32 FMA's 16), then scaled once: for w = scale * q + min,
//   sum(w x) over a chunk = scale * dx * sum(q qx) + min * dx * sum(qx).
// int8 weights (signed) are stored as u = q + 128 (vpdpbusd takes unsigned bytes) and each chunk's sum
// corrected by 128 * sum(qx), in integers: no float cancellation. Weights are repacked once at load into
// u8 panels (bits | kAct8), per 16 output rows and chunk, for one 64-byte load per vpdpbusd operand:
//   int4: 4 vectors; vector h holds, for row j at bytes 4j..4j+3, GGUF bytes 4h..4h+3 of the row's chunk
//         (low nibbles: columns 4h..4h+3; high nibbles: 16 + 4h..16 + 4h + 3): the file's own bytes;
//   int8: 8 vectors; vector s holds row j's codes of columns 4s..4s+3, plus 128;
// scales and mins [ceil(N / 16)][K / 32][16] float32; symmetric weights (Q8_0) have no mins (null), and
// every path then skips the min's fma. Each output is the same integer sums and the same float
// operations in the same order whatever the row count: batch-invariant, and the scalar path gives the
// SIMD paths' bits.

constexpr int kAct8 = 0x100;

// The activation codes and steps of a call, in blocks of kRows rows: codes [blocks][K / 32][kRows][32],
// steps and sums [blocks][K / 32][kRows] (at(r, c)). A chunk of a few consecutive rows is then one
// contiguous run (one pointer and constant offsets in the kernels), and a row's chunks lie kRows
// apart in order (streamed front to back).
struct QuantX {
  static constexpr int64_t kRows = 48;
  std::vector<int8_t> q;
  std::vector<float> dx, dxs;  // per row and chunk: the step, and the step times the sum of the codes
  std::vector<int32_t> isum;   // per row and chunk: the sum of the codes
  std::vector<int32_t> bias;   // -128 * isum: the int8 weights' correction (codes stored plus 128)
  int64_t chunks = 0;

  int64_t at(int64_t r, int64_t c) const { return ((r / kRows) * chunks + c) * kRows + r % kRows; }
  const int8_t* codes(int64_t r, int64_t c) const { return q.data() + at(r, c) * kChunk; }
};

inline void quantize_chunk_scalar(const float* x, int8_t* q, float& dx, float& dxs, int32_t& isum) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < kChunk; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kChunk; ++i) {
    q[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(std::nearbyint(x[i] * inv)), -127, 127));
    sum += q[i];
  }
  // A NaN or infinity in x makes the chunk's step NaN, so its outputs are NaN as a float dot's are.
  dx = finite ? amax / 127.0f : NAN;
  dxs = dx * static_cast<float>(sum);
  isum = sum;
}

// quantize_chunk_scalar on 8-float vectors: the same operations, so the same codes and steps.
SIMD_AVX2 void quantize_chunk_avx2(const float* x, int8_t* q, float& dx, float& dxs, int32_t& isum) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 v[4], amax = _mm256_setzero_ps();
  int finite = 1;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ)) == 0xFF;
    amax = _mm256_max_ps(amax, a);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(finite && top > 0.0f ? 127.0f / top : 0.0f);
  const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
  __m256i c[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lim), neg);
    total = _mm256_add_epi32(total, c[i]);
  }
  // Narrow to bytes in order: the packs interleave 128-bit lanes, the permute puts them back.
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  isum = _mm_cvtsi128_si32(t);
  dx = finite ? top / 127.0f : NAN;
  dxs = dx * static_cast<float>(isum);
}

// quantize_chunk_scalar on 16-float vectors, one chunk at a time: for a row or two (decode), where
// quantize_rows16_avx512 would reduce 16 rows' worth of vectors.
SIMD_VNNI void quantize_chunk_avx512(const float* x, int8_t* q, float& dx, float& dxs, int32_t& isum) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __mmask16 fa = _mm512_cmp_ps_mask(_mm512_abs_ps(a), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  const __mmask16 fb = _mm512_cmp_ps_mask(_mm512_abs_ps(b), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  const bool finite = fa == 0xFFFF && fb == 0xFFFF;
  const __m512 inv = _mm512_set1_ps(finite && amax > 0.0f ? 127.0f / amax : 0.0f);
  // Round to nearest even (the default rounding mode, as std::nearbyint), clamp, narrow.
  const __m512i lim = _mm512_set1_epi32(127);
  const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), lim),
                                      _mm512_sub_epi32(_mm512_setzero_si512(), lim));
  const __m512i qb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), lim),
                                      _mm512_sub_epi32(_mm512_setzero_si512(), lim));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  dx = finite ? amax / 127.0f : NAN;
  isum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  dxs = dx * static_cast<float>(isum);
}

struct MaxU32 {
  SIMD_VNNI __m512i operator()(__m512i a, __m512i b) const { return _mm512_max_epu32(a, b); }
};
struct AddI32 {
  SIMD_VNNI __m512i operator()(__m512i a, __m512i b) const { return _mm512_add_epi32(a, b); }
};

// Lane j of the result: op over the 16 lanes of v[j] (a transpose-and-reduce tree: 45 instructions for
// 16 reductions where one at a time takes 8 each, most of them on a dependency chain).
template <typename Op>
SIMD_VNNI inline __m512i reduce16(__m512i v[16], Op op) {
  __m512i u[8], t[4], z[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    u[i] = op(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[i] = op(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xDD));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    z[i] = op(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  }
  const __m512 g = _mm512_castsi512_ps(z[0]), h = _mm512_castsi512_ps(z[1]);
  const __m512i r =
      op(_mm512_castps_si512(_mm512_shuffle_ps(g, h, 0x88)), _mm512_castps_si512(_mm512_shuffle_ps(g, h, 0xDD)));
  // Lane 4q + e holds v[q + 4e].
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// quantize_chunk_scalar on 16 rows at a time, chunk by chunk: the same codes and steps (max |x| taken on
// the bits of |x|, which order as the floats do and put infinities and NaN above every finite value).
// Rows r0 .. r0 + 15 (r0 a multiple of 16) of a chunk are contiguous in QuantX, so each chunk's codes
// are one 512-byte run and its steps one vector each; rows from `rows` on read as zeros.
SIMD_VNNI void quantize_rows16_avx512(const float* x, int64_t k, int64_t rows, int64_t r0, QuantX& qx) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
  const __m512 k127 = _mm512_set1_ps(127.0f);
  for (int64_t c = 0; c < qx.chunks; ++c) {
    const float* xc = x + c * kChunk;
    const int64_t s = qx.at(r0, c);
    __m512i v[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      v[j] = _mm512_setzero_si512();
      if (j < rows) {
        v[j] = _mm512_max_epu32(_mm512_and_si512(_mm512_loadu_si512(xc + j * k), magnitude),
                                _mm512_and_si512(_mm512_loadu_si512(xc + j * k + 16), magnitude));
      }
    }
    const __m512i top = reduce16(v, MaxU32());
    const __mmask16 finite = _mm512_cmplt_epu32_mask(top, _mm512_set1_epi32(0x7F800000));
    const __m512 amax = _mm512_castsi512_ps(top);
    const __mmask16 scaled = finite & _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_maskz_div_ps(scaled, k127, amax));
    int8_t* out = qx.q.data() + s * kChunk;
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      v[j] = _mm512_setzero_si512();
      if (j < rows) {
        const __m512 iv = _mm512_set1_ps(inv[j]);
        const __m512i qa = _mm512_max_epi32(
            _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xc + j * k), iv)), lim), neg);
        const __m512i qb = _mm512_max_epi32(
            _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xc + j * k + 16), iv)), lim), neg);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j * kChunk), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j * kChunk + 16), _mm512_cvtepi32_epi8(qb));
        v[j] = _mm512_add_epi32(qa, qb);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * kChunk), _mm256_setzero_si256());
      }
    }
    const __m512i total = reduce16(v, AddI32());
    const __m512 dx = _mm512_mask_div_ps(_mm512_set1_ps(NAN), finite, amax, k127);
    _mm512_storeu_ps(qx.dx.data() + s, dx);
    _mm512_storeu_ps(qx.dxs.data() + s, _mm512_mul_ps(dx, _mm512_cvtepi32_ps(total)));
    _mm512_storeu_si512(qx.isum.data() + s, total);
    _mm512_storeu_si512(qx.bias.data() + s, _mm512_mullo_epi32(total, _mm512_set1_epi32(-128)));
  }
}

// From this many rows on the 512-bit quantizer takes 16 rows at a time (at 1 row it costs 1.4x the
// chunk-at-a-time one, at 4 the same, at 16 half).
constexpr int64_t kQuantizeRows16 = 4;

// width: 0 scalar, 256 or 512 bits.
const QuantX& quantize_rows(const float* x, int64_t m, int64_t k, int width, int threads) {
  static thread_local QuantX fixed;
  QuantX& qx = fixed;  // the calling thread's, shared with the pool below
  const int64_t chunks = k / kChunk;
  const int64_t blocks = (m + QuantX::kRows - 1) / QuantX::kRows;
  qx.chunks = chunks;
  qx.q.resize(blocks * QuantX::kRows * k);
  qx.dx.resize(blocks * QuantX::kRows * chunks);
  qx.dxs.resize(qx.dx.size());
  qx.isum.resize(qx.dx.size());
  qx.bias.resize(qx.dx.size());
  const int nt = m >= 64 ? threads : 1;
  if (width == 512 && m >= kQuantizeRows16) {
    // Rows past m up to a multiple of 16 get zero codes here.
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < m; r += 16) quantize_rows16_avx512(x + r * k, k, std::min<int64_t>(16, m - r), r, qx);
    return qx;
  }
  auto* quantize = width == 512 ? quantize_chunk_avx512 : width == 256 ? quantize_chunk_avx2 : quantize_chunk_scalar;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t s = qx.at(r, c);
      quantize(x + r * k + c * kChunk, qx.q.data() + s * kChunk, qx.dx[s], qx.dxs[s], qx.isum[s]);
      qx.bias[s] = -128 * qx.isum[s];
    }
  }
  return qx;
}

// Vectors of 16 rows x 4 bytes per chunk of a panel.
inline int64_t act8_vectors(int bits) { return (bits & 0xFF) == 4 ? 4 : 8; }

// The activation codes of a step of 4 columns as one int32 to broadcast.
inline int32_t quad(const int8_t* q) {
  int32_t v;
  memcpy(&v, q, 4);
  return v;
}

// The u8 code of row j, column i (0..31) of a chunk's panel bytes.
inline int32_t act8_code(const uint8_t* chunk, bool nibble, int64_t j, int64_t i) {
  if (!nibble) return chunk[(i / 4 * kPanel + j) * 4 + i % 4];
  const int64_t h = (i % 16) / 4;
  const uint8_t byte = chunk[(h * kPanel + j) * 4 + i % 4];
  return i < 16 ? byte & 15 : byte >> 4;
}

void act8_linear_scalar(const Weights& w, const QuantX& qx, int64_t m, float* y, int threads) {
  const int64_t chunks = w.k / kChunk, vectors = act8_vectors(w.bits);
  const bool nibble = vectors == 4;
  for_panel_share(w, threads, 1, [&](int64_t p, int64_t) {
    for (int64_t j = 0; j < valid_columns(w, p); ++j) {
      for (int64_t r = 0; r < m; ++r) {
        float out = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          const uint8_t* chunk = w.q + (p * chunks + c) * vectors * 64;
          const int64_t s = qx.at(r, c);
          const int8_t* xq = qx.q.data() + s * kChunk;
          int32_t acc = 0;
          for (int64_t i = 0; i < kChunk; ++i) acc += act8_code(chunk, nibble, j, i) * xq[i];
          if (!nibble) acc -= 128 * qx.isum[s];
          const int64_t f = (p * chunks + c) * kPanel + j;
          out = std::fma(static_cast<float>(acc), w.scales[f] * qx.dx[s], out);
          if (w.mins) out = std::fma(w.mins[f], qx.dxs[s], out);
        }
        y[r * w.n + p * kPanel + j] = out;
      }
    }
  });
}

// MR rows times NP consecutive panels: per chunk MR x NP int32 sums, then scaled into as many float
// accumulators. On Zen 4 vpdpbusd zmm, vmulps and vfmadd share two pipes (one zmm a cycle between
// them) while the conversion, the nibble split, broadcasts and loads run beside them: per row, panel
// and chunk the 8 vpdpbusd wait on the epilogue's mul and fma (and the min's fma where there are
// mins), and everything else only has to stay out of their way. So the loop holds no integer
// arithmetic but its pointers: the activations of the MR rows (QuantX's blocks) and their steps are
// read at constant offsets, the int8 weights' correction starts the sums (bias) instead of a subtract,
// and symmetric weights (no mins) skip the min's fma.
template <int MR, int NP, bool NIBBLE, bool MINS>
SIMD_VNNI void micro_act8(const Weights& w, const QuantX& qx, int64_t r0, int64_t p0, float* c, int64_t last_valid) {
  constexpr int64_t kVectors = NIBBLE ? 4 : 8;
  const int64_t chunks = w.k / kChunk;
  const int64_t panel_bytes = chunks * kVectors * 64, panel_floats = chunks * kPanel;
  const uint8_t* b = w.q + p0 * panel_bytes;
  const float* sc = w.scales + p0 * panel_floats;
  const float* mn = MINS ? w.mins + p0 * panel_floats : nullptr;
  const int64_t s0 = qx.at(r0, 0);
  const int8_t* xq = qx.q.data() + s0 * kChunk;
  const float* dx = qx.dx.data() + s0;
  const float* dxs = qx.dxs.data() + s0;
  const int32_t* bias = qx.bias.data() + s0;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 out[MR][NP];
  zero_tile512(out);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    // The MR rows' codes of a chunk 4 ahead (kRows x 32 bytes apart: a stride the hardware misses): a
    // prefetch per 64 bytes and one at the last byte, so every line of the run is touched.
    const int8_t* ahead = xq + 4 * QuantX::kRows * kChunk;
#pragma GCC unroll 4
    for (int64_t off = 0; off < MR * kChunk; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    if constexpr (MR * kChunk > 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + MR * kChunk - 1), _MM_HINT_T0);
    __m512i acc[MR][NP];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i start = NIBBLE ? _mm512_setzero_si512() : _mm512_set1_epi32(bias[i]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[i][j] = start;
    }
#pragma GCC unroll 4
    for (int64_t h = 0; h < 4; ++h) {
      __m512i lo[NP], hi[NP];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        const __m512i v = _mm512_loadu_si512(b + j * panel_bytes + h * 64);
        if constexpr (NIBBLE) {
          lo[j] = _mm512_and_si512(v, low4);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        } else {
          lo[j] = v;
          hi[j] = _mm512_loadu_si512(b + j * panel_bytes + (h + 4) * 64);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int8_t* xr = xq + i * kChunk;
        const __m512i xl = _mm512_set1_epi32(quad(xr + 4 * h)), xh = _mm512_set1_epi32(quad(xr + 16 + 4 * h));
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], lo[j], xl);
          acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], hi[j], xh);
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const __m512 scale = _mm512_loadu_ps(sc + j * panel_floats);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(dx[i]));
        out[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), scaled, out[i][j]);
        if constexpr (MINS) {
          out[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(mn + j * panel_floats), _mm512_set1_ps(dxs[i]), out[i][j]);
        }
      }
    }
    b += kVectors * 64;
    sc += kPanel;
    if constexpr (MINS) mn += kPanel;
    xq += QuantX::kRows * kChunk;
    dx += QuantX::kRows;
    dxs += QuantX::kRows;
    bias += QuantX::kRows;
  }
  store_tile512(out, c, w.n, last_valid);
}

// Rows and panels per micro-kernel call: 6 x 2 keeps 12 sums and 12 float accumulators in registers
// (31 of 32 with the weights, broadcasts and nibble mask), each weight vector and its nibble split
// serving 6 rows and each activation broadcast 2 panels. On Zen 5 the kernel alone ran 8 % faster than
// at 4 x 2 (section "int8 activations" of benchmarks/README.md); on Zen 4 they measured alike.
constexpr int64_t kAct8Rows = 6, kAct8Panels = 2;

// micro_act8 for min(R, rows) rows: tiles of R rows down to 1, picked at compile time. Calls wider than
// kAct8Panels take 1 or 2 rows only (act8_linear_avx512), so only those tiles are built for them.
template <int R, int NP, bool NIBBLE, bool MINS>
SIMD_VNNI void micro_act8_rows(int64_t rows, const Weights& w, const QuantX& qx, int64_t r0, int64_t p0, float* c,
                               int64_t last_valid) {
  if constexpr (R > 1) {
    if (rows < R) return micro_act8_rows<R - 1, NP, NIBBLE, MINS>(rows, w, qx, r0, p0, c, last_valid);
  }
  micro_act8<R, NP, NIBBLE, MINS>(w, qx, r0, p0, c, last_valid);
}

template <int NP, bool NIBBLE, bool MINS>
SIMD_VNNI void micro_act8_tile(int64_t rows, const Weights& w, const QuantX& qx, int64_t r0, int64_t p0, float* c,
                               int64_t last_valid) {
  constexpr int kRows = NP > kAct8Panels ? 2 : kAct8Rows;
  micro_act8_rows<kRows, NP, NIBBLE, MINS>(rows, w, qx, r0, p0, c, last_valid);
}

// Rows of x the AVX-512 kernel takes through its panels at a time: their codes (rows x K bytes) stay in
// L2 while the thread's panels stream past them (each panel group from L1 across the block), instead
// of every panel group reading all M rows' codes from L3 (at 2,048 rows of 576 columns, 1.2 MB).
constexpr int64_t kAct8BlockBytes = 256 << 10;

template <bool NIBBLE, bool MINS>
SIMD_VNNI void act8_linear_avx512(const Weights& w, const QuantX& qx, int64_t m, float* y, int threads) {
  constexpr int64_t kRows = kAct8Rows;
  static_assert(QuantX::kRows % kRows == 0, "a block of rows lies in one of QuantX's");
  const int64_t np = m <= 2 ? 4 : kAct8Panels;
  const int64_t block = std::max<int64_t>(1, kAct8BlockBytes / w.k / QuantX::kRows) * QuantX::kRows;
  const int64_t panels = (w.n + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(threads)
  {
    // Contiguous, equal shares of the panels, as for_panel_share.
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t r0 = 0; r0 < m; r0 += block) {
      const int64_t r1 = std::min(m, r0 + block);
      for (int64_t p = p0; p < p1; p += np) {
        const int64_t count = std::min(np, p1 - p);
        const int64_t last_valid = valid_columns(w, p + count - 1);
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t rows = std::min(kRows, r1 - r);
          float* c = y + r * w.n + p * kPanel;
          switch (count) {
            case 1: micro_act8_tile<1, NIBBLE, MINS>(rows, w, qx, r, p, c, last_valid); break;
            case 2: micro_act8_tile<2, NIBBLE, MINS>(rows, w, qx, r, p, c, last_valid); break;
            case 3: micro_act8_tile<3, NIBBLE, MINS>(rows, w, qx, r, p, c, last_valid); break;
            default: micro_act8_tile<4, NIBBLE, MINS>(rows, w, qx, r, p, c, last_valid); break;
          }
        }
      }
    }
  }
}

// The 256-bit kernels (linear_act8_lanes.h), one per integer dot product.
namespace act8_avx2 {
struct D {
  static constexpr bool kSumsUnsigned = false;
  // int4: u * x on vpmaddubsw (|u x + u' x'| <= 2 * 15 * 127 fits int16). int8: q = u - 128 times x as
  // |q| * (x signed as q), which fits int16 even for q = -128.
  template <bool INT8>
  SIMD_AVX2 static __m256i dot(__m256i acc, __m256i u, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (INT8) {
      const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
      return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
    } else {
      return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
    }
  }
};
#define ACT8_TARGET SIMD_AVX2
#include "linear_act8_lanes.h"
#undef ACT8_TARGET
}  // namespace act8_avx2

#define SIMD_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

bool cpu_has_avx_vnni() {
  __builtin_cpu_init();
  return simd::cpu_has_avx2_fma() && __builtin_cpu_supports("avxvnni");
}

namespace act8_avxvnni {
struct D {
  static constexpr bool kSumsUnsigned = true;
  template <bool INT8>
  SIMD_AVXVNNI static __m256i dot(__m256i acc, __m256i u, __m256i x) {
    return _mm256_dpbusd_avx_epi32(acc, u, x);
  }
};
#define ACT8_TARGET SIMD_AVXVNNI
#include "linear_act8_lanes.h"
#undef ACT8_TARGET
}  // namespace act8_avxvnni

namespace act8_vl {
struct D {
  static constexpr bool kSumsUnsigned = true;
  template <bool INT8>
  SIMD_VNNI static __m256i dot(__m256i acc, __m256i u, __m256i x) {
    return _mm256_dpbusd_epi32(acc, u, x);
  }
};
#define ACT8_TARGET SIMD_VNNI
#include "linear_act8_lanes.h"
#undef ACT8_TARGET
}  // namespace act8_vl

// ---------------------------------------------------------------- AMX (bf16)
//
// --dtype bfloat16 on Sapphire Rapids and later: tdpbf16ps multiplies a 16-row x 32-bf16 tile of x by a
// 16 x 64-byte tile of a pair panel (16 pairs of input columns for its 16 output rows: the [K / 2][16][2]
// layout as stored) into 16 x 16 float32 sums, 16x the products of a vdpbf16ps. Its sums are not the
// AVX512-BF16 kernel's: measured on a Xeon with AMX, one tdpbf16ps adds its 32 products among
// themselves with its own rounding before adding them to the sum (a product 2^-30 beside +1 and -1 is
// lost; vdpbf16ps adds the pairs to the sum one at a time). So where AMX-BF16 serves a weight it serves
// every row count of it, decode's single rows included (in tiles of that many rows: the weights' bytes
// bound those steps, not the tile products; 0.85x vdpbf16ps at 1-2 rows, 4-6x from 64 rows on the Xeon
// measured in benchmarks/README.md): each output is one chain of tile products over K in order,
// whatever the rows beside it, so the path is batch-invariant on its own. It checks itself on first
// use (close to the AVX512-BF16 kernel, and the same bits for a row alone as among others) and stays
// off if not; K not a multiple of 32 takes the AVX512-BF16 kernel.

// Tiles 0-3: the sums of two row tiles (0-1, 2-3) by two panels; 4-5: 16 rows of x each; 6-7: 16
// pairs of a panel each. Loaded per parallel region, by each thread: other libraries (oneDNN) may
// configure the tiles of the same threads their own way.
// With fewer than 16 rows of x, the sums' and x's tiles are that many rows: a tile product's time
// follows its rows (decode's single rows).
SIMD_AMX_BF16 void amx_bf16_tiles(int64_t m) {
  simd::TileConfig cfg = simd::TileConfig::whole();
  for (int t = 0; t < 6; ++t) cfg.rows[t] = static_cast<uint8_t>(std::min<int64_t>(m, 16));
  simd::load_tile_config(cfg);
}

SIMD_AMX_BF16 void amx_release() { _tile_release(); }

// RT row tiles of xb (k columns) times PT panels (`stride` elements apart) into out[r * PT + q] (row
// tile r by panel q, rows ld[.] bytes apart): four independent chains of tile products where both are 2.
template <int RT, int PT>
SIMD_AMX_BF16 void amx_bf16_block(const uint16_t* xb, int64_t k, const uint16_t* panel, int64_t stride,
                                  float* const* out, const int64_t* ld) {
  _tile_zero(0);
  if constexpr (PT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && PT > 1) _tile_zero(3);
  for (int64_t c = 0; c < k; c += kAmxBf16Cols) {
    // Tile loads do not start the hardware prefetchers the way vector loads do: the panels' next
    // steps are asked for ahead (what bounds decode's few rows).
    for (int64_t line = 0; line < 16; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (c + 8 * kAmxBf16Cols) * kPanel) + line * 64, _MM_HINT_T0);
      if constexpr (PT > 1) {
        _mm_prefetch(reinterpret_cast<const char*>(panel + stride + (c + 8 * kAmxBf16Cols) * kPanel) + line * 64,
                     _MM_HINT_T0);
      }
    }
    _tile_loadd(4, xb + c, k * 2);
    if constexpr (RT > 1) _tile_loadd(5, xb + 16 * k + c, k * 2);
    _tile_loadd(6, panel + c * kPanel, 64);  // pairs c / 2 on: 16 rows of 16 x 2 bf16
    if constexpr (PT > 1) _tile_loadd(7, panel + stride + c * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT > 1 && PT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out[0], ld[0]);
  if constexpr (PT > 1) _tile_stored(1, out[1], ld[1]);
  if constexpr (RT > 1) _tile_stored(2, out[PT], ld[PT]);
  if constexpr (RT > 1 && PT > 1) _tile_stored(3, out[3], ld[3]);
}

// m rows of xb (bf16, k columns, zero rows after them to a whole tile: rows_as_bf16_tiles) times
// `count` (1 or 2) consecutive pair panels into y (ldy apart); the last panel writes `last_valid` columns.
// The tiles hold `tile_rows` rows (as amx_bf16_tiles configured them). A tile whose rows and columns all
// fall in y is stored there directly (reading a tile's store back into vectors waits for it); a part
// tile goes through `sums`.
SIMD_AMX_BF16 void amx_bf16_rows(const uint16_t* xb, int64_t m, int64_t k, const uint16_t* panel, int64_t count,
                                 int64_t last_valid, float* y, int64_t ldy, int64_t tile_rows) {
  alignas(64) float sums[4 * 256];
  const int64_t stride = k * kPanel;
  for (int64_t r0 = 0; r0 < m; r0 += 32) {  // two row tiles a block
    const int64_t rt = r0 + 16 < m ? 2 : 1;
    float* out[4];
    int64_t ld[4], rows[4], cols[4];
    for (int64_t r = 0; r < rt; ++r) {
      for (int64_t q = 0; q < count; ++q) {
        const int64_t t = r * count + q;
        rows[t] = std::min<int64_t>(16, m - r0 - 16 * r), cols[t] = q + 1 == count ? last_valid : kPanel;
        const bool direct = cols[t] == kPanel && rows[t] == tile_rows;
        out[t] = direct ? y + (r0 + 16 * r) * ldy + q * kPanel : sums + t * 256;
        ld[t] = direct ? ldy * 4 : 64;
      }
    }
    const uint16_t* a = xb + r0 * k;
    if (rt == 2 && count == 2) amx_bf16_block<2, 2>(a, k, panel, stride, out, ld);
    else if (rt == 2) amx_bf16_block<2, 1>(a, k, panel, stride, out, ld);
    else if (count == 2) amx_bf16_block<1, 2>(a, k, panel, stride, out, ld);
    else amx_bf16_block<1, 1>(a, k, panel, stride, out, ld);
    for (int64_t r = 0; r < rt; ++r) {
      for (int64_t q = 0; q < count; ++q) {
        const int64_t t = r * count + q;
        if (out[t] != sums + t * 256) continue;  // stored in place
        const __mmask16 mask = static_cast<__mmask16>((1u << cols[t]) - 1);
        for (int64_t i = 0; i < rows[t]; ++i) {
          _mm512_mask_storeu_ps(y + (r0 + 16 * r + i) * ldy + q * kPanel, mask, _mm512_load_ps(out[t] + i * 16));
        }
      }
    }
  }
}

SIMD_AMX_BF16 void bf16_linear_amx(const Weights& w, const float* x, int64_t m, float* y, int threads) {
  const uint16_t* xb = rows_as_bf16_tiles(x, m, w.k, threads);
  const int64_t panels = (w.n + kPanel - 1) / kPanel, pairs = (panels + 1) / 2;
#pragma omp parallel num_threads(threads)
  {
    amx_bf16_tiles(m);
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Blocks of rows, so the rows a thread sweeps its panels with stay in its L2 (bf16 x of 512 rows
    // at the default model's widest K: 1.5 MB).
    for (int64_t r0 = 0; r0 < m; r0 += kAmxBf16RowBlock) {
      const int64_t rows = std::min(kAmxBf16RowBlock, m - r0);
      for (int64_t q = pairs * t / nt; q < pairs * (t + 1) / nt; ++q) {
        const int64_t p = 2 * q, count = std::min<int64_t>(2, panels - p);
        amx_bf16_rows(xb + r0 * w.k, rows, w.k, bf16_panels_of(w) + p * w.k * kPanel, count,
                      valid_columns(w, p + count - 1), y + r0 * w.n + p * kPanel, w.n, std::min<int64_t>(m, 16));
      }
    }
    amx_release();
  }
}

// Whether the AMX-BF16 path is usable here: the CPU has it, the process may use its tiles, and on a
// small problem its outputs are close to the AVX512-BF16 kernel's and a row alone gets the bits it gets
// among others. Asked once.
bool amx_bf16_usable() {
  static const bool usable = [] {
    if (!simd::cpu_has_amx_bf16()) return false;
    const int64_t n = 40, k = 64, m = 37, panels = (n + kPanel - 1) / kPanel;
    std::vector<uint16_t> pairs(panels * k * kPanel);
    std::vector<float> x(m * k), a(m * n), b(m * n), one(n);
    uint32_t state = 12345u;
    auto uniform = [&state] {
      state = state * 1664525u + 1013904223u;
      return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
    };
    for (auto& v : pairs) v = bf16_round(uniform());
    for (auto& v : x) v = uniform();
    const Weights w{reinterpret_cast<const uint8_t*>(pairs.data()), nullptr, nullptr, n, k, 0, 16};
    bf16_linear_avx512(w, x.data(), m, a.data(), 1);
    bf16_linear_amx(w, x.data(), m, b.data(), 1);
    for (int64_t i = 0; i < m * n; ++i) {
      if (!(std::fabs(a[i] - b[i]) <= 1e-4f * (1.0f + std::fabs(a[i])))) return false;
    }
    for (const int64_t r : {int64_t{0}, int64_t{17}, m - 1}) {
      bf16_linear_amx(w, x.data() + r * k, 1, one.data(), 1);
      if (memcmp(one.data(), b.data() + r * n, n * sizeof(float)) != 0) return false;
    }
    return true;
  }();
  return usable;
}

// CPU features the bf16 dispatch reads, as bits (so tests can hand it fake ones).
constexpr unsigned kFeatBf16 = 1, kFeatAmxBf16 = 2;

// The bf16 path `rows` rows of k columns run in `mode` with these CPU features: 0 scalar, 1 AVX512-BF16,
// 2 AMX-BF16.
int bf16_path_for(int mode, int64_t /*rows*/, int64_t k, unsigned features) {
  if (mode == 0 || !(features & kFeatBf16)) return 0;
  return (features & kFeatAmxBf16) && k % kAmxBf16Cols == 0 ? 2 : 1;
}

unsigned bf16_features() {
  static const unsigned features = (cpu_has_avx512_bf16() ? kFeatBf16 : 0) | (amx_bf16_usable() ? kFeatAmxBf16 : 0);
  return features;
}

// CPU features the act8 dispatch reads, as bits (so tests can hand it fake ones).
constexpr unsigned kFeatAvx2 = 1, kFeatAvxVnni = 2, kFeatVnni512 = 4;

// The act8 path a call runs for `rows` rows with these CPU features: 0 scalar; mode 1 256-bit (AVX-VNNI
// where the CPU has it, else AVX2); mode 5 the 256-bit VNNI code on AVX512-VL (tests reach it on CPUs
// without AVX-VNNI); other modes the widest the CPU has. Returns 0 scalar, 1 AVX2, 2 AVX-VNNI,
// 3 AVX512-VL VNNI, 4 AVX-512 VNNI.
int act8_path_for(int mode, int64_t rows, unsigned features) {
  if (mode == 0 || !(features & kFeatAvx2)) return 0;
  const bool narrow = mode == 1 || mode == 5;
  if (mode == 5 && (features & kFeatVnni512)) return 3;
  if (!narrow && (features & kFeatVnni512)) return 4;
  return features & kFeatAvxVnni ? 2 : 1;
}

unsigned act8_features() {
  static const unsigned features = (simd::cpu_has_avx2_fma() ? kFeatAvx2 : 0) | (cpu_has_avx_vnni() ? kFeatAvxVnni : 0) |
                                   (cpu_has_avx512_vnni() ? kFeatVnni512 : 0);
  return features;
}

void act8_run(int path, const Weights& w, const float* x, int64_t m, float* y, int threads) {
  const QuantX& qx = quantize_rows(x, m, w.k, path == 0 ? 0 : path >= 3 ? 512 : 256, threads);
  const bool nibble = act8_vectors(w.bits) == 4;
  switch (path) {
    case 0: act8_linear_scalar(w, qx, m, y, threads); break;
    case 1: nibble ? act8_avx2::linear<true>(w, qx, m, y, threads) : act8_avx2::linear<false>(w, qx, m, y, threads); break;
    case 2:
      nibble ? act8_avxvnni::linear<true>(w, qx, m, y, threads) : act8_avxvnni::linear<false>(w, qx, m, y, threads);
      break;
    case 3: nibble ? act8_vl::linear<true>(w, qx, m, y, threads) : act8_vl::linear<false>(w, qx, m, y, threads); break;
    default:
      if (nibble && w.mins) act8_linear_avx512<true, true>(w, qx, m, y, threads);
      else if (nibble) act8_linear_avx512<true, false>(w, qx, m, y, threads);
      else if (w.mins) act8_linear_avx512<false, true>(w, qx, m, y, threads);
      else act8_linear_avx512<false, false>(w, qx, m, y, threads);
  }
}

void act8_linear(const Weights& w, const float* x, int64_t m, float* y, int mode, int threads) {
  act8_run(act8_path_for(mode, m, act8_features()), w, x, m, y, threads);
}

// A mode bit that keeps a bf16 call off AMX tiles (the AVX512-BF16 kernel instead), so benchmarks and
// tests set the two against each other in one process.
constexpr int kModeNoAmx = 8;

}  // namespace

extern "C" {

int rq_has_avx2_fma(void) { return simd::cpu_has_avx2_fma(); }

int rq_has_avx512(void) { return simd::cpu_has_avx512(); }

int rq_has_avx512_vnni(void) { return cpu_has_avx512_vnni(); }

int rq_has_avx512_bf16(void) { return cpu_has_avx512_bf16(); }

int rq_has_avx_vnni(void) { return cpu_has_avx_vnni(); }

// The act8 path `rows` rows run in `mode` on this CPU, or with the given feature bits (kFeat*; tests
// fake them) when features >= 0.
int rq_act8_path(int mode, int64_t rows, int features) {
  return act8_path_for(mode, rows, features >= 0 ? static_cast<unsigned>(features) : act8_features());
}

// The bf16 path `rows` rows of k columns run in `mode` on this CPU, or with the given feature bits
// (kFeatBf16, kFeatAmxBf16; tests fake them) when features >= 0.
int rq_bf16_path(int mode, int64_t rows, int64_t k, int features) {
  return bf16_path_for(mode, rows, k, features >= 0 ? static_cast<unsigned>(features) : bf16_features());
}

// y[M, N] = x[M, K] @ W^T for an int8 weight without mins in row panels (see "int8 row panels" above):
// panels int8 [ceil(N / 16)][K / 2][16][2], scales float32 [ceil(N / 16)][K / 32][16] (rows past N
// zero). mode 0: the portable loop; otherwise AVX-512 VNNI where the CPU has it.
void rq_panel8_linear(const float* x, int64_t m, int64_t k, const int8_t* panels, const float* scales, int64_t n,
                      float* y, int mode, int threads) {
  static const bool vnni = cpu_has_avx512_vnni();
  static thread_local FixedX fixed;
  FixedX& f = fixed;  // the calling thread's, shared with the pool below
  fix_x(x, m, k, f);
  const int64_t count = (n + kPanel - 1) / kPanel;
  const bool vec = mode != 0 && vnni;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < count; ++p) {
    if (vec) {
      for (int64_t r = 0; r < m; r += 4) panel8_dispatch(panels, scales, f, r, std::min<int64_t>(4, m - r), k, n, p, y);
      continue;
    }
    float out[kPanel];
    for (int64_t r = 0; r < m; ++r) {
      panel8_scalar(panels, scales, f, r, k, p, out);
      for (int64_t j = 0; j < std::min(kPanel, n - p * kPanel); ++j) y[r * n + p * kPanel + j] = out[j];
    }
  }
}

// mode: 0 = scalar, 1 = AVX2 row-dot (decode), 2 = AVX2 panel GEMM, 3 = AVX-512 row-dot, 4 = bf16 panel
// GEMM; | kModeNoAmx keeps bf16 off AMX tiles. The caller picks (see linear_kernels.py), so tests reach
// every path on one machine; a CPU without AVX2+FMA always runs 0, one without AVX-512 runs 1 for 3, one
// without AVX512-BF16 runs 2 for 4. float32 panels (bits 32) have one kernel per SIMD width: 0 scalar,
// 1 AVX2, 2 or more the widest this CPU has; bf16 pair panels (bits 16) and u8 panels for int8
// activations (bits 4 or 8 | kAct8) one kernel for every mode but 0; quantized panels (bits 4 or 8 |
// kQuantPanels) 0 scalar, 1 256-bit, others the widest, all of them the same bits.
void rq_linear(const float* x, int64_t m, int64_t k, const uint8_t* q, const float* scales, const float* mins,
               int64_t n, int64_t group, int bits, float* y, int mode, int threads) {
  const Weights w{q, scales, mins, n, k, group, bits};
  static const bool avx2 = rq_has_avx2_fma();
  static const bool wide = rq_has_avx512();
  static const bool bf16 = cpu_has_avx512_bf16();
  if (bits & kAct8) {
    act8_linear(w, x, m, y, mode & ~kModeNoAmx, threads);
    return;
  }
  if (bits & kQuantPanels) {
    qp_linear(w, x, m, y, mode & ~kModeNoAmx, threads);
    return;
  }
  const unsigned bf16_feat = bf16_features() & (mode & kModeNoAmx ? ~kFeatAmxBf16 : ~0u);
  mode &= ~kModeNoAmx;
  if (bits == 16) {
    // The same bits at every row count (batch invariance); the scalar path where the CPU lacks bf16.
    switch (bf16_path_for(mode, m, k, bf16_feat)) {
      case 2: bf16_linear_amx(w, x, m, y, threads); break;
      case 1: bf16_linear_avx512(w, x, m, y, threads); break;
      default: bf16_linear_scalar(w, x, m, y, threads);
    }
  } else if (mode == 0 || !avx2) {
    if (bits == 32) f32_linear_scalar(w, x, m, y, threads);
    else linear_scalar(w, x, m, y, threads);
  } else if (bits == 32) {
    if (mode >= 2 && wide) f32_linear_avx512(w, x, m, y, threads);
    else f32_linear_avx2(w, x, m, y, threads);
  } else if (mode == 1 || mode == 3) {
    gemv_dispatch(w, x, m, y, threads, mode == 3 && wide);
  } else if (mode == 4 && bf16) {
    quant_bf16_gemm(w, x, m, y, threads, bf16_path_for(mode, m, k, bf16_feat) == 2);
  } else {
    gemm_avx2(w, x, m, y, threads);
  }
}

}  // extern "C"
