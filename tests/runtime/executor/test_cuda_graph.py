"""CUDA-graph decode: replayed steps give exactly what eager steps give, padding rows never leak into
real ones, and a decode step queues its work without waiting for the device. Recording real graphs
needs a GPU (RADIXLM_TEST_DEVICE=cuda); the runner's static buffers, padding and replay run everywhere
through a capturer that re-runs the captured forward, and so do sizing and flag checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt
from radixlm_runtime.config import EngineConfig
from radixlm_runtime.executor.cuda_graph import capture_sizes
from radixlm_runtime.forward_batch import ForwardBatch
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


class RerunCapturer:
    """Stands in for CUDA graphs where there are none: a replay runs the captured forward again on
    the same static buffers, with the attention metadata set at capture (a graph never recomputes
    it), into the captured output tensor. What it cannot check is the recording itself."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # batch size of each capture, in order

    def capture(self, forward):  # type: ignore[no-untyped-def]
        output = forward()
        self.captured.append(output.shape[0])
        return (lambda: output.copy_(forward())), output


def _rerun_engine(model_dir: Path, device: torch.device, graphs: bool) -> rt.Engine:
    """An engine on the test device and the graph-capturable Triton backend (under the interpreter on
    CPU), eager, its decode steps through a re-running graph runner when `graphs`. Every step takes
    the whole prefill budget (no step sizing by measured time), so which steps decode alone, and so
    which padded sizes replay, does not depend on the machine's speed."""
    engine = rt.Engine(
        str(model_dir),
        device=device.type,
        dtype="float32",
        attention_backend="triton",
        disable_cuda_graph=True,
        prefill_step_target_ms=0,
        max_total_tokens=2048,
        max_running_requests=10,
        log_level="warning",
    )
    if graphs:
        engine.runner.graphs = engine.runner.capture_decode_graphs(RerunCapturer())
    return engine


def test_graph_runner_pads_and_replays_like_eager(tiny_llama_dir: Path, test_device: torch.device) -> None:
    """Requests of different lengths leave one by one, so decode batches of 10 down to 1 (but for
    steps that also prefill, which run eagerly) run padded to 10, 8, 4, 2 and 1: tokens and logprobs
    equal the eager runs', and every padding row holds the dummy request (its KV goes to slot 0),
    rows a larger batch used before included."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " x" * i for i in range(10)]
    params = [{"max_new_tokens": 2 + i, "temperature": 0, "ignore_eos": True} for i in range(10)]

    def run(graphs: bool) -> tuple[list[dict], dict[int, int]]:
        engine = _rerun_engine(tiny_llama_dir, test_device, graphs)
        padded: dict[int, int] = {}
        runner = engine.runner.graphs
        if runner is not None:
            replay = runner.replay

            def counted(batch: ForwardBatch) -> torch.Tensor:
                out = replay(batch)
                bs = batch.batch_size
                padded[bs] = runner.sizes[[s >= bs for s in runner.sizes].index(True)]
                pad = runner.inputs[:, bs : padded[bs]]
                assert pad.tolist() == runner.pad[:, bs : padded[bs]].tolist()
                return out

            runner.replay = counted
        outs = engine.generate(prompts, params, return_logprob=True)
        return outs, padded

    eager, _ = run(graphs=False)
    graphed, padded = run(graphs=True)
    assert len(padded) >= 7 and set(padded.values()) == {1, 2, 4, 8, 10}
    for e, g in zip(eager, graphed, strict=True):
        assert g["output_ids"] == e["output_ids"]
        assert g["meta_info"]["output_token_logprobs"] == e["meta_info"]["output_token_logprobs"]


def test_graph_runner_captures_every_size_with_the_dummy_request(
    tiny_llama_dir: Path, test_device: torch.device
) -> None:
    """One capture per size, largest first, each over padding rows only: the dummy request's table
    row, token 0 at position 0, KV slot 0."""
    engine = _rerun_engine(tiny_llama_dir, test_device, graphs=False)
    capturer = RerunCapturer()
    runner = engine.runner.capture_decode_graphs(capturer)
    assert runner.sizes == [1, 2, 4, 8, 10] and capturer.captured == [10, 8, 4, 2, 1]
    assert runner.dummy_row == engine.runner.req_to_token.max_reqs - 1
    assert runner.inputs.tolist() == [
        [0] * 10,
        [0] * 10,
        [0] * 10,
        [runner.dummy_row] * 10,
        [1] * 10,
        [0] * 10,
    ]
    assert all(runner.outputs[bs].shape == (bs, 300) for bs in runner.sizes)


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
    """Batches of 3 and 20 are padded (to 4 and 32): the dummy rows must not change real ones. In
    bfloat16, cuBLAS picks its kernel (and so its rounding) by row count, so a padded batch equals an
    unpadded one bit for bit only on --deterministic's batch-invariant matmul (seen on an H200: one of
    20 greedy texts parted at its third token by default)."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " x" * i for i in range(batch)]
    flags = {"dtype": dtype, "deterministic": dtype == "bfloat16"}
    eager, none = _outputs(tiny_llama_dir, prompts, disable_cuda_graph=True, **flags)
    graphed, replays = _outputs(tiny_llama_dir, prompts, **flags)
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
