"""radixlm on a CUDA GPU beside transformers on the same GPU, weights and token ids (issue 14).

Sides: radixlm's offline Engine; transformers `generate` in eager mode (its default dynamic cache); and
transformers with a static cache and `torch.compile`: `model.generation_config.cache_implementation =
"static"`, with which `generate` compiles its decode forward itself (mode "reduce-overhead"), and under
`--hf-compile recipe` also the inference guide's `model.forward = torch.compile(model.forward,
mode="reduce-overhead", fullgraph=True)`. Each side runs alone in turn, greedy, with end-of-sequence
ignored so every side computes exactly the same number of tokens.

Parts:
  decode   distinct prompts of --prompt-tokens tokens, --new-tokens new tokens, all the batch in one
           call, at each of --batch-sizes. TTFT is the best wall time of a 1-token run; decode ms/token
           is (best full-run wall - TTFT) / (new tokens - 1); tokens/s is batch x new tokens / full-run
           wall. Warm-up runs (torch.compile's included) are timed and reported, never counted.
  busy     the share of a decode step the GPU is busy at --busy-batch: the runs of `decode` repeated
           under torch.profiler (CUDA activity only), busy time = union of the kernel / memcpy / memset
           intervals of the trace. Per decode step: (busy of a full run - busy of a 1-token run) /
           (new tokens - 1), over the step wall time taken the same way from runs without the profiler
           (kernel durations do not change under the profiler, launches do).
  fewshot  few-shot GSM8K: --fewshot-questions test questions behind one --fewshot-shots-example prefix,
           --fewshot-new-tokens new tokens each; radixlm gets every prompt in one call (radix cache on),
           transformers left-padded batches of --hf-fewshot-batch (padded to the longest prompt of the
           set, so every batch has one shape).

Without CUDA it prints that it needs a CUDA GPU and exits 0. `--device cpu` runs the same code paths on
the CPU in float32 for development and tests (the compiled side and the busy part need CUDA and are
reported as skipped).

    python benchmarks/bench_gpu.py                                   # everything, bf16, ~minutes
    python benchmarks/bench_gpu.py --skip hf_compile,fewshot         # a subset of sides and parts
    python benchmarks/bench_gpu.py --radixlm-variant nograph:disable_cuda_graph=true
    python benchmarks/bench_gpu.py --radixlm-arg cuda_graph_max_bs=256 --out-dir /tmp/gpu
    python benchmarks/bench_gpu.py --device cpu --tiny --model /path/to/tiny-hf-dir

The model is --model, else $RADIXLM_GPU_MODEL, else the embedded default model.
"""

from __future__ import annotations

import copy
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common import (
    REPO_ROOT,
    Size,
    Table,
    add_list_flag,
    bench_parser,
    fmt,
    list_flag,
    machine_info,
    parse_sizes,
    save_result,
)

NAME = "gpu"
MODEL_ENV = "RADIXLM_GPU_MODEL"
SKIP_MESSAGE = (
    "bench_gpu.py: skipped, this benchmark needs a CUDA GPU and none is available "
    "(pass --device cpu for a CPU smoke run of the same code paths)"
)
SIZES = {
    "prompt_tokens": Size(96, 16, "prompt tokens of every decode request", scales=False),
    "new_tokens": Size(128, 8, "new tokens per decode request", scales=False),
    "busy_batch": Size(64, 4, "batch size of the GPU busy part", scales=False),
    "busy_new_tokens": Size(32, 4, "new tokens per request in the GPU busy part", scales=False),
    "repeats": Size(2, 1, "timed runs of every measurement, the best kept"),
    "fewshot_questions": Size(256, 4, "few-shot GSM8K test questions"),
    "fewshot_shots": Size(5, 1, "solved examples in the few-shot prefix", scales=False),
    "fewshot_new_tokens": Size(64, 4, "new tokens per few-shot question", scales=False),
    "hf_fewshot_batch": Size(128, 2, "transformers batch size in the few-shot part", scales=False),
}
DEFAULT_BATCH_SIZES, TINY_BATCH_SIZES = "1,64,256", "1,4"
PARTS = ("decode", "busy", "fewshot")
SIDES = ("radixlm", "hf_eager", "hf_compile")
HF_SIDES = ("hf_eager", "hf_compile")
LABELS = {
    "radixlm": "radixlm",
    "radixlm_no_cache": "radixlm, radix cache disabled",
    "hf_eager": "transformers eager",
    "hf_compile": "transformers static cache + torch.compile",
}
DECODE_HEADERS = ["side", "batch", "TTFT ms", "decode ms/token", "tok/s", "decode tok/s", "radixlm speed-up"]
BUSY_HEADERS = ["side", "step ms", "GPU busy ms", "busy share", "busy share (profiled step)", "events/step"]
FEWSHOT_HEADERS = [
    "side",
    "wall s",
    "questions/s",
    "prompt tokens from cache",
    "radixlm speed-up",
    "same outputs",
]
# Kinds of trace events that occupy the device (torch.profiler's Chrome trace categories).
DEVICE_EVENT_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# SGLang's chunked prefill on an 80 GB GPU; the runtime's own default (1024) is sized for CPUs.
CUDA_CHUNKED_PREFILL = 8192


# -- results -----------------------------------------------------------------------------------------
@dataclass
class DecodeRun:
    side: str
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    wall_s: float
    decode_ms_per_token: float
    tokens_per_s: float  # batch x new tokens over the whole run, prefill included
    decode_tokens_per_s: float  # batch over decode ms/token: the decode phase alone
    warmup_s: list[float]  # wall time of each warm-up run (compilation shows here)
    runs_s: dict[str, list[float]]  # every timed run: "ttft" (1-token runs) and "full"
    first_output_ids: list[int]  # the first request's new tokens, for the record
    output_ids: list[list[int]] = field(repr=False)  # every request's (compared, not saved)


@dataclass
class BusyRun:
    side: str
    batch_size: int
    new_tokens: int
    step_ms: float  # decode step wall time without the profiler
    busy_ms: float  # device-busy time per decode step, from the trace
    busy_share: float  # busy_ms / step_ms: the figure the target checks
    step_ms_profiled: float  # the same steps' wall time under the profiler (launches slow down there)
    busy_share_profiled: float
    device_events_per_step: float
    runs_s: dict[str, list[float]]  # every unprofiled timed run: "one_token" and "full"
    # The kernels that take most of a decode step's device time: name, us per step, launches per step.
    top_kernels: list[tuple[str, float, float]] = field(default_factory=list)


@dataclass
class FewshotRun:
    side: str
    questions: int
    shots: int
    new_tokens: int
    wall_s: float
    warmup_s: list[float]
    runs_s: list[float]
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    output_ids: list[list[int]] = field(repr=False)

    @property
    def questions_per_s(self) -> float:
        return self.questions / self.wall_s


@dataclass
class Target:
    name: str
    measured: float | None
    threshold: float
    higher_is_better: bool
    unit: str
    detail: str

    @property
    def passed(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.threshold if self.higher_is_better else self.measured <= self.threshold

    def row(self) -> list[str]:
        verdict = {True: "pass", False: "MISS", None: "not measured"}[self.passed]
        bound = (">= " if self.higher_is_better else "<= ") + f"{self.threshold:g}{self.unit}"
        return [self.name, fmt(self.measured, ".2f", self.unit), bound, verdict, self.detail]


# -- sides -------------------------------------------------------------------------------------------
class SideUnavailable(RuntimeError):
    """A side that cannot run here (the compiled side without CUDA); reported as skipped."""


class Side(Protocol):
    name: str

    def reset(self) -> None:
        """Forgets what earlier runs left behind (radixlm's prefix cache), outside any timing."""

    def generate(
        self,
        prompts: list[list[int]],
        new_tokens: int,
        batch_size: int | None = None,
        pad_to: int | None = None,
    ) -> list[list[int]]:
        """Greedy, end-of-sequence ignored; returns when the outputs are on the host."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SideSpec:
    name: str
    kind: str  # "radixlm" or "hf"
    parts: tuple[str, ...]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # radixlm sides
    compiled: bool = False  # hf sides


class RadixlmSide:
    """The offline Engine; every call submits the whole list at once and lets the scheduler batch it."""

    def __init__(self, name: str, model_dir: Path, engine_kwargs: dict[str, Any]) -> None:
        import radixlm_runtime as rt

        self.name = name
        self.engine = rt.Engine(str(model_dir), **engine_kwargs)
        self.last_cached_tokens = 0

    def reset(self) -> None:
        if not self.engine.flush_cache():
            raise RuntimeError("flush_cache refused: requests still running")

    def generate(
        self,
        prompts: list[list[int]],
        new_tokens: int,
        batch_size: int | None = None,
        pad_to: int | None = None,
    ) -> list[list[int]]:
        params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        self.last_cached_tokens = sum(o["meta_info"]["cached_tokens"] for o in outs)
        return [o["output_ids"] for o in outs]

    def close(self) -> None:
        self.engine.shutdown()


class HfSide:
    """transformers `generate`: left-padded batches, greedy, end-of-sequence ignored (eos_token_id None:
    no token is masked, generation just does not stop). `compiled` applies the documented recipe."""

    def __init__(
        self, name: str, model_dir: Path, device: str, dtype: Any, compiled: bool, compile_mode: str
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if compiled and device != "cuda":
            raise SideUnavailable("needs CUDA (torch.compile mode='reduce-overhead' records CUDA graphs)")
        self.name = name
        self.device = device
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = 0 if pad is None else int(pad)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.model = model.to(device).eval()
        self.last_cached_tokens = None
        if compiled:
            self.model.generation_config.cache_implementation = "static"
            if compile_mode == "recipe":
                self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)

    def reset(self) -> None:
        pass

    def _config(self, new_tokens: int) -> Any:
        config = copy.deepcopy(self.model.generation_config)
        config.update(
            max_new_tokens=new_tokens,
            min_new_tokens=None,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=None,
            pad_token_id=self.pad_id,
        )
        return config

    def generate(
        self,
        prompts: list[list[int]],
        new_tokens: int,
        batch_size: int | None = None,
        pad_to: int | None = None,
    ) -> list[list[int]]:
        import torch

        config = self._config(new_tokens)
        step = batch_size or len(prompts)
        outputs: list[list[int]] = []
        for i in range(0, len(prompts), step):
            chunk = prompts[i : i + step]
            width = max(pad_to or 0, *(len(p) for p in chunk))
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            outputs.extend(out[:, width:].tolist())
        return outputs

    def close(self) -> None:
        del self.model


# -- measuring ---------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed_run(
    side: Side, device: str, prompts: list[list[int]], new_tokens: int, **kw: Any
) -> tuple[float, Any]:
    """Wall time of one generate call (the side's cache reset first, untimed), its outputs checked."""
    side.reset()
    _sync(device)
    t0 = time.perf_counter()
    outs = side.generate(prompts, new_tokens, **kw)
    wall = time.perf_counter() - t0
    short = [len(o) for o in outs if len(o) != new_tokens]
    if len(outs) != len(prompts) or short:
        raise RuntimeError(
            f"{side.name}: expected {len(prompts)} x {new_tokens} new tokens, got lengths {short}"
        )
    return wall, outs


def best_run(
    repeats: int, side: Side, device: str, prompts: list[list[int]], new_tokens: int, **kw: Any
) -> tuple[float, list[list[int]], list[float]]:
    """The fastest of `repeats` runs: its wall and outputs, and every run's wall (for the record)."""
    runs = [timed_run(side, device, prompts, new_tokens, **kw) for _ in range(repeats)]
    wall, outs = min(runs, key=lambda r: r[0])
    return wall, outs, [w for w, _ in runs]


def warm_up(side: Side, device: str, prompts: list[list[int]], new_tokens: int, warmups: int) -> list[float]:
    """Untimed runs of both shapes a measurement times (full and 1-token), returning the full runs'
    walls. The compiled side gets two: compilation, then the recording of its CUDA graphs."""
    walls = []
    for _ in range(max(warmups, 2) if side.name == "hf_compile" else warmups):
        walls.append(timed_run(side, device, prompts, new_tokens)[0])
        timed_run(side, device, prompts, 1)
    return walls


def measure_decode(
    side: Side, device: str, prompts: list[list[int]], new_tokens: int, repeats: int, warmups: int
) -> DecodeRun:
    warm = warm_up(side, device, prompts, new_tokens, warmups)
    ttft, _, ttfts = best_run(repeats, side, device, prompts, 1)
    wall, outs, walls = best_run(repeats, side, device, prompts, new_tokens)
    per_token = (wall - ttft) / (new_tokens - 1)
    batch = len(prompts)
    return DecodeRun(
        side=side.name,
        batch_size=batch,
        prompt_tokens=len(prompts[0]),
        new_tokens=new_tokens,
        ttft_s=ttft,
        wall_s=wall,
        decode_ms_per_token=1e3 * per_token,
        tokens_per_s=batch * new_tokens / wall,
        decode_tokens_per_s=batch / per_token if per_token > 0 else float("nan"),
        warmup_s=warm,
        runs_s={"ttft": ttfts, "full": walls},
        first_output_ids=outs[0],
        output_ids=outs,
    )


def device_busy_us(events: Iterable[dict[str, Any]]) -> tuple[float, int]:
    """Microseconds during which the device ran anything, and how many device events: the union of the
    kernel, memcpy and memset intervals of a torch.profiler Chrome trace. A union rather than a sum so
    that work overlapping on several streams is counted once."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENT_CATEGORIES
    )
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, len(spans)


def kernel_totals(events: Iterable[dict[str, Any]]) -> dict[str, tuple[float, int]]:
    """(device microseconds, launches) per kernel name in a torch.profiler Chrome trace."""
    totals: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            us, calls = totals.get(e["name"], (0.0, 0))
            totals[e["name"]] = (us + float(e.get("dur", 0.0)), calls + 1)
    return totals


def top_kernels(
    full: dict[str, tuple[float, int]], one: dict[str, tuple[float, int]], steps: int, n: int = 8
) -> list[tuple[str, float, float]]:
    """The n kernels with the most device time per decode step (a full run's totals less a 1-token
    run's, over its decode steps): (name, us per step, launches per step)."""
    per_step = []
    for name, (us, calls) in full.items():
        us_1, calls_1 = one.get(name, (0.0, 0))
        per_step.append((name, (us - us_1) / steps, (calls - calls_1) / steps))
    return sorted(per_step, key=lambda k: -k[1])[:n]


def profiled_run(
    side: Side, device: str, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, int, dict[str, tuple[float, int]]]:
    """(wall s, device-busy s, device events, kernel totals) of one generate call under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    side.reset()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        side.generate(prompts, new_tokens)
        _sync(device)
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    busy_us, count = device_busy_us(events)
    return wall, busy_us / 1e6, count, kernel_totals(events)


def measure_busy(
    side: Side, device: str, prompts: list[list[int]], new_tokens: int, repeats: int, warmups: int
) -> BusyRun:
    """Differences of a full run and a 1-token run (the prefill and the first token), so only the
    new_tokens - 1 decode steps remain, with and without the profiler."""
    warm_up(side, device, prompts, new_tokens, warmups)
    wall_n, _, walls_n = best_run(repeats, side, device, prompts, new_tokens)
    wall_1, _, walls_1 = best_run(repeats, side, device, prompts, 1)
    profiled_run(side, device, prompts, 1)  # the profiler's own start-up, kept out
    p_wall_1, busy_1, events_1, kernels_1 = profiled_run(side, device, prompts, 1)
    p_wall_n, busy_n, events_n, kernels_n = profiled_run(side, device, prompts, new_tokens)
    steps = new_tokens - 1
    step_s, p_step_s, busy_s = (
        (wall_n - wall_1) / steps,
        (p_wall_n - p_wall_1) / steps,
        (busy_n - busy_1) / steps,
    )
    if events_n == 0:
        raise RuntimeError("the profiler recorded no device activity (is CUPTI available?)")
    return BusyRun(
        side=side.name,
        batch_size=len(prompts),
        new_tokens=new_tokens,
        step_ms=1e3 * step_s,
        busy_ms=1e3 * busy_s,
        busy_share=busy_s / step_s,
        step_ms_profiled=1e3 * p_step_s,
        busy_share_profiled=busy_s / p_step_s,
        device_events_per_step=(events_n - events_1) / steps,
        runs_s={"one_token": walls_1, "full": walls_n},
        top_kernels=top_kernels(kernels_n, kernels_1, steps),
    )


def measure_fewshot(
    side: Side,
    device: str,
    prompts: list[list[int]],
    new_tokens: int,
    shots: int,
    repeats: int,
    warmups: int,
    hf_batch: int,
) -> FewshotRun:
    pad_to = max(len(p) for p in prompts)
    kw = {"batch_size": hf_batch, "pad_to": pad_to}
    # One batch of the measured shape warms every side up (compilation, kernel selection).
    warm_runs = max(warmups, 2) if side.name == "hf_compile" else warmups
    warm = [timed_run(side, device, prompts[:hf_batch], new_tokens, **kw)[0] for _ in range(warm_runs)]
    wall, outs, walls = best_run(repeats, side, device, prompts, new_tokens, **kw)
    cached = getattr(side, "last_cached_tokens", None)  # of the last run: every run sends the same
    return FewshotRun(
        side=side.name,
        questions=len(prompts),
        shots=shots,
        new_tokens=new_tokens,
        wall_s=wall,
        warmup_s=warm,
        runs_s=walls,
        prompt_tokens=sum(len(p) for p in prompts),
        cached_tokens=cached,
        output_tokens=sum(len(o) for o in outs),
        output_ids=outs,
    )


# -- workloads ---------------------------------------------------------------------------------------
def decode_prompts(tokenizer: Any, batch_size: int, prompt_tokens: int) -> list[list[int]]:
    """batch_size distinct prompts of exactly prompt_tokens tokens: windows at different offsets of one
    long passage, so no side pads and no two prompts share a prefix."""
    stride = 7
    need = (batch_size - 1) * stride + prompt_tokens
    sections: list[str] = []
    ids: list[int] = []
    while len(ids) < need:
        i = len(sections)
        sections.append(
            f"Section {i}. The harbour town of Lindqvist was founded in {1650 + 7 * i} by fishermen from "
            f"the northern islands; by {1700 + 9 * i} it exported {120 + 15 * i} tonnes of salted cod and "
            f"{30 + 11 * i % 17} barrels of oil to {3 + i % 5} southern ports."
        )
        ids = tokenizer.encode(" ".join(sections))
    prompts = [ids[i * stride : i * stride + prompt_tokens] for i in range(batch_size)]
    assert len({tuple(p) for p in prompts}) == batch_size
    return prompts


def fewshot_prompts(tokenizer: Any, questions: int, shots: int) -> list[list[int]]:
    from workloads import gsm8k_task

    return gsm8k_task(tokenizer, questions, shots).prompts


# -- comparing ---------------------------------------------------------------------------------------
def agreement(a: list[int], b: list[int]) -> dict[str, int]:
    """Leading tokens in common, and positions equal anywhere (bf16 sides may part after a while)."""
    prefix = 0
    for x, y in zip(a, b):
        if x != y:
            break
        prefix += 1
    return {"same_prefix": prefix, "same_positions": sum(x == y for x, y in zip(a, b)), "tokens": len(a)}


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def _without(run: Any, *keys: str) -> dict[str, Any]:
    return {k: v for k, v in asdict(run).items() if k not in keys}


def build_targets(
    decode: dict[str, dict[int, DecodeRun]],
    busy: dict[str, BusyRun],
    fewshot: dict[str, FewshotRun],
    batch: int,
) -> list[Target]:
    """The issue's four targets (meant for an H100 with the default model in bf16)."""
    ours = decode.get("radixlm", {})
    b1, b64, hf64 = ours.get(1), ours.get(64), decode.get("hf_compile", {}).get(64)
    share = busy.get("radixlm")
    few: tuple[str, float] | None = None
    if "radixlm" in fewshot:  # against the faster transformers side
        ratios = [(n, fewshot[n].wall_s / fewshot["radixlm"].wall_s) for n in HF_SIDES if n in fewshot]
        few = min(ratios, key=lambda item: item[1]) if ratios else None
    return [
        Target(
            "batch 1 decode ms/token", b1 and b1.decode_ms_per_token, 3.0, False, " ms", "radixlm, batch 1"
        ),
        Target(
            "batch 64 tokens/s vs transformers static + compile",
            b64 and hf64 and b64.tokens_per_s / hf64.tokens_per_s,
            2.0,
            True,
            "x",
            "radixlm tok/s over hf_compile tok/s at batch 64",
        ),
        Target(
            f"GPU busy share of a decode step at batch {batch}",
            share and 100 * share.busy_share,
            80.0,
            True,
            "%",
            "radixlm, kernel time over step wall time",
        ),
        Target(
            "few-shot GSM8K speed-up vs transformers",
            few and few[1],
            3.0,
            True,
            "x",
            f"vs the faster transformers side measured ({few[0]})" if few else "no transformers side ran",
        ),
    ]


# -- the run -----------------------------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """A --radixlm-arg value: true/false, none, an int, a float, else the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_kv(items: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = parse_value(value)
    return out


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """NAME:KEY=VALUE[,KEY=VALUE...] -> ("radixlm_NAME", kwargs)."""
    name, sep, rest = spec.partition(":")
    if not sep or not name.isidentifier():
        raise ValueError(f"expected NAME:KEY=VALUE[,KEY=VALUE...], got {spec!r}")
    return f"radixlm_{name}", parse_kv(p for p in rest.split(",") if p)


def gpu_description(device: str, dtype: str, model_dir: Path) -> dict[str, Any]:
    """common.machine_info plus what a GPU figure needs: the GPU, CUDA, driver, library versions, the
    model and the date."""
    import torch
    import transformers

    info = machine_info()
    config = json.loads((model_dir / "config.json").read_text())
    arch = ",".join(config.get("architectures") or [config.get("model_type", "?")])
    info.update(
        model=f"{model_dir.name} ({arch}, {config.get('num_hidden_layers')} layers, hidden "
        f"{config.get('hidden_size')}, vocab {config.get('vocab_size')})",
        model_path=str(model_dir),
        dtype=dtype,
        device=device,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        transformers=transformers.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
    )
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_compute_capability=f"{props.major}.{props.minor}",
            gpu_multiprocessors=props.multi_processor_count,
        )
        try:
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            info["nvidia_smi"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            info["nvidia_smi"] = None
    return info


class Bench:
    """Runs the selected parts side after side (one model on the device at a time) and keeps what each
    measured, writing the JSON after every side so a run cut short still leaves its figures."""

    def __init__(
        self, args: Any, sizes: dict[str, int], batch_sizes: list[int], specs: list[SideSpec]
    ) -> None:
        self.args, self.sizes, self.batch_sizes, self.specs = args, sizes, batch_sizes, specs
        self.decode: dict[str, dict[int, DecodeRun]] = {}
        self.busy: dict[str, BusyRun] = {}
        self.fewshot: dict[str, FewshotRun] = {}
        self.skipped: dict[str, str] = dict(args.part_skips)  # side or part -> why
        self.errors: dict[str, dict[str, str]] = {}
        self.setup_s: dict[str, float] = {}
        self.machine = gpu_description(args.device, args.dtype, args.model_dir)

    def error(self, side: str, what: str, exc: BaseException) -> None:
        print(f"{side} {what} FAILED: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=-4)
        self.errors.setdefault(side, {})[what] = f"{type(exc).__name__}: {exc}"[:2000]
        if self.args.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def make_side(self, spec: SideSpec) -> Side:
        args = self.args
        if spec.kind == "radixlm":
            return RadixlmSide(spec.name, args.model_dir, spec.engine_kwargs)
        return HfSide(
            spec.name, args.model_dir, args.device, args.torch_dtype, spec.compiled, args.hf_compile
        )

    def run(self, tokenizer: Any, on_progress: Any) -> None:
        s = self.sizes
        decode_sets = {b: decode_prompts(tokenizer, b, s["prompt_tokens"]) for b in self.batch_sizes}
        busy_set = decode_prompts(tokenizer, s["busy_batch"], s["prompt_tokens"])
        fewshot_set: list[list[int]] = []
        if any("fewshot" in spec.parts for spec in self.specs):
            try:
                fewshot_set = fewshot_prompts(tokenizer, s["fewshot_questions"], s["fewshot_shots"])
            except FileNotFoundError as e:  # the GSM8K files: $RADIXLM_DATA_DIR or ../shared/data
                print(f"skipping fewshot: {e}", flush=True)
                self.skipped["fewshot"] = str(e)
        for spec in self.specs:
            t0 = time.perf_counter()
            try:
                side = self.make_side(spec)
            except SideUnavailable as e:
                print(f"skipping {spec.name}: {e}", flush=True)
                self.skipped[spec.name] = str(e)
                continue
            except Exception as e:  # a side that fails to load must not cost the others
                self.error(spec.name, "setup", e)
                continue
            self.setup_s[spec.name] = time.perf_counter() - t0
            print(f"== {spec.name}: ready in {self.setup_s[spec.name]:.1f}s", flush=True)
            try:
                self.run_side(side, spec, decode_sets, busy_set, fewshot_set)
            finally:
                side.close()
                del side
                gc.collect()
                if self.args.device == "cuda":
                    import torch

                    torch.cuda.empty_cache()
            on_progress()

    def run_side(
        self,
        side: Side,
        spec: SideSpec,
        decode_sets: dict[int, list[list[int]]],
        busy_set: list[list[int]],
        fewshot_set: list[list[int]],
    ) -> None:
        a, s, name = self.args, self.sizes, spec.name
        # The compiled side stops at its first failure: a compile error would only repeat, slowly.
        broken = lambda: name == "hf_compile" and name in self.errors
        if "decode" in spec.parts:
            for b, prompts in decode_sets.items():
                if broken():
                    break
                try:
                    r = measure_decode(side, a.device, prompts, s["new_tokens"], s["repeats"], a.warmups)
                except Exception as e:
                    self.error(name, f"decode batch {b}", e)
                    continue
                self.decode.setdefault(name, {})[b] = r
                warm = ", ".join(f"{w:.1f}s" for w in r.warmup_s)
                print(
                    f"{name} decode B={b}: TTFT {1e3 * r.ttft_s:.1f} ms, {r.decode_ms_per_token:.2f} "
                    f"ms/token, {r.tokens_per_s:.0f} tok/s (warm-up {warm})",
                    flush=True,
                )
        if "busy" in spec.parts and not broken():
            try:
                r = measure_busy(side, a.device, busy_set, s["busy_new_tokens"], s["repeats"], a.warmups)
                self.busy[name] = r
                print(
                    f"{name} busy B={r.batch_size}: {r.busy_ms:.2f} of {r.step_ms:.2f} ms per step "
                    f"({r.busy_share:.0%}; {r.busy_share_profiled:.0%} of the profiled step)",
                    flush=True,
                )
                for kernel, us, calls in r.top_kernels:
                    print(f"    {us:8.1f} us/step  {calls:5.1f} launches  {kernel[:100]}", flush=True)
            except Exception as e:
                self.error(name, "busy", e)
        if "fewshot" in spec.parts and fewshot_set and not broken():
            try:
                r = measure_fewshot(
                    side,
                    a.device,
                    fewshot_set,
                    s["fewshot_new_tokens"],
                    s["fewshot_shots"],
                    s["repeats"],
                    a.warmups,
                    s["hf_fewshot_batch"],
                )
                self.fewshot[name] = r
                print(f"{name} fewshot: {r.wall_s:.2f}s, {r.questions_per_s:.1f} questions/s", flush=True)
            except Exception as e:
                self.error(name, "fewshot", e)

    # -- reporting -----------------------------------------------------------------------------------
    def agreement(self) -> dict[str, Any]:
        """Greedy outputs of every side against radixlm's: the batch-1 request token by token (bf16
        sides may part after a while), and how many requests of each batch are identical."""
        out: dict[str, Any] = {}
        ours = self.decode.get("radixlm", {})
        if 1 in ours:
            out["decode_batch1_vs_radixlm"] = {
                side: agreement(ours[1].first_output_ids, runs[1].first_output_ids)
                for side, runs in self.decode.items()
                if side != "radixlm" and 1 in runs
            }
        out["decode_same_outputs_vs_radixlm"] = {
            side: {b: _same(ours[b].output_ids, r.output_ids) for b, r in runs.items() if b in ours}
            for side, runs in self.decode.items()
            if side != "radixlm"
        }
        few = self.fewshot.get("radixlm")
        if few is not None:
            out["fewshot_same_outputs_vs_radixlm"] = {
                side: _same(few.output_ids, r.output_ids)
                for side, r in self.fewshot.items()
                if side != "radixlm"
            }
        return out

    def data(self) -> dict[str, Any]:
        a = self.args
        targets = build_targets(self.decode, self.busy, self.fewshot, self.sizes["busy_batch"])
        return {
            "machine": self.machine,
            "device": a.device,
            "dtype": a.dtype,
            "model_path": str(a.model_dir),
            "batch_sizes": self.batch_sizes,
            "sides": {
                spec.name: {"parts": list(spec.parts), "engine_kwargs": spec.engine_kwargs}
                for spec in self.specs
            },
            "hf_compile_mode": a.hf_compile,
            "setup_s": self.setup_s,
            "decode": {
                side: [_without(r, "output_ids") for r in runs.values()] for side, runs in self.decode.items()
            },
            "busy": {side: asdict(r) for side, r in self.busy.items()},
            "fewshot": {
                side: _without(r, "output_ids") | {"questions_per_s": r.questions_per_s}
                for side, r in self.fewshot.items()
            },
            "agreement": self.agreement(),
            "targets": [asdict(t) | {"passed": t.passed} for t in targets],
            "skipped": self.skipped,
            "errors": self.errors,
        }

    def tables(self) -> list[Table]:
        s, tables = self.sizes, []
        ours = self.decode.get("radixlm", {})
        rows = [
            [
                LABELS.get(side, side),
                str(b),
                fmt(1e3 * r.ttft_s, ".1f"),
                fmt(r.decode_ms_per_token, ".2f"),
                fmt(r.tokens_per_s, ".0f"),
                fmt(r.decode_tokens_per_s, ".0f"),
                fmt(ours[b].tokens_per_s / r.tokens_per_s if b in ours else None, ".2f", "x"),
            ]
            for b in self.batch_sizes
            for side, runs in self.decode.items()
            if (r := runs.get(b)) is not None
        ]
        if rows:
            title = f"Decode: {s['prompt_tokens']}-token prompts, {s['new_tokens']} new tokens"
            tables.append(Table(title, DECODE_HEADERS, rows))
        if self.busy:
            rows = [
                [
                    LABELS.get(side, side),
                    fmt(r.step_ms, ".2f"),
                    fmt(r.busy_ms, ".2f"),
                    fmt(100 * r.busy_share, ".0f", "%"),
                    fmt(100 * r.busy_share_profiled, ".0f", "%"),
                    fmt(r.device_events_per_step, ".0f"),
                ]
                for side, r in self.busy.items()
            ]
            tables.append(
                Table(f"GPU busy share of a decode step, batch {s['busy_batch']}", BUSY_HEADERS, rows)
            )
        if self.fewshot:
            base = self.fewshot.get("radixlm")
            same = self.agreement().get("fewshot_same_outputs_vs_radixlm", {})
            rows = [
                [
                    LABELS.get(side, side),
                    fmt(r.wall_s, ".2f"),
                    fmt(r.questions_per_s, ".1f"),
                    fmt(r.cached_tokens and 100 * r.cached_tokens / r.prompt_tokens, ".1f", "%"),
                    fmt(base and r.wall_s / base.wall_s, ".2f", "x"),
                    f"{same[side]}/{r.questions}" if side in same else "-",
                ]
                for side, r in self.fewshot.items()
            ]
            title = (
                f"Few-shot GSM8K: {s['fewshot_questions']} questions, {s['fewshot_shots']} shots, "
                f"{s['fewshot_new_tokens']} new tokens"
            )
            tables.append(Table(title, FEWSHOT_HEADERS, rows))
        targets = build_targets(self.decode, self.busy, self.fewshot, s["busy_batch"])
        title = f"Issue 14 targets (for an H100 in bf16; this run: {self.args.device}, {self.args.dtype})"
        tables.append(
            Table(title, ["target", "measured", "goal", "verdict", "how"], [t.row() for t in targets])
        )
        return tables

    def notes(self) -> list[str]:
        notes = [
            "decode: TTFT = best 1-token run; ms/token = (best full run - TTFT) / (new tokens - 1); tok/s = "
            "batch x new tokens / full run; every side greedy with end-of-sequence ignored.",
            "busy: union of kernel/memcpy/memset intervals from torch.profiler (CUDA activity), full run "
            "minus 1-token run, per decode step, over the step wall time measured without the profiler.",
            "fewshot: radixlm gets all prompts in one call (radix cache on); transformers batches of "
            f"{self.sizes['hf_fewshot_batch']} left-padded to the longest prompt.",
        ]
        for side, ag in self.agreement().get("decode_batch1_vs_radixlm", {}).items():
            notes.append(
                f"batch-1 greedy tokens, {side} vs radixlm: first {ag['same_prefix']}/{ag['tokens']} "
                f"identical, {ag['same_positions']}/{ag['tokens']} positions equal"
            )
        for side, runs in self.decode.items():
            if side == "hf_compile":
                warm = ", ".join(f"B={b}: {sum(r.warmup_s):.1f}s" for b, r in runs.items())
                notes.append(f"hf_compile warm-up (compilation and CUDA graph recording, not timed): {warm}")
        notes += [f"{what} skipped: {why}" for what, why in self.skipped.items()]
        notes += [
            f"{side} {what} failed: {msg.splitlines()[0][:300]}"
            for side, errs in self.errors.items()
            for what, msg in errs.items()
        ]
        return notes


def side_specs(args: Any, parser: Any) -> list[SideSpec]:
    """The sides to run, in order: radixlm (and its variants) first, then transformers."""
    skip = {x for x in (args.skip or "").split(",") if x}
    parts = tuple(p for p in args.parts.split(",") if p and p not in skip)
    sides = [x for x in args.sides.split(",") if x and x not in skip]
    unknown = (set(parts) - set(PARTS)) | (set(sides) - set(SIDES)) | (skip - set(PARTS) - set(SIDES))
    if unknown:
        parser.error(f"unknown part(s)/side(s) {sorted(unknown)}; parts: {PARTS}, sides: {SIDES}")
    if args.device == "cpu" and "busy" in parts:  # the profiler part measures device kernels
        parts = tuple(p for p in parts if p != "busy")
        args.part_skips["busy"] = "needs CUDA (it measures device kernels under torch.profiler)"
    try:
        common_kwargs = parse_kv(args.radixlm_arg)
        variants = [parse_variant(v) for v in args.radixlm_variant]
    except ValueError as e:
        parser.error(str(e))
    engine = {
        "device": args.device,
        "dtype": args.dtype,
        "log_level": "warning",
        "max_running_requests": max(
            [*args.batch_size_list, args.sizes["busy_batch"], args.sizes["fewshot_questions"]]
        ),
    }
    if args.device == "cuda":
        engine["chunked_prefill_size"] = CUDA_CHUNKED_PREFILL
    engine |= common_kwargs
    specs: list[SideSpec] = []
    if "radixlm" in sides:
        specs.append(SideSpec("radixlm", "radixlm", parts, engine))
        specs += [SideSpec(n, "radixlm", parts, engine | kw) for n, kw in variants]
        if args.fewshot_no_cache and "fewshot" in parts:
            specs.append(
                SideSpec("radixlm_no_cache", "radixlm", ("fewshot",), engine | {"disable_radix_cache": True})
            )
    if "hf_eager" in sides:
        specs.append(SideSpec("hf_eager", "hf", parts))
    if "hf_compile" in sides:
        compiled_parts = parts if args.fewshot_compile else tuple(p for p in parts if p != "fewshot")
        specs.append(SideSpec("hf_compile", "hf", compiled_parts, compiled=True))
    return [spec for spec in specs if spec.parts]


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--batch-sizes", "decode batch sizes", DEFAULT_BATCH_SIZES, TINY_BATCH_SIZES)
    ap.add_argument(
        "--model",
        default=None,
        help=f"Hugging Face model dir (default: ${MODEL_ENV}, else the embedded model).",
    )
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="Default: cuda; cpu is for development."
    )
    ap.add_argument(
        "--dtype", default=None, help="bfloat16 (default on cuda), float16 or float32 (default on cpu)."
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated among {', '.join(PARTS)}.")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"Comma-separated among {', '.join(SIDES)}.")
    ap.add_argument("--skip", default="", help="Comma-separated parts or sides to leave out.")
    ap.add_argument(
        "--radixlm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="An Engine keyword argument for every radixlm side (repeatable), e.g. disable_cuda_graph=true.",
    )
    ap.add_argument(
        "--radixlm-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="One more radixlm side, radixlm_NAME, with these Engine arguments on top (repeatable).",
    )
    ap.add_argument(
        "--fewshot-no-cache", action="store_true", help="Also few-shot with the radix cache disabled."
    )
    ap.add_argument(
        "--fewshot-compile", action="store_true", help="Also few-shot on hf_compile (compiles more)."
    )
    ap.add_argument(
        "--hf-compile",
        choices=("recipe", "auto"),
        default="auto",
        help="auto: a static cache, and generate compiles its decode forward itself (transformers 5's "
        "CompileConfig: inductor, mode='reduce-overhead'); recipe: also model.forward = torch.compile(..., "
        "mode='reduce-overhead', fullgraph=True) as the inference guide shows (on transformers 5.17 its "
        "compiled prefill fails with 'accessing tensor output of CUDAGraphs that has been overwritten').",
    )
    ap.add_argument(
        "--warmups", type=int, default=1, help="Untimed runs before each measurement (compiled side: >= 2)."
    )
    ap.add_argument(
        "--name", default=NAME, help="Result name: <out-dir>/<name>.json (to keep split runs apart)."
    )
    args, sizes = parse_sizes(ap, argv, SIZES)

    import torch

    if args.device is None or args.device == "cuda":
        if not torch.cuda.is_available():
            print(SKIP_MESSAGE)
            return
        args.device = "cuda"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.dtype not in ("bfloat16", "float16", "float32"):
        ap.error("--dtype takes bfloat16, float16 or float32")
    args.torch_dtype = getattr(torch, args.dtype)
    args.batch_size_list = list_flag(args, "--batch-sizes", int)
    args.sizes = sizes
    args.part_skips = {}
    if min(args.batch_size_list) < 1 or sizes["new_tokens"] < 2 or sizes["busy_new_tokens"] < 2:
        ap.error("batch sizes must be >= 1 and new-token counts >= 2")

    # Measure the runtime beside this script even when another checkout is the installed one.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from radixlm_runtime.io.tokenizer import load_tokenizer
    from radixlm_runtime.models.loader import resolve_model_path

    args.model_dir = resolve_model_path(args.model or os.environ.get(MODEL_ENV) or None)
    specs = side_specs(args, ap)
    print(
        f"model {args.model_dir} on {args.device} in {args.dtype}; sides: {', '.join(s.name for s in specs)}"
    )
    bench = Bench(args, sizes, args.batch_size_list, specs)
    partial = args.out_dir / f"{args.name}.partial.json"

    def save_partial() -> None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(bench.data(), indent=2) + "\n")

    bench.run(load_tokenizer(args.model_dir), save_partial)
    save_result(args.out_dir, args.name, bench.data(), bench.tables(), bench.notes(), [], sizes)
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
