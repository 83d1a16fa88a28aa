// Attention for CPUs, float32 queries and softmax, reading K/V straight from the KV pool (decode, extends
// and prefill chunks alike), with a layer's sliding window and logit soft-cap where it has them; and the
// KV store.
//
// Layout (radixlm_runtime/kvcache/pool.py, forward_batch.py):
//   k_buf, v_buf  one layer's [slots, Hkv, D] contiguous buffers of float32, bf16 or int8 (KvType; --dtype
//                 bfloat16 on CPU halves the pool's bytes per token, --kv-cache-dtype int8 quarters them,
//                 with k_scale, v_scale [slots, Hkv] float32 beside); slot 0 is a zeroed dummy.
//   table         the request-to-token table, int64 [max_reqs, table_stride]: row `rows[r]`, columns
//                 0 .. seq_lens[r] - 1 hold request r's KV slots, its new tokens' included (they are
//                 stored before attention runs).
//   q, out        [T, Hq, D]: rows of Hq * D contiguous floats, `*_stride` floats apart (q is a view of
//                 the fused qkv projection's output). Request r's num_new[r] new tokens are rows
//                 q_starts[r] ..; token j sits at position seq_len - num_new + j and sees keys
//                 0 .. seq_len - num_new + j (causal). GQA: q head h reads kv head h / G.
//
// Work is split over (request, chunk of up to kQueryChunk new tokens) items across OpenMP threads, each
// item holding every kv head (one kv head each where there are too few items for the threads: a single
// request decoding). Per kv head, an item's G q heads x n tokens (R = G * n query rows) walk the keys
// its last token sees together, kBlock keys at a time: each K/V row is read from the pool once per item
// and used for all R rows of every head, through a pointer per key looked up in the table, so no
// gathered copy of K/V is made (torch's path index_selects every request's K/V first, then runs its
// flash kernel, which with a cached prefix needs a mask and then computes every block, the causally
// hidden ones too). Chunking the query rows is what keeps a prefill's working set (R rows of scores and
// accumulators) in L2 and skips the keys after a chunk's last token; a request's chunks run longest
// first, so the pool's threads finish together. Softmax is online (a running max and sum per row,
// flash-attention style), accumulated in float32. Decoding requests that share a cached prefix attend
// to it once, in group items that run first (see Item). Decode streams the KV cache from memory: rows
// are prefetched a block ahead, between compute steps (see Prefetcher).
//
// Paths, picked at run time by asking the CPU. AVX2+FMA: scores come from register tiles of 3 rows x 4
// keys (2 x 4, 1 x 8 for the rest), P.V from tiles of 4 rows x 16 floats (3 x 16, 2 x 32, 1 x 64 for
// the rest): 6 to 12 independent FMA chains, which hide their latency at any R. exp is Cephes' polynomial
// (within 2 ulp). Prefill chunks and group items take a rows-as-lanes path instead
// (cpu_attention_lanes.h: AVX-512 or AVX2 vectors, the same bits either way); decode tokens stay on the
// row-major tiles. The portable scalar path (key by key, every row updated per key, libm expf) serves
// other CPUs and head dims that are not a multiple of 8. `mode` caps the path, so tests reach each one
// on one machine.
//
// A bf16 pool (--dtype bfloat16 or --kv-cache-dtype bfloat16 on CPU: half the bytes per token, so twice the
// tokens in the same memory and half the bytes a decode streams): the store rounds K/V to nearest even, as
// torch's .to(torch.bfloat16) does. Attention reads them widened to float32 (exact: a 16-bit shift) and
// rounds the scaled queries to bf16 as well, so on every path a score is a dot product of bf16 operands
// (exact products) summed in float32; softmax and P.V stay float32. The scalar path widens each element as it
// reads it, the row-major tiles (decode) in their registers as they load a row (load8), the rows-as-lanes
// kernels a block's rows of a head into the scratch once for all the item's rows (head_rows). So paths 0-2
// give over a bf16 pool the bits they give over a float32 pool holding the same rounded K/V, with the queries
// rounded. Path 3 (mode 3, a CPU with AVX512-BF16) runs both products of the rows-as-lanes kernels with
// vdpbf16ps instead, two elements an instruction: the scores with K's pairs read straight from the pool (the
// same products as the other paths', but vdpbf16ps rounds its sums its own way), and a prefill chunk's P.V
// over the weights rounded to bf16 (as flash-attention kernels round P) against V interleaved by key pairs
// once per block and head (head_rows). 1.5x the widening path on prefill shapes (16 prompts of 620 tokens, 2
// threads of a Zen 4: 231 GFLOP/s against 154); path 3 agrees with the others within bf16 rounding of the
// weights, not to the bit. A group item (decode tokens on a shared prefix) keeps float32 P.V, as a decode
// token alone has on the row-major tiles, so a decode token's result moves with the group it falls in only
// within float32 rounding. Path 3 is batch-invariant as the others are: each lane one chain over D (scores)
// and over the key pairs (P.V) in order, on either vector width, whatever else shares its item or however its
// request was chunked. Path 4 (mode 4, a CPU with AMX-BF16) runs a bf16 pool's prefill chunks
// with both products on AMX tiles instead (see "AMX path" below): about 2x the widening path on a Xeon
// whose vdpbf16ps runs at half its FMAs' rate.
//
// An int8 pool (--kv-cache-dtype int8: a quarter of float32's bytes per token plus a float32 scale per
// token and kv head, k_scale / v_scale [slots, Hkv]): the store quantizes each head's D values
// symmetrically (quantize_head: scale max |x| / 127, codes rounded to nearest even, pool.py's
// quantize_int8 to the bit). Attention reads the codes and factors the scales out of the dot products: a
// score is k_scale x (q . codes), and P.V sums (p x v_scale) x codes, so a decode tile only converts codes
// to float32 in its registers as it loads a row (load8), the rows-as-lanes kernels a block's rows of a
// head into the scratch once for all the item's rows (head_rows), and the scales are one multiply per key
// (scores) and per key and query row (weights): no dequantized copy of the pool is ever made, and a
// decode streams a quarter of the bytes. Every path computes that formula (within float32 rounding of
// attention over the dequantized K/V, codes x scales), each batch- and chunk-invariant as over a float32
// pool. Queries stay float32.
//
// Per-layer features (transformers' semantics). A sliding window of W keys: token j at position p sees
// keys p - W + 1 .. p, so an item's keys start at its first token's window (whole blocks before it are
// never read) and only a chunk's later tokens, whose windows start further on, mask keys from below. A
// logit soft-cap C: each score s (scale included) becomes C tanh(s / C) before the running max. Both are
// template parameters of the SIMD items, so a plain layer runs the code it ran without them.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using simd::exp_avx2;
using simd::hsum;
using simd::tanh_avx2;

// Keys per online-softmax step: enough that the per-block rescale is noise, few enough that a block's
// scores stay in L1. A multiple of 8 (the exp and max loops read whole vectors of a row).
constexpr int64_t kBlock = 64;
// New tokens per item: 16 tokens x G = 3 heads is 48 query rows, 12 KB of scores and accumulators.
constexpr int64_t kQueryChunk = 16;
// On path 4 (AMX tiles) 32: a block's K/V rows are laid out for the tiles once per item, so more rows
// per item share that work.
constexpr int64_t kAmxQueryChunk = 32;
// Under a window an item's keys start where its first token's window does, so each later token's window
// starts within kQueryChunk keys of there: every row sees a key of the first block, and no row's running
// max is still -inf (which would make the next rescale exp(-inf - -inf)) after it.
static_assert(kQueryChunk < kBlock && kAmxQueryChunk < kBlock, "every row of an item sees a key of its first block");
// Members per group item: 16 decode tokens (x G = 3 heads: 48 query rows, three full AVX-512 panels)
// where a group still gives every thread two items that way, else 8. Scratch is sized for kQueryChunk.
constexpr int64_t kGroupChunk = 8, kWideGroupChunk = 16;
static_assert(kWideGroupChunk <= kQueryChunk, "group items use the request chunks' scratch");
// Cache lines requested per scores tile (and one per P.V key) while the next block's rows stream in.
constexpr int64_t kPrefetchStep = 16;
// Below this much work (keys x query rows x D summed over items) a call stays on the calling thread,
// where waking the pool would cost more than it saves.
constexpr int64_t kAttentionParallelMin = 1 << 18;
constexpr float kNegInf = -INFINITY;
// The most query rows per vector on the rows-as-lanes prefill path (AVX-512's).
constexpr int64_t kLanes = 16;

// The KV pool's element type (cpu_backend.py's KV_TYPES).
enum KvType : int { kKvFloat32 = 0, kKvBf16 = 1, kKvInt8 = 2 };

inline int64_t kv_bytes(int kv_type) { return kv_type == kKvFloat32 ? 4 : kv_type == kKvBf16 ? 2 : 1; }

struct Problem {
  const float* q;
  int64_t q_stride;
  float* out;
  int64_t out_stride;
  const char* k_buf;
  const char* v_buf;
  int kv_type;  // KvType
  bool bf16;    // the pool holds bf16
  bool int8;    // the pool holds int8 codes, scaled by k_scale / v_scale
  bool pairs;   // bf16 pool on path 3: the rows-as-lanes scores and P.V by vdpbf16ps (lanes_*_pairs)
  // An int8 pool's scales, [slots, Hkv] float32 each (null for the others).
  const float* k_scale;
  const float* v_scale;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t group;
  const int64_t* table;
  int64_t table_stride;
  const int64_t* rows;
  const int64_t* seq_lens;
  const int64_t* q_starts;
  const int64_t* num_new;
  float scale;
  int64_t window;  // sliding window in keys; 0: none
  float softcap;   // logit soft-cap; 0: none
  // Shared-prefix groups of decoding requests: [3, G] member offsets, member counts, prefix lengths;
  // their members' request indices; per request, the prefix length its group item covers (0: none).
  const int64_t* groups;
  int64_t num_groups;
  const int64_t* members;
  const int64_t* prefix_of;
  // A group item's online-softmax state per (request, q head), which the member's own item starts from.
  float* state_m;
  float* state_l;
  float* state_acc;
  // Path 4: the K/V blocks of the requests whose prefill chunks run on tiles, laid out for them once per
  // call (amx_layout_block): K rows [blocks][Hkv][kBlock][D], V transposed into key pairs [blocks][Hkv][D]
  // [kBlock / 2]; per request the index of its first block, -1 where its items lay blocks out themselves.
  const uint16_t* amx_k = nullptr;
  const uint32_t* amx_v = nullptr;
  const int64_t* amx_first = nullptr;

  int64_t row_bytes() const { return kv_heads * head_dim * kv_bytes(kv_type); }
  // An int8 pool's scale of kv head h at slot (scales: k_scale or v_scale); 1 for the others (unused).
  float scale_at(const float* scales, int64_t slot, int64_t h) const {
    return int8 ? scales[slot * kv_heads + h] : 1.0f;
  }
  // A slot's row (every kv head) of k_buf or v_buf.
  const char* row(const char* buf, int64_t slot) const { return buf + slot * row_bytes(); }
};

// Grows v to at least n elements, never shrinks it: each buffer is checked against its own size, since
// calls differ in every dimension (one process may serve models of different head sizes).
template <typename T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// One thread's working set, kept across calls (grown, never shrunk) so decode steps do not allocate.
struct Scratch {
  std::vector<float> q, s, acc, m, l, corr;
  std::vector<float> kf, vf;  // a block's K and V rows of one head, widened from a bf16 or int8 pool
  std::vector<float> ks, vs;  // an int8 pool's scales of a block's rows of one head
  std::vector<uint32_t> qpairs;  // path 3: the queries as bf16 pairs, [heads][D / 2][lanes]
  std::vector<uint32_t> vpairs;  // path 3: a block's V rows of one head as key pairs, [keys / 2][D]
  std::vector<uint32_t> ppairs;  // paths 3-4: a block's weights as key pairs, [keys / 2][lanes]
  std::vector<uint16_t> ktile;   // path 4: a block's K rows of one head, contiguous, [keys][D]
  std::vector<uint32_t> vt;      // path 4: a block's V rows of one head as key pairs per element, [D][keys / 2]
  std::vector<const float*> kp, vp;
  std::vector<const uint16_t*> kb;  // path 3: a block's K rows of one head, bf16 in the pool
  std::vector<const char*> krow, vrow;
  std::vector<int32_t> pos;

  // rows: one head's query rows (rounded up to whole 16-lane panels, which the AVX-512 path fills);
  // heads: how many heads an item holds.
  void fit(int64_t rows, int64_t heads, int64_t d) {
    rows = (rows + kLanes - 1) / kLanes * kLanes;
    grow(q, rows * heads * d);
    grow(acc, rows * heads * d);
    grow(s, rows * kBlock);
    grow(m, rows * heads);
    grow(l, rows * heads);
    grow(corr, rows);
    grow(pos, rows);
    grow(qpairs, rows * heads * d / 2);
    grow(vpairs, kBlock / 2 * d);
    grow(ppairs, rows * kBlock / 2);
    grow(ktile, kBlock * d);
    grow(vt, d * kBlock / 2);
    grow(kf, kBlock * d);
    grow(ks, kBlock);
    grow(vs, kBlock);
    grow(vf, kBlock * d);
    grow(kp, kBlock);
    grow(vp, kBlock);
    grow(kb, kBlock);
    grow(krow, kBlock);
    grow(vrow, kBlock);
  }
};

thread_local Scratch tls_scratch;

// One unit of work, kv heads h0 .. h1 - 1 of either
//   a request chunk (r >= 0): request r's new tokens j0 .. j1 - 1, over its keys from prefix_of[r] on (the
//   keys before came from its group item, whose state it starts from), or
//   a group item (r = -1 - g): the decode tokens of members j0 .. j1 - 1 of group g, over the group's
//   shared prefix only; the state is saved for the members' own items. Stacking the members' query rows
//   is what makes the shared prefix cheap: one pass over its keys serves every member, with register
//   tiles full (a decode token alone is G rows).
struct Item {
  int64_t r, h0, h1, j0, j1;
};

// What an item computes, resolved from the Problem once.
struct Span {
  int64_t tokens;
  int64_t first;  // position of token 0: token j sees keys up to first + j
  int64_t from, len;  // the keys it walks: from .. len - 1
  const int64_t* slots;
  bool group;
  // The layer's window where it hides some of the keys from `from` on from a later token of the item
  // (token j sees keys first + j - window + 1 ..); 0 where every token sees them all.
  int64_t window;
};

Span span_of(const Problem& p, const Item& it) {
  if (it.r >= 0) {
    const int64_t len = p.seq_lens[it.r];
    const int64_t tokens = it.j1 - it.j0;
    const int64_t first = len - p.num_new[it.r] + it.j0;
    int64_t from = p.prefix_of[it.r], window = 0;
    if (p.window > 0) {
      from = std::max(from, first - p.window + 1);
      if (first + tokens - p.window > from) window = p.window;  // the last token's window starts later
    }
    return {tokens, first, from, first + tokens, p.table + p.rows[it.r] * p.table_stride, false, window};
  }
  // Groups are only formed where every member sees the whole shared prefix (see ca_decode).
  const int64_t g = -1 - it.r;
  const int64_t prefix = p.groups[2 * p.num_groups + g];
  const int64_t lead = p.members[p.groups[g]];
  return {it.j1 - it.j0, prefix - 1, 0, prefix, p.table + p.rows[lead] * p.table_stride, true, 0};
}

// The request and the q/out row of token t of the item.
inline int64_t token_req(const Problem& p, const Item& it, int64_t t) {
  return it.r >= 0 ? it.r : p.members[p.groups[-1 - it.r] + it.j0 + t];
}

inline int64_t token_row(const Problem& p, const Item& it, int64_t t) {
  return it.r >= 0 ? p.q_starts[it.r] + it.j0 + t : p.q_starts[token_req(p, it, t)];
}

// A query element as every path uses it: pre-multiplied by the scale, and over a bf16 pool rounded to bf16
// (the scores are then dot products of bf16 operands, whichever path computes them).
inline float query_at(const Problem& p, float x) {
  const float scaled = x * p.scale;
  return p.bf16 ? simd::bf16_widen(simd::bf16_round(scaled)) : scaled;
}

// Kv head h's query rows of the item, row i = token i / G, q head (h * G + i % G), as query_at gives them;
// and their online-softmax state: empty, or its group item's where that covered a prefix.
void load_queries(const Problem& p, const Item& it, const Span& sp, int64_t h, float* dst, float* acc, float* m,
                  float* l) {
  const int64_t d = p.head_dim, g = p.group, hq = p.kv_heads * g;
  for (int64_t t = 0; t < sp.tokens; ++t) {
    const float* src = p.q + token_row(p, it, t) * p.q_stride + h * g * d;
    float* row = dst + t * g * d;
    for (int64_t i = 0; i < g * d; ++i) row[i] = query_at(p, src[i]);
    const int64_t base = t * g;
    if (!sp.group && p.prefix_of[it.r] > 0) {
      const int64_t st = it.r * hq + h * g;
      std::copy(p.state_m + st, p.state_m + st + g, m + base);
      std::copy(p.state_l + st, p.state_l + st + g, l + base);
      std::copy(p.state_acc + st * d, p.state_acc + (st + g) * d, acc + base * d);
    } else {
      std::fill(m + base, m + base + g, kNegInf);
      std::fill(l + base, l + base + g, 0.0f);
      std::fill(acc + base * d, acc + (base + g) * d, 0.0f);
    }
  }
}

// A request chunk's outputs, normalized; or a group item's state, saved for its members.
void store_outputs(const Problem& p, const Item& it, const Span& sp, int64_t h, const float* acc, const float* m,
                   const float* l) {
  const int64_t d = p.head_dim, g = p.group, hq = p.kv_heads * g;
  for (int64_t t = 0; t < sp.tokens; ++t) {
    const int64_t base = t * g;
    if (sp.group) {
      const int64_t st = token_req(p, it, t) * hq + h * g;
      std::copy(m + base, m + base + g, p.state_m + st);
      std::copy(l + base, l + base + g, p.state_l + st);
      std::copy(acc + base * d, acc + (base + g) * d, p.state_acc + st * d);
      continue;
    }
    float* dst = p.out + token_row(p, it, t) * p.out_stride + h * g * d;
    for (int64_t e = 0; e < g; ++e) {
      const float inv = 1.0f / l[base + e];
      for (int64_t i = 0; i < d; ++i) dst[e * d + i] = acc[(base + e) * d + i] * inv;
    }
  }
}

// ---------------------------------------------------------------- portable scalar path

// A pool element as float32: a bf16's widening is exact, as is an int8 code's (its scale applied apart).
inline float kv_float(float x) { return x; }
inline float kv_float(uint16_t x) { return simd::bf16_widen(x); }
inline float kv_float(int8_t x) { return static_cast<float>(x); }

// T: the pool's element type (float, uint16_t for bf16, int8_t for int8 codes).
template <typename T>
void head_scalar(const Problem& p, const Item& it, const Span& sp, int64_t h, Scratch& w) {
  const int64_t d = p.head_dim, g = p.group;
  const int64_t rows = sp.tokens * g;
  const float cap = p.softcap;
  float *q = w.q.data(), *acc = w.acc.data(), *m = w.m.data(), *l = w.l.data();
  load_queries(p, it, sp, h, q, acc, m, l);
  for (int64_t t = sp.from; t < sp.len; ++t) {
    const T* k = reinterpret_cast<const T*>(p.row(p.k_buf, sp.slots[t])) + h * d;
    const T* v = reinterpret_cast<const T*>(p.row(p.v_buf, sp.slots[t])) + h * d;
    const float ks = p.scale_at(p.k_scale, sp.slots[t], h), vs = p.scale_at(p.v_scale, sp.slots[t], h);
    // Key t is visible to the tokens at or after it, rows from (t - first) * G on; under a window, to
    // those less than `window` positions after it, rows before (t - first + window) * G.
    const int64_t end = sp.window > 0 ? std::min(rows, (t - sp.first + sp.window) * g) : rows;
    for (int64_t i = std::max<int64_t>(0, t - sp.first) * g; i < end; ++i) {
      const float* qi = q + i * d;
      float* ai = acc + i * d;
      float s = 0.0f;
      for (int64_t e = 0; e < d; ++e) s += qi[e] * kv_float(k[e]);
      s *= ks;  // exact where it is 1 (not int8)
      if (cap > 0.0f) s = cap * tanhf(s / cap);
      float weight = 1.0f;
      if (s > m[i]) {
        const float corr = expf(m[i] - s);
        l[i] *= corr;
        for (int64_t e = 0; e < d; ++e) ai[e] *= corr;
        m[i] = s;
      } else {
        weight = expf(s - m[i]);
      }
      l[i] += weight;
      const float scaled = weight * vs;
      for (int64_t e = 0; e < d; ++e) ai[e] += scaled * kv_float(v[e]);
    }
  }
  store_outputs(p, it, sp, h, acc, m, l);
}

void item_scalar(const Problem& p, const Item& it, const Span& sp, Scratch& w) {
  for (int64_t h = it.h0; h < it.h1; ++h) {
    if (p.bf16) head_scalar<uint16_t>(p, it, sp, h, w);
    else if (p.int8) head_scalar<int8_t>(p, it, sp, h, w);
    else head_scalar<float>(p, it, sp, h, w);
  }
}

// The next block's K and V rows (heads h0 .. h0 + heads - 1), requested into L2 a few cache lines at a
// time between the current block's compute steps (scores tiles, P.V keys). Issued in one burst, a
// block's 1,500 prefetches filled the core's miss queue and stalled it until they landed, so memory and
// compute took turns: a decode step over unshared KV streamed at ~13 GB/s of the ~29 two cores read.
struct Prefetcher {
  const int64_t* slots = nullptr;
  const char* bufs[2] = {nullptr, nullptr};
  const char* base = nullptr;  // the row of line `next`
  int64_t row_bytes = 0, offset = 0, line_count = 0, rows = 0, next = 0, total = 0, row = 0, line = 0;

  void start(const Problem& p, const int64_t* block_slots, int64_t count, int64_t h0, int64_t heads) {
    slots = block_slots;
    bufs[0] = p.k_buf;
    bufs[1] = p.v_buf;
    row_bytes = p.row_bytes();
    const int64_t head_bytes = row_bytes / p.kv_heads;  // one kv head's D elements
    offset = h0 * head_bytes;
    line_count = (heads * head_bytes + 63) / 64;
    rows = count;
    next = row = line = 0;
    total = 2 * rows * line_count;
  }

  // Up to n more lines: K's rows first, then V's. The row and line advance by counting: a division per
  // line (an idiv, 15-40 cycles) cost more than the decode scores it was fetching for.
  void step(int64_t n) {
    for (const int64_t end = std::min(total, next + n); next < end; ++next) {
      if (line == 0) base = bufs[row >= rows] + slots[row >= rows ? row - rows : row] * row_bytes + offset;
      __builtin_prefetch(base + line * 64, 0, 2);
      if (++line == line_count) {
        line = 0;
        ++row;
      }
    }
  }

  void finish() { step(total); }
};

// Row pointers (all kv heads) of the item's keys b0 .. b0 + keys - 1 for a block padded to `padded`
// keys with the dummy slot 0 (zeros, weighted 0); and the next block's rows asked of the prefetcher.
inline void block_rows(const Problem& p, const Item& it, const Span& sp, int64_t b0, int64_t keys, int64_t padded,
                       const char** krow, const char** vrow, Prefetcher& pf) {
  for (int64_t t = 0; t < keys; ++t) {
    krow[t] = p.row(p.k_buf, sp.slots[b0 + t]);
    vrow[t] = p.row(p.v_buf, sp.slots[b0 + t]);
  }
  for (int64_t t = keys; t < padded; ++t) {
    krow[t] = p.k_buf;
    vrow[t] = p.v_buf;
  }
  const int64_t next = std::max<int64_t>(0, std::min(kBlock, sp.len - b0 - kBlock));
  pf.start(p, sp.slots + b0 + kBlock, next, it.h0, it.h1 - it.h0);
}

// 8 elements of a KV row as float32 (kv_float's values): a float32 pool's loaded, a bf16 pool's widened in
// the register, an int8 pool's codes converted (their scale applied apart).
SIMD_AVX2 inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

SIMD_AVX2 inline __m256 load8(const uint16_t* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

SIMD_AVX2 inline __m256 load8(const int8_t* x) {
  int64_t bytes;
  memcpy(&bytes, x, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
}

// n pool elements as float32 (load8's), n a multiple of 8.
template <typename T>
SIMD_AVX2 inline void widen_row(const T* x, int64_t n, float* out) {
  for (int64_t e = 0; e < n; e += 8) _mm256_storeu_ps(out + e, load8(x + e));
}

// x[0 .. n) *= scale[0 .. n), n a multiple of 8: an int8 pool's scales applied to a row of scores or
// weights, one per key.
SIMD_AVX2 inline void scale_by(float* x, const float* scale, int64_t n) {
  for (int64_t t = 0; t < n; t += 8) {
    _mm256_storeu_ps(x + t, _mm256_mul_ps(_mm256_loadu_ps(x + t), _mm256_loadu_ps(scale + t)));
  }
}

// Kv head h's K and V rows of a block (count rows, from block_rows, at slots[0 .. count), 0 past the
// block's keys) as the rows-as-lanes kernels read them, w.kp[t] and w.vp[t] (D floats each): in place in a
// float32 pool; a bf16 pool's widened, an int8 pool's codes converted (exact, either), into the scratch,
// once per block and head for every query row of the item to read (the lanes kernels broadcast single
// elements, which loads from a float row best); an int8 pool's scales into w.ks / w.vs. On path 3
// (p.pairs) a bf16 K stays in the pool, w.kb[t] pointing at it, and where P.V runs on pairs too
// (pv_pairs) V's rows are interleaved by key pairs into w.vpairs (pair tp, element e: V[2tp][e] low,
// V[2tp + 1][e] high), what vdpbf16ps broadcasts.
SIMD_AVX2 void head_rows(const Problem& p, int64_t h, int64_t count, const char* const* krow,
                         const char* const* vrow, const int64_t* slots, int64_t keys, bool pv_pairs, Scratch& w) {
  const int64_t d = p.head_dim;
  for (int64_t t = 0; t < count; ++t) {
    if (p.kv_type == kKvFloat32) {
      w.kp[t] = reinterpret_cast<const float*>(krow[t]) + h * d;
      w.vp[t] = reinterpret_cast<const float*>(vrow[t]) + h * d;
      continue;
    }
    float *kf = w.kf.data() + t * d, *vf = w.vf.data() + t * d;
    w.kp[t] = kf;
    w.vp[t] = vf;
    if (p.int8) {
      const int64_t slot = t < keys ? slots[t] : 0;
      widen_row(reinterpret_cast<const int8_t*>(krow[t]) + h * d, d, kf);
      widen_row(reinterpret_cast<const int8_t*>(vrow[t]) + h * d, d, vf);
      w.ks[t] = p.scale_at(p.k_scale, slot, h);
      w.vs[t] = p.scale_at(p.v_scale, slot, h);
      continue;
    }
    const uint16_t* k = reinterpret_cast<const uint16_t*>(krow[t]) + h * d;
    if (p.pairs) {
      w.kb[t] = k;
    } else {
      widen_row(k, d, kf);
    }
    if (!pv_pairs) widen_row(reinterpret_cast<const uint16_t*>(vrow[t]) + h * d, d, vf);
  }
  if (!pv_pairs) return;
  // count is a multiple of the lanes kernels' kTile, so even.
  for (int64_t tp = 0; tp < count / 2; ++tp) {
    const uint16_t* v0 = reinterpret_cast<const uint16_t*>(vrow[2 * tp]) + h * d;
    const uint16_t* v1 = reinterpret_cast<const uint16_t*>(vrow[2 * tp + 1]) + h * d;
    uint32_t* out = w.vpairs.data() + tp * d;
    for (int64_t e = 0; e < d; ++e) out[e] = v0[e] | static_cast<uint32_t>(v1[e]) << 16;
  }
}

// ---------------------------------------------------------------- AVX2 + FMA path

SIMD_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [sum(a), sum(b), sum(c), sum(d)]: four dot products finished with three horizontal adds.
SIMD_AVX2 inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// All-ones lanes where the lane index is below `count`.
SIMD_AVX2 inline __m256 lanes_below(int64_t count) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), iota));
}

// Scores of QT query rows (q, d floats apart) against KT keys at a time of kp[0 .. keys) (keys a
// multiple of KT; rows of the pool's element type T, an int8 row's scores multiplied by its scale ks[t])
// into s, a row per query row, kBlock apart. QT * KT accumulators, so with 8 or more the FMA latency is hidden; the loops
// over them unroll fully, which keeps the arrays in registers.
template <int QT, int KT, typename T>
SIMD_AVX2 void scores_tile(const float* q, int64_t d, const T* const* kp, const float* ks, int64_t keys, float* s,
                           Prefetcher& pf) {
  for (int64_t t = 0; t < keys; t += KT) {
    pf.step(kPrefetchStep);
    __m256 acc[QT][KT];
#pragma GCC unroll 8
    for (int i = 0; i < QT; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < KT; ++c) acc[i][c] = _mm256_setzero_ps();
    }
    for (int64_t e = 0; e < d; e += 8) {
      __m256 kv[KT];
#pragma GCC unroll 8
      for (int c = 0; c < KT; ++c) kv[c] = load8(kp[t + c] + e);
#pragma GCC unroll 8
      for (int i = 0; i < QT; ++i) {
        const __m256 qv = _mm256_loadu_ps(q + i * d + e);
#pragma GCC unroll 8
        for (int c = 0; c < KT; ++c) acc[i][c] = _mm256_fmadd_ps(qv, kv[c], acc[i][c]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < QT; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < KT; c += 4) {
        __m128 sums = hsum4(acc[i][c], acc[i][c + 1], acc[i][c + 2], acc[i][c + 3]);
        if constexpr (std::is_same_v<T, int8_t>) sums = _mm_mul_ps(sums, _mm_loadu_ps(ks + t + c));
        _mm_storeu_ps(s + i * kBlock + t + c, sums);
      }
    }
  }
}

// acc[i] += sum over keys t of p[i][t] * V[t] for QT query rows (acc rows d apart, p rows kBlock apart;
// over an int8 pool the weights already carry V's scales), NV vectors of each row at a time: per key NV V
// loads feed QT * NV FMAs.
template <int QT, int NV, typename T>
SIMD_AVX2 void pv_tile(const float* p, const T* const* vp, int64_t keys, float* acc, int64_t d, int64_t e0,
                       int64_t e1, Prefetcher& pf) {
  for (int64_t e = e0; e < e1; e += 8 * NV) {
    __m256 a[QT][NV];
#pragma GCC unroll 8
    for (int i = 0; i < QT; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) a[i][c] = _mm256_loadu_ps(acc + i * d + e + 8 * c);
    }
    for (int64_t t = 0; t < keys; ++t) {
      pf.step(1);
      __m256 v[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) v[c] = load8(vp[t] + e + 8 * c);
#pragma GCC unroll 8
      for (int i = 0; i < QT; ++i) {
        const __m256 w = _mm256_broadcast_ss(p + i * kBlock + t);
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) a[i][c] = _mm256_fmadd_ps(w, v[c], a[i][c]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < QT; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + i * d + e + 8 * c, a[i][c]);
    }
  }
}

// P.V for QT rows over all of d: several vectors per pass (3 rows: 2, to stay within 16 registers),
// then the tail of d a vector at a time.
template <int QT, typename T>
SIMD_AVX2 void pv_rows(const float* p, const T* const* vp, int64_t keys, float* acc, int64_t d, Prefetcher& pf) {
  constexpr int kNv = QT == 1 ? 8 : QT == 2 ? 4 : 2;
  const int64_t whole = d / (8 * kNv) * (8 * kNv);
  pv_tile<QT, kNv>(p, vp, keys, acc, d, 0, whole, pf);
  pv_tile<QT, 1>(p, vp, keys, acc, d, whole, d, pf);
}

// Online-softmax step of one query row over a block: s[0 .. visible) are its scores (visible >= 1),
// soft-capped in place first where kCap (cap: the soft-cap), then turned into weights exp(s - new max);
// s[visible .. padded) become 0 so the P.V tile can run over every row's whole block. Rescales the row's
// sum and accumulator to the new max.
template <bool kCap>
SIMD_AVX2 void softmax_row(float* s, int64_t visible, int64_t padded, float cap, float& m, float& l, float* acc,
                           int64_t d) {
  if constexpr (kCap) {
    const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap);
    for (int64_t t = 0; t < visible; t += 8) {
      _mm256_storeu_ps(s + t, _mm256_mul_ps(c, tanh_avx2(_mm256_mul_ps(_mm256_loadu_ps(s + t), inv))));
    }
  }
  __m256 mx = _mm256_set1_ps(kNegInf);
  int64_t t = 0;
  for (; t + 8 <= visible; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
  if (t < visible) {
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_loadu_ps(s + t), lanes_below(visible - t)));
  }
  const float m_new = std::max(m, hmax(mx));
  const float corr = expf(m - m_new);  // 0 on the first block (m = -inf)
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t < visible; t += 8) {
    __m256 w = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    if (t + 8 > visible) w = _mm256_and_ps(w, lanes_below(visible - t));
    _mm256_storeu_ps(s + t, w);  // t + 8 <= kBlock: blocks hold whole vectors
    sum = _mm256_add_ps(sum, w);
  }
  for (; t < padded; ++t) s[t] = 0.0f;
  // One rounding, spelled out: left to -ffp-contract, whether this fused depended on how the item was
  // inlined, and a float32 and a bf16 pool's items (or this library and llama_cpu.cpp's) could differ.
  l = fmaf(l, corr, hsum(sum));
  if (corr != 1.0f) {
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(acc + e, _mm256_mul_ps(c, _mm256_loadu_ps(acc + e)));
  }
  m = m_new;
}

// An item's heads walk its keys together, a block at a time: a block's K/V rows (all kv heads of a
// token are one contiguous row) are read from memory once and serve every head while they are in cache.
// Per head, query rows and their online-softmax state sit `rows` apart in the scratch arrays. No window
// masks keys here: the row-major items are decode tokens, each alone, its keys starting at its window.
// T: the pool's element type; a bf16 pool's K/V are widened, an int8 pool's codes converted, in the
// registers as the tiles load them (a decode token's few query rows would not repay widening them into the
// scratch first); an int8 pool's scales multiply the block's scores and, after the softmax, its weights.
template <typename T, bool kCap>
SIMD_AVX2 void item_avx2(const Problem& p, const Item& it, const Span& sp, Scratch& w) {
  const int64_t d = p.head_dim, g = p.group, heads = it.h1 - it.h0;
  const int64_t first = sp.first, len = sp.len;
  const int64_t rows = sp.tokens * g;
  float *q = w.q.data(), *s = w.s.data(), *acc_all = w.acc.data(), *m_all = w.m.data(), *l_all = w.l.data();
  const T* kp[kBlock];
  const T* vp[kBlock];
  float ks[kBlock], vs[kBlock];  // an int8 pool's scales of the block's rows for head h (else unread)
  const char** krow = w.krow.data();
  const char** vrow = w.vrow.data();
  Prefetcher pf;
  pf.start(p, sp.slots + sp.from, std::min(kBlock, len - sp.from), it.h0, heads);
  pf.finish();
  for (int64_t h = it.h0; h < it.h1; ++h) {
    const int64_t base = (h - it.h0) * rows;
    load_queries(p, it, sp, h, q + base * d, acc_all + base * d, m_all + base, l_all + base);
  }
  for (int64_t b0 = sp.from; b0 < len; b0 += kBlock) {
    const int64_t keys = std::min(kBlock, len - b0);
    const int64_t padded = (keys + 7) & ~int64_t{7};
    // The next block's rows stream into L2 while this one computes: left to the demand misses of one
    // core, streaming a KV cache from memory ran at a third of the bandwidth.
    block_rows(p, it, sp, b0, keys, padded, krow, vrow, pf);
    for (int64_t h = it.h0; h < it.h1; ++h) {
      const int64_t base = (h - it.h0) * rows;
      const float* qh = q + base * d;
      float *acc = acc_all + base * d, *m = m_all + base, *l = l_all + base;
      for (int64_t t = 0; t < padded; ++t) {
        kp[t] = reinterpret_cast<const T*>(krow[t]) + h * d;
        vp[t] = reinterpret_cast<const T*>(vrow[t]) + h * d;
        if constexpr (std::is_same_v<T, int8_t>) {
          const int64_t slot = t < keys ? sp.slots[b0 + t] : 0;
          ks[t] = p.scale_at(p.k_scale, slot, h);
          vs[t] = p.scale_at(p.v_scale, slot, h);
        }
      }
      int64_t i = 0;
      for (; i + 3 <= rows; i += 3) scores_tile<3, 4>(qh + i * d, d, kp, ks, padded, s + i * kBlock, pf);
      if (rows - i == 2) scores_tile<2, 4>(qh + i * d, d, kp, ks, padded, s + i * kBlock, pf);
      if (rows - i == 1) scores_tile<1, 8>(qh + i * d, d, kp, ks, padded, s + i * kBlock, pf);
      for (i = 0; i < rows; ++i) {
        const int64_t visible = std::min(keys, first + i / g + 1 - b0);
        if (visible > 0) {
          softmax_row<kCap>(s + i * kBlock, visible, padded, p.softcap, m[i], l[i], acc + i * d, d);
        } else {  // the block is past this token: it contributes nothing
          std::fill(s + i * kBlock, s + i * kBlock + padded, 0.0f);
        }
      }
      if constexpr (std::is_same_v<T, int8_t>) {
        for (i = 0; i < rows; ++i) scale_by(s + i * kBlock, vs, padded);
      }
      for (i = 0; i + 4 <= rows; i += 4) pv_rows<4>(s + i * kBlock, vp, padded, acc + i * d, d, pf);
      switch (rows - i) {
        case 3: pv_rows<3>(s + i * kBlock, vp, padded, acc + i * d, d, pf); break;
        case 2: pv_rows<2>(s + i * kBlock, vp, padded, acc + i * d, d, pf); break;
        case 1: pv_rows<1>(s + i * kBlock, vp, padded, acc + i * d, d, pf); break;
        default: break;
      }
    }
    pf.finish();
  }
  for (int64_t h = it.h0; h < it.h1; ++h) {
    const int64_t base = (h - it.h0) * rows;
    store_outputs(p, it, sp, h, acc_all + base * d, m_all + base, l_all + base);
  }
}

// ---------------------------------------------------------------- rows-as-lanes path (prefill)
//
// Prefill chunks on AVX2 and AVX-512 CPUs: the query rows are the vector lanes (cpu_attention_lanes.h,
// compiled once per vector width). The row-major tiles above end each score in a horizontal sum and run
// the softmax row by row; these do neither: 1.15-1.25x on prefill shapes with AVX-512 vectors (~165
// GFLOP/s, ~80 % of the fp32 peak of a 2-core Zen 4), 1.1x with AVX2 ones. Every lane runs the same
// operations in the same order whatever the width, so both give the same bits. Decode tokens (a
// handful of rows) stay on the row-major tiles, whose vectors run along the head dim.

// Kv head h's query rows of the item as a rows-as-lanes kernel reads them (lane i: token i / G, q head
// h * G + i % G; lanes past the rows zero), query_at's values: transposed, w.q [D][lanes] floats; or with
// `pairs` (paths 3-4) only as bf16 pairs, w.qpairs [D / 2][lanes] (element 2e in the low half of pair e),
// what vdpbf16ps and the tile products multiply K's pairs by. One element at a time.
void head_queries(const Problem& p, const Item& it, const Span& sp, int64_t h, int64_t lanes, bool pairs,
                  Scratch& w) {
  const int64_t d = p.head_dim, g = p.group, hi = h - it.h0;
  float* qt = w.q.data() + hi * d * lanes;
  uint32_t* qp = w.qpairs.data() + hi * (d / 2) * lanes;
  if (pairs) std::fill(qp, qp + d / 2 * lanes, 0u);
  else std::fill(qt, qt + d * lanes, 0.0f);
  for (int64_t t = 0; t < sp.tokens; ++t) {
    const float* src = p.q + token_row(p, it, t) * p.q_stride + h * g * d;
    for (int64_t e = 0; e < g; ++e) {
      const int64_t lane = t * g + e;
      for (int64_t i = 0; i < d; ++i) {
        const float x = query_at(p, src[e * d + i]);
        if (!pairs) {
          qt[i * lanes + lane] = x;
          continue;
        }
        uint32_t bits;
        memcpy(&bits, &x, 4);
        qp[i / 2 * lanes + lane] |= i % 2 ? bits & 0xffff0000u : bits >> 16;
      }
    }
  }
}

// query_at's values of 16 elements from x, as float32 bits.
SIMD_AVX512 inline __m512i queries16(const Problem& p, const float* x, __m512 scale) {
  const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(x), scale);
  return p.bf16 ? _mm512_slli_epi32(simd::bf16_round_avx512(scaled), 16) : _mm512_castps_si512(scaled);
}

// head_queries on AVX-512 (D a multiple of 32), the same values: 16 lanes' rows of 16 elements (or 32 as
// bf16 pairs) loaded, scaled and rounded as query_at does, then transposed in registers.
SIMD_AVX512 void head_queries_avx512(const Problem& p, const Item& it, const Span& sp, int64_t h, int64_t lanes,
                                     bool pairs, Scratch& w) {
  const int64_t d = p.head_dim, g = p.group, hi = h - it.h0, rows = sp.tokens * g;
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t c = 0; c < lanes; c += 16) {
    const float* src[16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t lane = c + j;
      src[j] = lane < rows ? p.q + token_row(p, it, lane / g) * p.q_stride + (h * g + lane % g) * d : nullptr;
    }
    const int64_t step = pairs ? 32 : 16;
    for (int64_t e0 = 0; e0 < d; e0 += step) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        if (src[j] == nullptr) {
          r[j] = _mm512_setzero_si512();
        } else if (pairs) {
          const __m256i lo = _mm512_cvtepi32_epi16(_mm512_srli_epi32(queries16(p, src[j] + e0, scale), 16));
          const __m256i hi16 = _mm512_cvtepi32_epi16(_mm512_srli_epi32(queries16(p, src[j] + e0 + 16, scale), 16));
          r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi16, 1);
        } else {
          r[j] = queries16(p, src[j] + e0, scale);
        }
      }
      simd::transpose16(r);
      for (int i = 0; i < 16; ++i) {
        void* dst = pairs ? static_cast<void*>(w.qpairs.data() + hi * (d / 2) * lanes + (e0 / 2 + i) * lanes + c)
                          : static_cast<void*>(w.q.data() + hi * d * lanes + (e0 + i) * lanes + c);
        _mm512_storeu_si512(dst, r[i]);
      }
    }
  }
}

// A rows-as-lanes item's start (paths 2-4): lane i is query row i, token i / G at position first + i / G,
// which sees the keys up to there (w.pos); padding lanes take the last token's position and zero queries
// (finite, and never stored). Per head, the queries (head_queries; on AVX-512 where `wide`), the
// accumulators w.acc [D][lanes] zeroed, the running max and sum w.m, w.l empty; the item's first block
// of K/V rows is fetched into cache (pf).
void lane_queries(const Problem& p, const Item& it, const Span& sp, int64_t lanes, bool pairs, bool wide,
                  Scratch& w, Prefetcher& pf) {
  const int64_t d = p.head_dim, g = p.group, heads = it.h1 - it.h0, rows = sp.tokens * g;
  for (int64_t i = 0; i < lanes; ++i) w.pos[i] = static_cast<int32_t>(sp.first + std::min(i, rows - 1) / g);
  pf.start(p, sp.slots + sp.from, std::min(kBlock, sp.len - sp.from), it.h0, heads);
  pf.finish();
  for (int64_t h = it.h0; h < it.h1; ++h) {
    if (wide && d % 32 == 0) head_queries_avx512(p, it, sp, h, lanes, pairs, w);
    else head_queries(p, it, sp, h, lanes, pairs, w);
  }
  std::fill(w.acc.begin(), w.acc.begin() + heads * d * lanes, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + heads * lanes, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + heads * lanes, 0.0f);
}

// A request chunk's outputs of kv head h on AVX-512 (D a multiple of 16), lane_outputs' values: the
// accumulators' [D][lanes] rows transposed in registers, 16 lanes by 16 elements at a time.
SIMD_AVX512 void head_outputs_avx512(const Problem& p, const Item& it, const Span& sp, int64_t h, int64_t lanes,
                                     const Scratch& w) {
  const int64_t d = p.head_dim, g = p.group, hi = h - it.h0, rows = sp.tokens * g;
  const float *acc = w.acc.data() + hi * d * lanes, *lh = w.l.data() + hi * lanes;
  for (int64_t c = 0; c < rows; c += 16) {
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(_mm512_loadu_ps(acc + (e0 + i) * lanes + c));
      simd::transpose16(r);
      for (int64_t j = 0; j < 16 && c + j < rows; ++j) {
        const int64_t lane = c + j;
        float* dst = p.out + token_row(p, it, lane / g) * p.out_stride + (h * g + lane % g) * d + e0;
        _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_castsi512_ps(r[j]), _mm512_set1_ps(1.0f / lh[lane])));
      }
    }
  }
}

// A rows-as-lanes item's end: a request chunk's outputs, normalized (on AVX-512 where `wide`); a group
// item's state, saved for its members' own items.
void lane_outputs(const Problem& p, const Item& it, const Span& sp, int64_t lanes, bool wide, const Scratch& w) {
  const int64_t d = p.head_dim, g = p.group, hq = p.kv_heads * g;
  for (int64_t h = it.h0; h < it.h1; ++h) {
    if (wide && !sp.group && d % 16 == 0) {
      head_outputs_avx512(p, it, sp, h, lanes, w);
      continue;
    }
    const int64_t hi = h - it.h0;
    const float *acc = w.acc.data() + hi * d * lanes, *mh = w.m.data() + hi * lanes, *lh = w.l.data() + hi * lanes;
    for (int64_t t = 0; t < sp.tokens; ++t) {
      for (int64_t e = 0; e < g; ++e) {
        const int64_t lane = t * g + e;
        if (sp.group) {
          const int64_t at = token_req(p, it, t) * hq + h * g + e;
          p.state_m[at] = mh[lane];
          p.state_l[at] = lh[lane];
          for (int64_t i = 0; i < d; ++i) p.state_acc[at * d + i] = acc[i * lanes + lane];
          continue;
        }
        float* dst = p.out + token_row(p, it, t) * p.out_stride + (h * g + e) * d;
        const float inv = 1.0f / lh[lane];
        for (int64_t i = 0; i < d; ++i) dst[i] = acc[i * lanes + lane] * inv;
      }
    }
  }
}

struct Avx512 {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static constexpr int kTile = 8;
  SIMD_AVX512 static Reg zero() { return _mm512_setzero_ps(); }
  SIMD_AVX512 static Reg load(const float* x) { return _mm512_loadu_ps(x); }
  SIMD_AVX512 static void store(float* x, Reg v) { _mm512_storeu_ps(x, v); }
  SIMD_AVX512 static Reg set1(float x) { return _mm512_set1_ps(x); }
  SIMD_AVX512 static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  SIMD_AVX512 static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  SIMD_AVX512 static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  SIMD_AVX512 static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  SIMD_AVX512 static Reg exp(Reg x) { return simd::exp_avx512(x); }
  SIMD_AVX512 static Reg tanh(Reg x) { return simd::tanh_avx512(x); }
  // The lanes whose position is at or past key t.
  SIMD_AVX512 static Mask visible(const int32_t* pos, int64_t t) {
    return _mm512_cmpge_epi32_mask(_mm512_loadu_si512(pos), _mm512_set1_epi32(static_cast<int>(t)));
  }
  // The lanes whose position is t .. last (a window's: the ones that see key t).
  SIMD_AVX512 static Mask between(const int32_t* pos, int64_t t, int32_t last) {
    const __m512i at = _mm512_loadu_si512(pos);
    return _mm512_mask_cmple_epi32_mask(_mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(static_cast<int>(t))), at,
                                        _mm512_set1_epi32(last));
  }
  SIMD_AVX512 static Reg max_where(Reg a, Mask m, Reg b) { return _mm512_mask_max_ps(a, m, a, b); }
  SIMD_AVX512 static Reg zero_unless(Mask m, Reg v) { return _mm512_maskz_mov_ps(m, v); }
  // Path 3: a pair of bf16 in every lane; acc + the lanes' pair dot products of a and b (vdpbf16ps).
  SIMD_BF16 static Reg set1_pair(uint32_t x) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x))); }
  SIMD_BF16 static Reg dot_pairs(Reg acc, Reg a, Reg b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(a), reinterpret_cast<const __m512bh&>(b));
  }
  // Lane i: x0[i] and x1[i] rounded to bf16 (nearest even), x0's in the low half.
  SIMD_BF16 static __m512i pairs_of(Reg x0, Reg x1) {
    const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x0)));
    const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x1)));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
  SIMD_BF16 static void pack_pairs(const float* x0, const float* x1, uint32_t* out) {
    _mm512_storeu_si512(out, pairs_of(load(x0), load(x1)));
  }
};

// 8-float vectors; on path 3 with AVX512-BF16's 256-bit vdpbf16ps, which computes each lane as the
// 512-bit one does.
struct Avx2 {
  using Reg = __m256;
  using Mask = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kTile = 4;
  SIMD_AVX2 static Reg zero() { return _mm256_setzero_ps(); }
  SIMD_AVX2 static Reg load(const float* x) { return _mm256_loadu_ps(x); }
  SIMD_AVX2 static void store(float* x, Reg v) { _mm256_storeu_ps(x, v); }
  SIMD_AVX2 static Reg set1(float x) { return _mm256_set1_ps(x); }
  SIMD_AVX2 static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  SIMD_AVX2 static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  SIMD_AVX2 static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  SIMD_AVX2 static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  SIMD_AVX2 static Reg exp(Reg x) { return exp_avx2(x); }
  SIMD_AVX2 static Reg tanh(Reg x) { return tanh_avx2(x); }
  SIMD_AVX2 static Mask visible(const int32_t* pos, int64_t t) {
    const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(at, _mm256_set1_epi32(static_cast<int>(t - 1))));
  }
  SIMD_AVX2 static Mask between(const int32_t* pos, int64_t t, int32_t last) {
    const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(last), _mm256_sub_epi32(at, _mm256_set1_epi32(1)));
    return _mm256_and_ps(visible(pos, t), _mm256_castsi256_ps(below));
  }
  SIMD_AVX2 static Reg max_where(Reg a, Mask m, Reg b) { return _mm256_blendv_ps(a, _mm256_max_ps(a, b), m); }
  SIMD_AVX2 static Reg zero_unless(Mask m, Reg v) { return _mm256_and_ps(m, v); }
  SIMD_BF16 static Reg set1_pair(uint32_t x) { return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(x))); }
  SIMD_BF16 static Reg dot_pairs(Reg acc, Reg a, Reg b) {
    return _mm256_dpbf16_ps(acc, reinterpret_cast<const __m256bh&>(a), reinterpret_cast<const __m256bh&>(b));
  }
  SIMD_BF16 static void pack_pairs(const float* x0, const float* x1, uint32_t* out) {
    const __m256i lo = _mm256_cvtepu16_epi32(reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(load(x0))));
    const __m256i hi = _mm256_cvtepu16_epi32(reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(load(x1))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
  }
};

namespace lanes16 {
using V = Avx512;
#define LANES_TARGET SIMD_AVX512
#include "cpu_attention_lanes.h"
#undef LANES_TARGET
}  // namespace lanes16

namespace lanes8 {
using V = Avx2;
#define LANES_TARGET SIMD_AVX2
#include "cpu_attention_lanes.h"
#undef LANES_TARGET
}  // namespace lanes8

// ---------------------------------------------------------------- AMX path (path 4: prefill over a bf16 pool)
//
// On CPUs with AMX-BF16 (Sapphire Rapids and later), a prefill chunk over a bf16 pool runs both products
// as tdpbf16ps tile products, 16x the products of a vdpbf16ps, around a rows-as-lanes online softmax
// (amx_softmax). The scores come transposed, S^T [keys][lanes] = K . Q^T: A is 16 keys x 32 head
// elements of K (a block's rows of one head copied contiguous, what a tile load needs), B the queries as
// pairs ([D / 2][lanes], path 3's). P.V comes transposed too, acc^T [D][lanes] += V^T . P^T: A is 16
// head elements x 32 keys of V^T (a block's V rows transposed into pairs of keys per head element,
// amx_head_rows; once per call for all of a request's items, amx_layout_block), B the weights rounded to
// bf16 as key pairs ([keys / 2][lanes], path 3's layout). Each output is one chain of tile products in
// order (over D for a score; over a block's 32-key tiles, after the block's rescale, for P.V), whatever
// else shares its item or however its request was chunked: keys past a token are weighted 0, so they
// add exact zeros, and a block padded to whole 32-key tiles adds zero tiles. A tile product sums its 32
// products with its own rounding (linear_cpu.cpp's "AMX (bf16)"), so the bits are not path 3's, within
// the same bf16 rounding of the weights. Group items and decode tokens run path 2, as on a CPU without
// AMX.

// bf16 values a tile row holds: a tile product's depth, 32 head elements of a score's chain and 32 keys of
// a P.V one; a block's keys are padded to a multiple of it, and D must be one.
constexpr int64_t kTileDepth = 32;

// Tiles 0-3: sums of two row tiles (0-1, 2-3) by two lane tiles; 4-5: A's row tiles; 6-7: B's lane
// tiles; every one 16 rows of 64 bytes. Configured per item, by its thread: other kernels on the same
// threads (linear_cpu.cpp's, oneDNN's) configure the tiles their own way.
SIMD_AMX_BF16 void amx_attention_tiles() { simd::load_tile_config(simd::TileConfig::whole()); }

// A tile product's operand: 16-row tiles of 64 bytes, `row` bytes between a tile's rows, `tile` bytes
// between neighbouring tiles (A's row tiles, B's lane tiles), `step` bytes between a chain's steps.
struct TileOperand {
  const char* base;
  int64_t row, tile, step;
};

// C's RT row tiles x CT lane tiles (rows `c_row` bytes apart, row tiles `c_tile` bytes, lane tiles 64
// bytes) = C (as stored where kLoad, else 0) + the sum over `steps` of A(r, s) . B(s, c), in order: up
// to four independent chains.
template <int RT, int CT, bool kLoad>
SIMD_AMX_BF16 void amx_chain(const TileOperand& a, const TileOperand& b, int64_t steps, char* c, int64_t c_row,
                             int64_t c_tile) {
  if constexpr (kLoad) {
    _tile_loadd(0, c, c_row);
    if constexpr (CT > 1) _tile_loadd(1, c + 64, c_row);
    if constexpr (RT > 1) _tile_loadd(2, c + c_tile, c_row);
    if constexpr (RT > 1 && CT > 1) _tile_loadd(3, c + c_tile + 64, c_row);
  } else {
    _tile_zero(0);
    if constexpr (CT > 1) _tile_zero(1);
    if constexpr (RT > 1) _tile_zero(2);
    if constexpr (RT > 1 && CT > 1) _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a.base + s * a.step, a.row);
    if constexpr (RT > 1) _tile_loadd(5, a.base + a.tile + s * a.step, a.row);
    _tile_loadd(6, b.base + s * b.step, b.row);
    if constexpr (CT > 1) _tile_loadd(7, b.base + b.tile + s * b.step, b.row);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT > 1 && CT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_row);
  if constexpr (CT > 1) _tile_stored(1, c + 64, c_row);
  if constexpr (RT > 1) _tile_stored(2, c + c_tile, c_row);
  if constexpr (RT > 1 && CT > 1) _tile_stored(3, c + c_tile + 64, c_row);
}

// c [row_tiles x 16][lanes] floats (+)= A . B over `steps`, in blocks of two row tiles by two lane tiles.
template <bool kLoad>
SIMD_AMX_BF16 void amx_product(const TileOperand& a, int64_t row_tiles, const TileOperand& b, int64_t lanes,
                               int64_t steps, float* c) {
  const int64_t c_row = lanes * 4, c_tile = 16 * c_row, lane_tiles = lanes / 16;
  for (int64_t r = 0; r < row_tiles; r += 2) {
    const TileOperand ar{a.base + r * a.tile, a.row, a.tile, a.step};
    for (int64_t q = 0; q < lane_tiles; q += 2) {
      const TileOperand bq{b.base + q * b.tile, b.row, b.tile, b.step};
      char* cq = reinterpret_cast<char*>(c) + r * c_tile + q * 64;
      const bool two_rows = row_tiles - r > 1, two_lanes = lane_tiles - q > 1;
      if (two_rows && two_lanes) amx_chain<2, 2, kLoad>(ar, bq, steps, cq, c_row, c_tile);
      else if (two_rows) amx_chain<2, 1, kLoad>(ar, bq, steps, cq, c_row, c_tile);
      else if (two_lanes) amx_chain<1, 2, kLoad>(ar, bq, steps, cq, c_row, c_tile);
      else amx_chain<1, 1, kLoad>(ar, bq, steps, cq, c_row, c_tile);
    }
  }
}

// Kv head h's rows of a block (`padded` keys, a multiple of kTileDepth, from block_rows) as path 4's A
// operands: K's rows copied contiguous into kt [padded][D] (bf16), V's transposed into key pairs vt
// [D][padded / 2] (element e, pair tp: V[2tp][e] low, V[2tp + 1][e] high). The transpose takes 32 keys x
// 32 elements at a time: each key pair's rows interleaved (unpacklo / unpackhi_epi16: pairs of elements
// 8L .. 8L + 3 and 8L + 4 .. 8L + 7 in 128-bit lane L), then two 16 x 16 transposes of the pairs.
SIMD_AVX512 void amx_head_rows(const char* const* krow, const char* const* vrow, int64_t h, int64_t d,
                               int64_t padded, uint16_t* kt, uint32_t* vt, Prefetcher& pf) {
  const int64_t head_bytes = d * 2, pairs = padded / 2;
  for (int64_t t = 0; t < padded; ++t) {
    if (t % 8 == 0) pf.step(kPrefetchStep);
    memcpy(kt + t * d, krow[t] + h * head_bytes, head_bytes);
  }
  for (int64_t tp0 = 0; tp0 < pairs; tp0 += 16) {
    pf.step(kPrefetchStep);
    for (int64_t e0 = 0; e0 < d; e0 += 32) {
      __m512i lo[16], hi[16];
      for (int j = 0; j < 16; ++j) {
        const char* v0 = vrow[2 * (tp0 + j)] + h * head_bytes + e0 * 2;
        const char* v1 = vrow[2 * (tp0 + j) + 1] + h * head_bytes + e0 * 2;
        const __m512i a = _mm512_loadu_si512(v0), b = _mm512_loadu_si512(v1);
        lo[j] = _mm512_unpacklo_epi16(a, b);
        hi[j] = _mm512_unpackhi_epi16(a, b);
      }
      simd::transpose16(lo);
      simd::transpose16(hi);
      for (int i = 0; i < 16; ++i) {
        const int64_t e = e0 + 8 * (i / 4) + i % 4;
        _mm512_storeu_si512(vt + e * pairs + tp0, lo[i]);
        _mm512_storeu_si512(vt + (e + 4) * pairs + tp0, hi[i]);
      }
    }
  }
}

// Path 4's layout of block b (keys b * kBlock ..) of request r, kv head h, into kt [kBlock][D] and vt [D]
// [kBlock / 2]: a whole block, keys past the request's end from the dummy slot 0 (zeros). Items whose
// last block ends sooner read the first rows of it; the keys after an item's tokens are weighted 0, so
// real K/V there give the bits the dummy's zeros give.
void amx_layout_block(const Problem& p, int64_t r, int64_t b, int64_t h, uint16_t* kt, uint32_t* vt, Scratch& w) {
  const int64_t* slots = p.table + p.rows[r] * p.table_stride;
  const int64_t b0 = b * kBlock, keys = std::min(kBlock, p.seq_lens[r] - b0);
  for (int64_t t = 0; t < kBlock; ++t) {
    const int64_t slot = t < keys ? slots[b0 + t] : 0;
    w.krow[t] = p.row(p.k_buf, slot);
    w.vrow[t] = p.row(p.v_buf, slot);
  }
  Prefetcher none;  // nothing to fetch ahead: the next task is another block
  amx_head_rows(w.krow.data(), w.vrow.data(), h, p.head_dim, kBlock, kt, vt, none);
}

// acc^T [D][lanes] rescaled lane by lane by the online softmax's corrections; a panel none of whose
// corrections differs from 1 (its running max unchanged, most blocks past the first few) is skipped.
SIMD_AVX512 inline void rescale_lanes(float* acct, int64_t d, int64_t lanes, const float* corr) {
  for (int64_t i = 0; i < lanes; i += 16) {
    const __m512 c = _mm512_loadu_ps(corr + i);
    if (_mm512_cmp_ps_mask(c, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) == 0) continue;
    for (int64_t e = 0; e < d; ++e) {
      _mm512_storeu_ps(acct + e * lanes + i, _mm512_mul_ps(_mm512_loadu_ps(acct + e * lanes + i), c));
    }
  }
}

// exp(x) on 16 lanes within ~3e-6 relatively (x clamped at -100; NaN gives exp(-100)): 2^n (vscalefps)
// times 2^f, x log2 e = n + f with f in [-0.5, 0.5], 2^f by its Taylor polynomial of degree 5. Half the
// operations of simd::exp_avx512 (within 2 ulp); path 4's softmax only, whose weights are rounded to
// bf16 (4e-3) for P.V.
SIMD_AVX512 inline __m512 exp_fast(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.3333558e-3f);  // (ln 2)^k / k!, k = 5 .. 0
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// lanes16::lanes_softmax for path 4, one panel: the same running max (lanes_max), the weights by
// exp_fast, and written only as bf16 key pairs into pp (rows `lanes` apart; pack_weights' layout),
// which is all P.V reads; the sum takes them in float32, key by key in order.
template <bool kWindow, bool kCap>
SIMD_AMX_BF16 void amx_softmax(float* st, int64_t lanes, int64_t b0, int64_t keys, int64_t padded,
                               const int32_t* pos, int64_t window, float cap, float* m, float* l, float* corr,
                               uint32_t* pp) {
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 mx = lanes16::lanes_max<kWindow, kCap>(st, lanes, b0, keys, pos, window, cap, m_old);
  __m512 sum = _mm512_setzero_ps();
  auto weight = [&](int64_t t) SIMD_AVX512 {
    if (t >= keys) return _mm512_setzero_ps();
    const __m512 e = exp_fast(_mm512_sub_ps(_mm512_loadu_ps(st + t * lanes), mx));
    return _mm512_maskz_mov_ps(lanes16::sees<kWindow>(pos, b0 + t, window), e);
  };
  for (int64_t t = 0; t < padded; t += 2) {
    const __m512 w0 = weight(t), w1 = weight(t + 1);
    sum = _mm512_add_ps(_mm512_add_ps(sum, w0), w1);
    _mm512_storeu_si512(pp + t / 2 * lanes, Avx512::pairs_of(w0, w1));
  }
  const __m512 c = exp_fast(_mm512_sub_ps(m_old, mx));  // ~0 on the first block (m = -inf)
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), c, sum));
  _mm512_storeu_ps(m, mx);
  _mm512_storeu_ps(corr, c);
}

// A request chunk over a bf16 pool on path 4 (D a multiple of kTileDepth): lanes16::item_lanes's walk,
// with the two products on tiles, over its request's blocks as laid out for the call (p.amx_first) or,
// where they are not (a sliding window: its items start at different keys), as it lays them out.
template <bool kWindow, bool kCap>
SIMD_AMX_BF16 void item_amx(const Problem& p, const Item& it, const Span& sp, Scratch& w) {
  constexpr int64_t kl = Avx512::kLanes;
  const int64_t d = p.head_dim, rows = sp.tokens * p.group;
  const int64_t panels = (rows + kl - 1) / kl, lanes = panels * kl;
  float *st = w.s.data(), *corr = w.corr.data();
  uint32_t* pp = w.ppairs.data();
  const char** krow = w.krow.data();
  const char** vrow = w.vrow.data();
  const int64_t first_block = p.amx_first != nullptr && sp.from == 0 ? p.amx_first[it.r] : -1;
  Prefetcher pf;
  lane_queries(p, it, sp, lanes, true, true, w, pf);
  amx_attention_tiles();
  for (int64_t b0 = sp.from; b0 < sp.len; b0 += kBlock) {
    const int64_t keys = std::min(kBlock, sp.len - b0);
    const int64_t padded = (keys + kTileDepth - 1) / kTileDepth * kTileDepth;
    if (first_block < 0) block_rows(p, it, sp, b0, keys, padded, krow, vrow, pf);
    for (int64_t h = it.h0; h < it.h1; ++h) {
      const int64_t hi = h - it.h0;
      float *acc = w.acc.data() + hi * d * lanes, *m = w.m.data() + hi * lanes, *l = w.l.data() + hi * lanes;
      const uint16_t* kt = w.ktile.data();
      const uint32_t* vt = w.vt.data();
      int64_t vt_row = padded * 2;  // bytes between V^T rows
      if (first_block >= 0) {
        const int64_t at = (first_block + b0 / kBlock) * p.kv_heads + h;
        kt = p.amx_k + at * kBlock * d;
        vt = p.amx_v + at * d * (kBlock / 2);
        vt_row = kBlock * 2;
      } else {
        amx_head_rows(krow, vrow, h, d, padded, w.ktile.data(), w.vt.data(), pf);
      }
      const TileOperand k_rows{reinterpret_cast<const char*>(kt), d * 2, 16 * d * 2, 64};
      const TileOperand q_pairs{reinterpret_cast<const char*>(w.qpairs.data() + hi * (d / 2) * lanes), lanes * 4, 64,
                                16 * lanes * 4};
      amx_product<false>(k_rows, padded / 16, q_pairs, lanes, d / kTileDepth, st);
      for (int64_t c = 0; c < panels; ++c) {
        amx_softmax<kWindow, kCap>(st + c * kl, lanes, b0, keys, padded, w.pos.data() + c * kl, sp.window,
                                   p.softcap, m + c * kl, l + c * kl, corr + c * kl, pp + c * kl);
      }
      rescale_lanes(acc, d, lanes, corr);
      const TileOperand v_pairs{reinterpret_cast<const char*>(vt), vt_row, 16 * vt_row, 64};
      const TileOperand p_pairs{reinterpret_cast<const char*>(pp), lanes * 4, 64, 16 * lanes * 4};
      amx_product<true>(v_pairs, d / 16, p_pairs, lanes, padded / kTileDepth, acc);
    }
    pf.finish();
  }
  _tile_release();
  lane_outputs(p, it, sp, lanes, true, w);
}

// The path a call runs: the widest of the mode asked for (0 scalar, 1 AVX2, 2 AVX-512 on prefill
// chunks, 3 that and, over a bf16 pool, their scores and P.V by vdpbf16ps) that the CPU has, where a
// head is whole 8-float vectors; otherwise the scalar one. Mode 4 asks for 2 with a bf16 pool's prefill
// chunks on AMX tiles: path 4 where the CPU has AMX-BF16 and a head is whole 32-element tiles, else 2
// (not 3: the CPUs with AMX measured so far run vdpbf16ps at half the FMAs' rate).
int select_path(int mode, bool avx2, bool avx512, bool avx512_bf16, bool amx_bf16, int64_t head_dim) {
  if (mode == 0 || !avx2 || head_dim % 8 != 0) return 0;
  if (mode == 1 || !avx512) return 1;
  if (mode == 4) return amx_bf16 && head_dim % kTileDepth == 0 ? 4 : 2;
  return mode == 3 && avx512_bf16 ? 3 : 2;
}

// f(window, cap) with each flag a compile-time bool (std::true_type / std::false_type): the branch is
// taken once per item, and an item without either runs code that has neither.
template <typename F>
void with_features(bool window, bool cap, F&& f) {
  if (window) {
    if (cap) f(std::true_type{}, std::true_type{});
    else f(std::true_type{}, std::false_type{});
  } else {
    if (cap) f(std::false_type{}, std::true_type{});
    else f(std::false_type{}, std::false_type{});
  }
}

// The groups (laid out [3, G] as ca_decode takes them) every member of which sees the whole shared prefix
// through its window: a member decoding at position seq_len - 1 sees keys from seq_len - window on, the
// prefix only if seq_len <= window. The others are not formed for this layer, their members run alone:
// a group item walks its keys once for every member, so it cannot start at each one's window.
int64_t groups_in_window(const int64_t* groups, int64_t num_groups, const int64_t* members, const int64_t* seq_lens,
                         int64_t window, std::vector<int64_t>& kept) {
  auto seen_whole = [&](int64_t g) {
    const int64_t* begin = members + groups[g];
    return std::all_of(begin, begin + groups[num_groups + g], [&](int64_t r) { return seq_lens[r] <= window; });
  };
  int64_t n = 0;
  for (int64_t g = 0; g < num_groups; ++g) n += seen_whole(g);
  kept.resize(3 * n);
  for (int64_t g = 0, i = 0; g < num_groups; ++g) {
    if (!seen_whole(g)) continue;
    for (int64_t f = 0; f < 3; ++f) kept[f * n + i] = groups[f * num_groups + g];
    ++i;
  }
  return n;
}

}  // namespace

extern "C" {

int ca_has_avx2_fma(void) { return simd::cpu_has_avx2_fma(); }

int ca_has_avx512(void) { return simd::cpu_has_avx512(); }

int ca_has_avx512_bf16(void) { return simd::cpu_has_avx512_bf16(); }

// vdpbf16ps's measured flop rate over float32 FMAs' here (0 without AVX512-BF16): whether path 3 pays.
double ca_bf16_dot_over_fma(void) { return simd::bf16_dot_over_fma(); }

double ca_fma_zmm_over_ymm(void) { return simd::fma_zmm_over_ymm(); }

int ca_full_width_zmm(void) { return simd::full_width_zmm(); }

int ca_has_amx_bf16(void) { return simd::cpu_has_amx_bf16(); }

// Exposed so tests can hand in a fake CPU feature set and see which path it picks.
int ca_select_path(int mode, int cpu_has_avx2_fma, int cpu_has_avx512, int cpu_has_avx512_bf16,
                   int cpu_has_amx_bf16, int64_t head_dim) {
  return select_path(mode, cpu_has_avx2_fma != 0, cpu_has_avx512 != 0, cpu_has_avx512_bf16 != 0,
                     cpu_has_amx_bf16 != 0, head_dim);
}

// One head's d floats x as int8 codes and their scale, as pool.py's quantize_int8 computes them: scale =
// max |x| / 127, code = x / scale rounded to nearest even (nearbyintf in the default rounding mode), all
// codes 0 where the head is all zeros.
void quantize_head(const float* x, int64_t d, int8_t* codes, float* scale) {
  float amax = 0.0f;
  for (int64_t e = 0; e < d; ++e) amax = std::max(amax, fabsf(x[e]));
  const float s = amax / 127.0f;
  *scale = s;
  for (int64_t e = 0; e < d; ++e) {
    const float c = s > 0.0f ? nearbyintf(x[e] / s) : 0.0f;
    codes[e] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, c)));
  }
}

// Copies row i of k and of v (Hkv * D contiguous floats each, `*_stride` floats apart) to slot loc[i]
// of k_buf / v_buf (kv_type: KvType): a bf16 pool's rounded to nearest even, an int8 pool's quantized per
// head (quantize_head) with the scales into k_scale / v_scale ([slots, Hkv]; unused otherwise): the new
// tokens' KV store.
void ca_store_kv(const float* k, int64_t k_stride, const float* v, int64_t v_stride, const int64_t* loc,
                 int64_t n, int64_t kv_heads, int64_t head_dim, void* k_buf, void* v_buf, float* k_scale,
                 float* v_scale, int kv_type, int threads) {
  const int64_t row_floats = kv_heads * head_dim;
  const int nt = n * row_floats >= kAttentionParallelMin ? threads : 1;
  const int64_t row_bytes = row_floats * kv_bytes(kv_type);
  char *kb = static_cast<char*>(k_buf), *vb = static_cast<char*>(v_buf);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < n; ++i) {
    char *kd = kb + loc[i] * row_bytes, *vd = vb + loc[i] * row_bytes;
    const float *ks = k + i * k_stride, *vs = v + i * v_stride;
    if (kv_type == kKvFloat32) {
      memcpy(kd, ks, row_bytes);
      memcpy(vd, vs, row_bytes);
    } else if (kv_type == kKvBf16) {
      uint16_t *kh = reinterpret_cast<uint16_t*>(kd), *vh = reinterpret_cast<uint16_t*>(vd);
      for (int64_t e = 0; e < row_floats; ++e) kh[e] = simd::bf16_round(ks[e]);
      for (int64_t e = 0; e < row_floats; ++e) vh[e] = simd::bf16_round(vs[e]);
    } else {
      int8_t *kq = reinterpret_cast<int8_t*>(kd), *vq = reinterpret_cast<int8_t*>(vd);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = h * head_dim;
        quantize_head(ks + at, head_dim, kq + at, k_scale + loc[i] * kv_heads + h);
        quantize_head(vs + at, head_dim, vq + at, v_scale + loc[i] * kv_heads + h);
      }
    }
  }
}

// out rows of `num_reqs` requests = causal attention of their new tokens over their KV (see the top of
// the file), however many new tokens each has. `requests` is int64 [4, num_reqs]: table rows, sequence
// lengths, first q rows and new-token counts (each >= 1). `groups` ([3, num_groups]: offsets into
// `members`, member counts, shared prefix lengths) lists decoding requests (one new token each) whose KV
// starts with the same prefix slots: that prefix is attended once for all members (0 groups: none).
// window: the layer's sliding window in keys, softcap its logit soft-cap (0: none, either).
// k_buf, v_buf: of kv_type (KvType); k_scale, v_scale: an int8 pool's scales ([slots, Hkv] float32; null
// for the others). mode: 0 = scalar, 1 = AVX2, 2 = AVX-512 (prefill chunks; decode on
// AVX2), 3 = 2 with, over a bf16 pool, prefill chunks' scores and P.V by vdpbf16ps (AVX512-BF16), 4 = 2
// with a bf16 pool's prefill chunks on AMX tiles (AMX-BF16), where select_path allows it.
void ca_decode(const float* q, int64_t q_stride, float* out, int64_t out_stride, const void* k_buf,
               const void* v_buf, const float* k_scale, const float* v_scale, int kv_type, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
               const int64_t* table, int64_t table_stride, const int64_t* requests, int64_t num_reqs,
               const int64_t* groups, int64_t num_groups, const int64_t* members, float scale, int64_t window,
               float softcap, int mode, int threads) {
  static const bool avx2 = simd::cpu_has_avx2_fma();
  static const bool avx512 = simd::cpu_has_avx512();
  static const bool avx512_bf16 = simd::cpu_has_avx512_bf16();
  static const bool amx_bf16 = simd::cpu_has_amx_bf16();
  const int path = select_path(mode, avx2, avx512, avx512_bf16, amx_bf16, head_dim);
  const int64_t group = num_q_heads / num_kv_heads;
  static thread_local std::vector<int64_t> prefix_of, kept_groups;
  static thread_local std::vector<float> state_m, state_l, state_acc;
  if (window > 0 && num_groups > 0) {
    num_groups = groups_in_window(groups, num_groups, members, requests + num_reqs, window, kept_groups);
    groups = kept_groups.data();
  }
  prefix_of.assign(num_reqs, 0);
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int64_t i = 0; i < groups[num_groups + g]; ++i) prefix_of[members[groups[g] + i]] = groups[2 * num_groups + g];
  }
  if (num_groups > 0) {
    grow(state_m, num_reqs * num_q_heads);
    grow(state_l, num_reqs * num_q_heads);
    grow(state_acc, num_reqs * num_q_heads * head_dim);
  }
  const bool bf16 = kv_type == kKvBf16;
  Problem p{q, q_stride, out, out_stride, static_cast<const char*>(k_buf), static_cast<const char*>(v_buf),
            kv_type, bf16, kv_type == kKvInt8, bf16 && path == 3, k_scale, v_scale, num_kv_heads, head_dim, group, table, table_stride, requests,
            requests + num_reqs, requests + 2 * num_reqs, requests + 3 * num_reqs, scale, window, softcap,
            groups, num_groups, members, prefix_of.data(), state_m.data(), state_l.data(), state_acc.data()};
  // Path 4 without a window: every prefill request's K/V blocks laid out for the tiles once, before its
  // items run (each of them walks the blocks from the first, so a block served each item's copy of it).
  static thread_local std::vector<int64_t> amx_first, amx_blocks;  // blocks: (request, block) pairs
  static thread_local std::vector<uint16_t> amx_k;
  static thread_local std::vector<uint32_t> amx_v;
  amx_blocks.clear();
  if (path == 4 && bf16 && window == 0) {
    amx_first.assign(num_reqs, -1);
    for (int64_t r = 0; r < num_reqs; ++r) {
      if (p.num_new[r] < 2 || prefix_of[r] > 0) continue;  // not a rows-as-lanes request
      amx_first[r] = static_cast<int64_t>(amx_blocks.size()) / 2;
      for (int64_t b = 0; b * kBlock < p.seq_lens[r]; ++b) amx_blocks.insert(amx_blocks.end(), {r, b});
    }
    const int64_t blocks = static_cast<int64_t>(amx_blocks.size()) / 2;
    grow(amx_k, blocks * num_kv_heads * kBlock * head_dim);
    grow(amx_v, blocks * num_kv_heads * head_dim * (kBlock / 2));
    p.amx_k = amx_k.data();
    p.amx_v = amx_v.data();
    p.amx_first = amx_first.data();
  }
  // The pool's threads read this thread's buffers through these.
  const int64_t layouts = static_cast<int64_t>(amx_blocks.size()) / 2 * num_kv_heads;
  const int64_t* layout_blocks = amx_blocks.data();
  uint16_t* layout_k = amx_k.data();
  uint32_t* layout_v = amx_v.data();
  // Every kv head in one item where there are enough items to keep the threads busy, otherwise an item
  // per head (one request decoding: its heads are the parallelism). A request's chunks run from its last.
  int64_t chunks = 0;
  const int64_t query_chunk = path == 4 && bf16 ? kAmxQueryChunk : kQueryChunk;
  for (int64_t r = 0; r < num_reqs; ++r) chunks += (p.num_new[r] + query_chunk - 1) / query_chunk;
  const int64_t head_step = chunks >= 2 * threads ? num_kv_heads : 1;
  static thread_local std::vector<Item> items;
  items.clear();
  // A group's prefix is the bulk of the step's arithmetic: it is split finely (a kv head and 8 or 16
  // members an item), so every thread has a share.
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t size = groups[num_groups + g];
    const int64_t chunk = size / kWideGroupChunk * num_kv_heads >= 2 * threads ? kWideGroupChunk : kGroupChunk;
    for (int64_t j0 = 0; j0 < size; j0 += chunk) {
      const int64_t j1 = std::min(size, j0 + chunk);
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({-1 - g, h, h + 1, j0, j1});
    }
  }
  const int64_t group_items = static_cast<int64_t>(items.size());
  int64_t work = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = p.num_new[r], keys = p.seq_lens[r] - prefix_of[r];
    work += (window > 0 ? std::min(keys, window) : keys) * n;
    for (int64_t j1 = n; j1 > 0; j1 -= query_chunk) {
      for (int64_t h = 0; h < num_kv_heads; h += head_step) {
        items.push_back({r, h, h + head_step, std::max<int64_t>(0, j1 - query_chunk), j1});
      }
    }
  }
  for (int64_t g = 0; g < num_groups; ++g) work += groups[num_groups + g] * groups[2 * num_groups + g];
  work *= num_q_heads * head_dim;
  const int64_t count = static_cast<int64_t>(items.size());
  const Item* list = items.data();  // items is this thread's: the pool's threads read it through this
  static const int64_t lanes16_rows =
      simd::full_width_zmm() ? Avx2::kLanes + 1 : lanes16::kTilePanels * Avx512::kLanes;
  const int nt = static_cast<int>(std::min<int64_t>(work >= kAttentionParallelMin ? threads : 1, count));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    Scratch& w = tls_scratch;
    w.fit(query_chunk * group, head_step, head_dim);  // group items are no larger
    // Prefill chunks (a request adding two or more tokens, all of a request's chunks alike so a
    // token's result does not depend on how its request was cut) and group items take the
    // rows-as-lanes path, on AVX-512 vectors where the item fills three panels of 16 rows (on fewer
    // rows part-empty panels made them slower than AVX2's on a Zen 4, whose zmm FMAs are two ymm
    // halves), or on full-width units where it has more rows than one AVX2 vector (there one part-empty
    // zmm does the work of two ymm: a 4-token chunk at context 3,900, 12 rows, took 0.75x the time on a
    // Zen 5); either width gives the same bits. Decode tokens take the row-major tiles. A window masks
    // keys only for a chunk's tokens after its first (Span::window), so those tiles, which serve single
    // tokens, have no window code.
    auto run = [&](const Item& it) {
      const Span sp = span_of(p, it);
      const bool lanes = it.r < 0 || (p.num_new[it.r] >= 2 && p.prefix_of[it.r] == 0);
      with_features(sp.window > 0, p.softcap > 0.0f, [&](auto window_t, auto cap_t) {
        constexpr bool kWindow = decltype(window_t)::value, kCap = decltype(cap_t)::value;
        if (path == 4 && p.bf16 && lanes && !sp.group) {
          item_amx<kWindow, kCap>(p, it, sp, w);
        } else if (path >= 2 && lanes && sp.tokens * group >= lanes16_rows) {
          lanes16::item_lanes<kWindow, kCap>(p, it, sp, w);
        } else if (path >= 1 && lanes) {
          lanes8::item_lanes<kWindow, kCap>(p, it, sp, w);
        } else if (path >= 1) {
          if (p.bf16) item_avx2<uint16_t, kCap>(p, it, sp, w);
          else if (p.int8) item_avx2<int8_t, kCap>(p, it, sp, w);
          else item_avx2<float, kCap>(p, it, sp, w);
        } else {
          item_scalar(p, it, sp, w);
        }
      });
    };
    // Group items first: their states are where the members' own items start (the loop's barrier); and
    // path 4's block layouts.
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < group_items; ++i) run(list[i]);
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < layouts; ++i) {  // block i / Hkv (as p.amx_first counts them), kv head i % Hkv
      const int64_t* block = layout_blocks + 2 * (i / num_kv_heads);
      amx_layout_block(p, block[0], block[1], i % num_kv_heads, layout_k + i * kBlock * head_dim,
                       layout_v + i * head_dim * (kBlock / 2), w);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = group_items; i < count; ++i) run(list[i]);
  }
}

}  // extern "C"
