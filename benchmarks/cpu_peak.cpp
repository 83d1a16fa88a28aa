// This CPU's peak arithmetic rate per vector instruction set, the ceiling bench_linear_cpu.py holds the
// linear kernels against: fp32 FMA (vfmadd*ps), bf16 pair dot products (vdpbf16ps, AVX512-BF16) and
// int8 dot products (vpdpbusd, AVX512-VNNI; AVX-VNNI on ymm), each on zmm where the CPU has AVX-512, and
// on every CPU with AVX2 fp32 FMA on ymm and AVX2's int8 dot product (vpmaddubsw + vpmaddwd + vpaddd);
// on Sapphire Rapids and later the AMX tile products too (tdpbusd, tdpbf16ps).
//
// Each thread runs 16 (zmm) or 12 (ymm) independent accumulator chains held in registers (more chains
// than the instruction's latency times the ports that issue it, so none waits on its own result), on
// operands the compiler cannot fold, for `iters` rounds of one instruction per chain. The features are asked of
// the CPU at run time (`__builtin_cpu_supports`), and a path the CPU lacks returns -1 instead of
// running. Built and loaded by radixlm_runtime/kernels/native.py's load_library (-O3 -fopenmp, no
// -march: each path carries its own target attribute); benchmarks/cpu_peak.py calls it.

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// The paths, as cpu_peak.py numbers them.
enum Isa { FMA_YMM = 0, FMA_ZMM = 1, BF16_ZMM = 2, VNNI_ZMM = 3, VNNI_YMM = 4, INT8_AVX2 = 5, AMX_INT8 = 6, AMX_BF16 = 7 };

// Operands the compiler cannot see as constants (read once per call through a volatile).
volatile float g_seed = 1.0f;

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// AVX2 machines have 16 ymm registers: 12 chains and the two operands fit. AVX-512 ones have 32.
constexpr int kAccYmm = 12;
constexpr int kAccZmm = 16;

// A path: a function NAME(iters) with TARGET's features, its operands a and b made by SETUP, and the
// chains acc0, acc1, ... (REP names them: GCC moves an array of vectors between registers or to the
// stack inside the loop, named variables stay put) of type V, each set to INIT(i), stepped as OP(acc)
// `iters` times and read back as LANE(acc) (one lane each keeps every chain live).
#define CP_REP12(X, ...)                                                                                   \
  X(0, __VA_ARGS__) X(1, __VA_ARGS__) X(2, __VA_ARGS__) X(3, __VA_ARGS__) X(4, __VA_ARGS__) X(5, __VA_ARGS__) \
  X(6, __VA_ARGS__) X(7, __VA_ARGS__) X(8, __VA_ARGS__) X(9, __VA_ARGS__) X(10, __VA_ARGS__) X(11, __VA_ARGS__)
#define CP_REP16(X, ...) \
  CP_REP12(X, __VA_ARGS__) X(12, __VA_ARGS__) X(13, __VA_ARGS__) X(14, __VA_ARGS__) X(15, __VA_ARGS__)
#define CP_DECL(i, V, INIT, OP, LANE) V acc##i = INIT(i);
#define CP_STEP(i, V, INIT, OP, LANE) acc##i = OP(acc##i);
#define CP_SUM(i, V, INIT, OP, LANE) sum += LANE(acc##i);
#define CP_PATH(NAME, TARGET, REP, SETUP, V, INIT, OP, LANE) \
  __attribute__((target(TARGET))) double NAME(int64_t iters) { \
    SETUP                                                      \
    REP(CP_DECL, V, INIT, OP, LANE)                            \
    for (int64_t it = 0; it < iters; ++it) {                   \
      REP(CP_STEP, V, INIT, OP, LANE)                          \
    }                                                          \
    double sum = 0.0;                                          \
    REP(CP_SUM, V, INIT, OP, LANE)                             \
    return sum;                                                \
  }

#define CP_PS256(i) _mm256_set1_ps(static_cast<float>(i))
#define CP_PS512(i) _mm512_set1_ps(static_cast<float>(i))
#define CP_LANE_PS256(acc) _mm256_cvtss_f32(acc)
#define CP_LANE_PS512(acc) _mm512_cvtss_f32(acc)

#define CP_FMA_YMM_SETUP const __m256 a = _mm256_set1_ps(g_seed * 0.999f), b = _mm256_set1_ps(g_seed * 1e-7f);
#define CP_FMA_YMM(acc) _mm256_fmadd_ps(acc, a, b)
CP_PATH(fma_ymm, "avx2,fma", CP_REP12, CP_FMA_YMM_SETUP, __m256, CP_PS256, CP_FMA_YMM, CP_LANE_PS256)

#define CP_FMA_ZMM_SETUP const __m512 a = _mm512_set1_ps(g_seed * 0.999f), b = _mm512_set1_ps(g_seed * 1e-7f);
#define CP_FMA_ZMM(acc) _mm512_fmadd_ps(acc, a, b)
CP_PATH(fma_zmm, "avx512f,avx512bw,avx512vl,avx2,fma", CP_REP16, CP_FMA_ZMM_SETUP, __m512, CP_PS512, CP_FMA_ZMM,
        CP_LANE_PS512)

// 0x3f80 is bf16 1.0 (for the seed 1): each pair adds 2 to every lane, far from overflow here.
#define CP_BF16_SETUP                                                                                \
  const __m512i one = _mm512_set1_epi16(static_cast<short>(0x3f80 + static_cast<int>(g_seed) - 1)); \
  const __m512bh a = reinterpret_cast<__m512bh>(one), b = a;
#define CP_BF16_ZMM(acc) _mm512_dpbf16_ps(acc, a, b)
CP_PATH(bf16_zmm, "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma", CP_REP16, CP_BF16_SETUP, __m512, CP_PS512,
        CP_BF16_ZMM, CP_LANE_PS512)

// vpdpbusd through asm: with the intrinsic GCC copies every chain to another register each step.
#define CP_VNNI_ZMM_SETUP const __m512i a = _mm512_set1_epi8(static_cast<char>(g_seed)), b = a;
#define CP_VNNI_ZMM(acc) ({ asm("vpdpbusd %1, %2, %0" : "+v"(acc) : "v"(a), "v"(b)); acc; })
#define CP_EPI512(i) _mm512_set1_epi32(i)
#define CP_LANE_EPI512(acc) _mm512_reduce_add_epi32(acc)
CP_PATH(vnni_zmm, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma", CP_REP16, CP_VNNI_ZMM_SETUP, __m512i,
        CP_EPI512, CP_VNNI_ZMM, CP_LANE_EPI512)

#define CP_VNNI_YMM_SETUP const __m256i a = _mm256_set1_epi8(static_cast<char>(g_seed)), b = a;
#define CP_VNNI_YMM(acc) ({ asm("%{vex%} vpdpbusd %1, %2, %0" : "+x"(acc) : "x"(a), "x"(b)); acc; })
#define CP_EPI256(i) _mm256_set1_epi32(i)
#define CP_LANE_EPI256(acc) _mm_cvtsi128_si32(_mm256_castsi256_si128(acc))
CP_PATH(vnni_ymm, "avx2,fma,avxvnni", CP_REP12, CP_VNNI_YMM_SETUP, __m256i, CP_EPI256, CP_VNNI_YMM, CP_LANE_EPI256)

// AVX2's int8 dot product without VNNI (what the int8-activation kernels run there): vpmaddubsw (u8 x s8
// pairs summed to int16), vpmaddwd by ones (int16 pairs to int32), vpaddd into the chain; the same
// 64 operations per 32 bytes as a ymm vpdpbusd. One asm block a step, so nothing is hoisted.
#define CP_AVX2_INT8_SETUP                                                               \
  const __m256i a = _mm256_set1_epi8(static_cast<char>(g_seed)), b = a;                  \
  const __m256i ones = _mm256_set1_epi16(static_cast<short>(g_seed));
#define CP_AVX2_INT8(acc)                                                                        \
  ({                                                                                             \
    __m256i t;                                                                                   \
    asm("vpmaddubsw %2, %3, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0"                      \
        : "+x"(acc), "=&x"(t)                                                                    \
        : "x"(a), "x"(b), "x"(ones));                                                            \
    acc;                                                                                         \
  })
CP_PATH(int8_avx2, "avx2,fma", CP_REP12, CP_AVX2_INT8_SETUP, __m256i, CP_EPI256, CP_AVX2_INT8, CP_LANE_EPI256)

// AMX: four accumulator tiles (0-3) of 16 x 16 int32 or float32, each stepped every round by one tile
// product of two operand tiles (4-5 times 6-7), so no product waits on the one before it in its chain.
// A tdpbusd is 16 x 16 x 64 byte products, a tdpbf16ps 16 x 16 x 32 bf16 ones.
constexpr int kAmxChains = 4;

#define CP_AMX_PATH(NAME, TARGET, DP, ELEM)                                     \
  __attribute__((target(TARGET))) double NAME(int64_t iters) {                 \
    simd::load_tile_config(simd::TileConfig::whole());                           \
    alignas(64) uint8_t operand[16 * 64];                                        \
    for (auto& b : operand) b = static_cast<uint8_t>(g_seed) & 1;                \
    _tile_loadd(4, operand, 64);                                                 \
    _tile_loadd(5, operand, 64);                                                 \
    _tile_loadd(6, operand, 64);                                                 \
    _tile_loadd(7, operand, 64);                                                 \
    _tile_zero(0);                                                               \
    _tile_zero(1);                                                               \
    _tile_zero(2);                                                               \
    _tile_zero(3);                                                               \
    for (int64_t it = 0; it < iters; ++it) {                                     \
      DP(0, 4, 6);                                                               \
      DP(1, 4, 7);                                                               \
      DP(2, 5, 6);                                                               \
      DP(3, 5, 7);                                                               \
    }                                                                            \
    alignas(64) ELEM out[4][16 * 16];                                            \
    _tile_stored(0, out[0], 64);                                                 \
    _tile_stored(1, out[1], 64);                                                 \
    _tile_stored(2, out[2], 64);                                                 \
    _tile_stored(3, out[3], 64);                                                 \
    _tile_release();                                                             \
    return static_cast<double>(out[0][0]) + out[1][0] + out[2][0] + out[3][0];   \
  }

#define CP_TDPBUSD(c, a, b) _tile_dpbusd(c, a, b)
CP_AMX_PATH(amx_int8, "amx-tile,amx-int8", CP_TDPBUSD, int32_t)
// Operand bytes 0 or 1 make bf16 values of 0 or about 1e-38: the float sums stay far from overflow.
#define CP_TDPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
CP_AMX_PATH(amx_bf16, "amx-tile,amx-bf16", CP_TDPBF16PS, float)

// What one other instruction costs vpdpbusd zmm when it runs among them: the int8-activation kernels
// put a float epilogue (a multiply and one or two FMAs per 8 vpdpbusd), the int4 nibble split and the
// activations' broadcasts beside their dot products, and which of those share vpdpbusd's ports differs
// by CPU (on Zen 4 and Zen 5 vmulps and vfmadd do, at full cost). A round is the 16 chains of the VNNI
// path plus kMixOps instructions of kind OP, each on a chain of its own (so none waits on itself).
constexpr int kMixOps = 4;
enum Mix {
  MIX_NONE, MIX_MULPS, MIX_FMADDPS, MIX_ADDPS, MIX_CVTDQ2PS, MIX_PADDD, MIX_PANDD, MIX_PSRLW, MIX_BCAST,
  MIX_PSHUFD, MIX_BCAST128, MIX_COUNT
};

#define CP_MIX_DECL(i, ...) __m512i acc##i = _mm512_set1_epi32(i);
#define CP_MIX_STEP(i, ...) asm("vpdpbusd %1, %2, %0" : "+v"(acc##i) : "v"(a), "v"(b));
#define CP_MIX_SUM(i, ...) sum += _mm512_reduce_add_epi32(acc##i);

template <int OP>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))) inline void mix_op(__m512i& c, __m512i s,
                                                                                             const int* m) {
  if constexpr (OP == MIX_MULPS) asm volatile("vmulps %1, %0, %0" : "+v"(c) : "v"(s));
  if constexpr (OP == MIX_FMADDPS) asm volatile("vfmadd231ps %1, %1, %0" : "+v"(c) : "v"(s));
  if constexpr (OP == MIX_ADDPS) asm volatile("vaddps %1, %0, %0" : "+v"(c) : "v"(s));
  if constexpr (OP == MIX_CVTDQ2PS) asm volatile("vcvtdq2ps %0, %0" : "+v"(c));
  if constexpr (OP == MIX_PADDD) asm volatile("vpaddd %1, %0, %0" : "+v"(c) : "v"(s));
  if constexpr (OP == MIX_PANDD) asm volatile("vpandd %1, %0, %0" : "+v"(c) : "v"(s));
  if constexpr (OP == MIX_PSRLW) asm volatile("vpsrlw $4, %0, %0" : "+v"(c));
  if constexpr (OP == MIX_BCAST) asm volatile("vpbroadcastd %1, %0" : "=v"(c) : "m"(*m));
  if constexpr (OP == MIX_PSHUFD) asm volatile("vpshufd $0x55, %0, %0" : "+v"(c));
  if constexpr (OP == MIX_BCAST128) {
    asm volatile("vbroadcasti32x4 %1, %0" : "=v"(c) : "m"(*reinterpret_cast<const __m128i*>(m)));
  }
}

template <int OP>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))) double mix_run(int64_t iters) {
  CP_VNNI_ZMM_SETUP
  const __m512i s = _mm512_set1_epi32(static_cast<int>(g_seed));
  alignas(16) const int word[4] = {static_cast<int>(g_seed), 0, 0, 0};
  CP_REP16(CP_MIX_DECL)
  // Named, as the chains are (an array of vectors would go through the stack).
  __m512i c0 = s, c1 = s, c2 = s, c3 = s;
  static_assert(kMixOps == 4, "one named chain per companion instruction");
  for (int64_t it = 0; it < iters; ++it) {
    CP_REP16(CP_MIX_STEP)
    if constexpr (OP != MIX_NONE) {
      mix_op<OP>(c0, s, word);
      mix_op<OP>(c1, s, word);
      mix_op<OP>(c2, s, word);
      mix_op<OP>(c3, s, word);
    }
  }
  double sum = 0.0;
  CP_REP16(CP_MIX_SUM)
  for (const __m512i& v : {c0, c1, c2, c3}) sum += _mm512_reduce_add_epi32(v);
  return sum;
}

}  // namespace

extern "C" {

// Whether this CPU runs path `isa` (0 fma_ymm, 1 fma_zmm, 2 bf16_zmm, 3 vnni_zmm, 4 vnni_ymm, 5 int8_avx2,
// 6 amx_int8, 7 amx_bf16): AMX also needs the kernel's leave to use tile state.
int cpu_peak_supported(int isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case FMA_YMM: return avx2;
    case FMA_ZMM: return avx2 && has_avx512();
    case BF16_ZMM: return avx2 && has_avx512() && __builtin_cpu_supports("avx512bf16");
    case VNNI_ZMM: return avx2 && has_avx512() && __builtin_cpu_supports("avx512vnni");
    case VNNI_YMM: return avx2 && __builtin_cpu_supports("avxvnni");
    case INT8_AVX2: return avx2;
    case AMX_INT8: return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && simd::amx_tiles_permitted();
    case AMX_BF16: return simd::cpu_has_amx_bf16();
    default: return 0;
  }
}

// Independent chains per thread of path `isa`: one instruction each per round.
int cpu_peak_chains(int isa) {
  if (isa == AMX_INT8 || isa == AMX_BF16) return kAmxChains;
  return isa == FMA_YMM || isa == VNNI_YMM || isa == INT8_AVX2 ? kAccYmm : kAccZmm;
}

// Runs path `isa` on `threads` OpenMP threads, `iters` rounds each; returns the wall seconds of the
// parallel region and writes the threads that ran to *team; -1 where the CPU lacks the path.
double cpu_peak_run(int isa, int threads, int64_t iters, int* team) {
  *team = 0;
  if (!cpu_peak_supported(isa)) return -1.0;
  std::vector<double> sink(static_cast<size_t>(threads), 0.0);
  const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
#pragma omp single
    *team = omp_get_num_threads();
    double r = 0.0;
    switch (isa) {
      case FMA_YMM: r = fma_ymm(iters); break;
      case FMA_ZMM: r = fma_zmm(iters); break;
      case BF16_ZMM: r = bf16_zmm(iters); break;
      case VNNI_ZMM: r = vnni_zmm(iters); break;
      case VNNI_YMM: r = vnni_ymm(iters); break;
      case AMX_INT8: r = amx_int8(iters); break;
      case AMX_BF16: r = amx_bf16(iters); break;
      default: r = int8_avx2(iters); break;
    }
    sink[static_cast<size_t>(t)] = r;
  }
  const double seconds = omp_get_wtime() - start;
  volatile double keep = 0.0;
  for (double v : sink) keep = keep + v;
  (void)keep;
  return seconds;
}

// One thread's seconds for `iters` rounds of 16 vpdpbusd zmm and kMixOps instructions of kind `op`
// (0 none, 1 vmulps, 2 vfmadd231ps, 3 vaddps, 4 vcvtdq2ps, 5 vpaddd, 6 vpandd, 7 vpsrlw, 8 vpbroadcastd
// from memory, 9 vpshufd, 10 vbroadcasti32x4 from memory; all zmm); -1 where the CPU lacks
// AVX512-VNNI or `op` is out of range.
double cpu_peak_mix(int op, int64_t iters) {
  static constexpr double (*kRuns[MIX_COUNT])(int64_t) = {
      mix_run<MIX_NONE>,   mix_run<MIX_MULPS>, mix_run<MIX_FMADDPS>, mix_run<MIX_ADDPS>,
      mix_run<MIX_CVTDQ2PS>, mix_run<MIX_PADDD>, mix_run<MIX_PANDD>,   mix_run<MIX_PSRLW>,
      mix_run<MIX_BCAST>,  mix_run<MIX_PSHUFD>, mix_run<MIX_BCAST128>};
  if (!cpu_peak_supported(VNNI_ZMM) || op < 0 || op >= MIX_COUNT) return -1.0;
  const double start = omp_get_wtime();
  volatile double keep = kRuns[op](iters);
  (void)keep;
  return omp_get_wtime() - start;
}

}  // extern "C"
