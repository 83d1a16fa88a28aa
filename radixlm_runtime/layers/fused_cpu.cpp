// Fused elementwise ops of the decoder layer for CPUs, float32: RMSNorm with the residual add,
// per-head RMSNorm of q and k in place (Qwen3, Gemma 3), rotary embedding of q and k in place,
// SiLU-and-mul and GELU(tanh)-and-mul.
//
// In torch each of these is 3-10 passes over the activations and as many op dispatches; at decode
// (one row per request) the dispatches, not the arithmetic, are the cost. Each op here is one pass
// and one call. An AVX2+FMA path is picked at run time by asking the CPU, with a portable scalar path
// beside it; `mode` 0 forces the scalar path so tests reach both on one machine.
//
// Rows are independent, so large calls split rows across OpenMP threads; small ones (decode) stay on
// the calling thread, where waking a pool would cost more than the work.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

namespace {

using simd::exp_avx2;
using simd::hsum;

// Below this many floats a call runs on one thread.
constexpr int64_t kParallelMin = 1 << 15;

int pick_threads(int64_t work, int threads) { return work >= kParallelMin ? threads : 1; }

// ---------------------------------------------------------------- scalar

void rms_norm_row_scalar(const float* x, float* residual, const float* w, float* out, int64_t h, float eps) {
  const float* src = x;
  if (residual) {
    for (int64_t i = 0; i < h; ++i) residual[i] += x[i];
    src = residual;
  }
  float ss = 0.0f;
  for (int64_t i = 0; i < h; ++i) ss += src[i] * src[i];
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = w[i] * (src[i] * scale);
}

void rope_row_scalar(float* x, const float* cos, const float* sin, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * d;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

void silu_mul_row_scalar(const float* gate_up, float* out, int64_t inter) {
  const float* up = gate_up + inter;
  for (int64_t i = 0; i < inter; ++i) {
    const float g = gate_up[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): the
// sigmoid form needs one exp and, unlike 1 + tanh, does not cancel for negative g.
constexpr float kGeluTwoBeta = 2.0f * 0.7978845608028654f, kGeluKappa = 0.044715f;

inline float gelu_tanh(float g) { return g / (1.0f + expf(-kGeluTwoBeta * (g + kGeluKappa * (g * g * g)))); }

void gelu_tanh_mul_row_scalar(const float* gate_up, float* out, int64_t inter) {
  const float* up = gate_up + inter;
  for (int64_t i = 0; i < inter; ++i) out[i] = gelu_tanh(gate_up[i]) * up[i];
}

// ---------------------------------------------------------------- AVX2 + FMA

SIMD_AVX2 void rms_norm_row_avx2(const float* x, float* residual, const float* w, float* out, int64_t h, float eps) {
  const float* src = x;
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  if (residual) {
    for (; i + 8 <= h; i += 8) {
      const __m256 r = _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(x + i));
      _mm256_storeu_ps(residual + i, r);
      acc = _mm256_fmadd_ps(r, r, acc);
    }
    for (int64_t j = i; j < h; ++j) residual[j] += x[j];
    src = residual;
  } else {
    for (; i + 8 <= h; i += 8) {
      const __m256 r = _mm256_loadu_ps(x + i);
      acc = _mm256_fmadd_ps(r, r, acc);
    }
  }
  float ss = hsum(acc);
  for (int64_t j = i; j < h; ++j) ss += src[j] * src[j];
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(h) + eps);
  const __m256 vs = _mm256_set1_ps(scale);
  for (i = 0; i + 8 <= h; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + i), vs);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), v));
  }
  for (; i < h; ++i) out[i] = w[i] * (src[i] * scale);
}

SIMD_AVX2 void rope_row_avx2(float* x, const float* cos, const float* sin, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * d;
    float* x2 = x1 + half;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
      const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
      _mm256_storeu_ps(x1 + i, _mm256_fnmadd_ps(b, s, _mm256_mul_ps(a, c)));
      _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(a, s, _mm256_mul_ps(b, c)));
    }
    for (; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

SIMD_AVX2 void silu_mul_row_avx2(const float* gate_up, float* out, int64_t inter) {
  const float* up = gate_up + inter;
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= inter; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate_up + i);
    const __m256 denom = _mm256_add_ps(one, exp_avx2(_mm256_xor_ps(g, sign)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, denom), _mm256_loadu_ps(up + i)));
  }
  for (; i < inter; ++i) {
    const float g = gate_up[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

SIMD_AVX2 void gelu_tanh_mul_row_avx2(const float* gate_up, float* out, int64_t inter) {
  const float* up = gate_up + inter;
  const __m256 one = _mm256_set1_ps(1.0f), minus_two_beta = _mm256_set1_ps(-kGeluTwoBeta);
  const __m256 kappa = _mm256_set1_ps(kGeluKappa);
  int64_t i = 0;
  for (; i + 8 <= inter; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate_up + i);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 minus_two_u = _mm256_mul_ps(minus_two_beta, _mm256_fmadd_ps(kappa, cube, g));
    const __m256 denom = _mm256_add_ps(one, exp_avx2(minus_two_u));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, denom), _mm256_loadu_ps(up + i)));
  }
  for (; i < inter; ++i) out[i] = gelu_tanh(gate_up[i]) * up[i];
}

// The gated activations by rf_gated_act's `act`.
enum Activation : int { kSilu = 0, kGeluTanh = 1 };

}  // namespace

extern "C" {

int rf_has_avx2_fma(void) { return simd::cpu_has_avx2_fma(); }

// out[r] = weight * rms_norm(x[r] (+ residual[r])); with residual non-null, residual[r] += x[r] first
// (the residual stream, updated in place). Row strides are in floats.
void rf_rms_norm(const float* x, int64_t x_stride, float* residual, const float* weight, float* out,
                 int64_t rows, int64_t hidden, float eps, int mode, int threads) {
  const bool vec = simd::use_avx2(mode);
#pragma omp parallel for schedule(static) num_threads(pick_threads(rows * hidden, threads))
  for (int64_t r = 0; r < rows; ++r) {
    float* res = residual ? residual + r * hidden : nullptr;
    if (vec) {
      rms_norm_row_avx2(x + r * x_stride, res, weight, out + r * hidden, hidden, eps);
    } else {
      rms_norm_row_scalar(x + r * x_stride, res, weight, out + r * hidden, hidden, eps);
    }
  }
}

// RMSNorm in place over each head (of `head_dim`) of each row of x: the first q_heads heads with
// q_weight, the next kv_heads with k_weight (q and k of a fused projection's output, before rotary).
void rf_head_rms_norm(float* x, int64_t x_stride, int64_t rows, int64_t q_heads, int64_t kv_heads,
                      int64_t head_dim, const float* q_weight, const float* k_weight, float eps, int mode,
                      int threads) {
  const bool vec = simd::use_avx2(mode);
  const int64_t heads = q_heads + kv_heads;
#pragma omp parallel for schedule(static) num_threads(pick_threads(rows * heads * head_dim, threads))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      float* head = x + r * x_stride + h * head_dim;
      const float* w = h < q_heads ? q_weight : k_weight;
      if (vec) {
        rms_norm_row_avx2(head, nullptr, w, head, head_dim, eps);
      } else {
        rms_norm_row_scalar(head, nullptr, w, head, head_dim, eps);
      }
    }
  }
}

// Rotates the first `heads` heads (of `head_dim`) of each row of x in place, neox style (the two
// halves of a head are the pairs). cos and sin are [rows, head_dim / 2], row r's position's entries.
void rf_rope(float* x, int64_t x_stride, const float* cos, const float* sin, int64_t rows, int64_t heads,
             int64_t head_dim, int mode, int threads) {
  const bool vec = simd::use_avx2(mode);
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(pick_threads(rows * heads * head_dim, threads))
  for (int64_t r = 0; r < rows; ++r) {
    if (vec) {
      rope_row_avx2(x + r * x_stride, cos + r * half, sin + r * half, heads, head_dim);
    } else {
      rope_row_scalar(x + r * x_stride, cos + r * half, sin + r * half, heads, head_dim);
    }
  }
}

// out[r, i] = act(gate_up[r, i]) * gate_up[r, inter + i]; gate_up is [rows, 2 * inter]; act 0 SiLU,
// 1 GELU with the tanh approximation.
void rf_gated_act(const float* gate_up, float* out, int64_t rows, int64_t inter, int act, int mode, int threads) {
  const bool vec = simd::use_avx2(mode);
  using Row = void (*)(const float*, float*, int64_t);
  const Row row = act == kGeluTanh ? (vec ? gelu_tanh_mul_row_avx2 : gelu_tanh_mul_row_scalar)
                                   : (vec ? silu_mul_row_avx2 : silu_mul_row_scalar);
#pragma omp parallel for schedule(static) num_threads(pick_threads(rows * inter, threads))
  for (int64_t r = 0; r < rows; ++r) row(gate_up + r * 2 * inter, out + r * inter, inter);
}

}  // extern "C"
