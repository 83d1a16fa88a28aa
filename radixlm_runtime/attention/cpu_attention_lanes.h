// The rows-as-lanes prefill path of cpu_attention.cpp, written once over a vector type: that file
// includes it twice, inside namespace lanes16 (V = 16-float AVX-512 vectors) and lanes8 (V = 8-float
// AVX2 vectors), with LANES_TARGET the matching target attribute. V gives Reg, Mask, kLanes (query rows
// per vector), kTile (keys, or head elements, per register-tile row: 8 x 3 zmm or 4 x 3 ymm
// accumulators, within the 32 or 16 registers) and the few operations below.
//
// A prefill chunk's R = tokens x G query rows are the lanes of V vectors ("panels"), its queries
// transposed once into qt [D][lanes]. Scores come out transposed, S^T = K . Q^T, by broadcasting each
// key's elements straight from the pool row against up to 3 panels: no horizontal sums, and the online
// softmax's max, exp and sum run vertically, one vector per key for kLanes rows at once. P.V is
// acc^T [D][lanes] += V[key][e] x P^T[key], V elements broadcast the same way; or, on items of up to
// kTilePanels panels, acc [lanes][D] += P[row][key] x V[key] with the head elements as lanes (rows_pv),
// the same bits.

// Panels per register tile.
constexpr int kTilePanels = 3;

// A register tile of S^T: kTile keys x NP panels of accumulators, zeroed; stored as rows t0 .. of st.
template <int NP>
LANES_TARGET inline void zero_tile(typename V::Reg (&acc)[V::kTile][NP]) {
#pragma GCC unroll 8
  for (int j = 0; j < V::kTile; ++j) {
#pragma GCC unroll 4
    for (int c = 0; c < NP; ++c) acc[j][c] = V::zero();
  }
}

template <int NP>
LANES_TARGET inline void store_tile(const typename V::Reg (&acc)[V::kTile][NP], float* st, int64_t lanes) {
#pragma GCC unroll 8
  for (int j = 0; j < V::kTile; ++j) {
#pragma GCC unroll 4
    for (int c = 0; c < NP; ++c) V::store(st + j * lanes + c * V::kLanes, acc[j][c]);
  }
}

// The register tile of rows src[j * lanes ..] (a P.V accumulator's kTile head elements), each lane
// rescaled by its online-softmax correction corr[lane].
template <int NP>
LANES_TARGET inline void load_tile(typename V::Reg (&acc)[V::kTile][NP], const float* src, int64_t lanes,
                                   const float* corr) {
  typename V::Reg cv[NP];
#pragma GCC unroll 4
  for (int c = 0; c < NP; ++c) cv[c] = V::load(corr + c * V::kLanes);
#pragma GCC unroll 8
  for (int j = 0; j < V::kTile; ++j) {
#pragma GCC unroll 4
    for (int c = 0; c < NP; ++c) acc[j][c] = V::mul(V::load(src + j * lanes + c * V::kLanes), cv[c]);
  }
}

// S^T rows (keys t of kp[0 .. keys), keys a multiple of kTile) for NP panels: st[t][c * kLanes ..] =
// sum over e of K[t][e] * qt[e][c * kLanes ..]. qt and st rows are `lanes` floats apart.
template <int NP>
LANES_TARGET void lanes_scores(const float* qt, int64_t lanes, const float* const* kp, int64_t d, int64_t keys,
                               float* st, Prefetcher& pf) {
  constexpr int kt = V::kTile;
  for (int64_t t0 = 0; t0 < keys; t0 += kt) {
    pf.step(kPrefetchStep);
    typename V::Reg acc[kt][NP];
    zero_tile<NP>(acc);
    for (int64_t e = 0; e < d; ++e) {
      typename V::Reg qv[NP];
#pragma GCC unroll 4
      for (int c = 0; c < NP; ++c) qv[c] = V::load(qt + e * lanes + c * V::kLanes);
#pragma GCC unroll 8
      for (int j = 0; j < kt; ++j) {
        const typename V::Reg kb = V::set1(kp[t0 + j][e]);
#pragma GCC unroll 4
        for (int c = 0; c < NP; ++c) acc[j][c] = V::fmadd(kb, qv[c], acc[j][c]);
      }
    }
    store_tile<NP>(acc, st + t0 * lanes, lanes);
  }
}

// lanes_scores over a bf16 pool on path 3 (AVX512-BF16): two head elements per instruction, vdpbf16ps
// taking each lane's query pair from qp ([D / 2][lanes] pairs of bf16, rows `lanes` apart) and key t's
// pair broadcast straight from its bf16 row kb[t] in the pool (no widening). Each score is one chain of
// pair dot products over D in order, in every lane alike: batch-invariant, and the same bits on either
// width. The products are exact (bf16 x bf16), the rounding of the sums vdpbf16ps's own (Intel's
// pseudo-code rounds after each product, flushing denormals; CPUs differ), so the scores agree with the
// float32 kernels' on the same bf16 operands within float32 rounding, not to the bit.
template <int NP>
SIMD_BF16 void lanes_scores_pairs(const uint32_t* qp, int64_t lanes, const uint16_t* const* kb, int64_t d,
                                  int64_t keys, float* st, Prefetcher& pf) {
  constexpr int kt = V::kTile;
  for (int64_t t0 = 0; t0 < keys; t0 += kt) {
    pf.step(kPrefetchStep);
    typename V::Reg acc[kt][NP];
    zero_tile<NP>(acc);
    for (int64_t e = 0; e < d / 2; ++e) {
      typename V::Reg qv[NP];
#pragma GCC unroll 4
      for (int c = 0; c < NP; ++c) qv[c] = V::load(reinterpret_cast<const float*>(qp + e * lanes + c * V::kLanes));
#pragma GCC unroll 8
      for (int j = 0; j < kt; ++j) {
        uint32_t pair;
        memcpy(&pair, kb[t0 + j] + 2 * e, 4);
        const typename V::Reg kv = V::set1_pair(pair);
#pragma GCC unroll 4
        for (int c = 0; c < NP; ++c) acc[j][c] = V::dot_pairs(acc[j][c], qv[c], kv);
      }
    }
    store_tile<NP>(acc, st + t0 * lanes, lanes);
  }
}

// acc^T [D][lanes] of NP panels = acc^T * corr + sum over keys t of V[t] x P^T[t] (pt rows `lanes`
// floats apart), kTile head elements at a time: per key kTile V broadcasts feed kTile x NP FMAs.
template <int NP>
LANES_TARGET void lanes_pv(const float* pt, int64_t lanes, const float* const* vp, int64_t d, int64_t keys,
                           float* acct, const float* corr, Prefetcher& pf) {
  constexpr int kt = V::kTile;
  for (int64_t e0 = 0; e0 < d; e0 += kt) {
    typename V::Reg a[kt][NP];
    load_tile<NP>(a, acct + e0 * lanes, lanes, corr);
    for (int64_t t = 0; t < keys; ++t) {
      pf.step(1);
      typename V::Reg pv[NP];
#pragma GCC unroll 4
      for (int c = 0; c < NP; ++c) pv[c] = V::load(pt + t * lanes + c * V::kLanes);
#pragma GCC unroll 8
      for (int j = 0; j < kt; ++j) {
        const typename V::Reg vb = V::set1(vp[t][e0 + j]);
#pragma GCC unroll 4
        for (int c = 0; c < NP; ++c) a[j][c] = V::fmadd(vb, pv[c], a[j][c]);
      }
    }
    store_tile<NP>(a, acct + e0 * lanes, lanes);
  }
}

// lanes_pv with the head elements as the lanes instead: acc [lanes][D] (row r's accumulators at acc +
// r * d), R rows x E vectors of D a register tile, each of the rows' weights of key t broadcast against E
// vectors of V[t]. lanes_pv broadcasts one V element per NP FMAs (one panel: per FMA, its rows past the
// item's computed too); this one weight per E FMAs, the item's rows only. Each element is lanes_pv's
// chain: acc x corr, then fma(weight, V, acc) over the keys in order (the same products, the same
// roundings): the same bits. On a Zen 5, 2 to 5 tokens of the default model (one panel) 1.2-1.4x the
// item's time, 8 to 16 tokens (2-3 panels) 1.0-1.1x.
template <int R, int E>
LANES_TARGET void rows_pv_tile(const float* pt, int64_t lanes, const float* const* vp, int64_t keys, float* acc,
                               int64_t d, int64_t r0, int64_t e0, const float* corr) {
  constexpr int64_t kl = V::kLanes;
  typename V::Reg a[R][E];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const typename V::Reg c = V::set1(corr[r0 + r]);
#pragma GCC unroll 4
    for (int e = 0; e < E; ++e) a[r][e] = V::mul(V::load(acc + (r0 + r) * d + e0 + e * kl), c);
  }
  for (int64_t t = 0; t < keys; ++t) {
    typename V::Reg v[E];
#pragma GCC unroll 4
    for (int e = 0; e < E; ++e) v[e] = V::load(vp[t] + e0 + e * kl);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const typename V::Reg w = V::set1(pt[t * lanes + r0 + r]);
#pragma GCC unroll 4
      for (int e = 0; e < E; ++e) a[r][e] = V::fmadd(w, v[e], a[r][e]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int e = 0; e < E; ++e) V::store(acc + (r0 + r) * d + e0 + e * kl, a[r][e]);
  }
}

// Vectors of D per rows_pv tile, and rows: 4 x 6 zmm (24 of 32 registers) or 2 x 4 ymm (8 of 16).
constexpr int kRowsPvVectors = V::kTile / 2;
constexpr int kRowsPvRows = V::kLanes == 16 ? 6 : 4;

// The tile of the first min(N, n) rows from r0: N rows where n has them, else one row fewer, down to 1.
template <int E, int N = kRowsPvRows>
LANES_TARGET void rows_pv_rows(int64_t n, const float* pt, int64_t lanes, const float* const* vp, int64_t keys,
                               float* acc, int64_t d, int64_t r0, int64_t e0, const float* corr) {
  if constexpr (N > 1) {
    if (n < N) return rows_pv_rows<E, N - 1>(n, pt, lanes, vp, keys, acc, d, r0, e0, corr);
  }
  rows_pv_tile<N, E>(pt, lanes, vp, keys, acc, d, r0, e0, corr);
}

template <int E>
LANES_TARGET void rows_pv_cols(const float* pt, int64_t lanes, const float* const* vp, int64_t keys, float* acc,
                               int64_t d, int64_t rows, int64_t e0, const float* corr) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPvRows) {
    rows_pv_rows<E>(rows - r0, pt, lanes, vp, keys, acc, d, r0, e0, corr);
  }
}

// rows_pv_tile over the item's `rows` rows and D (a multiple of kLanes).
LANES_TARGET void rows_pv(const float* pt, int64_t lanes, const float* const* vp, int64_t keys, float* acc,
                          int64_t d, int64_t rows, const float* corr) {
  constexpr int64_t kl = V::kLanes, wide = kRowsPvVectors * kl;
  int64_t e0 = 0;
  for (; e0 + wide <= d; e0 += wide) rows_pv_cols<kRowsPvVectors>(pt, lanes, vp, keys, acc, d, rows, e0, corr);
  for (; e0 < d; e0 += kl) rows_pv_cols<1>(pt, lanes, vp, keys, acc, d, rows, e0, corr);
}

// acc [lanes][D] (rows_pv's) as [D][lanes] (lanes_pv's, which lane_outputs reads), through tmp.
LANES_TARGET inline void rows_to_lanes(float* acc, int64_t d, int64_t lanes, float* tmp) {
  std::copy(acc, acc + lanes * d, tmp);
  for (int64_t r = 0; r < lanes; ++r) {
    for (int64_t e = 0; e < d; ++e) acc[e * lanes + r] = tmp[r * d + e];
  }
}

// lanes_pv over a bf16 pool on path 3: two keys per vdpbf16ps, each lane's weights of keys 2tp and 2tp + 1
// as a bf16 pair from pp ([keys / 2][lanes], pack_weights') against V's elements of those keys, a pair
// broadcast from vpairs ([keys / 2][D], head_rows'). The weights are rounded to bf16 here (as
// flash-attention kernels round P before P.V), V is exact; each output is one chain over the key pairs
// in order, batch-invariant as lanes_pv is.
template <int NP>
SIMD_BF16 void lanes_pv_pairs(const uint32_t* pp, int64_t lanes, const uint32_t* vpairs, int64_t d, int64_t keys,
                              float* acct, const float* corr, Prefetcher& pf) {
  constexpr int kt = V::kTile;
  for (int64_t e0 = 0; e0 < d; e0 += kt) {
    typename V::Reg a[kt][NP];
    load_tile<NP>(a, acct + e0 * lanes, lanes, corr);
    for (int64_t tp = 0; tp < keys / 2; ++tp) {
      pf.step(2);
      typename V::Reg pv[NP];
#pragma GCC unroll 4
      for (int c = 0; c < NP; ++c) pv[c] = V::load(reinterpret_cast<const float*>(pp + tp * lanes + c * V::kLanes));
#pragma GCC unroll 8
      for (int j = 0; j < kt; ++j) {
        const typename V::Reg vb = V::set1_pair(vpairs[tp * d + e0 + j]);
#pragma GCC unroll 4
        for (int c = 0; c < NP; ++c) a[j][c] = V::dot_pairs(a[j][c], pv[c], vb);
      }
    }
    store_tile<NP>(a, acct + e0 * lanes, lanes);
  }
}

// Path 3: a block's weights st ([keys][lanes] floats, keys even) as bf16 key pairs pp [keys / 2][lanes].
SIMD_BF16 inline void pack_weights(const float* st, int64_t lanes, int64_t keys, uint32_t* pp) {
  for (int64_t tp = 0; tp < keys / 2; ++tp) {
    for (int64_t i = 0; i < lanes; i += V::kLanes) {
      V::pack_pairs(st + 2 * tp * lanes + i, st + (2 * tp + 1) * lanes + i, pp + tp * lanes + i);
    }
  }
}

// Rows t of x (keys; rows `lanes` floats apart, a multiple of kLanes) times scale[t], t < rows: an int8
// pool's scales on a block's scores (K's) or weights (V's).
LANES_TARGET inline void scale_rows(float* x, int64_t lanes, const float* scale, int64_t rows) {
  for (int64_t t = 0; t < rows; ++t) {
    const typename V::Reg s = V::set1(scale[t]);
    for (int64_t i = 0; i < lanes; i += V::kLanes) V::store(x + t * lanes + i, V::mul(V::load(x + t * lanes + i), s));
  }
}

// Runs f(NP, c0) over the panels in tiles of up to kTilePanels.
template <typename F>
void for_panel_tiles(int64_t panels, F&& f) {
  for (int64_t c0 = 0; c0 < panels; c0 += kTilePanels) {
    switch (std::min<int64_t>(kTilePanels, panels - c0)) {
      case 1: f(std::integral_constant<int, 1>{}, c0); break;
      case 2: f(std::integral_constant<int, 2>{}, c0); break;
      default: f(std::integral_constant<int, 3>{}, c0); break;
    }
  }
}

// The lanes that see key t: their position (pos) is at or past it and, under a window of `window` keys
// (kWindow), less than `window` past it.
template <bool kWindow>
LANES_TARGET inline typename V::Mask sees(const int32_t* pos, int64_t t, int64_t window) {
  if constexpr (kWindow) {
    return V::between(pos, t, static_cast<int32_t>(std::min<int64_t>(t + window - 1, INT32_MAX)));
  } else {
    return V::visible(pos, t);
  }
}

// The first half of an online-softmax step of one panel (lanes_softmax's, and path 4's amx_softmax): the
// new running max, from `mx` and the panel's scores over the keys b0 .. b0 + keys - 1 that each lane sees,
// soft-capped in place first where kCap.
template <bool kWindow, bool kCap>
LANES_TARGET typename V::Reg lanes_max(float* st, int64_t lanes, int64_t b0, int64_t keys, const int32_t* pos,
                                       int64_t window, float cap, typename V::Reg mx) {
  for (int64_t t = 0; t < keys; ++t) {
    typename V::Reg x = V::load(st + t * lanes);
    if constexpr (kCap) {
      x = V::mul(V::set1(cap), V::tanh(V::mul(x, V::set1(1.0f / cap))));
      V::store(st + t * lanes, x);
    }
    mx = V::max_where(mx, sees<kWindow>(pos, b0 + t, window), x);
  }
  return mx;
}

// Online-softmax step of one panel over a block of keys b0 .. b0 + keys - 1 (st's column of scores,
// rows `lanes` apart, padded to `padded` rows): scores, soft-capped first where kCap (cap: the cap),
// become the weights exp(s - new max), 0 where a lane does not see the key (see `sees`) and in the
// padding; m and l move to the new max, and corr (exp(old max - new max)) is what the accumulators are
// rescaled by.
template <bool kWindow, bool kCap>
LANES_TARGET void lanes_softmax(float* st, int64_t lanes, int64_t b0, int64_t keys, int64_t padded,
                                const int32_t* pos, int64_t window, float cap, float* m, float* l, float* corr) {
  const typename V::Reg m_old = V::load(m);
  const typename V::Reg mx = lanes_max<kWindow, kCap>(st, lanes, b0, keys, pos, window, cap, m_old);
  typename V::Reg sum = V::zero();
  for (int64_t t = 0; t < keys; ++t) {
    const typename V::Reg x = V::sub(V::load(st + t * lanes), mx);
    const typename V::Reg w = V::zero_unless(sees<kWindow>(pos, b0 + t, window), V::exp(x));
    V::store(st + t * lanes, w);
    sum = V::add(sum, w);
  }
  for (int64_t t = keys; t < padded; ++t) V::store(st + t * lanes, V::zero());
  const typename V::Reg c = V::exp(V::sub(m_old, mx));  // ~0 on the first block (m = -inf)
  V::store(l, V::fmadd(V::load(l), c, sum));
  V::store(m, mx);
  V::store(corr, c);
}

// A request chunk (from 0 or its first token's window, two or more tokens) or a group item on the
// rows-as-lanes path; a group's member tokens all see the whole shared prefix (their positions are past
// it, and groups are formed only where their windows hold it). Scratch: qt and acc hold [D][lanes] per
// head, s [kBlock][lanes], m / l `lanes` per head, corr and pos `lanes`.
template <bool kWindow, bool kCap>
LANES_TARGET void item_lanes(const Problem& p, const Item& it, const Span& sp, Scratch& w) {
  constexpr int64_t kl = V::kLanes;
  const int64_t d = p.head_dim, g = p.group;
  const int64_t len = sp.len, rows = sp.tokens * g;
  // A prefill chunk's P.V on bf16 pairs; a group item's stays float32, as its members' decode tiles are.
  const bool pv_pairs = p.pairs && !sp.group;
  const int64_t panels = (rows + kl - 1) / kl, lanes = panels * kl;
  // P.V with the head elements as lanes (rows_pv) up to a register tile of panels, its accumulators
  // [lanes][D] until the end (rows_to_lanes through w.kf, kBlock x D floats).
  static_assert(kTilePanels * V::kLanes <= kBlock, "rows_to_lanes's scratch holds a tile of panels");
  const bool pv_rows = !pv_pairs && panels <= kTilePanels && d % kl == 0;
  float *qt = w.q.data(), *st = w.s.data(), *acct = w.acc.data(), *m = w.m.data(), *l = w.l.data();
  float* corr = w.corr.data();
  const int32_t* pos = w.pos.data();
  const float* const* vp = w.vp.data();
  const char** krow = w.krow.data();
  const char** vrow = w.vrow.data();
  Prefetcher pf;
  lane_queries(p, it, sp, lanes, p.pairs, V::kLanes == 16, w, pf);
  for (int64_t b0 = sp.from; b0 < len; b0 += kBlock) {
    const int64_t keys = std::min(kBlock, len - b0);
    const int64_t padded = (keys + V::kTile - 1) / V::kTile * V::kTile;
    block_rows(p, it, sp, b0, keys, padded, krow, vrow, pf);
    for (int64_t h = it.h0; h < it.h1; ++h) {
      const int64_t hi = h - it.h0;
      float *q = qt + hi * d * lanes, *acc = acct + hi * d * lanes;
      head_rows(p, h, padded, krow, vrow, sp.slots + b0, keys, pv_pairs, w);
      if (p.pairs) {
        const uint32_t* qp = w.qpairs.data() + hi * (d / 2) * lanes;
        for_panel_tiles(panels, [&](auto np, int64_t c0) {
          lanes_scores_pairs<decltype(np)::value>(qp + c0 * kl, lanes, w.kb.data(), d, padded, st + c0 * kl, pf);
        });
      } else {
        for_panel_tiles(panels, [&](auto np, int64_t c0) {
          lanes_scores<decltype(np)::value>(q + c0 * kl, lanes, w.kp.data(), d, padded, st + c0 * kl, pf);
        });
      }
      if (p.int8) scale_rows(st, lanes, w.ks.data(), padded);
      for (int64_t c = 0; c < panels; ++c) {
        const int64_t o = hi * lanes + c * kl;
        lanes_softmax<kWindow, kCap>(st + c * kl, lanes, b0, keys, padded, pos + c * kl, sp.window, p.softcap,
                                     m + o, l + o, corr + c * kl);
      }
      if (p.int8) scale_rows(st, lanes, w.vs.data(), padded);
      if (pv_pairs) {
        uint32_t* pp = w.ppairs.data();
        pack_weights(st, lanes, padded, pp);
        for_panel_tiles(panels, [&](auto np, int64_t c0) {
          lanes_pv_pairs<decltype(np)::value>(pp + c0 * kl, lanes, w.vpairs.data(), d, padded, acc + c0 * kl,
                                              corr + c0 * kl, pf);
        });
      } else if (pv_rows) {
        rows_pv(st, lanes, vp, padded, acc, d, rows, corr);
      } else {
        for_panel_tiles(panels, [&](auto np, int64_t c0) {
          lanes_pv<decltype(np)::value>(st + c0 * kl, lanes, vp, d, padded, acc + c0 * kl, corr + c0 * kl, pf);
        });
      }
    }
    pf.finish();
  }
  if (pv_rows) {
    for (int64_t hi = 0; hi < it.h1 - it.h0; ++hi) rows_to_lanes(acct + hi * d * lanes, d, lanes, w.kf.data());
  }
  lane_outputs(p, it, sp, lanes, V::kLanes == 16, w);
}
