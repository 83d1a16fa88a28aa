// SIMD helpers shared by the C++ CPU kernels (layers/linear_cpu.cpp, layers/fused_cpu.cpp,
// attention/cpu_attention.cpp, and benchmarks/cpu_peak.cpp): CPU feature checks, bf16 rounding and
// widening, AVX2 and AVX-512 exp and tanh, a 16 x 16 transpose, AMX tile set-up. kernels/native.py
// compiles each kernel with this folder on the include path and hashes this header into every library's
// cache key, so editing it rebuilds them all.

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

// The target attributes of the SIMD paths, beside the run-time checks for exactly those features. Each
// wider one is a superset of the narrower (F16C included: cpu_has_avx2_fma checks it), so the narrower
// paths' helpers inline into it.
#define SIMD_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SIMD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define SIMD_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#define SIMD_AMX_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")))

namespace simd {

// Whether this CPU runs the AVX2+FMA paths (F16C beside, which every AVX2 CPU has): asked of the CPU
// at run time, never assumed.
inline bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// Whether this CPU runs the AVX-512 paths (F, BW, VL on top of AVX2+FMA).
inline bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// Whether this CPU has bf16 dot products (AVX512-BF16's vdpbf16ps) on top of AVX-512.
inline bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// An AMX tile configuration (palette 1): the rows and bytes per row of each of the 8 tiles, 0 for unused.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  // All 8 tiles whole: 16 rows of 64 bytes.
  static TileConfig whole() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    return cfg;
  }
};

// Whether the kernel lets this process use AMX tile state (Linux asks for it: arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA). Asked once.
inline bool amx_tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Whether this process can run AMX-BF16 tile products: the CPU has them (and AVX512-BF16 beside, which
// every AMX-BF16 CPU has and the kernels' vector parts use) and the kernel permits the tile state.
inline bool cpu_has_amx_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512_bf16() && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         amx_tiles_permitted();
}

// Configures this thread's tiles as `cfg` says. GCC 12 does not see ldtilecfg read its operand and
// drops the stores that filled it (a configuration of stack garbage, or a fault): the asm makes them
// land first.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Whether a kernel call runs its AVX2 path: asked for (`mode` != 0; tests force 0 to reach the
// portable path) and the CPU has it (asked once).
inline bool use_avx2(int mode) {
  static const bool has = cpu_has_avx2_fma();
  return mode != 0 && has;
}

// bf16 (a float32's upper 16 bits) from float32, rounding to nearest even as torch's .to(torch.bfloat16)
// does; a NaN stays a quiet NaN.
inline uint16_t bf16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

// float32 from bf16: exact, a 16-bit shift.
inline float bf16_widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// bf16_round on 16 lanes: each lane's bf16 in its low 16 bits, the same bits (not vcvtneps2bf16's,
// which flushes denormals).
SIMD_AVX512 inline __m512i bf16_round_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

// Transposes 16 rows of 16 32-bit elements in place: r[i][j] becomes r[j][i].
SIMD_AVX512 inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // Per group of four rows, u_j's 128-bit lane L holds column 4L + j of the group's rows.
  for (int g = 0; g < 4; ++g) {
    __m512i* u = r + 4 * g;
    const __m512i* v = t + 4 * g;
    u[0] = _mm512_unpacklo_epi64(v[0], v[2]);
    u[1] = _mm512_unpackhi_epi64(v[0], v[2]);
    u[2] = _mm512_unpacklo_epi64(v[1], v[3]);
    u[3] = _mm512_unpackhi_epi64(v[1], v[3]);
  }
  // Column 4L + j gathers lane L of u_j from the four groups.
  for (int j = 0; j < 4; ++j) {
    const __m512i x01 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), y01 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i x23 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i y23 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_i32x4(x01, x23, 0x88);       // lane 0
    t[8 + j] = _mm512_shuffle_i32x4(x01, x23, 0xdd);   // lane 2
    t[4 + j] = _mm512_shuffle_i32x4(y01, y23, 0x88);   // lane 1
    t[12 + j] = _mm512_shuffle_i32x4(y01, y23, 0xdd);  // lane 3
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

SIMD_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Cephes' expf, shared by both widths so that they give the same bits: inputs clamped to
// [kExpMin, kExpMax], x = n ln 2 + r with ln 2 split in two (kExpLn2Hi + kExpLn2Lo), e^r a degree-5
// polynomial (kExpPoly, highest power first) times r^2 plus 1 + r.
constexpr float kExpMin = -87.3f, kExpMax = 88.3f, kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for float32 lanes, within 2 ulp of expf.
SIMD_AVX2 inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kExpLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kExpLn2Lo), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// exp_avx2 on 16 lanes: the same operations, so the same bits per lane.
SIMD_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kExpLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kExpLn2Lo), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// tanh(x) = 1 - 2 / (exp(2x) + 1) for float32 lanes, within 2e-7 of tanh absolutely (not relatively:
// near 0 the subtraction cancels, which attention's soft-cap, a shift-invariant softmax's input, does not
// mind). exp clamps its input, so large |x| give exactly +-1 instead of inf / inf. Both widths run the
// same operations, so they give the same bits.
SIMD_AVX2 inline __m256 tanh_avx2(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_avx2(_mm256_add_ps(x, x));
  return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
}

SIMD_AVX512 inline __m512 tanh_avx512(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp_avx512(_mm512_add_ps(x, x));
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
}

// Twelve copies of an instruction, one per chain register a0 .. a11 (its sources in INSN), each named
// with operand modifier M ("": the zmm; "t": its ymm half).
#define SIMD_CHAINS12(INSN, M)                                                                            \
  INSN "%" M "[a0]\n\t" INSN "%" M "[a1]\n\t" INSN "%" M "[a2]\n\t" INSN "%" M "[a3]\n\t" INSN "%" M     \
       "[a4]\n\t" INSN "%" M "[a5]\n\t" INSN "%" M "[a6]\n\t" INSN "%" M "[a7]\n\t" INSN "%" M "[a8]\n\t" \
       INSN "%" M "[a9]\n\t" INSN "%" M "[a10]\n\t" INSN "%" M "[a11]"
#define SIMD_CHAIN_REGS                                                                                     \
  [a0] "+v"(a0), [a1] "+v"(a1), [a2] "+v"(a2), [a3] "+v"(a3), [a4] "+v"(a4), [a5] "+v"(a5), [a6] "+v"(a6), \
      [a7] "+v"(a7), [a8] "+v"(a8), [a9] "+v"(a9), [a10] "+v"(a10), [a11] "+v"(a11)

// What time_chains times: vfmadd231ps on zmm, vdpbf16ps on zmm, vfmadd231ps on ymm.
enum class Chains { kFmaZmm, kBf16Zmm, kFmaYmm };

// Seconds for `iters` rounds of 12 independent chains of `kind`, one thread (asm: each chain stays in its
// register and every instruction runs; the ymm chains are the zmm registers' lower halves). Compiled for
// AVX-512 alone: the FMA chains also run on AVX-512 CPUs without BF16 (fma_zmm_over_ymm), and vdpbf16ps
// exists only in the asm of the kBf16Zmm branch, which only bf16_dot_over_fma runs, on CPUs that have it.
SIMD_AVX512 inline double time_chains(Chains kind, int64_t iters) {
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-7f);
  const __m512i p = _mm512_set1_epi16(0x3580);  // bf16 pairs of 2^-20: no overflow
  __m512 a0 = y, a1 = y, a2 = y, a3 = y, a4 = y, a5 = y, a6 = y, a7 = y, a8 = y, a9 = y, a10 = y, a11 = y;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    if (kind == Chains::kBf16Zmm) {
      asm volatile(SIMD_CHAINS12("vdpbf16ps %[p], %[p], ", "") : SIMD_CHAIN_REGS : [p] "v"(p));
    } else if (kind == Chains::kFmaYmm) {
      asm volatile(SIMD_CHAINS12("vfmadd231ps %t[x], %t[y], ", "t")
                   : SIMD_CHAIN_REGS
                   : [x] "v"(x), [y] "v"(y));
    } else {
      asm volatile(SIMD_CHAINS12("vfmadd231ps %[x], %[y], ", "") : SIMD_CHAIN_REGS : [x] "v"(x), [y] "v"(y));
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Best seconds of chains `a` over chains `b`, alternating three rounds each (the first also wakes the
// AVX-512 units): about a millisecond.
inline double chains_time_ratio(Chains a, Chains b) {
  constexpr int64_t kIters = 1 << 14;
  double ta = 1e30, tb = 1e30;
  for (int round = 0; round < 3; ++round) {
    ta = std::min(ta, time_chains(a, kIters));
    tb = std::min(tb, time_chains(b, kIters));
  }
  return ta / tb;
}

// vdpbf16ps's flop rate over float32 FMAs' on this CPU (two products a lane against one), timed once:
// CPUs with AVX512-BF16 differ by 4x here (a Zen 4 issues it as fast as an FMA: 2x; a Sapphire Rapids
// Xeon at a quarter of that: 0.5x), so whether bf16 dot products pay is measured, not assumed. 0 where
// the CPU lacks them.
inline double bf16_dot_over_fma() {
  static const double ratio =
      cpu_has_avx512_bf16() ? 2.0 * chains_time_ratio(Chains::kFmaZmm, Chains::kBf16Zmm) : 0.0;
  return ratio;
}

// Float32 FMA flops on zmm over ymm on this CPU, timed once: about 1 where 512-bit FMAs issue as two
// 256-bit halves (Zen 4), 2 where the units are full width (Zen 5, the Xeons). There float32 arithmetic
// doubles on zmm while the bf16 paths' layout work does not, and a part-empty zmm still beats two ymm.
// 0 without AVX-512.
inline double fma_zmm_over_ymm() {
  static const double ratio = cpu_has_avx512() ? 2.0 * chains_time_ratio(Chains::kFmaYmm, Chains::kFmaZmm) : 0.0;
  return ratio;
}

// From this zmm / ymm FMA ratio on, a CPU's 512-bit units count as full width (between Zen 4's 1 and the
// 2 of Zen 5 and the Xeons).
constexpr double kFullWidthFmaRatio = 1.5;

inline bool full_width_zmm() {
  static const bool wide = fma_zmm_over_ymm() >= kFullWidthFmaRatio;
  return wide;
}

}  // namespace simd
