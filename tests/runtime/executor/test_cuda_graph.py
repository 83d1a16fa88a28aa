"""CUDA-graph decode: replayed steps give exactly what eager steps give, padding rows never leak into
real ones, and a decode step queues its work without waiting for the device. The graph tests need a
GPU (RADIXLM_TEST_DEVICE=cuda); sizing and flag checks run everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt
from radixlm_runtime.config import EngineConfig
from radixlm_runtime.executor.cuda_graph import capture_sizes
from radixlm_runtime.step import StepPlan

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

PROMPTS = ["the theater then", "an interesting answer", "abc abc abc", "<|im_start|>user\nhi<|im_end|>\n"]


def test_capture_sizes_cover_every_batch_up_to_the_largest() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    sizes = capture_sizes(100)
    assert sizes[:6] == [1, 2, 4, 8, 12, 16] and sizes[-2:] == [96, 100]
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))


def test_cuda_graph_max_bs_is_validated() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=0)


def test_cpu_runner_captures_nothing(tiny_llama_dir: Path) -> None:
    engine = rt.Engine(str(tiny_llama_dir), device="cpu", max_total_tokens=512, log_level="warning")
    assert engine.runner.graphs is None


def _outputs(model_dir: Path, prompts: list[str], **flags: object) -> tuple[list[str], int]:
    """Greedy texts, and how many steps replayed a graph."""
    engine = rt.Engine(
        str(model_dir),
        device="cuda",
        max_total_tokens=4096,
        max_running_requests=32,
        log_level="warning",
        **flags,
    )
    replays = 0
    graphs = engine.runner.graphs
    if graphs is not None:
        replay = graphs.replay

        def counted(batch):  # type: ignore[no-untyped-def]
            nonlocal replays
            replays += 1
            return replay(batch)

        graphs.replay = counted
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    texts = [out["text"] for out in engine.generate(prompts, params)]
    return texts, replays


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3, 20])
def test_graph_replay_matches_eager(tiny_llama_dir: Path, dtype: str, batch: int) -> None:
    """Batches of 3 and 20 are padded (to 4 and 32): the dummy rows must not change real ones."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " x" * i for i in range(batch)]
    eager, none = _outputs(tiny_llama_dir, prompts, dtype=dtype, disable_cuda_graph=True)
    graphed, replays = _outputs(tiny_llama_dir, prompts, dtype=dtype)
    assert none == 0 and replays > 0
    assert graphed == eager


@needs_cuda
def test_decode_step_launches_without_syncing(tiny_llama_dir: Path) -> None:
    """A decode step (graph replay, greedy and sampled rows) queues everything up to the copy of its
    results with no host-device synchronisation: reading the results is the step's one wait."""
    engine = rt.Engine(str(tiny_llama_dir), device="cuda", max_total_tokens=4096, log_level="warning")
    runner = engine.runner
    launch = runner.launch
    strict_steps = 0

    def strict(plan: StepPlan):  # type: ignore[no-untyped-def]
        nonlocal strict_steps
        if any(len(it.input_ids) != 1 for it in plan.items):
            return launch(plan)  # prefill steps are not held to it
        strict_steps += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = strict
    params = [
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0.8, "top_k": 20, "ignore_eos": True, "seed": 1},
        {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True, "seed": 2},
    ]
    outs = engine.generate(PROMPTS[:3], params)
    assert strict_steps >= 10
    assert all(out["meta_info"]["completion_tokens"] == 12 for out in outs)
