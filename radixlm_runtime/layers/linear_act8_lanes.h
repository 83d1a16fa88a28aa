// The int8-activation kernel of linear_cpu.cpp (see "int8 activations" there) on 256-bit vectors,
// written once over the integer dot product: linear_cpu.cpp includes it three times, each inside its
// own namespace with ACT8_TARGET the matching target attribute and D the dot product:
//   act8_avx2:    vpmaddubsw + vpmaddwd (AVX2 CPUs without VNNI);
//   act8_avxvnni: VEX vpdpbusd (AVX-VNNI, on AVX2 CPUs that have it);
//   act8_vl:      EVEX vpdpbusd on 256 bits (AVX512-VL), which runs the AVX-VNNI code's arithmetic on
//                 CPUs with AVX512-VNNI, so the tests check it where AVX-VNNI itself is absent.
// D::dot<INT8>(acc, u, x) adds, per 32-bit lane, the 4 products of the codes u and activations x: for
// int8 weights (u = q + 128) either u * x (D::kSumsUnsigned: the kernel subtracts 128 * sum(x) per chunk,
// as the 512-bit kernel does) or q * x directly (vpmaddubsw would saturate on u * x). Either way every
// chunk's integer sum is the 512-bit kernel's, and the float operations after it are the same lane by
// lane: the same bits.

// MR rows of x times panel p (two halves of 8 output rows).
template <int MR, bool NIBBLE, bool MINS>
ACT8_TARGET void micro(const Weights& w, const QuantX& qx, int64_t r0, int64_t p, float* c, int64_t valid) {
  constexpr int64_t kVectors = NIBBLE ? 4 : 8;
  const int64_t chunks = w.k / kChunk;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 out[MR][2];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) out[i][0] = out[i][1] = _mm256_setzero_ps();
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint8_t* b = w.q + (p * chunks + ch) * kVectors * 64;
    __m256i acc[MR][2];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t h = 0; h < 4; ++h) {
      __m256i lo[2], hi[2];
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + h * 64 + half * 32));
        if constexpr (NIBBLE) {
          lo[half] = _mm256_and_si256(v, low4);
          hi[half] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        } else {
          lo[half] = v;
          hi[half] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (h + 4) * 64 + half * 32));
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const int8_t* xr = qx.codes(r0 + i, ch);
        const __m256i xl = _mm256_set1_epi32(quad(xr + 4 * h)), xh = _mm256_set1_epi32(quad(xr + 16 + 4 * h));
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          acc[i][half] = D::template dot<!NIBBLE>(acc[i][half], lo[half], xl);
          acc[i][half] = D::template dot<!NIBBLE>(acc[i][half], hi[half], xh);
        }
      }
    }
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const int64_t f = (p * chunks + ch) * kPanel + half * 8;
      const __m256 sc = _mm256_loadu_ps(w.scales + f);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const int64_t s = qx.at(r0 + i, ch);
        __m256i sum = acc[i][half];
        if constexpr (!NIBBLE && D::kSumsUnsigned) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * qx.isum[s]));
        const __m256 scaled = _mm256_mul_ps(sc, _mm256_set1_ps(qx.dx[s]));
        out[i][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scaled, out[i][half]);
        if constexpr (MINS) {
          out[i][half] = _mm256_fmadd_ps(_mm256_loadu_ps(w.mins + f), _mm256_set1_ps(qx.dxs[s]), out[i][half]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) store_row(c + i * w.n, out[i][0], out[i][1], valid);
}

template <bool NIBBLE, bool MINS>
ACT8_TARGET void linear_mins(const Weights& w, const QuantX& qx, int64_t m, float* y, int threads) {
  for_panel_share(w, threads, 1, [&](int64_t p, int64_t) {
    const int64_t valid = valid_columns(w, p);
    int64_t r = 0;
    for (; r + 2 <= m; r += 2) micro<2, NIBBLE, MINS>(w, qx, r, p, y + r * w.n + p * kPanel, valid);
    if (r < m) micro<1, NIBBLE, MINS>(w, qx, r, p, y + r * w.n + p * kPanel, valid);
  });
}

// Weights without mins (symmetric) skip the min's fma, as the other paths do.
template <bool NIBBLE>
ACT8_TARGET void linear(const Weights& w, const QuantX& qx, int64_t m, float* y, int threads) {
  if (w.mins) linear_mins<NIBBLE, true>(w, qx, m, y, threads);
  else linear_mins<NIBBLE, false>(w, qx, m, y, threads);
}
