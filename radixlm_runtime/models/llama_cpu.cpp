// The decoder stack of Llama-shaped models in one call, for float32 activations on CPUs with linears on
// linear_cpu.cpp's kernels (float32 panels or weight-only int8/int4): every layer's norms, projections,
// q/k norms, rotary, KV store, attention and gated MLP. Serves Llama/Mistral/Qwen2, Qwen3 (per-head q/k
// norms) and Gemma 2/3 (four norms a layer, GeGLU, a rotary table per layer type).
//
// Per layer the Python path makes about ten calls into the C++ kernels (norms, four linears,
// rotary, KV store, attention, the gated activation) plus their torch wrappers: at one decode token the
// interpreter's share of those, ~2.5 ms a step over 30 layers, is a fifth of the step. This file
// compiles the same kernels into one library (a unity build of their sources) and chains them here, so
// a step crosses from Python once and its results are bit-identical to the Python path's: the same
// kernels on the same buffers in the same order.
//
// Each layer arrives as kFields int64 values (pointers and sizes, laid out by llama_cpu.py):
//   0 input_norm, 1 post_attention_norm, 2 pre_feedforward_norm and 3 post_feedforward_norm (Gemma's
//   sandwich norms; 0: a plain pre-norm layer), 4 q_norm and 5 k_norm (per head; 0: none), 6 qkv_bias
//   (0: none), 7 k_buf, 8 v_buf (the KV pool's: float32, bf16 under --dtype bfloat16, int8 under
//   --kv-cache-dtype int8), 9 the attention's sliding window (0: none), 10 the layer's rotary table (an
//   index into cos / sin), 11 the MLP's activation (fused_cpu.cpp's Activation), 12 k_scale, 13 v_scale
//   (an int8 pool's per-token, per-head scales; 0: none), then four linears (qkv, o, gate_up, down) of 7
//   values each: q (or float32 panels), scales, mins (0: none), n, group, bits, k;
// and kAttentionFloats float32 values: 0 the attention's scale, 1 its logit soft-cap (0: none).
// Under tensor parallelism each rank holds some heads and MLP columns, and `reduce` (null: one process)
// sums the ranks' partial o_proj and down_proj outputs in `hidden` (tokens x hidden_size) after each.

#include "../attention/cpu_attention.cpp"
#include "../layers/fused_cpu.cpp"
#include "../layers/linear_cpu.cpp"

namespace {

constexpr int64_t kLinearFields = 7;
constexpr int64_t kLinearsAt = 14;
constexpr int64_t kFields = kLinearsAt + 4 * kLinearFields;
constexpr int64_t kAttentionFloats = 2;

// A linear's fields (kernel_args of its QuantizedWeight or FloatPanels, then in_features) as
// linear_cpu.cpp's Weights.
Weights linear_at(const int64_t* f) {
  return {reinterpret_cast<const uint8_t*>(f[0]), reinterpret_cast<const float*>(f[1]),
          reinterpret_cast<const float*>(f[2]), f[3], f[6], f[4], static_cast<int>(f[5])};
}

template <typename T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(v);
}

// The step's activations, kept across calls (grown, never shrunk) so decode steps do not allocate.
struct Buffers {
  std::vector<float> x, qkv, attn, gate_up, act;

  void fit(int64_t tokens, int64_t hidden, int64_t qkv_width, int64_t q_width, int64_t inter) {
    auto grow = [](std::vector<float>& v, int64_t size) {
      if (static_cast<int64_t>(v.size()) < size) v.resize(size);
    };
    grow(x, tokens * hidden);
    grow(qkv, tokens * qkv_width);
    grow(attn, tokens * q_width);
    grow(gate_up, tokens * 2 * inter);
    grow(act, tokens * inter);
  }
};

void run_linear(const Weights& w, const float* x, int64_t m, float* y, int mode, int threads) {
  rq_linear(x, m, w.k, w.q, w.scales, w.mins, w.n, w.group, w.bits, y, mode, threads);
}

}  // namespace

extern "C" {

// hidden [T, H]: the embeddings in, the last layer's MLP output out; residual [T, H]: the residual
// stream out (the model's final norm adds the two). cos, sin [tables, T, D / 2]. loc [T]: the new tokens'
// KV slots. window_loc, window_table: a windowed pool's window slots of them and its window table (null: none;
// every sliding-window layer reads them). table, requests, groups, members, kv_type (the KV pool's element type: float32, bf16, int8): as
// ca_decode takes them. Modes: the linears' kernel (rq_linear), the fused ops' and the attention's (0
// scalar, else SIMD: ca_decode's). layers and attention: per layer, see the top. Every op runs as the
// Python layer (models/base.py) runs it, in its order.
void lc_forward(const int64_t* layers, const float* attention, int64_t num_layers, int64_t hidden_size,
                int64_t inter, int64_t q_heads, int64_t kv_heads, int64_t head_dim, float eps, float* hidden,
                float* residual, int64_t tokens, const float* cos, const float* sin, const int64_t* loc,
                const int64_t* table, int64_t table_stride, const int64_t* window_loc,
                const int64_t* window_table, const int64_t* requests, int64_t num_reqs, const int64_t* groups,
                int64_t num_groups, const int64_t* members, int kv_type, int linear_mode, int fused_mode,
                int attention_mode, int threads, void (*reduce)(float*, int64_t)) {
  const int64_t q_width = q_heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width, rope_stride = tokens * (head_dim / 2);
  static thread_local Buffers b;
  b.fit(tokens, hidden_size, qkv_width, q_width, inter);
  float *x = b.x.data(), *qkv = b.qkv.data(), *attn = b.attn.data();
  memset(residual, 0, tokens * hidden_size * sizeof(float));  // layer 0's residual add: 0 + embeddings
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* f = layers + l * kFields;
    const float* a = attention + l * kAttentionFloats;
    const Weights qkv_w = linear_at(f + kLinearsAt), o_w = linear_at(f + kLinearsAt + kLinearFields);
    const Weights gate_up_w = linear_at(f + kLinearsAt + 2 * kLinearFields);
    const Weights down_w = linear_at(f + kLinearsAt + 3 * kLinearFields);
    const bool sandwich = f[2] != 0;
    rf_rms_norm(hidden, hidden_size, residual, ptr<const float>(f[0]), x, tokens, hidden_size, eps, fused_mode,
                threads);
    run_linear(qkv_w, x, tokens, qkv, linear_mode, threads);
    if (f[6]) {
      const float* bias = ptr<const float>(f[6]);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t i = 0; i < qkv_width; ++i) qkv[t * qkv_width + i] += bias[i];
      }
    }
    if (f[4]) {
      rf_head_rms_norm(qkv, qkv_width, tokens, q_heads, kv_heads, head_dim, ptr<const float>(f[4]),
                       ptr<const float>(f[5]), eps, fused_mode, threads);
    }
    rf_rope(qkv, qkv_width, cos + f[10] * rope_stride, sin + f[10] * rope_stride, tokens, q_heads + kv_heads,
            head_dim, fused_mode, threads);
    void *k_buf = ptr<void>(f[7]), *v_buf = ptr<void>(f[8]);
    float *k_scale = ptr<float>(f[12]), *v_scale = ptr<float>(f[13]);
    // A windowed pool keeps every sliding-window layer's KV in window slots (window_loc, window_table).
    const bool windowed = window_loc != nullptr && f[9] != 0;
    ca_store_kv(qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, windowed ? window_loc : loc, tokens,
                kv_heads, head_dim, k_buf, v_buf, k_scale, v_scale, kv_type, threads);
    ca_decode(qkv, qkv_width, attn, q_width, k_buf, v_buf, k_scale, v_scale, kv_type, q_heads, kv_heads, head_dim,
              windowed ? window_table : table, table_stride, requests, num_reqs, groups, num_groups, members, a[0], f[9], a[1], attention_mode,
              threads);
    run_linear(o_w, attn, tokens, hidden, linear_mode, threads);
    if (reduce) reduce(hidden, tokens * hidden_size);
    if (sandwich) {
      // The attention's output normed on its own (in place), then added into the stream by the
      // pre-feedforward norm.
      rf_rms_norm(hidden, hidden_size, nullptr, ptr<const float>(f[1]), hidden, tokens, hidden_size, eps,
                  fused_mode, threads);
      rf_rms_norm(hidden, hidden_size, residual, ptr<const float>(f[2]), x, tokens, hidden_size, eps, fused_mode,
                  threads);
    } else {
      rf_rms_norm(hidden, hidden_size, residual, ptr<const float>(f[1]), x, tokens, hidden_size, eps, fused_mode,
                  threads);
    }
    run_linear(gate_up_w, x, tokens, b.gate_up.data(), linear_mode, threads);
    rf_gated_act(b.gate_up.data(), b.act.data(), tokens, inter, static_cast<int>(f[11]), fused_mode, threads);
    run_linear(down_w, b.act.data(), tokens, hidden, linear_mode, threads);
    if (reduce) reduce(hidden, tokens * hidden_size);
    if (sandwich) {
      rf_rms_norm(hidden, hidden_size, nullptr, ptr<const float>(f[3]), hidden, tokens, hidden_size, eps,
                  fused_mode, threads);
    }
  }
}

}  // extern "C"
