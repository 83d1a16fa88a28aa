"""A model built, loaded and quantized on its device: the registry's class for the architecture,
constructed on the meta device, its checkpoint loaded, its rotary tables built, its linears given
int8/int4 weights per --quantization, its float linears pre-packed for the CPU kernels and, under
--deterministic, every linear made batch-invariant."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from radixlm_runtime.config import EngineConfig
from radixlm_runtime.distributed.group import TPGroup
from radixlm_runtime.distributed.shard import ShardLayout, parallelize
from radixlm_runtime.layers import fused_triton
from radixlm_runtime.layers.linear import Linear, prepack_linears
from radixlm_runtime.layers.linear_kernels import (
    FP32,
    PANEL_GEMM_MIN_ROWS,
    LinearKernelError,
    act8_available,
    act8_path,
    kernel_mode,
    load_kernels,
)
from radixlm_runtime.layers.quantization import QuantizedSource, plan_linear, resolve_quantization
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.loader import load_weights
from radixlm_runtime.models.quantized_checkpoint import (
    QuantizedCheckpoint,
    checkpoint_weights,
    open_checkpoint,
    quantized_source,
)
from radixlm_runtime.models.registry import CausalLM, model_class
from radixlm_runtime.utils import cpu
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# Rows per matmul call under --deterministic: small enough that a decode step pads little.
DETERMINISTIC_ROW_BLOCK = 16


def build_model(
    model_dir: Path,
    config: ModelConfig,
    engine_config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    context_len: int,
    compute: str = FP32,
    tp: TPGroup | None = None,
) -> CausalLM:
    """The model with its weights loaded, quantized per --quantization and its CPU linears packed for
    `compute` arithmetic (linear_kernels.FP32 or BF16); under tensor parallelism (`tp`) this rank's
    part of it (distributed/shard.py)."""
    cls = model_class(config.architecture)
    mode = _quantization_mode(engine_config.quantization, device, dtype)
    layout = None if tp is None else ShardLayout.of(config, tp.rank, tp.size)
    # Built on the meta device: every weight is overwritten by the checkpoint, so random init
    # would only cost start-up time. The dtype is set while still on meta, so parameters are
    # allocated once, in their final dtype (not in float32 first and cast after: 3x the bf16
    # weights at peak on a GPU).
    with torch.device("meta"):
        model = cls(config if layout is None else layout.local_config())
        if layout is not None:
            parallelize(model, layout, tp)
        model = model.to(dtype=dtype)
    model = model.to_empty(device=device)
    # AWQ/GPTQ/FP8 linears load as their dequantized floats; the quantizer takes AWQ/GPTQ's own
    # int4 weights from the same checkpoint, which keeps them from the float path's unpacking.
    checkpoint = open_checkpoint(model_dir, keep_int4=mode != "none")
    model.load_weights(_weights(model_dir, checkpoint, layout))
    model.eval()
    model.init_rotary(context_len, device, functools.partial(_hf_config, model_dir))
    if mode != "none":
        source = quantized_source(
            engine_config.model_path, checkpoint, config.num_heads, config.num_kv_heads, model_dir
        )
        if source is not None and layout is not None:
            source = layout.quantized_source(source)
        _quantize(model, mode, source)
        if engine_config.cpu_act_quant == "int8":
            _quantize_activations(model, compute)
    logger.info("CPU linears: %s", prepack_linears(model, compute))
    if engine_config.deterministic:
        _make_linears_batch_invariant(model)
    return model


def _weights(
    model_dir: Path, checkpoint: QuantizedCheckpoint | None, layout: ShardLayout | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model loads them; under tensor parallelism this rank's parts, read
    as parts from float safetensors, cut after dequantizing from an AWQ/GPTQ/FP8 checkpoint (whose packed
    tensors are laid out otherwise)."""
    if layout is None:
        return checkpoint_weights(checkpoint, load_weights(model_dir))
    if checkpoint is None:
        return load_weights(model_dir, layout.tensor_shard)
    return (
        (name, tensor if (part := layout.tensor_shard(name)) is None else part.take(tensor))
        for name, tensor in checkpoint_weights(checkpoint, load_weights(model_dir))
    )


def _hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _quantization_mode(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The --quantization mode served on device (resolved before loading, so the checkpoint knows
    whether its int4 weights will be served quantized)."""
    mode = resolve_quantization(requested, device, dtype)
    if mode != requested:
        logger.info("quantization %r serves float weights on %s (%s)", requested, device, dtype)
    return mode


def _quantize(model: CausalLM, mode: str, source: QuantizedSource | None) -> None:
    """Gives linears int8/int4 weights per --quantization: the checkpoint's own blocks where it has
    them, otherwise quantized from the float weights just loaded (which are then dropped)."""
    targets = model.linear_shards()
    plans = [(target, plan_linear(target, mode, source)) for target in targets]
    plans = [(target, weight) for target, weight in plans if weight is not None]
    if not plans:
        return
    try:
        load_kernels()
    except LinearKernelError:
        if mode != "auto":
            raise
        logger.warning("quantization 'auto' serves float weights: the quantized kernels are unavailable")
        return
    for target, weight in plans:
        target.linear.set_quantized(weight)
        if target.is_lm_head:
            target.linear.pack_row_panels()
    bits = sorted({weight.bits for _, weight in plans})
    logger.info(
        "quantization %s: %d of %d linears int%s (lm_head %s)",
        mode,
        len(plans),
        len(targets),
        "/int".join(map(str, bits)),
        next((f"int{w.bits}" for t, w in plans if t.is_lm_head), "float"),
    )


def _quantize_activations(model: CausalLM, compute: str = FP32) -> None:
    """--cpu-act-quant int8: the quantized linears, the lm_head's included (as llama.cpp's Q8 dot
    products), take int8 activations where the CPU has a SIMD path for them. A batch of 16 decodes
    spent 10 % of its step in a float-activation lm_head (49152 x 576); with int8 ones the cached
    few-shot GSM8K batch ran 2.25 -> 2.10 s, and the accuracy measured the same (benchmarks/README.md,
    "Accuracy of the CPU arithmetic"). What stays on
    float activations is pinned to one kernel, so every row's output is batch-invariant, as the int8
    kernels' are (a prompt served from the radix cache then gets the bits it gets fresh): an lm_head to
    the row-dot kernel (its few rows a step), a decoder linear the int8 layout does not fit to the
    panel GEMM (prefill's many)."""
    if not act8_available():
        logger.warning(
            "cpu_act_quant int8: no SIMD path for int8 activations on this CPU, so they stay float32 (%s)",
            cpu.detect().describe(),
        )
        return
    shards = model.linear_shards()
    served = sum(shard.linear.quantize_activations() for shard in shards)
    pinned = 0
    for shard in shards:
        linear = shard.linear
        if linear.quantized is not None and not linear.batch_invariant:
            linear.pinned_mode = kernel_mode(1 if shard.is_lm_head else PANEL_GEMM_MIN_ROWS, compute)
            pinned += 1
    logger.info(
        "cpu_act_quant int8: %d of %d linears take int8 activations (%s; prefill %s); "
        "%d float-activation linears pinned to one kernel (batch-invariant)",
        served,
        len(shards),
        act8_path(1),
        act8_path(PANEL_GEMM_MIN_ROWS),
        pinned,
    )


def _make_linears_batch_invariant(model: CausalLM) -> None:
    """--deterministic: batch-invariant matmuls (see EngineConfig); the executor makes the attention
    backend per-token where it builds it."""
    variant = [m for m in model.modules() if isinstance(m, Linear) and not m.batch_invariant]
    for module in variant:
        if fused_triton.supports(module.weight):
            module.invariant_matmul = True
        else:
            module.row_block = DETERMINISTIC_ROW_BLOCK
    on_triton = sum(m.invariant_matmul for m in variant)
    logger.info(
        "deterministic: per-token attention; %d linears on the invariant Triton matmul, %d in "
        "blocks of %d rows (the others are batch-invariant as they are)",
        on_triton,
        len(variant) - on_triton,
        DETERMINISTIC_ROW_BLOCK,
    )
