"""The Triton backend's sliding windows and logit soft-caps against the torch backend (the reference
for both features) on the same KV pool, request-to-token table and ForwardBatch: prefills with and
without a cached prefix, decodes, mixed steps and per-token mode, with sequences shorter than, around
and several times the window. On CPU the kernels run under the Triton interpreter
(tests/device_helpers.py), so shapes stay small; sequences still span several KV blocks, so blocks
wholly before a window are skipped and the window's first block is masked."""

from __future__ import annotations

import pytest
import torch
from device_helpers import tolerance

from radixlm_runtime.attention import triton_backend
from radixlm_runtime.attention.base import AttentionLayer
from radixlm_runtime.attention.torch_backend import TorchAttentionBackend
from radixlm_runtime.attention.triton_backend import TritonAttentionBackend
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable

WINDOW = 40
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5

LAYERS = {
    "window": AttentionLayer(SCALE, sliding_window=WINDOW),
    "softcap": AttentionLayer(SCALE, logit_softcap=2.5),
    "window-softcap": AttentionLayer(SCALE, sliding_window=WINDOW, logit_softcap=2.5),
}

# (cached prefix, new tokens) per request; sequences below, around and 3x the window.
STEPS = {
    "prefill": ([0, 0, 0, 0], [12, 41, 120, 40]),
    "prefill-with-prefix": ([30, 100, 5, 60], [10, 30, 36, 1]),
    "decode": ([11, 39, 40, 129], [1, 1, 1, 1]),
    "mixed": ([39, 0, 119, 3], [1, 41, 1, 70]),
}


def _step(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    q_scale: float = 3.0,
) -> tuple[KVPool, ReqToTokenTable, ForwardBatch, torch.Tensor]:
    """A one-layer pool of random K/V whose requests' slots are shuffled over it, sitting in
    scattered table rows, and q for the step's new tokens; q_scale makes scores large enough that
    the soft-cap bends them."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    size = 2 * sum(seq_lens)
    pool = KVPool(size, 1, num_kv_heads, HEAD_DIM, dtype, device)
    pool.k_buffers[0][1:] = torch.randn(size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    pool.v_buffers[0][1:] = torch.randn(size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    order = (1 + torch.randperm(size, generator=gen)).tolist()
    seqs, offset = [], 0
    for n in seq_lens:
        seqs.append(order[offset : offset + n])
        offset += n
    rows = torch.randperm(8, generator=gen)[: len(seqs)].tolist()
    table = ReqToTokenTable(8, max(seq_lens), device)
    table.write(
        torch.tensor([r for r, slots in zip(rows, seqs) for _ in slots], device=device),
        torch.tensor([i for slots in seqs for i in range(len(slots))], device=device),
        torch.tensor([s for slots in seqs for s in slots], device=device),
    )
    batch = ForwardBatch.build(
        input_ids=[0] * sum(extend_lens),
        req_pool_indices=rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        out_cache_loc=[s for slots, n in zip(seqs, extend_lens) for s in slots[len(slots) - n :]],
        logits_indices=[],
        seq_slots=seqs,
        device=device,
    )
    q = q_scale * torch.randn(batch.num_tokens, num_q_heads, HEAD_DIM, generator=gen)
    return pool, table, batch, q.to(dtype).to(device)


def _check(
    layer: AttentionLayer,
    prefix_lens: list[int],
    extend_lens: list[int],
    device: torch.device,
    num_q_heads: int = 6,
    num_kv_heads: int = 2,
    per_token: bool = False,
    dtype: torch.dtype = torch.float32,
    q_scale: float = 3.0,
    poison_hidden: bool = False,
) -> None:
    """The Triton backend's output on the step equals the torch backend's; poison_hidden fills the
    K/V of keys no new token's window reaches with NaN, which reach the output if they are read."""
    pool, table, batch, q = _step(prefix_lens, extend_lens, num_q_heads, num_kv_heads, device, dtype, q_scale)
    if poison_hidden:
        assert layer.sliding_window is not None
        for slots, n in zip(batch.seq_slots_cpu, extend_lens):
            hidden = slots[: max(0, len(slots) - n - layer.sliding_window + 1)]
            pool.k_buffers[0][hidden] = float("nan")
            pool.v_buffers[0][hidden] = float("nan")
    reference = TorchAttentionBackend(pool, table, [layer])
    reference.init_forward_metadata(batch)
    want = reference.attend(q, 0, batch).float().cpu()

    backend = TritonAttentionBackend(pool, table, [layer])
    backend.per_token = per_token
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.all_decode == (per_token or max(extend_lens) == 1)
    got = backend.attend(q, 0, batch)
    assert got.dtype == dtype
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.float().cpu(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("layer", LAYERS.values(), ids=LAYERS.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_matches_torch_reference(
    layer: AttentionLayer, step: tuple[list[int], list[int]], test_device: torch.device
) -> None:
    _check(layer, *step, test_device)


@pytest.mark.parametrize(
    "layer", [LAYERS["window"], LAYERS["window-softcap"]], ids=["window", "window-softcap"]
)
def test_per_token_mode(layer: AttentionLayer, test_device: torch.device) -> None:
    """--deterministic: every new token of a mixed step, prefill chunks included, runs through the
    decode kernel as a decode of its own prefix, windowed at its own position."""
    _check(layer, [39, 0, 90], [1, 45, 12], test_device, per_token=True)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("step", [STEPS["decode"], STEPS["mixed"]], ids=["decode", "mixed"])
def test_group_sizes(
    num_q_heads: int, num_kv_heads: int, step: tuple[list[int], list[int]], test_device: torch.device
) -> None:
    _check(LAYERS["window-softcap"], *step, test_device, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_split_counts(
    num_kv_splits: int, monkeypatch: pytest.MonkeyPatch, test_device: torch.device
) -> None:
    """The splits cover only the window: one split covers all of it, an odd count leaves uneven
    splits, and empty ones for the shortest sequence (which the merge must skip)."""
    monkeypatch.setattr(triton_backend, "DECODE_KV_SPLITS", num_kv_splits)
    _check(LAYERS["window"], [2, 39, 100, 150], [1, 1, 1, 1], test_device)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("step", [STEPS["prefill-with-prefix"], STEPS["decode"]], ids=["extend", "decode"])
def test_keys_before_the_window_are_never_read(
    step: tuple[list[int], list[int]], per_token: bool, test_device: torch.device
) -> None:
    """Both kernels start at the window: KV blocks before it are skipped, not loaded and masked."""
    _check(LAYERS["window"], *step, test_device, per_token=per_token, poison_hidden=True)


def test_window_of_one(test_device: torch.device) -> None:
    """Each token sees only itself (a window value Triton specializes as a constant)."""
    layer = AttentionLayer(SCALE, sliding_window=1)
    _check(layer, *STEPS["mixed"], test_device)
    _check(layer, *STEPS["decode"], test_device)


# The interpreter's exp overflows to inf (as intended: the sigmoid is then 0) and numpy warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_softcap_stable_for_huge_scores(test_device: torch.device) -> None:
    """Scores far past the cap saturate at +-cap, with no overflow to NaN in the tanh."""
    _check(LAYERS["softcap"], *STEPS["mixed"], test_device, q_scale=1e4)
    _check(LAYERS["softcap"], *STEPS["decode"], test_device, q_scale=1e4)


def test_half_precision(test_device: torch.device) -> None:
    _check(LAYERS["window-softcap"], *STEPS["prefill-with-prefix"], test_device, dtype=torch.float16)
    _check(LAYERS["window-softcap"], *STEPS["decode"], test_device, dtype=torch.float16)
