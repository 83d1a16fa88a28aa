"""Tensor parallelism against one process: the plan's wire format, logits within 1e-4 of tp 1 on tiny
random-init models (Llama; Qwen3 with per-head q/k norms; a Llama with 3 KV heads split 2 + 1 and
int4 weights cut per rank; Llama's layers from Python rather than the C++ decoder), greedy tokens
and cached runs equal; the default model's greedy outputs
with --tp-size 2 equal tp 1's on 20 of 20 prompts (slow).

Every engine here runs on the CPU (gloo), on a GPU machine too: the one-call C++ decoder and the
int4 kernels are CPU paths, and NCCL would need a GPU per rank."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import TINY_MODEL_KWARGS, build_tiny_tokenizer

import radixlm_runtime as rt
from radixlm_runtime.executor.tp import decode_plan, encode_plan
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.step import ForwardItem, KVCopy, PromptLogprobSpec, SampleSpec, StepPlan

PROMPTS = [
    "the theater then",
    "an interesting answer to the question",
    "abc abc abc abc abc",
    "<|im_start|>user\nhello there<|im_end|>\n",
]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def test_plan_round_trips_through_its_wire_format() -> None:
    mask = np.array([-1, 5, 0], dtype=np.int32)
    spec = SampleSpec(
        SamplingParams(temperature=0.5, logit_bias={7: -2.0}),
        seed=3,
        draw=4,
        banned_ids=[2],
        history=([1, 2], [3]),
        allowed=mask,
        return_logprob=True,
        top_logprobs_num=2,
    )
    item = ForwardItem(0, 2, [5, 6], [1, 2, 3, 4], 2, 3, spec, PromptLogprobSpec([0], [6], [3]), 1, [spec])
    # Tier moves: a load, a write to the disk tier with its path's tokens, disk slots let go.
    copies = [
        KVCopy("host", "device", [1], [2]),
        KVCopy("device", "disk", [2], [7], [4, 5]),
        KVCopy("disk", None, [7]),
    ]
    plan = decode_plan(encode_plan(StepPlan([item], copies)))
    assert plan.copies == copies
    got = plan.items[0]
    assert isinstance(got.sample.allowed, np.ndarray) and got.sample.allowed.tolist() == mask.tolist()
    got.sample.allowed = got.draft_samples[0].allowed = spec.allowed = mask
    assert got == item


def _kv3_model_dir(out_dir: Path) -> Path:
    """A tiny Llama shaped like the default model's attention: 6 query heads on 3 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    shape = {"hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3}
    LlamaForCausalLM(LlamaConfig(**(TINY_MODEL_KWARGS | shape))).save_pretrained(out_dir)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama_kv3_int4", "llama_python_layers"])
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(tp 1 engine, tp 2 engine) on one model; the decoder layers in the one-call C++ decoder (its
    all-reduces called back between layers), except with the torch attention backend (from Python)."""
    flags: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "max_total_tokens": 2048,
        "log_level": "warning",
    }
    if request.param == "llama_kv3_int4":
        model_dir = _kv3_model_dir(tmp_path_factory.mktemp("tiny_kv3"))
        flags["quantization"] = "int4"
    else:
        model_dir = request.getfixturevalue(f"tiny_{request.param.split('_')[0]}_dir")
    if request.param == "llama_python_layers":
        flags["attention_backend"] = "torch"
    pair = (rt.Engine(str(model_dir), **flags), rt.Engine(str(model_dir), tp_size=2, **flags))
    in_cpp = pair[1].runner.runner.model.cpu_decoder is not None
    assert in_cpp == (request.param != "llama_python_layers")
    yield pair
    for engine in pair:
        engine.shutdown()


def _prompt_logits(engine: rt.Engine, model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The logits of every prompt position, as the model (rank 0's under tp 2: gathered) returns them."""
    captured: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, logits: captured.append(logits.clone()))
    try:
        engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )
    finally:
        hook.remove()
    return torch.cat(captured)  # a long prompt's prefill chunks, in order


def test_logits_within_1e4_of_one_process(engines: tuple) -> None:
    one, two = engines
    for prompt in PROMPTS:
        ids = one.tokenizer.encode(prompt)
        one.flush_cache()
        two.flush_cache()
        expect = _prompt_logits(one, one.runner.model, ids)
        got = _prompt_logits(two, two.runner.runner.model, ids)
        assert got.shape == expect.shape == (len(ids), one.runner.info.vocab_size)
        torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)


def test_greedy_tokens_equal_and_cached_equals_uncached(engines: tuple) -> None:
    one, two = engines
    expect = [out["output_ids"] for out in one.generate(PROMPTS, sampling_params=GREEDY)]
    two.flush_cache()
    fresh = two.generate(PROMPTS, sampling_params=GREEDY)
    assert [out["output_ids"] for out in fresh] == expect
    # Again: each prompt now comes from the radix cache.
    cached = two.generate(PROMPTS, sampling_params=GREEDY)
    assert all(out["meta_info"]["cached_tokens"] > 0 for out in cached)
    assert [out["output_ids"] for out in cached] == expect


def test_constrained_tokens_equal(engines: tuple) -> None:
    """A constraint's allowed-token bitmask travels in the plan to every rank."""
    one, two = engines
    params = {"regex": "(abc|the) [a-z]{3,6}", "max_new_tokens": 12, "temperature": 0}
    outputs = [engine.generate(PROMPTS[:2], sampling_params=params) for engine in (one, two)]
    assert [o["output_ids"] for o in outputs[1]] == [o["output_ids"] for o in outputs[0]]


def test_mixture_of_experts_is_refused(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from family_models import build_family_dir

    model_dir = build_family_dir(tmp_path / "mixtral", "mixtral")
    with pytest.raises(ValueError, match="dense models only"):
        rt.Engine(
            str(model_dir),
            device="cpu",
            dtype="float32",
            max_total_tokens=2048,
            log_level="warning",
            tp_size=2,
        )


DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "Write a haiku about the sea.",
    "import numpy as np\n",
    "Q: What is 12 times 7?\nA:",
    "The largest planet in the solar system",
    "Translate to French: good morning",
    "List three fruits:",
    "The theory of relativity states",
    "SELECT name FROM users WHERE",
    "In 1492, Columbus",
    "A recipe for pancakes:",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "for i in range(10):",
    "The meaning of life is",
    "Water boils at",
    "<|im_start|>user\nWhat is a prime number?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.slow
def test_default_model_greedy_equal_on_twenty_prompts() -> None:
    """SmolLM2-135M (Q4_1 int4 layers, 3 KV heads: 2 on rank 0, 1 on rank 1) with --tp-size 2."""
    assert len(DEFAULT_PROMPTS) == 20
    params = {"max_new_tokens": 24, "temperature": 0}
    outputs = []
    for tp in (1, 2):
        engine = rt.Engine(device="cpu", max_total_tokens=8192, log_level="warning", tp_size=tp)
        try:
            outputs.append(
                [out["output_ids"] for out in engine.generate(DEFAULT_PROMPTS, sampling_params=params)]
            )
        finally:
            engine.shutdown()
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    assert same == 20, f"{same} of 20 prompts equal"
