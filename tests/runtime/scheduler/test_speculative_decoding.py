"""Speculative decoding by prompt lookup on a tiny random-init model: drafting, token-identical
greedy outputs, the same output distribution when sampling, KV rollback, stops and limits inside
a draft, retraction and aborts mid-draft, and constrained requests."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scheduler_helpers import assert_no_leak, make_req, message

import radixlm_runtime as rt
from radixlm_runtime.constrained.backend import make_backend
from radixlm_runtime.constrained.constraint import Constraint
from radixlm_runtime.scheduler.speculative import Drafter, propose

K = 4
GREEDY = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
SEED_PROMPT = [(7 * i) % 250 + 3 for i in range(12)]


def _engine(model_dir: Path, k: int, **kwargs: object) -> rt.Engine:
    kwargs.setdefault("max_total_tokens", 8192)
    return rt.Engine(
        str(model_dir), dtype="float32", speculative_num_draft_tokens=k, log_level="warning", **kwargs
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> tuple[rt.Engine, rt.Engine]:
    """(speculation off, speculation on), both with the radix cache."""
    return _engine(tiny_llama_dir, 0), _engine(tiny_llama_dir, K)


@pytest.fixture(scope="module")
def lookup_prompt(engines: tuple[rt.Engine, rt.Engine]) -> list[int]:
    """S + greedy(S) + S: at its end, prompt lookup proposes the model's own continuation."""
    plain, _ = engines
    cont = plain.generate(input_ids=SEED_PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12})
    return SEED_PROMPT + cont["output_ids"] + SEED_PROMPT


def _prompts(lookup: list[int]) -> list[list[int]]:
    """A batch mixing prompts where lookup hits with prompts sharing prefixes where it mostly misses."""
    others = [[(11 * i + j) % 250 + 3 for j in range(9 + i)] for i in range(4)]
    return [lookup, lookup[:20], *others, lookup + [5, 6]]


def _outputs(engine: rt.Engine, prompts: list[list[int]], params: dict) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=params)


# -- drafting ---------------------------------------------------------------------------------
def test_propose_continues_the_latest_longest_match() -> None:
    ids = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" occurred twice before the end; the latest (followed by 7 8) wins.
    assert propose(ids, 2, 1, 3) == [7, 8]
    assert propose(ids, 10, 1, 3) == [7, 8, 5, 2, 3]
    # The 3-gram "5 2 3" never occurred before; with only 3-grams there is no draft.
    assert propose(ids, 2, 3, 3) == []
    assert propose(ids, 0, 1, 3) == []
    assert propose([4], 2, 1, 3) == []


def test_propose_prefers_longer_matches() -> None:
    ids = [1, 2, 3, 4, 9, 3, 5, 6, 2, 3]
    assert propose(ids, 1, 1, 2) == [4]  # "2 3" beats the later "3"
    assert propose(ids, 1, 1, 1) == [5]


def test_propose_matches_whole_tokens_only() -> None:
    # Little-endian bytes of 256 are 00 01 00 00: a byte-level search would find [1] inside
    # [256, 0] misaligned; only token-aligned hits count.
    ids = [256, 0, 7, 1]
    assert propose(ids, 2, 1, 1) == []
    assert propose([1, 8, 256, 0, 7, 1], 2, 1, 1) == [8, 256]


def _drafter(vocab_size: int = 300, context_len: int = 512) -> Drafter:
    return Drafter(K, 1, 3, frozenset({2}), context_len, vocab_size)


def test_draft_respects_limits_and_stops() -> None:
    ids = [10, 11, 12, 13, 2, 14, 10, 11]
    drafter = _drafter()
    assert drafter.draft(make_req("a", ids, {"max_new_tokens": 9}), room=8) == [12, 13]  # EOS cuts it
    assert drafter.draft(make_req("b", ids, {"max_new_tokens": 9, "stop_token_ids": [13]}), 8) == [12]
    assert drafter.draft(make_req("c", ids, {"max_new_tokens": 2}), room=8) == [12]  # 1 left after it
    assert drafter.draft(make_req("d", ids, {"max_new_tokens": 9}), room=1) == [12]
    assert _drafter(context_len=len(ids) + 1).draft(make_req("e", ids, {"max_new_tokens": 9}), 8) == [12]


def test_draft_stops_before_a_token_the_constraint_forbids(engines: tuple[rt.Engine, rt.Engine]) -> None:
    tokenizer = engines[0].tokenizer
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    req = make_req("r", [a, b, b, c, a], {"max_new_tokens": 9})
    vocab = len(tokenizer)
    backend = make_backend("llguidance", tokenizer, frozenset({tokenizer.eos_token_id}), vocab)
    req.guide = backend.guide(backend.compile(Constraint("regex", "b+")))
    before = req.guide.allowed_mask(vocab).copy()
    # Lookup proposes "b b c a"; "c" does not fit b+, so the draft ends before it.
    assert _drafter(vocab_size=vocab).draft(req, room=8) == [b, b]
    assert np.array_equal(req.guide.allowed_mask(vocab), before)  # the walk was rolled back


# -- greedy: the same tokens -------------------------------------------------------------------
def test_greedy_outputs_are_token_identical(
    engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    plain, spec = engines
    prompts = _prompts(lookup_prompt)
    want = _outputs(plain, prompts, GREEDY)
    for _ in range(2):  # the second round reads the radix cache the first one filled
        got = _outputs(spec, prompts, GREEDY)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    meta = got[0]["meta_info"]
    assert meta["spec_accept_token_num"] > 0
    assert meta["spec_verify_ct"] < meta["completion_tokens"] - 1
    assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
    assert 0 < meta["spec_accept_rate"] <= 1
    stats = spec.scheduler.stats
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # some drafts were rejected
    assert_no_leak(spec)


def test_rejected_tokens_never_reach_the_radix_tree(tiny_llama_dir: Path, lookup_prompt: list[int]) -> None:
    """The same requests leave exactly the same tokens in the tree with speculation as without."""
    trees = []
    for k in (0, K):
        # Speculation never overlaps steps; overlap would also cache each request's last token,
        # whose KV the step launched before its finish was read computes.
        engine = _engine(tiny_llama_dir, k, disable_overlap_schedule=True)
        _outputs(engine, _prompts(lookup_prompt), GREEDY)
        assert_no_leak(engine)
        tree = engine.scheduler.cache.tree
        free = engine.scheduler.cache.allocator.available_size()
        trees.append((tree.total_size(), free, sorted(_tree_sequences(tree.root_node))))
    assert trees[0] == trees[1]


def _tree_sequences(node: object, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Every root-to-leaf token sequence of the radix tree."""
    children = list(node.children.values())  # type: ignore[attr-defined]
    if not children:
        return [prefix]
    return [seq for child in children for seq in _tree_sequences(child, prefix + tuple(child.key))]


def test_logprobs_match_without_speculation(
    engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    plain, spec = engines
    kwargs = {"return_logprob": True, "top_logprobs_num": 3, "sampling_params": GREEDY}
    want = plain.generate(input_ids=lookup_prompt, **kwargs)["meta_info"]
    got = spec.generate(input_ids=lookup_prompt, **kwargs)["meta_info"]
    assert got["spec_accept_token_num"] > 0
    pairs = list(zip(got["output_token_logprobs"], want["output_token_logprobs"], strict=True))
    assert all(g[1] == w[1] and g[0] == pytest.approx(w[0], abs=1e-4) for g, w in pairs)
    for g_top, w_top in zip(got["output_top_logprobs"], want["output_top_logprobs"], strict=True):
        assert [t[1] for t in g_top] == [t[1] for t in w_top]
        assert [t[0] for t in g_top] == pytest.approx([t[0] for t in w_top], abs=1e-4)


def test_max_new_tokens_inside_a_draft(
    engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    plain, spec = engines
    for n in range(1, 9):
        params = {**GREEDY, "max_new_tokens": n}
        want = plain.generate(input_ids=lookup_prompt, sampling_params=params)
        got = spec.generate(input_ids=lookup_prompt, sampling_params=params)
        assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == n
    assert_no_leak(spec)


def test_stops_inside_an_accepted_draft(
    engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    """Each stop string / stop token ends the output where it ends without speculation."""
    plain, spec = engines
    full = plain.generate(input_ids=lookup_prompt, sampling_params=GREEDY)
    tokenizer = plain.tokenizer
    accepted = 0
    for pos in (3, 6, 9, 14):
        stop_text = tokenizer.decode(full["output_ids"][pos : pos + 2])
        for extra in ({"stop": [stop_text]}, {"stop_token_ids": [full["output_ids"][pos]]}):
            params = {**GREEDY, **extra}
            want = plain.generate(input_ids=lookup_prompt, sampling_params=params)
            got = spec.generate(input_ids=lookup_prompt, sampling_params=params)
            assert got["output_ids"] == want["output_ids"], extra
            assert got["text"] == want["text"]
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
            accepted += got["meta_info"].get("spec_accept_token_num", 0)
    assert accepted > 0
    assert_no_leak(spec)


# -- sampling: the same distribution -----------------------------------------------------------
def test_sampled_outputs_follow_the_same_distribution(
    engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    """The joint distribution of the first three sampled tokens (top-k 3, so 27 outcomes) over
    1500 seeded requests each: speculation on and off agree within a total variation distance
    the sampling noise stays well below (about 0.05 expected), while the drafts are both accepted
    and rejected. A wrong acceptance rule (e.g. accepting drafts the sampler would rarely pick)
    moves the distribution by far more. Seeded, so the test is deterministic."""
    plain, spec = engines
    n = 1500
    base = {
        "temperature": 0.8,
        "top_k": 3,
        "repetition_penalty": 1.3,
        "max_new_tokens": 3,
        "ignore_eos": True,
    }

    def joint(engine: rt.Engine, first_seed: int) -> tuple[Counter, list[dict]]:
        params = [{**base, "seed": first_seed + i} for i in range(n)]
        outs = engine.generate(input_ids=[lookup_prompt] * n, sampling_params=params)
        return Counter(tuple(o["output_ids"]) for o in outs), outs

    want, _ = joint(plain, 0)
    got, outs = joint(spec, 10_000)
    accepted = sum(o["meta_info"].get("spec_accept_token_num", 0) for o in outs)
    drafted = sum(o["meta_info"].get("spec_draft_token_num", 0) for o in outs)
    assert 0 < accepted < drafted
    tv = sum(abs(want[key] - got[key]) for key in want.keys() | got.keys()) / (2 * n)
    assert tv < 0.12, (tv, want.most_common(5), got.most_common(5))
    assert_no_leak(spec)


def test_seeded_requests_sample_the_same_tokens_as_without_speculation(
    engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    """A row's draw is numbered by the output token it samples, so a seed gives the same stream."""
    plain, spec = engines
    params = [
        {"temperature": 0.8, "top_k": 3, "max_new_tokens": 12, "seed": s, "ignore_eos": True}
        for s in range(40)
    ]
    want = plain.generate(input_ids=[lookup_prompt] * 40, sampling_params=params)
    got = spec.generate(input_ids=[lookup_prompt] * 40, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in got)
    assert 0 < accepted < sum(o["meta_info"]["spec_draft_token_num"] for o in got)


# -- KV memory: retraction and aborts mid-draft ------------------------------------------------
def test_retraction_mid_draft_matches(
    tiny_llama_dir: Path, engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    plain, _ = engines
    prompts = [lookup_prompt + [3 + i] for i in range(8)]
    want = _outputs(plain, prompts, GREEDY)
    engine = _engine(tiny_llama_dir, K, max_total_tokens=200)
    got = _outputs(engine, prompts, GREEDY)
    assert engine.scheduler.stats.num_retractions > 0
    assert engine.scheduler.stats.spec_accepted_tokens > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert_no_leak(engine)


def test_abort_mid_draft_frees_everything(tiny_llama_dir: Path, lookup_prompt: list[int]) -> None:
    engine = _engine(tiny_llama_dir, K)
    sched = engine.scheduler
    free = sched.cache.allocator.available_size()
    reqs = [sched.submit(message(f"r{i}", lookup_prompt + [3 + i], GREEDY)) for i in range(3)]
    while not any(r.spec_accept_token_num for r in reqs):
        sched.step()
    sched.abort("r1")
    sched.step()
    assert reqs[1].finished_reason is not None and reqs[1].finished_reason.kind == "abort"
    while sched.has_work():
        sched.step()
    assert_no_leak(engine)
    assert engine.flush_cache()
    assert sched.cache.allocator.available_size() == free


# -- constrained decoding ----------------------------------------------------------------------
def test_constrained_request_with_speculation(
    engines: tuple[rt.Engine, rt.Engine], lookup_prompt: list[int]
) -> None:
    plain, spec = engines
    regex = "[a-e ]{4,24}"
    prompt = plain.tokenizer.encode("abc abc abc abd abc ab", add_special_tokens=False)
    params = {"temperature": 0, "max_new_tokens": 24, "regex": regex}
    want = plain.generate(input_ids=prompt, sampling_params=params)
    got = spec.generate(input_ids=prompt, sampling_params=params)
    assert got["output_ids"] == want["output_ids"]
    assert re.fullmatch(regex, got["text"])
    assert got["meta_info"]["spec_draft_token_num"] > 0  # the constraint let some drafts through
    assert_no_leak(spec)


def test_bad_speculative_flags_are_rejected_by_name(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        _engine(tiny_llama_dir, -1)
    with pytest.raises(ValueError, match="speculative_ngram_min_match_window_size"):
        _engine(tiny_llama_dir, K, speculative_ngram_min_match_window_size=4)
