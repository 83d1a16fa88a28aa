"""Behavioural tests for the batched sampler: every assertion is against an independent reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.sampling.sampler import (
    PenaltyInfo,
    Sampler,
    SamplingBatchInfo,
    accepted_draft_len,
    apply_penalties,
    apply_token_bitmask_,
    build_token_bitmask,
    seeded_uniform,
    unpack_bits_numpy,
    unpack_bits_shifts,
)


def sp(**kwargs: object) -> SamplingParams:
    return SamplingParams.from_dict(dict(kwargs))


def build(
    params: list[SamplingParams],
    vocab_size: int,
    history: list[tuple[list[int], list[int]]] | None = None,
    banned: list[list[int]] | None = None,
    seeded: bool = True,
    draw: int = 0,
) -> SamplingBatchInfo:
    """A batch whose seeded rows take draw number `draw` of their seed's stream."""
    draws = [None if p.seed is None or not seeded else (p.seed, draw) for p in params]
    return SamplingBatchInfo.build(params, draws, history, vocab_size, banned_token_ids=banned)


def random_logits(batch: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws for one request, batched as n identical unseeded rows."""
    info = build([params] * n, logits_row.numel(), seeded=False)
    return Sampler(seed=seed)(logits_row.expand(n, -1).contiguous(), info).next_token_ids


def nucleus(logits_row: torch.Tensor, top_p: float) -> set[int]:
    """Reference top-p set: the shortest most-probable prefix whose mass reaches top_p."""
    probs = torch.softmax(logits_row.double(), dim=-1)
    values, order = torch.sort(probs, descending=True)
    before = torch.cumsum(values, dim=0) - values
    return set(order[before < top_p].tolist())


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(16, 100)
    out = Sampler(seed=0)(logits, build([sp(temperature=0.0)] * 16, 100))
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))
    assert out.next_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_1_is_greedy_whatever_the_seed() -> None:
    logits = random_logits(8, 50, seed=1)
    for seed in range(5):
        params = [sp(temperature=1.3, top_k=1, seed=seed)] * 8
        assert torch.equal(Sampler(seed=seed)(logits, build(params, 50)).next_token_ids, logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    batch, vocab = 32, 64
    logits = random_logits(batch, vocab, seed=2, scale=0.5)  # flat, so sampled rows rarely hit argmax
    params = [sp(temperature=0.0) if i % 2 == 0 else sp(temperature=1.0, top_p=0.95) for i in range(batch)]
    sampler = Sampler(seed=0)
    sampled_hits_argmax = 0
    for _ in range(10):
        ids = sampler(logits, build(params, vocab, seeded=False)).next_token_ids
        assert torch.equal(ids[0::2], logits[0::2].argmax(-1))
        sampled_hits_argmax += int((ids[1::2] == logits[1::2].argmax(-1)).sum())
    assert sampled_hits_argmax < 100  # the sampled rows really were sampled


# --- seeding --------------------------------------------------------------------------------------


def test_seeded_request_samples_the_same_in_any_batch() -> None:
    vocab = 1024
    target_logits = random_logits(1, vocab, seed=3, scale=1.5)[0]
    target = sp(temperature=0.9, top_p=0.9, seed=1234)
    companions = [
        sp(temperature=0.0),
        sp(top_k=700),  # widens the topk prefix shared with the target row
        sp(min_p=0.1),
        sp(temperature=2.0),  # unseeded: draws from the shared generator
        sp(top_p=0.5, seed=7),
    ]

    def run(position: int, others: list[SamplingParams]) -> list[int]:
        params = others[:position] + [target] + others[position:]
        logits = random_logits(len(params), vocab, seed=4)
        logits[position] = target_logits
        sampler = Sampler(seed=position)
        return [
            int(sampler(logits, build(params, vocab, draw=d)).next_token_ids[position]) for d in range(20)
        ]

    alone = run(0, [])
    assert len(set(alone)) > 5  # genuinely random, so equality below is meaningful
    assert run(3, companions) == alone
    assert run(1, companions[:2]) == alone
    assert run(5, companions) == alone


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    logits = torch.zeros(1, 100)

    def sequence(seed: int) -> list[int]:
        sampler = Sampler(seed=0)
        return [int(sampler(logits, build([sp(seed=seed)], 100, draw=i)).next_token_ids) for i in range(50)]

    assert sequence(1) == sequence(1)
    assert sequence(1) != sequence(2)
    assert sequence(-1) == sequence(2**64 - 1)  # seeds are taken mod 2**64


def _splitmix64_reference(seed: int, draw: int) -> float:
    """SplitMix64 in numpy's wrapping uint64 arithmetic: state = mix(seed), then `draw + 1` steps."""
    golden = np.uint64(0x9E3779B97F4A7C15)

    def mix(z: np.uint64) -> np.uint64:
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        state = mix(np.uint64(seed % 2**64))
        out = mix(state + np.uint64(draw + 1) * golden)
    return int(out >> np.uint64(40)) / 2**24


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1, -5])
def test_seeded_uniform_is_splitmix64(seed: int) -> None:
    for draw in (0, 1, 7, 10**6, 2**40):
        assert seeded_uniform(seed, draw) == _splitmix64_reference(seed, draw)


def test_seeded_uniforms_are_uniform_and_independent() -> None:
    """Along one request's draws and across requests' seeds: 20-bin chi-square, float32-exact values
    in [0, 1), and no correlation between consecutive draws or neighbouring seeds."""
    n = 20000
    along = np.array([seeded_uniform(12345, d) for d in range(n)])
    across = np.array([seeded_uniform(s, 3) for s in range(n)])
    for u in (along, across):
        assert ((u >= 0) & (u < 1)).all()
        assert (u.astype(np.float32) == u).all()
        counts = np.bincount((u * 20).astype(int), minlength=20)
        chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
        assert chi2 < 50.0  # 19 degrees of freedom: p ~ 1e-4
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.05


def test_seeded_rows_sample_the_softmax() -> None:
    """Rows of one seed at successive draw numbers follow the distribution, as a request's tokens do."""
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    params = [sp(seed=99)] * n
    draws = [(99, i) for i in range(n)]
    info = SamplingBatchInfo.build(params, draws, None, 6)
    ids = Sampler(seed=0)(row.expand(n, -1).contiguous(), info).next_token_ids
    counts = torch.bincount(ids, minlength=6).double()
    expected = torch.softmax(row.double(), dim=-1) * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 25.0


# --- filters --------------------------------------------------------------------------------------


def test_top_k_never_samples_outside_the_top_k() -> None:
    vocab = 50
    row = random_logits(1, vocab, seed=5, scale=0.3)[0]
    for k in (2, 5, 20):
        draws = draw_many(row, sp(top_k=k, temperature=2.0), 3000)
        allowed = set(torch.topk(row, k).indices.tolist())
        assert set(draws.tolist()) == allowed  # within the top k, and all of them reachable


def test_top_k_rows_with_different_k_in_one_batch() -> None:
    vocab = 1000
    logits = random_logits(3, vocab, seed=6, scale=0.2).repeat_interleave(400, dim=0)
    ks = [3, 40, 250]
    params = [sp(top_k=k) for k in ks for _ in range(400)]
    ids = Sampler(seed=1)(logits, build(params, vocab, seeded=False)).next_token_ids
    for j, k in enumerate(ks):
        rows = slice(400 * j, 400 * (j + 1))
        allowed = set(torch.topk(logits[400 * j], k).indices.tolist())
        assert set(ids[rows].tolist()) <= allowed


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(64, 200, seed=7, scale=0.1)
    params = [sp(temperature=1.5, top_p=1e-6)] * 64
    ids = Sampler(seed=0)(logits, build(params, 200, seeded=False)).next_token_ids
    assert torch.equal(ids, logits.argmax(-1))


def test_top_p_samples_exactly_the_nucleus() -> None:
    row = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    for top_p in (0.5, 0.64, 0.7, 0.92):
        draws = set(draw_many(row, sp(top_p=top_p), 4000).tolist())
        assert draws == nucleus(row, top_p), top_p


def test_top_p_after_top_k_renormalises_within_top_k() -> None:
    row = torch.log(torch.tensor([[0.3, 0.3, 0.2, 0.1, 0.1]]))
    # Within the top 3 the masses are 3/8, 3/8, 2/8: the first two reach 0.7 of that, so token 2 goes.
    # The top-p-only companion forces the full-sort path instead of the top-k prefix.
    for companions in ([], [sp(top_p=0.9)]):
        params = [sp(top_k=3, top_p=0.7)] * 2000 + companions
        logits = row.expand(len(params), -1).contiguous()
        ids = Sampler(seed=0)(logits, build(params, 5, seeded=False)).next_token_ids[:2000]
        assert set(ids.tolist()) == {0, 1}


def test_wide_nucleus_is_not_cut_at_the_topk_prefix() -> None:
    vocab = 1024
    flat = random_logits(1, vocab, seed=8, scale=0.5)[0]  # nucleus of hundreds of tokens
    peaked = flat.clone()
    peaked[:5] += 12.0  # nucleus within the first few
    assert len(nucleus(flat, 0.9)) > 300 and len(nucleus(peaked, 0.9)) <= 5
    flat_draws = draw_many(flat, sp(top_p=0.9), 1000).tolist()
    assert set(flat_draws) <= nucleus(flat, 0.9)
    assert set(draw_many(peaked, sp(top_p=0.9), 1000).tolist()) <= nucleus(peaked, 0.9)
    rank = {t: r for r, t in enumerate(torch.argsort(flat, descending=True).tolist())}
    assert max(rank[t] for t in flat_draws) > 256


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.11, 0.09]))
    draws = set(draw_many(row, sp(min_p=0.2), 4000).tolist())  # threshold 0.1
    assert draws == {0, 1, 2}
    assert set(draw_many(row, sp(min_p=1.0), 200).tolist()) == {0}
    assert set(draw_many(row, sp(min_p=0.2, top_p=0.999), 4000).tolist()) == {0, 1, 2}
    assert set(draw_many(row, sp(min_p=0.2, top_k=3, temperature=3.0), 4000).tolist()) == {0, 1, 2}


@pytest.mark.parametrize("u", [0.0, 1.0])
@pytest.mark.parametrize("params", [sp(), sp(top_p=0.99), sp(top_k=4)])
def test_extreme_uniforms_never_pick_masked_edge_tokens(
    monkeypatch: pytest.MonkeyPatch, u: float, params: SamplingParams
) -> None:
    """u = 0 and u = 1 (the latter only reachable through rounding of u * total) must not land on
    the zero-probability tokens at either end of the cumulative distribution."""
    monkeypatch.setattr(Sampler, "_uniforms", lambda self, info: torch.full((len(info.sampled_rows),), u))
    logits = torch.tensor([[5.0, 1.0, 2.0, 3.0, 0.5, 9.0]])
    info = build([params], 6)
    info.vocab_mask = bitmask_of(torch.tensor([[False, True, True, True, True, False]]))
    token = int(Sampler()(logits, info).next_token_ids)
    assert token in (1, 2, 3, 4)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    counts = torch.bincount(draw_many(row, sp(temperature=temperature), n, seed=11), minlength=6).double()
    expected = torch.softmax(row.double() / temperature, dim=-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # 5 degrees of freedom: p ~ 1e-4


def test_no_full_sort_when_the_topk_prefix_suffices(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("full vocabulary sort")

    monkeypatch.setattr(torch, "sort", no_sort)
    vocab = 2048
    logits = random_logits(4, vocab, seed=12)
    logits[:, :3] += 20.0  # nucleus fits the topk prefix
    params = [sp(), sp(top_k=50), sp(min_p=0.05, temperature=0.7), sp(top_p=0.9, top_k=100)]
    Sampler(seed=0)(logits, build(params, vocab))
    Sampler(seed=0)(logits, build([sp(top_p=0.9)] * 4, vocab))


# --- penalties ------------------------------------------------------------------------------------


def reference_penalties(
    logits: torch.Tensor, params: list[SamplingParams], history: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    out = logits.clone()
    for b, (p, (prompt, output)) in enumerate(zip(params, history, strict=True)):
        for t in set(prompt + output):
            value = out[b, t]
            out[b, t] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for t in set(output):
            out[b, t] = out[b, t] - p.frequency_penalty * output.count(t)
            out[b, t] = out[b, t] - p.presence_penalty
    return out


def test_penalties_follow_their_formulas() -> None:
    vocab = 40
    logits = random_logits(4, vocab, seed=13)
    history = [([1, 2, 3, 3], [3, 4, 4, 4]), ([5, 6], [7, 7, 8]), ([], [9, 9]), ([10, 11], [])]
    cases = [
        [sp(repetition_penalty=1.3)] * 4,
        [sp(repetition_penalty=0.7)] * 4,
        [sp(frequency_penalty=0.5)] * 4,
        [sp(frequency_penalty=-1.5)] * 4,
        [sp(presence_penalty=0.8)] * 4,
        [
            sp(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=-0.3),
            sp(),
            sp(presence_penalty=2.0),
            sp(repetition_penalty=1.9),
        ],
    ]
    for params in cases:
        penalties = PenaltyInfo.build(params, history, vocab, "cpu")
        assert penalties is not None
        got = logits.clone()
        apply_penalties(got, penalties)
        torch.testing.assert_close(got, reference_penalties(logits, params, history), rtol=1e-6, atol=1e-6)


def test_repetition_penalty_sign_convention() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    penalties = PenaltyInfo.build([sp(repetition_penalty=2.0)], [([0, 1], [0])], 4, "cpu")
    assert penalties is not None
    apply_penalties(logits, penalties)
    assert logits.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_neutral_penalties_are_a_no_op() -> None:
    assert PenaltyInfo.build([sp(repetition_penalty=1.0)], [([1, 2], [2])], 10, "cpu") is None
    logits = random_logits(2, 30, seed=14)
    history = [([1, 2, 3], [3, 4]), ([5], [6, 6])]
    # A penalised row beside an unpenalised one: the latter and p=1 rows must be untouched bit for bit.
    penalties = PenaltyInfo.build(
        [sp(repetition_penalty=1.0, presence_penalty=0.5), sp()], history, 30, "cpu"
    )
    assert penalties is not None
    got = logits.clone()
    apply_penalties(got, penalties)
    assert torch.equal(got[1], logits[1])
    untouched = [t for t in range(30) if t not in (3, 4)]
    assert torch.equal(got[0, untouched], logits[0, untouched])


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    history = [([], [0, 0])]
    plain = Sampler()(logits, build([sp(temperature=0.0)], 3, history))
    penalised = Sampler()(logits, build([sp(temperature=0.0, frequency_penalty=1.0)], 3, history))
    assert int(plain.next_token_ids) == 0 and int(penalised.next_token_ids) == 1


def test_penalties_need_history() -> None:
    with pytest.raises(ValueError, match="token_history"):
        build([sp(presence_penalty=1.0)], 10, None)
    with pytest.raises(ValueError, match="token_history"):
        build([sp(presence_penalty=1.0)], 10, [([1], [10])])


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_from_the_raw_distribution() -> None:
    vocab = 80
    logits = random_logits(6, vocab, seed=15)
    params = [
        sp(temperature=0.0),
        sp(temperature=0.3, top_k=5),
        sp(top_p=0.5, repetition_penalty=1.5),
        sp(min_p=0.2, frequency_penalty=1.0),
        sp(temperature=2.0),
        sp(temperature=0.0, presence_penalty=2.0),
    ]
    history = [([1, 2], [3])] * 6
    out = Sampler(seed=0)(logits, build(params, vocab, history), return_logprob=True, top_logprobs_num=4)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))
    values, ids = out.top_logprobs
    ref_values, ref_ids = torch.topk(raw, 4, dim=-1)
    torch.testing.assert_close(values, ref_values)
    assert torch.equal(ids, ref_ids)
    assert bool((values[:, :-1] >= values[:, 1:]).all())


def test_top_logprobs_without_return_logprob() -> None:
    logits = random_logits(2, 10, seed=16)
    out = Sampler()(logits, build([sp(temperature=0.0)] * 2, 10), top_logprobs_num=20)
    assert out.top_logprobs is not None and out.top_logprobs[0].shape == (2, 10)


# --- masks and robustness -------------------------------------------------------------------------


def bitmask_of(mask: torch.Tensor) -> torch.Tensor:
    """The int32 token bitmask (bit t % 32 of word t // 32) of a [B, V] bool mask."""
    rows, vocab = mask.shape
    padded = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.bool)
    padded[:, :vocab] = mask
    packed = np.packbits(padded.numpy(), axis=1, bitorder="little")
    return torch.from_numpy(packed.view(np.int32).copy())


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 49152])
def test_bitmask_unpacks_the_same_on_both_paths(vocab: int) -> None:
    mask = torch.rand(3, vocab, generator=torch.Generator().manual_seed(vocab)) < 0.5
    bits = bitmask_of(mask)
    assert torch.equal(unpack_bits_numpy(bits, vocab), mask)
    assert torch.equal(unpack_bits_shifts(bits, vocab), mask)


def test_build_token_bitmask_leaves_unconstrained_rows_open() -> None:
    assert build_token_bitmask([None, None], 40) is None
    only_3 = np.zeros(2, dtype=np.int32)
    only_3[0] = 1 << 3
    bits = build_token_bitmask([None, only_3], 40)
    assert bits is not None and bits.dtype == torch.int32 and bits.shape == (2, 2)
    logits = torch.zeros(2, 40)
    apply_token_bitmask_(logits, bits)
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3]
    with pytest.raises(ValueError, match="vocab_mask: expected shape"):
        apply_token_bitmask_(torch.zeros(2, 80), bits)


def test_vocab_mask_is_respected_greedy_and_sampled() -> None:
    vocab = 100
    logits = random_logits(200, vocab, seed=17)
    mask = torch.rand(200, vocab, generator=torch.Generator().manual_seed(18)) < 0.1
    mask[:, 0] = True  # never empty
    params = [sp(temperature=0.0) if i < 100 else sp(temperature=1.5) for i in range(200)]
    info = build(params, vocab, seeded=False)
    info.vocab_mask = bitmask_of(mask)
    ids = Sampler(seed=0)(logits, info).next_token_ids
    assert bool(mask.gather(1, ids[:, None]).all())
    assert torch.equal(ids[:100], logits[:100].masked_fill(~mask[:100], -math.inf).argmax(-1))


def test_banned_ids_are_respected() -> None:
    vocab = 20
    logits = random_logits(2, vocab, seed=19)
    top2 = torch.topk(logits[0], 2).indices.tolist()
    info = build([sp(temperature=0.0), sp(temperature=5.0)], vocab, banned=[[top2[0]], list(range(10))])
    assert int(Sampler()(logits, info).next_token_ids[0]) == top2[1]
    sampler = Sampler(seed=3)
    for _ in range(50):
        assert int(sampler(logits, info).next_token_ids[1]) >= 10


def test_ban_is_lifted_only_where_it_would_leave_nothing() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    info = build([sp(temperature=0.0)] * 2, 3, banned=[[2], [2]])
    info.vocab_mask = bitmask_of(torch.tensor([[False, True, True], [False, False, True]]))
    assert Sampler()(logits, info).next_token_ids.tolist() == [1, 2]


def dense_bias(params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """Reference: each row's logit_bias as a dense [B, vocab] addend."""
    out = torch.zeros(len(params), vocab)
    for row, p in enumerate(params):
        for tid, bias in p.logit_bias.items():
            out[row, tid] = bias
    return out


def test_logit_bias_matches_a_dense_reference_greedy_and_sampled() -> None:
    vocab = 64
    logits = random_logits(6, vocab, seed=23)
    biases = [{}, {3: 5.0, 10: -2.5}, {0: 100.0}, {}, {7: 1.5, 8: -100.0, 9: 30.0}, {1: 0.5}]
    params = [
        sp(temperature=0.0 if row % 2 else 0.8, seed=row, logit_bias=bias) for row, bias in enumerate(biases)
    ]
    biased = Sampler()(logits.clone(), build(params, vocab)).next_token_ids
    plain = [sp(temperature=p.temperature, seed=p.seed) for p in params]
    reference = Sampler()(logits + dense_bias(params, vocab), build(plain, vocab)).next_token_ids
    assert torch.equal(biased, reference)
    greedy_rows = [1, 3, 5]
    assert torch.equal(biased[greedy_rows], (logits + dense_bias(params, vocab))[greedy_rows].argmax(-1))


def test_logit_bias_forces_and_bans_tokens_and_never_unmasks() -> None:
    vocab = 50
    logits = random_logits(2, vocab, seed=29)
    best = int(logits[0].argmax())
    forced = (best + 1) % vocab
    params = [sp(temperature=1.0, logit_bias={forced: 100}), sp(temperature=0.0, logit_bias={best: -100})]
    sampler = Sampler(seed=5)
    for _ in range(20):
        ids = sampler(logits.clone(), build(params, vocab, seeded=False)).next_token_ids.tolist()
        assert ids[0] == forced and ids[1] != best
    info = build([sp(temperature=0.0, logit_bias={forced: 100})], vocab)
    mask = torch.ones(1, vocab, dtype=torch.bool)
    mask[0, forced] = False
    info.vocab_mask = bitmask_of(mask)
    assert int(Sampler()(logits[:1].clone(), info).next_token_ids[0]) != forced


def test_logit_bias_leaves_reported_logprobs_raw() -> None:
    logits = random_logits(1, 30, seed=31)
    out = Sampler()(
        logits.clone(), build([sp(temperature=0.0, logit_bias={4: 100})], 30), return_logprob=True
    )
    assert int(out.next_token_ids[0]) == 4
    assert math.isclose(float(out.logprobs[0]), float(torch.log_softmax(logits[0], -1)[4]), rel_tol=1e-5)


def test_empty_vocab_mask_row_is_an_error() -> None:
    info = build([sp()], 4)
    info.vocab_mask = bitmask_of(torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="vocab_mask"):
        Sampler()(torch.zeros(1, 4), info)


@pytest.mark.parametrize("temperature", [1e-5, 1e-30, 1e-45, 1e-60])
def test_tiny_temperature_is_finite_and_respects_mask(temperature: float) -> None:
    vocab = 64
    logits = random_logits(32, vocab, seed=20, scale=50.0)
    mask = torch.rand(32, vocab, generator=torch.Generator().manual_seed(21)) < 0.5
    mask[:, 7] = True
    params = [
        sp(temperature=temperature, top_p=0.9 if i % 2 else 1.0, min_p=0.1 * (i % 3)) for i in range(32)
    ]
    info = build(params, vocab, seeded=False)
    info.vocab_mask = bitmask_of(mask)
    out = Sampler(seed=0)(logits, info, return_logprob=True)
    assert torch.equal(out.next_token_ids, logits.masked_fill(~mask, -math.inf).argmax(-1))
    assert bool(torch.isfinite(out.logprobs).all())


def test_non_finite_logits_never_yield_bad_tokens() -> None:
    logits = torch.randn(4, 10)
    logits[0, 3] = math.inf
    logits[1, :5] = math.nan
    logits[2, :] = -math.inf
    logits[2, 6] = 0.0
    logits[3, 9] = math.nan
    sampler = Sampler(seed=0)
    for params in ([sp(temperature=0.0)] * 4, [sp()] * 4, [sp(top_p=0.8)] * 4):
        for _ in range(20):
            ids = sampler(logits, build(params, 10, seeded=False)).next_token_ids.tolist()
            assert ids[0] == 3 and ids[1] >= 5 and ids[2] == 6 and ids[3] != 9


def test_padded_logits_never_yield_ids_past_the_vocab() -> None:
    logits = torch.zeros(3, 16)
    logits[:, 12:] = 100.0  # padding columns beyond vocab_size = 12
    ids = Sampler(seed=0)(logits, build([sp(temperature=0.0), sp(), sp(top_k=3)], 12)).next_token_ids
    assert bool((ids < 12).all())


def test_build_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="banned_token_ids"):
        build([sp()], 10, banned=[[10]])
    with pytest.raises(ValueError, match="draws"):
        SamplingBatchInfo.build([sp()], [], None, 10)
    with pytest.raises(ValueError, match="temperature"):
        build([SamplingParams(temperature=math.inf)], 10)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(1, 5), build([sp()], 10))


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 6),
    vocab=st.integers(2, 40),
)
def test_any_params_give_allowed_in_vocab_tokens(data: st.DataObject, batch: int, vocab: int) -> None:
    params = [
        sp(
            temperature=data.draw(st.sampled_from([0.0, 1e-6, 0.5, 1.0, 3.0])),
            top_k=data.draw(st.sampled_from([-1, 1, 2, vocab + 5])),
            top_p=data.draw(st.sampled_from([1e-3, 0.3, 0.9, 1.0])),
            min_p=data.draw(st.sampled_from([0.0, 0.5, 1.0])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 1e-3, 2.0])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 2.0])),
            seed=data.draw(st.sampled_from([None, 5])),
        )
        for _ in range(batch)
    ]
    seed = data.draw(st.integers(0, 2**16))
    logits = random_logits(batch, vocab, seed=seed, scale=data.draw(st.sampled_from([0.0, 1.0, 1e4])))
    mask = torch.rand(batch, vocab, generator=torch.Generator().manual_seed(seed)) < 0.5
    mask[
        torch.arange(batch), torch.randint(vocab, (batch,), generator=torch.Generator().manual_seed(seed))
    ] = True
    history = [([0, 1], [1, vocab - 1])] * batch
    info = build(params, vocab, history, banned=[[0]] * batch)
    info.vocab_mask = bitmask_of(mask)
    ids = Sampler(seed=seed)(logits, info).next_token_ids
    assert ids.shape == (batch,)
    assert bool(((ids >= 0) & (ids < vocab)).all())
    assert bool(mask.gather(1, ids[:, None]).all())
    for b, p in enumerate(params):
        if p.is_greedy:
            assert int(ids[b]) == int(_reference_masked(logits, info)[b].argmax())


def _reference_masked(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Masked, penalised logits the greedy rows must take the argmax of (ban lifted on empty rows)."""
    assert info.vocab_mask is not None
    x = logits.masked_fill(~unpack_bits_shifts(info.vocab_mask, logits.shape[1]), -math.inf)
    if info.penalties is not None:
        apply_penalties(x, info.penalties)
    banned = x.clone()
    banned[:, 0] = -math.inf
    keep_ban = torch.isfinite(banned).any(dim=-1, keepdim=True)
    return torch.where(keep_ban, banned, x)


def test_accepted_draft_len_stops_at_the_first_mismatch() -> None:
    assert accepted_draft_len([], [5]) == 0
    assert accepted_draft_len([5, 6, 7], [5, 6, 7, 8]) == 3  # all accepted, 8 is the bonus
    assert accepted_draft_len([5, 6, 7], [5, 9, 7, 8]) == 1  # 9 corrects the rejected 6
    assert accepted_draft_len([5, 6], [4, 6, 1]) == 0


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_verifying_a_draft_is_rejection_sampling_with_a_one_hot_proposal(draft: int) -> None:
    """Sampling a draft's row as usual and accepting the draft when the draw equals it accepts with
    probability p(x) and, on rejection, yields a token from normalize(max(p - onehot(x), 0)), the
    exact rule; p is the request's processed distribution (here temperature and top-k)."""
    logits = random_logits(1, 8, seed=3, scale=1.5)[0]
    params = sp(temperature=0.7, top_k=5)
    n = 40_000
    draws = draw_many(logits, params, n, seed=1)
    kept = torch.topk(logits, 5).indices
    p = torch.zeros(8, dtype=torch.float64)
    p[kept] = torch.softmax(logits[kept].double() / 0.7, dim=0)
    accepted = [accepted_draft_len([draft], [int(t)]) for t in draws]
    assert sum(accepted) / n == pytest.approx(float(p[draft]), abs=0.01)
    rejected = draws[torch.tensor(accepted) == 0]
    residual = (p - torch.nn.functional.one_hot(torch.tensor(draft), 8)).clamp(min=0)
    residual /= residual.sum()
    empirical = torch.bincount(rejected, minlength=8).double() / rejected.numel()
    assert float((empirical - residual).abs().sum()) / 2 < 0.02
