"""layers/moe.py against transformers' MoE blocks (Mixtral, Qwen3-MoE, OLMoE) on the same random weights:
expert choice and routing weights bit-identical, outputs within float32 rounding; the Triton expert
path (under the interpreter on the CPU, natively under RADIXLM_TEST_DEVICE=cuda) against the gather
path; and load_expert's placement and errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from device_helpers import tolerance
from torch import nn

from radixlm_runtime.layers.moe import MoE

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 2


def _mixtral(norm_topk_prob: bool) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        experts_implementation="eager",
    )
    return MixtralSparseMoeBlock(config)


def _qwen3_moe(norm_topk_prob: bool) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        experts_implementation="eager",
    )
    return Qwen3MoeSparseMoeBlock(config)


def _olmoe(norm_topk_prob: bool) -> nn.Module:
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    config = OlmoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        experts_implementation="eager",
    )
    return OlmoeSparseMoeBlock(config)


# (builder, norm_topk_prob): Mixtral always renormalises.
FAMILIES: dict[str, tuple[Callable[[bool], nn.Module], bool]] = {
    "mixtral": (_mixtral, True),
    "qwen3_moe": (_qwen3_moe, False),
    "qwen3_moe_norm": (_qwen3_moe, True),
    "olmoe": (_olmoe, False),
}


def build_pair(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[nn.Module, MoE]:
    """transformers' block with random weights, and a MoE loaded from it through load_expert."""
    builder, renormalize = FAMILIES[family]
    torch.manual_seed(seed)
    block = builder(renormalize)
    with torch.no_grad():
        block.gate.weight.normal_()
        block.experts.gate_up_proj.normal_(std=HIDDEN**-0.5)
        block.experts.down_proj.normal_(std=INTER**-0.5)
    block.to(dtype).eval()
    moe = MoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize)
    moe.gate.weight.data.copy_(block.gate.weight)
    for e in range(EXPERTS):
        gate, up = block.experts.gate_up_proj[e].detach().chunk(2)
        moe.load_expert(e, "gate", gate)
        moe.load_expert(e, "up", up)
        moe.load_expert(e, "down", block.experts.down_proj[e].detach())
    return block, moe.to(dtype)


def check_against_transformers(block: nn.Module, moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Routing bit-identical, outputs close; returns the expert ids."""
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(x)
        want = block(x.unsqueeze(0)).squeeze(0)
        weights, ids = moe.route(x)
        got = moe(x)
    assert torch.equal(ids, want_ids)
    # Mixtral's router leaves its weights in float32 (transformers multiplies in float32, then rounds).
    assert torch.equal(weights, want_weights.to(x.dtype))
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    return ids


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_matches_transformers(family: str, tokens: int) -> None:
    block, moe = build_pair(family)
    x = torch.randn(tokens, HIDDEN)
    ids = check_against_transformers(block, moe, x)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    assert (counts == 0).any() if tokens == 1 else counts.max() > 1  # idle experts / shared experts


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_in_bfloat16(family: str) -> None:
    block, moe = build_pair(family, torch.bfloat16)
    check_against_transformers(block, moe, torch.randn(9, HIDDEN).to(torch.bfloat16))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_expert_no_token_routes_to(family: str) -> None:
    """Every token leans along d, and expert 3's router row points against it."""
    block, moe = build_pair(family)
    d = torch.nn.functional.normalize(torch.randn(HIDDEN), dim=0)
    with torch.no_grad():
        for gate in (block.gate.weight, moe.gate.weight):
            gate[3] = -10 * d
    x = torch.randn(40, HIDDEN) + 4 * d
    counts = torch.bincount(check_against_transformers(block, moe, x).flatten(), minlength=EXPERTS)
    assert counts[3] == 0 and (counts > 0).sum() > TOP_K


def test_renormalize_changes_only_the_weights() -> None:
    block, moe = build_pair("qwen3_moe")
    x = torch.randn(5, HIDDEN)
    weights, ids = moe.route(x)
    moe.renormalize = True
    norm_weights, norm_ids = moe.route(x)
    assert torch.equal(ids, norm_ids)
    torch.testing.assert_close(norm_weights, weights / weights.sum(-1, keepdim=True))
    torch.testing.assert_close(norm_weights.sum(-1), torch.ones(5))


def test_top_k_ties_break_as_torch_topk() -> None:
    """A zero router gives every expert the same probability: torch.topk's choice, weights 1/E (1/k
    renormalised)."""
    moe = MoE(HIDDEN, INTER, EXPERTS, TOP_K, renormalize=True)
    moe.gate.weight.data.zero_()
    x = torch.randn(3, HIDDEN)
    weights, ids = moe.route(x)
    assert torch.equal(ids, torch.topk(torch.full((3, EXPERTS), 1 / EXPERTS), TOP_K).indices)
    assert torch.equal(weights, torch.full((3, TOP_K), 1 / TOP_K))


def test_no_tokens() -> None:
    _, moe = build_pair("mixtral")
    assert moe(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


def test_load_expert_fills_the_right_rows() -> None:
    moe = MoE(4, 3, num_experts=2, top_k=1, renormalize=False)
    moe.w13.data.zero_()
    moe.w2.data.zero_()
    gate, up, down = torch.full((3, 4), 1.0), torch.full((3, 4), 2.0), torch.full((4, 3), 3.0)
    moe.load_expert(1, "gate", gate)
    moe.load_expert(1, "up", up)
    moe.load_expert(1, "down", down)
    assert torch.equal(moe.w13[1], torch.cat([gate, up]))
    assert torch.equal(moe.w2[1], down)
    assert not moe.w13[0].any() and not moe.w2[0].any()


def test_load_expert_rejects_bad_arguments() -> None:
    moe = MoE(4, 3, num_experts=2, top_k=1, renormalize=False)
    with pytest.raises(ValueError, match="'w1'"):
        moe.load_expert(0, "w1", torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"expected \(4, 3\)"):
        moe.load_expert(0, "down", torch.zeros(3, 4))
    with pytest.raises(ValueError, match="expert 2 out of range"):
        moe.load_expert(2, "gate", torch.zeros(3, 4))
    with pytest.raises(ValueError, match="top_k"):
        MoE(4, 3, num_experts=2, top_k=3, renormalize=False)


# The Triton expert path. H and 2I span two BLOCK_N tiles and K two BLOCK_K steps; 4 experts take up
# to 40 slots each at T=40, more than one BLOCK_M tile; T=1 leaves experts idle.
T_HIDDEN, T_INTER, T_EXPERTS = 80, 40, 4


def test_align_block_size_groups_slots_by_expert() -> None:
    from radixlm_runtime.layers import moe_triton

    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]])
    slots, experts, num_padded = moe_triton.align_block_size(ids, num_experts=5, block=4)
    n = ids.numel()
    # Expert 0: slots 1, 4; 1: 7; 2: 0, 2, 5, 6; 3: 3 (expert 4 none): one tile each.
    assert num_padded.item() == 16
    assert slots[:16].tolist() == [1, 4, n, n, 7, n, n, n, 0, 2, 5, 6, 3, n, n, n]
    assert experts[:4].tolist() == [0, 1, 2, 3]
    assert (slots[16:] == n).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_triton_path_matches_the_gather_path(
    test_device: torch.device, dtype: torch.dtype, tokens: int
) -> None:
    from radixlm_runtime.layers import moe_triton

    torch.manual_seed(tokens)
    moe = MoE(T_HIDDEN, T_INTER, T_EXPERTS, top_k=2, renormalize=False)
    with torch.no_grad():
        moe.gate.weight.normal_()
        moe.w13.normal_(std=T_HIDDEN**-0.5)
        moe.w2.normal_(std=T_INTER**-0.5)
    moe.to(dtype)
    x = torch.randn(tokens, T_HIDDEN).to(dtype)
    with torch.no_grad():
        weights, ids = moe.route(x)
        want = moe(x)  # the gather path: x is on the CPU
        got = moe_triton.fused_experts(
            x.to(test_device),
            moe.w13.to(test_device),
            moe.w2.to(test_device),
            weights.to(test_device),
            ids.to(test_device),
        )
    assert got.dtype == dtype
    counts = torch.bincount(ids.flatten(), minlength=T_EXPERTS)
    if tokens == 1:
        assert (counts == 0).any()  # idle experts: no tile
    if tokens == 40:
        assert counts.max() > moe_triton.BLOCK_M  # an expert over two tiles
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
