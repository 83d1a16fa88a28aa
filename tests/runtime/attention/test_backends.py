"""The attention backends behind one interface give the same results through the whole engine, on
the test device. On CPU the Triton kernels run under TRITON_INTERPRET=1 (set in tests/device_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from device_helpers import TEST_DEVICE, tolerance

import radixlm_runtime as rt
from radixlm_runtime.attention.base import AttentionLayer
from radixlm_runtime.attention.registry import create_attention_backend
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable

PROMPTS = [
    [(5 * i) % 250 + 3 for i in range(30)] + [7, 8, 9],
    [(5 * i) % 250 + 3 for i in range(30)] + [11, 12],
    [40, 41, 42, 43, 44, 45],
]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _run(model_dir: Path, backend: str, device: str = TEST_DEVICE) -> tuple[list[list[int]], list[float]]:
    """Greedy outputs and logprobs of PROMPTS in float32, where the backends agree to rounding."""
    engine = rt.Engine(
        str(model_dir),
        device=device,
        dtype="float32",
        max_total_tokens=1024,
        attention_backend=backend,
        log_level="warning",
    )
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
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < tolerance(torch.float32)[0]


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
        engine = rt.Engine(
            str(tiny_llama_dir),
            dtype="float32",
            max_total_tokens=2048,
            attention_backend="torch",
            log_level="warning",
        )
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
            str(tiny_llama_dir),
            dtype="float32",
            max_total_tokens=1024,
            chunked_prefill_size=16,
            attention_backend="torch",
            log_level="warning",
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


def _table_with(rows: list[int], seqs: list[list[int]], device: torch.device) -> ReqToTokenTable:
    """A request-to-token table holding each sequence's slots in its row, written the way the
    executor does it: one scatter of (row, position) -> slot entries."""
    table = ReqToTokenTable(8, 64, device)
    table.write(
        torch.tensor([r for r, slots in zip(rows, seqs) for _ in slots], device=device),
        torch.tensor([i for slots in seqs for i in range(len(slots))], device=device),
        torch.tensor([s for slots in seqs for s in slots], device=device),
    )
    return table


def test_forward_batch_build_packs_device_tensors_and_host_mirrors() -> None:
    """Two decodes and a chunk with a cached prefix: the device tensors and the host lists the
    backends plan from describe the same step."""
    seqs = [[3, 4, 5], [9], [20, 21, 22, 23, 24]]
    batch = ForwardBatch.build(
        input_ids=[11, 12, 13, 14, 15],
        req_pool_indices=[2, 0, 7],
        prefix_lens=[2, 0, 2],
        extend_lens=[1, 1, 3],
        out_cache_loc=[5, 9, 22, 23, 24],
        logits_indices=[0, 1, 4],
        seq_slots=seqs,
        device=torch.device("cpu"),
    )
    assert batch.input_ids.tolist() == [11, 12, 13, 14, 15]
    assert batch.positions.tolist() == [2, 0, 2, 3, 4]
    assert batch.out_cache_loc.tolist() == [5, 9, 22, 23, 24]
    assert batch.req_pool_indices.tolist() == [2, 0, 7]
    assert batch.seq_lens.tolist() == [3, 1, 5]
    assert batch.extend_lens.tolist() == [1, 1, 3]
    assert batch.extend_start_loc.tolist() == [0, 1, 2]
    assert batch.logits_indices.tolist() == [0, 1, 4]
    for t in (batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices):
        assert t.dtype == torch.int64
    assert batch.req_pool_indices_cpu == [2, 0, 7]
    assert batch.seq_lens_cpu == [3, 1, 5]
    assert batch.extend_lens_cpu == [1, 1, 3]
    assert batch.extend_start_loc_cpu == [0, 1, 2]
    assert batch.seq_slots_cpu == seqs
    assert batch.batch_size == 3 and batch.num_tokens == 5 and batch.max_extend_len == 3
    assert batch.attn_metadata is None


def _reference_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    seqs: list[list[int]],
    ext: list[int],
    scale: float,
) -> torch.Tensor:
    """Each new token attends to its request's keys up to its own position, computed densely (in float32
    over a bf16 pool's widened K/V)."""
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // k_buf.shape[1]
    for slots, n in zip(seqs, ext):
        k = k_buf[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buf[slots].float().repeat_interleave(group, dim=1)
        for j in range(n):
            visible = len(slots) - n + j + 1
            scores = torch.einsum("hd,lhd->hl", q[row], k[:visible]) * scale
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:visible])
            row += 1
    return out


def _hand_built_step(
    extend_lens: list[int], head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[KVPool, ReqToTokenTable, list[list[int]], ForwardBatch]:
    """Four requests, the first three sharing 40 prefix slots and the last an outsider, sitting in
    scattered table rows; each adds its last extend_lens[b] tokens this step. The KV pool (of dtype)
    holds random data in every slot, stored as set_kv stores it."""
    pool = KVPool(400, 1, 2, head_dim, dtype, device)
    k, v = torch.randn(400, 2, head_dim), torch.randn(400, 2, head_dim)
    pool.set_kv(0, torch.arange(1, 401, device=device), k.to(device), v.to(device))
    shared = list(range(1, 41))
    seqs = [shared + list(range(50 + 30 * i, 50 + 30 * i + 7 + i)) for i in range(3)]
    seqs.append(list(range(300, 337)))
    # Long extends (and the Triton kernels) read KV through the table, the torch backend's row
    # blocks through the batch's host slot lists, so both must describe the same sequences.
    rows = [5, 0, 3, 6]
    table = _table_with(rows, seqs, device)
    batch = ForwardBatch.build(
        input_ids=[0] * sum(extend_lens),
        req_pool_indices=rows,
        prefix_lens=[len(s) - n for s, n in zip(seqs, extend_lens)],
        extend_lens=extend_lens,
        out_cache_loc=[s for slots, n in zip(seqs, extend_lens) for s in slots[len(slots) - n :]],
        logits_indices=[],
        seq_slots=seqs,
        device=device,
    )
    return pool, table, seqs, batch


@pytest.mark.parametrize(
    "extend_lens",
    [[1, 1, 1, 1], [1, 3, 5, 2], [1, 1, 3, 2], [1, 1, 20, 4], [2, 2, 2, 2]],
    ids=["decodes", "short-extends", "mixed", "with-long-extend", "equal-extends"],
)
def test_torch_row_blocks_match_dense_reference(extend_lens: list[int], test_device: torch.device) -> None:
    """Decode tokens and short extends run as padded per-request row blocks over a causal mask
    (single tokens and longer blocks in separate calls), with a shared prefix merged by log-sum-exp
    (the first three requests share 40 slots, the last is an outsider); every real token's output
    equals dense attention over its visible keys."""
    from radixlm_runtime.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    num_q_heads, head_dim = 6, 8
    scale = head_dim**-0.5
    pool, table, seqs, batch = _hand_built_step(extend_lens, head_dim, test_device)
    backend = TorchAttentionBackend(pool, table, AttentionLayer.uniform(pool.num_layers, scale))
    backend.init_forward_metadata(batch)
    q = torch.randn(batch.num_tokens, num_q_heads, head_dim)
    got = backend.attend(q.to(test_device), 0, batch)
    want = _reference_attention(q, pool.k_buffers[0].cpu(), pool.v_buffers[0].cpu(), seqs, extend_lens, scale)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    # Requests sharing the 40 slots attend to them as a group within each call they share.
    assert any(call.groups for call in batch.attn_metadata.decode)


@pytest.mark.parametrize(
    "extend_lens",
    [[1, 1, 1, 1], [1, 3, 5, 2], [1, 1, 20, 4]],
    ids=["decode-kernel", "extend-kernel", "with-long-extend"],
)
def test_triton_backend_forward_matches_dense_reference(
    extend_lens: list[int], test_device: torch.device
) -> None:
    """The Triton backend on a hand-built step: forward stores the new tokens' K/V at
    out_cache_loc, then every token attends through the request-to-token table (all-decode steps
    through the decode kernel, the rest through the extend kernel)."""
    from radixlm_runtime.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    num_q_heads, head_dim = 6, 16
    scale = head_dim**-0.5
    pool, table, seqs, batch = _hand_built_step(extend_lens, head_dim, test_device)
    backend = TritonAttentionBackend(pool, table, AttentionLayer.uniform(pool.num_layers, scale))
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.all_decode == (max(extend_lens) == 1)
    q = torch.randn(batch.num_tokens, num_q_heads, head_dim, device=test_device)
    k = torch.randn(batch.num_tokens, 2, head_dim, device=test_device)
    v = torch.randn(batch.num_tokens, 2, head_dim, device=test_device)
    got = backend.forward(q, k, v, 0, batch)
    assert torch.equal(pool.k_buffers[0][batch.out_cache_loc], k)
    assert torch.equal(pool.v_buffers[0][batch.out_cache_loc], v)
    k_all, v_all = pool.k_buffers[0].cpu(), pool.v_buffers[0].cpu()
    want = _reference_attention(q.cpu(), k_all, v_all, seqs, extend_lens, scale)
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)


def test_plain_attention_with_lse_matches_the_cpu_kernel() -> None:
    """The formulation the torch backend uses off CPU equals torch's fused CPU kernel, masked
    rows and the log-sum-exp included."""
    from radixlm_runtime.attention.torch_backend import _flash, attention_with_lse

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 6, 16, generator=gen)
    k = torch.randn(3, 2, 9, 16, generator=gen)
    v = torch.randn(3, 2, 9, 16, generator=gen)
    mask = torch.zeros(3, 1, 6, 9)
    mask[:, :, :, 7:] = float("-inf")  # padded keys
    mask[1, :, 2:, 4:] = float("-inf")
    for m in (None, mask):
        out, lse = attention_with_lse(q, k, v, m, 0.25)
        ref_out, ref_lse = _flash(q, k, v, m, 0.25)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.reshape(ref_lse.shape), ref_lse, atol=1e-5, rtol=1e-5)


# The quantized pools of --kv-cache-dtype: int8 (with scales) everywhere, fp8 on sm89+ GPUs (the engine
# refuses it on the CPU; the backends read it there too, the Triton kernels under the interpreter).
QUANTIZED_KV = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", QUANTIZED_KV, ids=["int8", "fp8_e4m3"])
@pytest.mark.parametrize(
    "extend_lens", [[1, 1, 1, 1], [1, 3, 5, 2], [1, 1, 20, 4]], ids=["decodes", "short", "long"]
)
def test_quantized_pools_read_as_their_dequantized_values(
    backend: str, dtype: torch.dtype, extend_lens: list[int], test_device: torch.device
) -> None:
    """forward stores the new tokens quantized (int8 codes and scales, as quantize_int8 computes them;
    fp8 cast), then every token attends over its request's K/V read straight from the quantized pool:
    dense attention over the pool's dequantized values (KVPool.read_kv), within float32 rounding."""
    old_gpu = test_device.type == "cuda" and torch.cuda.get_device_capability(test_device) < (8, 9)
    if dtype == torch.float8_e4m3fn and old_gpu:
        pytest.skip("fp8 KV needs a GPU of compute capability 8.9 or later")
    torch.manual_seed(0)
    num_q_heads, head_dim = 6, 16
    scale = head_dim**-0.5
    pool, table, seqs, batch = _hand_built_step(extend_lens, head_dim, test_device, dtype)
    attn = create_attention_backend(backend, pool, table, AttentionLayer.uniform(pool.num_layers, scale))
    attn.init_forward_metadata(batch)
    q = torch.randn(batch.num_tokens, num_q_heads, head_dim, device=test_device)
    k = torch.randn(batch.num_tokens, 2, head_dim, device=test_device)
    v = torch.randn(batch.num_tokens, 2, head_dim, device=test_device)
    got = attn.forward(q, k, v, 0, batch)
    stored = KVPool(pool.size, 1, 2, head_dim, dtype, test_device)
    stored.set_kv(0, batch.out_cache_loc, k, v)
    for mine, theirs in zip(pool.layer_tensors(0), stored.layer_tensors(0)):
        bits = mine[batch.out_cache_loc].cpu().view(torch.uint8)
        assert torch.equal(bits, theirs[batch.out_cache_loc].cpu().view(torch.uint8))
    k_all, v_all = (t.cpu() for t in pool.read_kv(0, slice(None), torch.float32))
    want = _reference_attention(q.cpu(), k_all, v_all, seqs, extend_lens, scale)
    atol, rtol = tolerance(torch.float32)
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
    # Quantized, not float32: the stored K differ from the new tokens' own.
    assert not torch.equal(k_all[batch.out_cache_loc.cpu()], k.cpu())
