"""Every registered family against transformers on the same tiny random-init weights: greedy output on
20 prompts, prompt logprobs, and cached against uncached runs, on each CPU attention backend. Prompts of
the sliding-window families are 3x the window, so the window is what decides their outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from device_helpers import TEST_DEVICE
from family_models import FAMILIES, SLIDING_FAMILIES, WINDOW, build_family_dir

import radixlm_runtime as rt
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.registry import model_class

NEW_TOKENS = 12
WORDS = [
    "the",
    "theater",
    "then",
    "an",
    "interesting",
    "answer",
    "to",
    "the",
    "question",
    "abc",
    "on",
    "in",
    "her",
]


def _prompts(tokenizer: object, n: int, min_tokens: int) -> list[list[int]]:
    """n distinct prompts of at least min_tokens tokens each."""
    prompts = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(4 * min_tokens)]
        ids = tokenizer.encode(" ".join(words))
        prompts.append(ids[: min_tokens + i])
    return prompts


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def hf_model(family_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(family_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["torch", "cpu"])
def engine(request: pytest.FixtureRequest, family_dir: Path) -> Iterator[rt.Engine]:
    eng = rt.Engine(
        str(family_dir),
        device="cpu" if request.param == "cpu" else "auto",  # the C++ kernels, on a GPU machine too
        dtype="float32",
        attention_backend=request.param,
        max_total_tokens=8192,
        log_level="warning",
    )
    yield eng
    eng.shutdown()


@torch.inference_mode()
def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' argmax over n steps, each a full forward (no cache, and unlike `generate` with
    `min_new_tokens` no EOS suppression: the engine runs with ignore_eos)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def _min_tokens(family_dir: Path) -> int:
    return 3 * WINDOW if family_dir.name.rstrip("0123456789") in SLIDING_FAMILIES else 12


def test_family_is_registered_and_served_by_its_own_class(family_dir: Path) -> None:
    config = ModelConfig.from_dir(family_dir)
    # Mistral is a Llama with a window: one registry line on the Llama class.
    expected = {"MistralForCausalLM": "LlamaForCausalLM"}.get(config.architecture, config.architecture)
    assert model_class(config.architecture).__name__ == expected


def test_greedy_matches_transformers_on_20_prompts(
    engine: rt.Engine, hf_model: torch.nn.Module, family_dir: Path
) -> None:
    prompts = _prompts(engine.tokenizer, 20, _min_tokens(family_dir))
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    )
    matches = sum(
        out["output_ids"] == _hf_greedy(hf_model, ids, NEW_TOKENS)
        for ids, out in zip(prompts, outs, strict=True)
    )
    assert matches == 20


def test_prompt_logprobs_match_transformers(
    engine: rt.Engine, hf_model: torch.nn.Module, family_dir: Path, prompt_logprobs: Callable[..., dict]
) -> None:
    for ids in _prompts(engine.tokenizer, 3, _min_tokens(family_dir)):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        ours = prompt_logprobs(engine, ids, start=0)["input_token_logprobs"]
        got = torch.tensor([lp for lp, _, _ in ours[1:]])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_cached_equals_uncached(engine: rt.Engine, family_dir: Path) -> None:
    """Prompts that share a long prefix (longer than the window): each alone on an empty cache, then
    all of them after the prefix was cached."""
    n = _min_tokens(family_dir)
    base = _prompts(engine.tokenizer, 1, 2 * n)[0]
    prompts = [base + [40 + i, 50 + i] for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    uncached = []
    for ids in prompts:
        engine.flush_cache()
        uncached.append(engine.generate(input_ids=ids, sampling_params=params, return_logprob=True))
    engine.flush_cache()
    engine.generate(input_ids=base, sampling_params={"max_new_tokens": 1})
    cached = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    for a, b in zip(uncached, cached, strict=True):
        assert b["meta_info"]["cached_tokens"] >= len(base) - 1
        assert a["output_ids"] == b["output_ids"]
        la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_triton_backend_matches_torch(family: str, tmp_path: Path) -> None:
    """The Triton kernels (under the interpreter on CPU) on the families with windows, soft-caps and
    per-layer rotary bases, against the torch reference backend: same tokens, logprobs within 1e-4."""
    model_dir = build_family_dir(tmp_path, family)
    results = []
    for backend in ("torch", "triton"):
        eng = rt.Engine(
            str(model_dir),
            device=TEST_DEVICE,
            dtype="float32",
            attention_backend=backend,
            max_total_tokens=2048,
        )
        prompts = _prompts(eng.tokenizer, 3, 3 * WINDOW)
        outs = eng.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            return_logprob=True,
        )
        eng.shutdown()
        results.append(
            [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]
        )
    for (ids_t, lp_t), (ids_k, lp_k) in zip(*results, strict=True):
        assert ids_t == ids_k
        assert max(abs(a - b) for a, b in zip(lp_t, lp_k, strict=True)) < 1e-4
