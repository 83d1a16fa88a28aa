"""The attention backends behind one interface give the same results through the whole engine.
On CPU the Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt

PROMPTS = [
    [(5 * i) % 250 + 3 for i in range(30)] + [7, 8, 9],
    [(5 * i) % 250 + 3 for i in range(30)] + [11, 12],
    [40, 41, 42, 43, 44, 45],
]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _run(model_dir: Path, backend: str) -> tuple[list[list[int]], list[float]]:
    engine = rt.Engine(str(model_dir), max_total_tokens=1024, attention_backend=backend, log_level="warning")
    outs = engine.generate(
        input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
    )
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
    logprobs += [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    return [o["output_ids"] for o in outs], logprobs


@pytest.mark.parametrize("backend", ["triton"])
def test_backend_matches_torch(tiny_llama_dir: Path, backend: str) -> None:
    ref_ids, ref_lp = _run(tiny_llama_dir, "torch")
    ids, lp = _run(tiny_llama_dir, backend)
    assert ids == ref_ids
    assert len(lp) == len(ref_lp)
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4


@pytest.mark.parametrize("with_outsider", [False, True])
def test_torch_decode_shared_prefix_groups_match_ungrouped(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, with_outsider: bool
) -> None:
    """Decode attention over a shared cached prefix (read once per group, merged by log-sum-exp)
    equals attending to each request's whole sequence; with an outsider in the batch the group
    is a subset of the decode requests."""
    from radixlm_runtime.attention import torch_backend

    prompts = [[(3 * i) % 250 + 3 for i in range(48)] + [100 + j] for j in range(4)]
    if with_outsider:
        prompts.append([200, 201, 202, 203])
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run() -> list[list[float]]:
        engine = rt.Engine(str(tiny_llama_dir), max_total_tokens=2048, log_level="warning")
        engine.generate(input_ids=prompts[0][:48], sampling_params={"max_new_tokens": 0})
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]

    calls = []
    original = torch_backend.TorchAttentionBackend._merge_shared_prefix

    def spy(self, *args, **kwargs):
        calls.append(args[3].members is None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch_backend.TorchAttentionBackend, "_merge_shared_prefix", spy)
    grouped = run()
    # Without the outsider every group spans the whole batch; with it, some steps group a subset.
    assert calls and (False in calls) == with_outsider
    calls.clear()
    monkeypatch.setattr(torch_backend, "MIN_SHARED_PREFIX", 10**9)
    ungrouped = run()
    assert not calls
    for a, b in zip(grouped, ungrouped, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_torch_short_extends_batched_like_decodes_match_per_request(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extends up to MAX_BATCHED_EXTEND tokens (16-token prefill chunks here, the tokens a
    jump-forward appends) run as decode-style query rows; that equals one attention call per
    request over its whole sequence."""
    from radixlm_runtime.attention import torch_backend

    def run() -> list[float]:
        engine = rt.Engine(
            str(tiny_llama_dir), max_total_tokens=1024, chunked_prefill_size=16, log_level="warning"
        )
        outs = engine.generate(
            input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
        )
        lps = [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
        return lps + [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]

    batched = run()
    monkeypatch.setattr(torch_backend, "MAX_BATCHED_EXTEND", 0)
    per_request = run()
    assert len(batched) == len(per_request)
    assert max(abs(a - b) for a, b in zip(batched, per_request)) < 1e-5


def _reference_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    seqs: list[list[int]],
    ext: list[int],
    scale: float,
) -> torch.Tensor:
    """Each new token attends to its request's keys up to its own position, computed densely."""
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // k_buf.shape[1]
    for slots, n in zip(seqs, ext):
        k = k_buf[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buf[slots].repeat_interleave(group, dim=1)
        for j in range(n):
            visible = len(slots) - n + j + 1
            scores = torch.einsum("hd,lhd->hl", q[row], k[:visible]) * scale
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:visible])
            row += 1
    return out


@pytest.mark.parametrize(
    "extend_lens",
    [[1, 1, 1, 1], [1, 3, 5, 2], [1, 1, 3, 2], [1, 1, 20, 4], [2, 2, 2, 2]],
    ids=["decodes", "short-extends", "mixed", "with-long-extend", "equal-extends"],
)
def test_torch_row_blocks_match_dense_reference(extend_lens: list[int]) -> None:
    """Decode tokens and short extends run as padded per-request row blocks over a causal mask
    (single tokens and longer blocks in separate calls), with a shared prefix merged by log-sum-exp
    (the first three requests share 40 slots, the last is an outsider); every real token's output
    equals dense attention over its visible keys."""
    from radixlm_runtime.attention.torch_backend import TorchAttentionBackend
    from radixlm_runtime.engine.forward_batch import ForwardBatch
    from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenPool

    torch.manual_seed(0)
    num_q_heads, num_kv_heads, head_dim, scale = 6, 2, 8, 8**-0.5
    pool = KVPool(400, 1, num_kv_heads, head_dim, torch.float32, "cpu")
    pool.k_buffers[0][1:] = torch.randn(400, num_kv_heads, head_dim)
    pool.v_buffers[0][1:] = torch.randn(400, num_kv_heads, head_dim)
    shared = list(range(1, 41))
    seqs = [shared + list(range(50 + 30 * i, 50 + 30 * i + 7 + i)) for i in range(3)]
    seqs.append(list(range(300, 337)))
    req_pool = ReqToTokenPool(8, 64)
    for i, slots in enumerate(seqs):
        req_pool.req_to_token[i, : len(slots)] = torch.tensor(slots)
    prefix_lens = [len(s) - n for s, n in zip(seqs, extend_lens)]
    total = sum(extend_lens)
    batch = ForwardBatch.build(
        input_ids=[0] * total,
        req_pool_indices=list(range(len(seqs))),
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        out_cache_loc=torch.zeros(total, dtype=torch.int64),
        logits_indices=[],
        device=torch.device("cpu"),
    )
    backend = TorchAttentionBackend(pool, req_pool, scale)
    backend.init_forward_metadata(batch)
    q = torch.randn(total, num_q_heads, head_dim)
    got = backend.attend(q, 0, batch)
    want = _reference_attention(q, pool.k_buffers[0], pool.v_buffers[0], seqs, extend_lens, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Requests sharing the 40 slots attend to them as a group within each call they share.
    assert any(call.groups for call in batch.attn_metadata.decode)
