"""Frozen configuration, one dataclass per layer: each layer is handed only its own part.

`ServerArgs` (server_args.py) composes them into the CLI's one set of flags; each field's help
text here is the flag's `--help`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Grammar engines of constrained decoding (radixlm_runtime/constrained/), the first the default.
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")
# --reasoning-parser names (radixlm_runtime/server/reasoning.py), as vLLM and SGLang call them.
REASONING_PARSERS = ("qwen3", "deepseek-r1")
# --router-policy names (radixlm_runtime/router/policy.py), as SGLang's router calls them.
ROUTER_POLICIES = ("cache_aware", "round_robin", "least_load")


def flag(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


def _check_choices(config: Any) -> None:
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        if choices and getattr(config, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {list(choices)}, got {getattr(config, f.name)!r}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The model executor: weights, device, KV memory."""

    model_path: str | None = flag(
        None, "Hugging Face model directory or .gguf file. Default: the embedded SmolLM2-135M-Instruct."
    )
    sampling_defaults: str = flag(
        "model",
        "Where a request's unset sampling fields come from. 'model': the temperature, top_p, top_k, min_p "
        "and repetition_penalty the model's generation_config.json recommends (as SGLang and vLLM do), the "
        "built-in defaults for the fields it leaves out; 'openai': always the built-in (OpenAI's) "
        "defaults. A request's own values always win.",
        ("model", "openai"),
    )
    device: str = flag("auto", "Device to run on: 'cpu', 'cuda' or 'auto' (cuda when available).")
    dtype: str = flag(
        "auto",
        "Weight and activation dtype. 'auto' is float32 on CPU and bfloat16 on CUDA. On CPU, 'bfloat16' "
        "runs the linear layers in bf16 (float weights stored as bf16, bf16 dot products with float32 "
        "accumulation; quantized weights multiplied in bf16 from 9 rows on) on CPUs with AVX512-BF16, "
        "the tensors between them staying float32, and holds the KV cache in bf16 (twice the tokens in the "
        "same memory); a CPU without bf16 dot products runs float32 (logged).",
        ("auto", "float32", "bfloat16", "float16"),
    )
    quantization: str = flag(
        "auto",
        "Weight-only quantization of the linear layers, activations and accumulation staying float32 "
        "(CPU). 'auto' keeps what the checkpoint has: a GGUF's quantized tensors are served from their "
        "own blocks (Q4_0/Q4_1/Q4_K as int4, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as int8; the embedded model: Q4_1 "
        "layers as int4, its Q8_0 lm_head as int8), an AWQ/GPTQ checkpoint's int4 weights as int4, a float "
        "checkpoint stays float. 'int8' (per output channel) and 'int4' (groups of 32 "
        "columns, scale and min) quantize every linear a checkpoint does not already hold at that width; "
        "the lm_head stays int8 under int4. 'none' serves float weights (a GGUF dequantized). Embeddings "
        "stay float. On CUDA only 'none' and 'auto' (float weights there) are implemented.",
        ("auto", "none", "int8", "int4"),
    )
    cpu_act_quant: str = flag(
        "none",
        "Activations into the int4/int8 quantized linears on CPU. 'int8': quantized per token and 32 "
        "columns on the fly (as llama.cpp's Q8 blocks) and multiplied with the weights' integer codes "
        "(AVX512-VNNI, AVX-VNNI or AVX2 byte products, whichever the CPU has), int32 sums "
        "scaled once per block: 1.4x the float32 kernels at one row, 2-2.7x from 16 rows (Zen 4), the same "
        "bits at any batch shape, the weights repacked for it at load (the lm_head's included). A "
        "CPU without AVX2 runs float32 activations (logged). 'none' (default: the greedy text stays "
        "transformers'; int8 keeps GSM8K/MMLU accuracy within 1 question per 100 but changes the text, "
        "see benchmarks/README.md): float32 activations.",
        ("none", "int8"),
    )
    attention_backend: str = flag(
        "auto",
        "Attention kernels: 'cpu' (default on CPU for float32: decode in C++ reading K/V in place from the "
        "KV pool, prefill chunks as in 'torch'), 'torch' (plain torch, the reference; default on CPU for "
        "other dtypes) or 'triton' (default on CUDA). 'auto' skips a backend whose kernels lack a feature "
        "the model's layers use (sliding window, logit soft-cap); a named one that lacks it is an error.",
        ("auto", "cpu", "torch", "triton"),
    )
    kv_cache_dtype: str = flag(
        "auto",
        "What the KV cache stores. 'auto': the model's dtype (float32 on CPU; bf16 under --dtype bfloat16"
        " on CPU and on CUDA). 'bfloat16': K and V rounded to bf16 under float32 arithmetic (half "
        "float32's bytes, so twice the tokens and half a decode's reads); on a CPU whose vdpbf16ps outruns "
        "its float32 FMAs (timed at start: AMD Zen 4 yes, Intel Sapphire Rapids no) the C++ prefill "
        "attention then runs on vdpbf16ps (1.5x float32 on a Zen 4; the fastest CPU setting there with "
        "--quantization auto --cpu-act-quant int8). 'int8': K and V as int8 with a float32 scale per "
        "token and kv head (symmetric, max |x| / 127), quantized as they are stored and read directly by "
        "every attention backend (C++ CPU, torch, Triton; dequantized in registers or per block, never a "
        "dequantized copy of the pool): 3.8x float32's tokens in the same memory at head dim 64, and a "
        "decode reads a quarter of the bytes. 'fp8_e4m3': float8 K/V, on CUDA GPUs of compute capability "
        "8.9 or later (torch and Triton backends); a ValueError on the CPU. The host KV tier stores what "
        "the pool stores. Accuracy: see benchmarks/README.md (bench_kv_quant.py).",
        ("auto", "bfloat16", "int8", "fp8_e4m3"),
    )
    max_total_tokens: int | None = flag(
        None, "Size of the KV cache pool in tokens. Default: derived from --mem-fraction-static."
    )
    swa_full_tokens_ratio: float = flag(
        0.8,
        "Models with sliding-window layers (Gemma 2 and 3, gpt-oss, Qwen2 with use_sliding_window): "
        "those layers keep their KV in a pool of their own of this many slots per token of the "
        "pool, since a token's KV there is needed only while it is within a query's window. The "
        "radix cache keeps a cached prefix's window KV at its end while there is room and drops it "
        "least recently used first; a prefix without it is recomputed from the last point that "
        "has it. Lower holds more tokens in the same memory at the cost of fewer reusable prefix "
        "ends. The host KV tier keeps window slots in the same ratio, and the host and disk tiers keep "
        "the window KV before the ends of finished sequences. 1 keeps every layer in the one pool. "
        "SGLang's flag of the same name.",
    )
    kv_host_tokens: int = flag(
        0,
        "Size in tokens of the host KV tier under the radix cache (0: none). Cached prefixes evicted "
        "from the KV pool are copied there instead of dropped, and a later request whose prefix is "
        "there loads it back before its forward instead of recomputing it; the least recently used "
        "go when it is full. It lives in host memory (pinned on CUDA), as many bytes per token as "
        "the pool (with window slots, --swa-full-tokens-ratio, as many of those per token too).",
    )
    kv_disk_dir: str | None = flag(
        None,
        "Directory of the disk KV tier under the host tier (needs --kv-host-tokens): cached prefixes "
        "leaving the host tier are written there (one file per radix-tree node, a checksummed header "
        "and raw tensor bytes, written atomically) instead of dropped, and read back through the host "
        "tier when a request's prefix is there. Entries live in a subdirectory per model identity (a "
        "digest of the weights and config, the numeric settings and the KV layout), so a server started "
        "again on the same model and directory serves the prefixes it finds there, and another model or "
        "KV format never reads them. A file that fails its checksum is deleted and its tokens recomputed. "
        "One server per directory (a second one is refused): give each replica its own.",
    )
    kv_disk_bytes: int = flag(
        8 * 2**30,
        "Size cap of the disk KV tier: its entry files' bytes, headers included (an entry counts whole "
        "until its file is deleted); the least recently used entries go when it is full. Default 8 GiB.",
    )
    mem_fraction_static: float | None = flag(
        None,
        "Fraction of available memory after the weights are loaded given to the KV cache pool when "
        "--max-total-tokens is not set. CPU: of the host's available RAM, default 0.15 (the host keeps "
        "running everything else). CUDA: of the free GPU memory left once the activations of the "
        "largest steps (a --chunked-prefill-size prefill, the largest CUDA-graph decode batch), "
        "measured at start-up, are set aside; default 0.9.",
    )
    max_running_requests: int = flag(
        128, "Most requests decoding at once in the running batch (sizes the request-to-token table)."
    )
    context_length: int | None = flag(
        None, "Longest prompt + output in tokens. Default: the model's max_position_embeddings."
    )
    num_threads: int | None = flag(None, "torch intra-op threads on CPU. Default: all cores.")
    cpu_thread_policy: str = flag(
        "adaptive",
        "How many of the --num-threads the CPU kernels use. 'adaptive': every half second, one fewer per "
        "core that other processes keep busy (from 0.75 of a core, counting the time our threads waited "
        "for one), back once they leave it: kernel threads meet at a barrier after every parallel loop, "
        "and a thread on a shared core makes each barrier wait for it (2.8x the idle time with one of two "
        "cores taken, where one thread takes 2x). 'fixed': always --num-threads.",
        ("adaptive", "fixed"),
    )
    deterministic: bool = flag(
        False,
        "Batch-invariant kernels: a request gets the same tokens and logprobs whatever it is batched "
        "with and whether its prefix came from the radix cache. Every token attends on its own (the "
        "decode kernel); linears run on kernels whose tiling does not depend on the row count (CUDA: a "
        "Triton matmul; CPU: the float32 and quantized panel kernels and int8 activations as they are, "
        "other CPU linears in fixed blocks of 16 rows). "
        "It costs throughput (see benchmarks/README.md). Needs the 'cpu' or 'triton' attention backend.",
    )
    tp_size: int = flag(
        1,
        "Tensor parallelism: run the model on this many rank processes (torch.distributed: gloo on CPU, "
        "NCCL on CUDA, one GPU a rank), each holding 1/N of every layer. q/k/v and gate/up are split by "
        "output features, o_proj and down_proj by input features (one all-reduce after each), the embedding "
        "and lm_head by vocabulary rows. Query heads are split in whole KV-head groups, unevenly where the "
        "KV heads do not divide (3 KV heads on 2 ranks: 2 groups and 1); with fewer KV heads than ranks "
        "each KV head is replicated on N / kv_heads ranks, which split its group. Rank 0 runs the scheduler "
        "and sends each step's plan to the others. On CPU each rank takes --num-threads (default: the "
        "cores / N) threads, so 2 ranks on a 2-core machine are no faster than one (see "
        "benchmarks/bench_tp.py). Dense models only (no MoE).",
    )
    disable_cuda_graph: bool = flag(
        False,
        "On CUDA, run decode steps eagerly instead of replaying the CUDA graphs captured at start-up "
        "(for debugging; each eager step launches ~300 kernels from Python).",
    )
    cuda_graph_max_bs: int = flag(
        256,
        "Largest decode batch replayed from a CUDA graph; one graph is captured per padded batch size "
        "up to it (capped by --max-running-requests). Larger decode batches and every step with a "
        "prefill chunk run eagerly.",
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.kv_host_tokens < 0:
            raise ValueError(f"kv_host_tokens must be >= 0, got {self.kv_host_tokens}")
        if self.kv_disk_bytes <= 0:
            raise ValueError(f"kv_disk_bytes must be > 0, got {self.kv_disk_bytes}")
        if self.kv_disk_dir is not None and self.kv_host_tokens == 0:
            raise ValueError("kv_disk_dir needs a host tier to load through: set kv_host_tokens > 0")
        if self.kv_disk_dir is not None and self.tp_size > 1:
            raise ValueError(
                "kv_disk_dir: no disk tier under tensor parallelism (tp_size > 1) yet: each rank holds "
                "its own KV heads, so each would write and read its own shard of every entry, and the "
                "tensor-parallel executor does not run the tree's disk reads (move_kv) on its ranks. "
                "Use tp_size 1 with a disk tier, or no kv_disk_dir"
            )


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching, cache policy and program sessions."""

    chunked_prefill_size: int = flag(
        1024,
        "Token budget of one forward step. Longer prompts are prefilled in chunks so they never "
        "stall running decodes.",
    )
    prefill_step_target_ms: float = flag(
        250.0,
        "Wall time a step carrying prefill is sized to while no request decodes (it bounds the wait "
        "of requests arriving behind a long prompt's chunk); while streamed requests decode, "
        "--prefill-step-decode-ratio sizes it instead. Step times are measured on this device while "
        "serving (the decode step alone as costs per step, per token and per key its tokens attend to; "
        "prefill as costs per token, per token x context, the attention work, and per key before a "
        "chunk; recent steps weighing most), and each chunk gets what fits at its own context, between "
        "16 and --chunked-prefill-size tokens a step. "
        "0: every step takes --chunked-prefill-size tokens, however long that takes.",
    )
    prefill_step_decode_ratio: float = flag(
        2.5,
        "With --prefill-step-target-ms, while requests decode and one of them is streamed, a step "
        "carrying prefill is sized to this many times the measured time of their decode step alone at "
        "short context: a long prompt's chunks then stretch a running stream's gaps by at most this "
        "factor, on any device (a long-context request's slower decode takes from the prefill's share, "
        "not the streams' gaps). Requests nobody streams (offline batches, non-streamed responses) see "
        "only their end, and their steps are sized by --prefill-step-target-ms. 0: "
        "--prefill-step-target-ms applies while requests decode too.",
    )
    disable_prefill_interleave: bool = flag(
        False,
        "Let a long prompt's remaining prefill chunks finish before another waiting request starts. By "
        "default a waiting prompt that fits a step's budget whole, or is much shorter than the long "
        "prompt's remainder, runs ahead of them (several prompts are then prefilled in chunks at "
        "once, shortest remainder first; the one that started first keeps a quarter of each step's "
        "prefill budget, so it always advances).",
    )
    schedule_policy: str = flag(
        "lpm",
        "Order of the waiting queue: 'lpm' (longest cached prefix first), 'dfs-weight' (walk the "
        "radix tree so requests sharing a prefix run together) or 'fcfs' (arrival order).",
        ("lpm", "dfs-weight", "fcfs"),
    )
    enable_priority_scheduling: bool = flag(
        False,
        "Admit waiting requests by their `priority` field first (larger values first, as in SGLang), "
        "the schedule policy ordering requests of equal priority. Waiting raises a request's "
        "priority by one level every --priority-aging-s seconds, so nothing starves.",
    )
    schedule_low_priority_values_first: bool = flag(
        False, "With --enable-priority-scheduling, smaller `priority` values go first (vLLM's convention)."
    )
    priority_aging_s: float = flag(
        10.0, "Seconds of waiting that raise a request's effective priority by one level."
    )
    disable_radix_cache: bool = flag(False, "Do not reuse KV across requests (for ablations and baselines).")
    kv_host_write_policy: str = flag(
        "write_back",
        "With --kv-host-tokens, when a cached prefix's KV is copied to the host tier: 'write_back' when "
        "it is evicted from the KV pool (only what leaves the pool is copied, at the step that evicts "
        "it), 'write_through' as soon as it is cached (every computed prefix is copied, and evicting "
        "it later costs no copy).",
        ("write_back", "write_through"),
    )
    kv_disk_write_policy: str = flag(
        "write_through",
        "With --kv-disk-dir, when a cached prefix's KV is written to the disk tier: 'write_through' as "
        "soon as it is cached (default: everything the server computed survives a restart or a crash, "
        "and leaving the host tier costs no write), 'write_back' when it is evicted from the host tier "
        "and at a graceful shutdown what is still only in memory, as far as the tier has free room (less "
        "disk traffic; a crash loses what was only in memory).",
        ("write_through", "write_back"),
    )
    disable_kv_disk_prefetch: bool = flag(
        False,
        "With --kv-disk-dir, read a waiting request's prefix from the disk tier only when it is "
        "admitted, in the step that needs it. By default it is read ahead on a thread of its own while "
        "the request waits (up to the host tier's size in bytes at a time), and the request waits for "
        "that read while other requests' steps run instead of stalling a step on the disk.",
    )
    disable_overlap_schedule: bool = flag(
        False,
        "Plan each step only after the previous one's tokens are read back. By default, where steps "
        "run asynchronously (CUDA), the next step is planned while the device runs the current one "
        "(its decode inputs are the tokens still on the device); a request that finishes then "
        "computes one token more, which is dropped. Steps with constrained, penalised or "
        "speculative requests, or short of KV memory, are never overlapped.",
    )
    grammar_backend: str = flag(
        GRAMMAR_BACKENDS[0],
        "Grammar engine of regex / json_schema / ebnf constraints: 'llguidance' (compiles lazily in "
        "milliseconds, cheapest mask on CPU) or 'xgrammar' (precompiled masks; slower to compile "
        "large schemas). See benchmarks/bench_constrained.py.",
        GRAMMAR_BACKENDS,
    )
    disable_jump_forward: bool = flag(
        False,
        "Decode the text a regex / json_schema / ebnf constraint forces (keys, punctuation, literals) "
        "token by token instead of appending it without decode steps (for ablations). Requests that return "
        "logprobs never jump, so every output token has its logprob.",
    )
    new_token_ratio: float = flag(
        0.5,
        "Fraction of a running request's remaining max_new_tokens reserved when admitting new "
        "requests; lower admits more but retracts more often.",
    )
    random_seed: int = flag(0, "Seed for requests that give no seed of their own.")
    session_timeout_s: float = flag(
        60.0,
        "Seconds a program session (requests sharing a session_id) may stay idle before it is closed "
        "and the KV of its history, pinned between its calls, is released.",
    )
    session_pin_fraction: float = flag(
        0.5,
        "Share of the KV pool that idle sessions' pinned histories keep when requests need the "
        "memory; beyond it they are unpinned, least recently used first. Pins never stall the "
        "queue: when nothing else can run, any pin gives way.",
    )
    speculative_num_draft_tokens: int = flag(
        0,
        "Speculative decoding by prompt lookup (no draft model): each decoding request proposes up "
        "to this many tokens that followed an earlier occurrence of its last tokens in its prompt "
        "and output, and one forward verifies them all; outputs are distributed exactly as without "
        "it (greedy outputs are the same tokens). 0 turns it off.",
    )
    speculative_ngram_min_match_window_size: int = flag(
        1, "Shortest run of last tokens that prompt lookup matches (it tries the longest first)."
    )
    speculative_ngram_max_match_window_size: int = flag(
        3, "Longest run of last tokens that prompt lookup matches."
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.chunked_prefill_size < 16:
            raise ValueError(f"chunked_prefill_size must be >= 16, got {self.chunked_prefill_size}")
        if self.prefill_step_target_ms < 0:
            raise ValueError(f"prefill_step_target_ms must be >= 0, got {self.prefill_step_target_ms}")
        if self.prefill_step_decode_ratio < 0:
            raise ValueError(f"prefill_step_decode_ratio must be >= 0, got {self.prefill_step_decode_ratio}")
        if not self.session_timeout_s > 0:
            raise ValueError(f"session_timeout_s must be > 0, got {self.session_timeout_s}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not 0.0 <= self.session_pin_fraction <= 1.0:
            raise ValueError(f"session_pin_fraction must be in [0, 1], got {self.session_pin_fraction}")
        if self.speculative_num_draft_tokens < 0:
            raise ValueError(
                f"speculative_num_draft_tokens must be >= 0, got {self.speculative_num_draft_tokens}"
            )
        low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "speculative_ngram_min_match_window_size and speculative_ngram_max_match_window_size "
                f"must satisfy 1 <= min <= max, got {low} and {high}"
            )


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The HTTP process (radixlm-server / python -m radixlm_runtime.launch_server)."""

    host: str = flag("127.0.0.1", "Address the HTTP server binds to. Use 0.0.0.0 to serve other machines.")
    port: int = flag(30000, "Port the HTTP server listens on.")
    api_key: str | None = flag(
        None, "When set, every endpoint except /health requires 'Authorization: Bearer <api-key>'."
    )
    served_model_name: str | None = flag(
        None, "Model name reported by /v1/models and in OpenAI responses. Default: the model directory name."
    )
    allow_any_model_name: bool = flag(
        False,
        "Serve OpenAI requests whatever their `model` names. By default a `model` other than the "
        "served model name gets 404 model_not_found, as OpenAI answers; this is for clients that "
        "send a fixed name.",
    )
    max_queued_requests: int = flag(
        4096,
        "Most requests (counting each of n samples) admitted but not finished; beyond it the server "
        "answers 503 with Retry-After instead of queueing without bound.",
    )
    max_request_bytes: int = flag(
        8 * 1024 * 1024, "Largest accepted request body in bytes; larger bodies get HTTP 413."
    )
    max_n: int = flag(
        128, "Most samples (n) one request may ask for per prompt, as OpenAI allows; more get HTTP 400."
    )
    max_logprobs: int = flag(
        20,
        "Most top logprobs per position (/generate top_logprobs_num, /v1 logprobs / top_logprobs); "
        "each one costs response bytes for every sampled and prompt token. More get HTTP 400.",
    )
    max_stop_strings: int = flag(
        64, "Most stop strings per request; every streamed token is checked against them. More get HTTP 400."
    )
    max_stop_length: int = flag(512, "Longest stop string in characters; longer ones get HTTP 400.")
    max_tool_calls: int = flag(
        8,
        "Most tool calls in one chat completion choice when parallel_tool_calls is allowed: after each "
        "call the model chooses to end its turn or open another, and a model that keeps calling stops here.",
    )
    shutdown_timeout: float = flag(
        15.0,
        "Seconds a SIGTERM (or Ctrl-C) lets running requests finish: the server answers new requests "
        "with 503 at once, and ends the requests still running after this long with finish reason "
        "abort (a stream gets its final event and [DONE]) before it exits. A second signal exits at once.",
    )
    reasoning_parser: str | None = flag(
        None,
        "Split a reasoning model's <think>...</think> block out of its chat completions: the message's "
        "(or stream delta's) `reasoning_content` holds the text inside it, `content` the answer after it. "
        "'qwen3': the output is the answer until the model opens <think> (Qwen3 with enable_thinking=false "
        "writes no block, so all of it is content). 'deepseek-r1': the chat template already opened the "
        "block, so the output is reasoning until </think>, whether or not the model repeats <think>. "
        "The tags must reach the text: ordinary tokens (as Qwen3's and DeepSeek-R1's are), or special "
        "ones with skip_special_tokens false in the request. "
        "Default: off (the tags stay in `content`).",
        REASONING_PARSERS,
    )
    dp_size: int = flag(
        1,
        "Data parallelism: run this many replicas of the server (each its own HTTP and scheduler "
        "process, on loopback ports of their own, the other flags as given) behind the router on "
        "--host/--port, which routes by --router-policy (see radixlm-router --help). On CPU give each "
        "replica its share of the cores with --num-threads.",
    )
    router_policy: str = flag(
        "cache_aware",
        "With --dp-size > 1, how the router picks a replica (see radixlm-router).",
        ROUTER_POLICIES,
    )
    ray_address: str | None = flag(
        None,
        "Place the --dp-size replicas on the Ray cluster at this address ('auto': the one `ray start` "
        "runs on this machine) instead of on this machine: a placement group per replica, with a "
        "bundle of --num-threads CPUs (1 if unset) per --tp-size rank, packed on one node. Each replica "
        "binds to its node's IP address and the router here, on --host/--port, routes to them over "
        "HTTP; a replica whose process dies is started again. Needs the ray extra: "
        "pip install 'radixlm[ray]'.",
    )
    disable_dashboard: bool = flag(
        False,
        "Turn off the live dashboard (/dashboard and its /dashboard/api/* feeds): the radix tree, "
        "requests, program sessions, metrics over time and a playground. With --api-key the page "
        "asks for the key and every feed requires it.",
    )
    dashboard_redact: bool = flag(
        False,
        "Hide prompt and output text from the dashboard: the cache and requests views show token "
        "counts, hits and timings but no text, and the tree's text search is refused.",
    )

    def __post_init__(self) -> None:
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router_policy must be one of {list(ROUTER_POLICIES)}, got {self.router_policy!r}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        for name in ("max_n", "max_stop_strings", "max_stop_length", "max_tool_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser (--reasoning-parser) must be one of {list(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The data-parallel router (radixlm-router / python -m radixlm_runtime.router) in front of
    running radixlm or SGLang servers."""

    worker_urls: tuple[str, ...] = flag(
        (), "Base URLs of the replicas to route to, e.g. http://127.0.0.1:30001."
    )
    host: str = flag("127.0.0.1", "Address the router binds to. Use 0.0.0.0 to serve other machines.")
    port: int = flag(30000, "Port the router listens on.")
    router_policy: str = flag(
        "cache_aware",
        "How a request's replica is chosen. 'cache_aware': the replica whose approximate prefix tree "
        "(the texts it was sent) shares the longest prefix with the request, unless the replicas' loads "
        "differ by more than --balance-abs-threshold requests and --balance-rel-threshold times, or the "
        "best match covers less than --cache-threshold of the request: then the least loaded one. "
        "'round_robin': in turn. 'least_load': fewest requests in flight. Whatever the policy, requests "
        "with a session_id stick to the replica of the session's first request.",
        ROUTER_POLICIES,
    )
    cache_threshold: float = flag(
        0.5, "cache_aware: the share of a request's text the best replica must match to win on its cache."
    )
    balance_abs_threshold: int = flag(
        8,
        "cache_aware: requests in flight by which the busiest replica must lead the idlest to override "
        "the cache.",
    )
    balance_rel_threshold: float = flag(
        1.5, "cache_aware: and the factor by which its load must exceed the idlest's."
    )
    tree_chars: int = flag(
        1 << 22,
        "cache_aware: characters of request text remembered per replica; the least recently matched "
        "go first.",
    )
    health_check_interval_s: float = flag(
        2.0, "Seconds between health checks of each replica; a replica that fails one is routed around."
    )
    max_request_bytes: int = flag(
        8 * 1024 * 1024, "Largest request body the router forwards, in bytes; larger ones get HTTP 413."
    )
    api_key: str | None = flag(
        None,
        "When set, every endpoint except /health requires 'Authorization: Bearer <api-key>'; the header "
        "is passed on to the replicas, which may check it too.",
    )
    log_level: str = flag("info", "Logging level.", ("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        _check_choices(self)
        if not self.worker_urls:
            raise ValueError("worker_urls: give at least one replica URL")
        bad = [u for u in self.worker_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"worker_urls must be http(s) URLs, got {bad}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.tree_chars < 1 or self.health_check_interval_s <= 0 or self.max_request_bytes < 1:
            raise ValueError("tree_chars, health_check_interval_s and max_request_bytes must be positive")
