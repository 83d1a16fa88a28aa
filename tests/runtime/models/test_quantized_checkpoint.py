"""Pre-quantized checkpoints: AWQ and GPTQ (with and without act-order) int4 converted exactly, through the
format and through the kernels; FP8 dequantized at load; unsupported formats named; a tiny Llama served
from an AWQ and a GPTQ checkpoint gives the greedy tokens of its dequantized fp32 twin.

The checkpoints are written here: the weights quantized with group 128 and packed in each format's layout
by the helpers below (no quantization library involved)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tiny_models import TINY_MODEL_KWARGS, build_tiny_tokenizer

import radixlm_runtime as rt
from radixlm_runtime.config import EngineConfig
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.linear_kernels import PANEL_GEMM_MIN_ROWS
from radixlm_runtime.models.builder import build_model
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.gguf_weights import GGUFQuantizedWeights
from radixlm_runtime.models.loader import default_model_path, load_weights
from radixlm_runtime.models.quantized_checkpoint import (
    QuantizedCheckpoint,
    checkpoint_format,
    checkpoint_weights,
    open_checkpoint,
    quantized_source,
)

GROUP = 128
PREFIX = "model.layers.0.mlp.down_proj"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8


# ---------------------------------------------------------------- writing checkpoints


def quantize(weight: torch.Tensor, g_idx: torch.Tensor, sym: bool) -> dict[str, torch.Tensor]:
    """Round-to-nearest int4 of weight [N, K] per group (g_idx: each input column's group): codes [N, K],
    zeros [N, G] (8 when sym), fp16 scales [N, G], and the reference float32 weight scale * (q - zero)."""
    n, k = weight.shape
    groups = k // GROUP
    codes = torch.zeros(n, k, dtype=torch.int64)
    zeros = torch.zeros(n, groups, dtype=torch.int64)
    scales = torch.zeros(n, groups, dtype=torch.float16)
    for g in range(groups):
        cols = weight[:, g_idx == g]
        if sym:
            scale = (cols.abs().amax(dim=1) / 7.5).clamp_min(1e-4).half()
            zero = torch.full((n,), 8)
        else:
            low, high = cols.amin(dim=1), cols.amax(dim=1)
            scale = ((high - low) / 15).clamp_min(1e-4).half()
            zero = torch.round(-low / scale.float()).clamp(0, 15).long()
        q = torch.round(cols / scale.float()[:, None]) + zero[:, None]
        codes[:, g_idx == g] = q.clamp(0, 15).long()
        zeros[:, g], scales[:, g] = zero, scale
    reference = scales.float()[:, g_idx] * (codes - zeros[:, g_idx]).float()
    return {"codes": codes, "zeros": zeros, "scales": scales, "reference": reference}


def pack(values: torch.Tensor) -> torch.Tensor:
    """int32 [...] from int values [..., 8] in 0..15: value i at bits 4i..4i+3."""
    packed = sum(values[..., i].to(torch.int64) << (4 * i) for i in range(8))
    return torch.from_numpy(packed.numpy().astype(np.uint32).view(np.int32))


def awq_pack(columns: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] of values [R, C]: 8 consecutive columns per int32 in AWQ_ORDER."""
    rows, cols = columns.shape
    return pack(columns.view(rows, cols // 8, 8)[..., AWQ_ORDER])


def gptq_pack_rows(values: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight int32 [K / 8, N] of values [K, N]: nibble i of row j is row 8j + i."""
    k, n = values.shape
    return pack(values.view(k // 8, 8, n).transpose(1, 2))


def gptq_pack_columns(values: torch.Tensor) -> torch.Tensor:
    """GPTQ's qzeros int32 [G, N / 8] of values [G, N]: nibble i of column j is column 8j + i."""
    rows, cols = values.shape
    return pack(values.view(rows, cols // 8, 8))


def act_order_g_idx(k: int, seed: int) -> torch.Tensor:
    """An act-order g_idx: groups of GROUP columns in a random order over K."""
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))] = (
        torch.arange(k, dtype=torch.int32) // GROUP
    )
    return g_idx


# (quantization_config, sym, act-order) per checkpoint kind.
KINDS = {
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True},
        False,
        False,
    ),
    "gptq": (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
        True,
        False,
    ),
    "gptq-act-order": (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True},
        True,
        True,
    ),
    "gptq-v2-act-order": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
        False,
        True,
    ),
}


def quantized_tensors(
    kind: str, prefix: str, weight: torch.Tensor, g_idx: torch.Tensor
) -> tuple[dict, torch.Tensor]:
    """The checkpoint tensors of one linear in `kind`'s format, and its reference dequantized weight."""
    qc, sym, _ = KINDS[kind]
    q = quantize(weight, g_idx.long(), sym)
    codes, zeros, scales = q["codes"].T.contiguous(), q["zeros"].T.contiguous(), q["scales"].T.contiguous()
    if qc["quant_method"] == "awq":
        tensors = {"qweight": awq_pack(codes), "qzeros": awq_pack(zeros), "scales": scales}
    else:
        stored = zeros - (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)  # v1: zero - 1
        tensors = {"qweight": gptq_pack_rows(codes), "qzeros": gptq_pack_columns(stored), "scales": scales}
        tensors["g_idx"] = g_idx
    return {f"{prefix}.{part}": t for part, t in tensors.items()}, q["reference"]


def write_config(model_dir: Path, quantization_config: dict, base: dict | None = None) -> None:
    (model_dir / "config.json").write_text(
        json.dumps({**(base or {}), "quantization_config": quantization_config})
    )


def g_idx_for(kind: str, k: int, seed: int) -> torch.Tensor:
    return act_order_g_idx(k, seed) if KINDS[kind][2] else torch.arange(k, dtype=torch.int32) // GROUP


@pytest.fixture(params=list(KINDS))
def one_linear(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, torch.Tensor]:
    """A checkpoint dir holding one quantized [96, 256] linear, a float norm and the linear's bias; the
    kind, the dir and the reference weight."""
    kind = request.param
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    tensors, reference = quantized_tensors(kind, PREFIX, weight, g_idx_for(kind, 256, seed=1))
    tensors |= {f"{PREFIX}.bias": torch.randn(96), "model.norm.weight": torch.ones(256)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, KINDS[kind][0])
    return kind, tmp_path, reference


# ---------------------------------------------------------------- conversion


def test_int4_checkpoints_convert_exactly(one_linear: tuple[str, Path, torch.Tensor]) -> None:
    kind, model_dir, reference = one_linear
    weight = QuantizedCheckpoint(model_dir, checkpoint_format(model_dir))(f"{PREFIX}.weight")
    assert (weight.bits, weight.group_size) == (4, GROUP)
    assert (weight.input_order is not None) == KINDS[kind][2]
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize("rows", [1, PANEL_GEMM_MIN_ROWS + 3])
def test_int4_checkpoint_layers_match_float_linear(
    one_linear: tuple[str, Path, torch.Tensor], rows: int
) -> None:
    """The kernels (after the act-order gather) multiply by the reference weight: fp32 tolerance."""
    _, model_dir, reference = one_linear
    weight = QuantizedCheckpoint(model_dir, checkpoint_format(model_dir))(f"{PREFIX}.weight")
    linear = Linear(256, 96, bias=False)
    linear.set_quantized(weight)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(linear(x), F.linear(x, reference), rtol=1e-5, atol=1e-4)


def test_checkpoint_weights_yield_the_dequantized_float_model(
    one_linear: tuple[str, Path, torch.Tensor],
) -> None:
    _, model_dir, reference = one_linear
    loaded = dict(checkpoint_weights(open_checkpoint(model_dir), load_weights(model_dir)))
    assert set(loaded) == {f"{PREFIX}.weight", f"{PREFIX}.bias", "model.norm.weight"}
    assert torch.equal(loaded[f"{PREFIX}.weight"], reference)


def test_float_checkpoints_pass_through_and_have_no_source(tiny_llama_dir: Path) -> None:
    assert checkpoint_format(tiny_llama_dir) is None
    reference = dict(load_weights(tiny_llama_dir))
    loaded = dict(checkpoint_weights(open_checkpoint(tiny_llama_dir), load_weights(tiny_llama_dir)))
    assert loaded.keys() == reference.keys()
    assert quantized_source(str(tiny_llama_dir), open_checkpoint(tiny_llama_dir), 4, 2) is None


def test_quantized_source_by_checkpoint_kind(one_linear: tuple[str, Path, torch.Tensor]) -> None:
    _, model_dir, _ = one_linear
    source = quantized_source(str(model_dir), open_checkpoint(model_dir), 4, 2)
    assert isinstance(source, QuantizedCheckpoint)
    assert source("model.norm.weight") is None and source(f"{PREFIX}.bias") is None
    gguf = quantized_source(default_model_path(), open_checkpoint(model_dir), 9, 3)
    assert isinstance(gguf, GGUFQuantizedWeights)


def test_act_order_groups_must_each_hold_group_size_columns(tmp_path: Path) -> None:
    kind = "gptq-act-order"
    tensors, _ = quantized_tensors(kind, PREFIX, torch.randn(32, 256), act_order_g_idx(256, seed=3))
    tensors[f"{PREFIX}.g_idx"][:3] = 0  # group 0 now holds more than GROUP columns
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, KINDS[kind][0])
    with pytest.raises(ValueError, match=f"{PREFIX}: g_idx must give each of the 2 groups exactly 128"):
        QuantizedCheckpoint(tmp_path, checkpoint_format(tmp_path))(f"{PREFIX}.weight")


# ---------------------------------------------------------------- FP8


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_weights_are_dequantized_at_load(tmp_path: Path, scheme: str) -> None:
    rows, cols = 200, 300  # not multiples of the 128x128 blocks
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(rows, cols, generator=gen).to(torch.float8_e4m3fn)
    if scheme == "block":
        scale = torch.rand(2, 3, generator=gen) + 0.5
        expanded = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        tensors = {f"{PREFIX}.weight_scale_inv": scale}
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    else:
        scale = torch.rand(1 if scheme == "tensor" else rows, 1, generator=gen) + 0.5
        expanded = scale
        tensors = {f"{PREFIX}.weight_scale": scale, f"{PREFIX}.input_scale": torch.ones(1)}
        weights = {"type": "float", "num_bits": 8, "strategy": scheme}
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
        }
    tensors |= {f"{PREFIX}.weight": weight, "model.norm.weight": torch.ones(cols)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, config)
    loaded = dict(checkpoint_weights(open_checkpoint(tmp_path), load_weights(tmp_path)))
    assert set(loaded) == {f"{PREFIX}.weight", "model.norm.weight"}
    assert torch.equal(loaded[f"{PREFIX}.weight"], weight.float() * expanded)
    assert quantized_source(str(tmp_path), open_checkpoint(tmp_path), 4, 2) is None


# ---------------------------------------------------------------- unsupported formats


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "hqq"}, "quant_method 'hqq'"),
        ({"quant_method": "eetq"}, "quant_method 'eetq'"),
        ({"quant_method": "exl2"}, "quant_method 'exl2'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}, "awq version 'marlin'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with bits 8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
    ],
)
def test_unsupported_formats_are_named_with_the_supported_ones(
    tmp_path: Path, config: dict, named: str
) -> None:
    write_config(tmp_path, config)
    with pytest.raises(ValueError, match="not supported") as excinfo:
        checkpoint_format(tmp_path)
    assert named in str(excinfo.value)
    assert "awq, gptq, fp8, compressed-tensors" in str(excinfo.value)


# ---------------------------------------------------------------- a whole model

PROMPTS = ["The quick brown fox", "Once upon a time", "def f(x):"]
NEW_TOKENS = 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linears that read one input share its act-order g_idx (GPTQ orders columns by that input's Hessian).
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
INPUTS = ("attn", "o_proj", "mlp", "down_proj")


@pytest.fixture(scope="module")
def tiny_float_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose linears are group-128 sized (hidden 128, intermediate 256). Weights 10x the
    default init: peaked logits, so greedy tokens do not hinge on fp32 rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_MODEL_KWARGS, "hidden_size": 128, "intermediate_size": 256})
    config.initializer_range = 0.2
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_llama_128")
    LlamaForCausalLM(config).save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


def write_quantized_model(float_dir: Path, kind: str, out: Path) -> tuple[Path, Path]:
    """`kind`'s checkpoint of the float model and its dequantized fp32 twin (same config and tokenizer)."""
    quantized, twin = out / kind, out / f"{kind}-twin"
    for model_dir in (quantized, twin):
        shutil.copytree(float_dir, model_dir, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    base = json.loads((float_dir / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps(base))
    write_config(quantized, KINDS[kind][0], base)
    q_tensors, twin_tensors = {}, {}
    for name, tensor in load_weights(float_dir):
        module = name.rsplit(".", 2)[-2]
        if module not in LINEARS:
            q_tensors[name] = twin_tensors[name] = tensor
            continue
        seed = 10 * int(name.split(".")[2]) + INPUTS.index(INPUT_OF.get(module, module))
        parts, reference = quantized_tensors(
            kind, name.removesuffix(".weight"), tensor, g_idx_for(kind, tensor.shape[1], seed)
        )
        q_tensors |= parts
        twin_tensors[name] = reference
    save_file(q_tensors, str(quantized / "model.safetensors"))
    save_file(twin_tensors, str(twin / "model.safetensors"))
    return quantized, twin


def greedy(model_dir: Path) -> tuple[list[list[int]], rt.Engine]:
    engine = rt.Engine(str(model_dir), dtype="float32", max_total_tokens=2048, log_level="warning")
    outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    return [out["output_ids"] for out in outs], engine


@pytest.mark.parametrize("kind", ["awq", "gptq-act-order"])
def test_quantized_checkpoint_serves_the_tokens_of_its_float_twin(
    tiny_float_model: Path, tmp_path: Path, kind: str
) -> None:
    quantized, twin = write_quantized_model(tiny_float_model, kind, tmp_path)
    expected, twin_engine = greedy(twin)
    twin_engine.shutdown()
    tokens, engine = greedy(quantized)
    try:
        layer = engine.runner.model.layers[0]
        linears = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        # The int4 kernels are CPU paths: a GPU serves the dequantized floats.
        on_cpu = engine.runner.device.type == "cpu"
        assert all(linear.quantized is None for linear in linears) or on_cpu
        for linear in linears if on_cpu else ():
            assert linear.quantized is not None and (linear.quantized.bits, linear.quantized.group_size) == (
                4,
                GROUP,
            )
            # Act-order reorders only inputs of more than one group (here down_proj's).
            assert (linear.quantized.input_order is not None) == (
                KINDS[kind][2] and linear.in_features > GROUP
            )
    finally:
        engine.shutdown()
    assert tokens == expected


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_each_int4_linear_is_unpacked_once(
    tiny_float_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str
) -> None:
    """The float path and the quantizer read one checkpoint: served on the int4 kernels or as floats,
    each AWQ linear's int4 tensors are unpacked once."""
    quantized, _ = write_quantized_model(tiny_float_model, "awq", tmp_path)
    unpacked: Counter[str] = Counter()
    unpack = QuantizedCheckpoint.int4

    def spy(self: QuantizedCheckpoint, prefix: str) -> object:
        unpacked[prefix] += 1
        return unpack(self, prefix)

    monkeypatch.setattr(QuantizedCheckpoint, "int4", spy)
    config = ModelConfig.from_dir(quantized)
    engine_config = EngineConfig(model_path=str(quantized), quantization=quantization)
    model = build_model(quantized, config, engine_config, torch.device("cpu"), torch.float32, 64)
    assert len(unpacked) == len(LINEARS) * config.num_layers and set(unpacked.values()) == {1}
    served = [target.linear.quantized for target in model.linear_shards() if not target.is_lm_head]
    assert all((weight is not None) == (quantization == "auto") for weight in served)
