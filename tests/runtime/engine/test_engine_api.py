"""The offline Engine API on a tiny random-init model: outputs, sampling options, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

import radixlm_runtime as rt
from radixlm_runtime.entrypoints import engine as engine_module

PROMPT = "the theater then an answer"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> rt.Engine:
    return rt.Engine(
        str(tiny_llama_dir), dtype="float32", max_total_tokens=4096, context_length=256, log_level="warning"
    )


def test_output_shape(engine: rt.Engine) -> None:
    out = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 12 == meta["completion_tokens"]
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    # A character the length cut left incomplete (U+FFFD) is dropped, as streaming holds it back.
    full = engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"] == full.rstrip("\ufffd")
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}


def test_batch_returns_list_in_order(engine: rt.Engine) -> None:
    prompts = [PROMPT, "abc abc", "interesting"]
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    outs = engine.generate(prompts, greedy)
    singles = [engine.generate(p, greedy)["output_ids"] for p in prompts]
    assert [o["output_ids"] for o in outs] == singles
    per_prompt = engine.generate(prompts, [{**greedy, "max_new_tokens": n} for n in (1, 2, 3)])
    assert [len(o["output_ids"]) for o in per_prompt] == [1, 2, 3]


def test_input_ids_and_cached_tokens(engine: rt.Engine) -> None:
    ids = engine.tokenizer.encode(PROMPT + " and more words here")
    first = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    second = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1
    assert first["meta_info"]["prompt_tokens"] == len(ids)


def test_seeded_sampling_is_reproducible_and_batch_independent(engine: rt.Engine) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(PROMPT, params)["output_ids"]
    batch = engine.generate(["abc", PROMPT, "def"], [params | {"seed": 1}, params, params | {"seed": 2}])
    assert batch[1]["output_ids"] == alone
    other = engine.generate(PROMPT, params | {"seed": 99})["output_ids"]
    assert other != alone


def test_n_returns_distinct_samples(engine: rt.Engine) -> None:
    outs = engine.generate(
        PROMPT, {"temperature": 1.0, "max_new_tokens": 12, "n": 3, "seed": 5, "ignore_eos": True}
    )
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3


def test_stop_string_is_trimmed(engine: rt.Engine) -> None:
    full = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    text = full["text"]
    stop = text[6:9]
    assert stop and stop in text
    out = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "stop": stop, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    kept = engine.generate(
        PROMPT,
        {"temperature": 0, "max_new_tokens": 24, "stop": [stop], "no_stop_trim": True, "ignore_eos": True},
    )
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_stop_token_ids(engine: rt.Engine) -> None:
    full = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})["output_ids"]
    target = full[5]
    out = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [target]})
    assert out["output_ids"] == full[: full.index(target) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}


def test_min_new_tokens_blocks_stop_tokens(engine: rt.Engine) -> None:
    full = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})["output_ids"]
    first = full[0]
    out = engine.generate(
        PROMPT, {"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [first], "min_new_tokens": 4}
    )
    assert len(out["output_ids"]) >= 4 and first not in out["output_ids"][:4]


def test_output_logprobs(engine: rt.Engine) -> None:
    out = engine.generate(
        PROMPT,
        {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["input_token_logprobs"] == []
    for (lp, tok, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        # Greedy picks the argmax, so the chosen token is the top-1 entry with the same logprob.
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-5 and lp <= 0
        assert text == engine.tokenizer.decode([tok])
        assert [x[0] for x in top] == sorted((x[0] for x in top), reverse=True)


def test_max_new_tokens_zero_returns_prompt_logprobs_and_caches(engine: rt.Engine) -> None:
    ids = engine.tokenizer.encode("warming the cache with this prompt")
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=2
    )
    assert out["output_ids"] == [] and out["text"] == ""
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == ids[2:]
    again = engine.generate(input_ids=ids + [5], sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == len(ids)


def test_per_prompt_logprob_arguments(engine: rt.Engine) -> None:
    """Lists give each prompt its own logprob settings (SGLang's multiple-choice scoring: every
    question's choices scored from their own offset in one call); each equals that prompt alone."""
    prompts = [engine.tokenizer.encode(t) for t in ("one two three four", "alpha beta gamma", "x y z w v")]
    starts, tops = [1, 3, 0], [0, 2, 1]
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    batch = engine.generate(
        input_ids=prompts,
        sampling_params=params,
        return_logprob=[True, True, False],
        logprob_start_len=starts,
        top_logprobs_num=tops,
    )
    assert "input_token_logprobs" not in batch[2]["meta_info"]
    for ids, out, start, top in zip(prompts[:2], batch, starts, tops):
        alone = engine.generate(
            input_ids=ids,
            sampling_params=params,
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=top,
        )
        assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == ids[start:]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got = [lp for lp, _, _ in out["meta_info"][key] if lp is not None]
            want = [lp for lp, _, _ in alone["meta_info"][key] if lp is not None]
            assert got == pytest.approx(want, abs=1e-4)
        assert all(len(t) == top for t in out["meta_info"]["output_top_logprobs"])


def test_generate_stream_yields_growing_text(engine: rt.Engine) -> None:
    chunks, running = [], []
    for chunk in engine.generate_stream(PROMPT, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}):
        # A streamed request: its gaps are seen, so prefill beside it is paced (step_budget.py).
        running.append([r.stream for r in engine.scheduler.admission.running])
        chunks.append(chunk)
    assert running == [[True]] * 5 + [[]]
    assert len(chunks) == 6
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    final = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert chunks[-1]["output_ids"] == final["output_ids"]


BAD_INPUTS = [
    ({"prompt": ""}, "empty"),
    ({"prompt": "x" * 400}, "context length"),
    ({"prompt": PROMPT, "sampling_params": {"max_new_tokens": 300}}, "max_new_tokens"),
    ({"prompt": PROMPT, "sampling_params": {"max_tokens": 3}}, "unknown field"),
    ({"prompt": PROMPT, "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"prompt": PROMPT, "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"prompt": PROMPT, "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"prompt": PROMPT, "sampling_params": {"top_k": 0}}, "top_k"),
    ({"prompt": PROMPT, "sampling_params": {"top_k": -2}}, "top_k"),
    ({"prompt": PROMPT, "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"prompt": PROMPT, "sampling_params": {"regex": "a", "json_schema": "{}"}}, "regex"),
    ({"input_ids": [1, 2, 10**6]}, "input_ids"),
    ({"prompt": PROMPT, "input_ids": [1, 2]}, "exactly one"),
    ({"prompt": [PROMPT, PROMPT], "sampling_params": [{}, {}, {}]}, "sampling_params"),
    ({"prompt": PROMPT, "logprob_start_len": 99}, "logprob_start_len"),
    ({"prompt": [PROMPT, PROMPT], "logprob_start_len": [0]}, "logprob_start_len: got 1 entries for 2"),
    ({"prompt": [PROMPT, PROMPT], "return_logprob": [True, "yes"]}, "return_logprob must be a boolean"),
    ({"prompt": PROMPT, "top_logprobs_num": -1}, "top_logprobs_num"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_INPUTS)
def test_bad_input_raises_before_running(engine: rt.Engine, kwargs: dict, message: str) -> None:
    before = engine.scheduler.stats.num_requests
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    assert engine.scheduler.stats.num_requests == before
    assert not engine.scheduler.has_work()


def test_bad_item_in_batch_rejects_whole_batch(engine: rt.Engine) -> None:
    before = engine.scheduler.stats.num_requests
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([PROMPT, PROMPT], [{"max_new_tokens": 2}, {"temperature": -1}])
    assert engine.scheduler.stats.num_requests == before
    ok = engine.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0})
    assert len(ok["output_ids"]) == 2


def test_unknown_engine_argument(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown engine argument"):
        rt.Engine(str(tiny_llama_dir), max_totl_tokens=10)


def test_a_stalled_scheduler_raises_instead_of_spinning(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadlock in scheduling (steps that run nothing, with requests pending) is a runtime bug: the
    offline engine, with no other input that could unblock it, names it instead of hanging."""
    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=1024, log_level="warning")
    try:
        monkeypatch.setattr(engine.scheduler.admission, "schedule", lambda: [])
        monkeypatch.setattr(engine_module, "STALL_LIMIT_S", 0.0)
        with pytest.raises(RuntimeError, match="no step ran for .* with 1 requests waiting"):
            engine.generate("hello", {"max_new_tokens": 2})
    finally:
        engine.shutdown()
