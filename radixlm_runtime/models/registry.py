"""Model families by architecture name, and the protocol the rest of the runtime holds them by.

Each family module under `models/` registers the Hugging Face architecture names it serves with
`@register(...)`; a Llama-shaped architecture is one name added to `llama.py`'s list. The executor, the
CUDA-graph runner, the quantizer and the C++ decoder depend on `CausalLM` below, never on a family.
Family modules are imported on the first lookup, so naming an architecture is enough to find it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from radixlm_runtime.attention.base import AttentionBackend, AttentionLayer
    from radixlm_runtime.forward_batch import ForwardBatch
    from radixlm_runtime.layers.quantization import LinearShards
    from radixlm_runtime.models.config import ModelConfig


class CausalLM(Protocol):
    """What the runtime needs of a model: a forward that returns logits for a batch's logits rows,
    its layers' attention parameters, its linears for the quantizer, and a checkpoint loader."""

    config: ModelConfig
    # Whether its decoder layers are built from the ops the one-call C++ decoder runs (llama_cpu.py:
    # Llama-style or Gemma-style norms, SwiGLU or GeGLU, per-head q/k norms, a rotary table per layer).
    supports_cpu_decoder: ClassVar[bool]
    cpu_decoder: Any

    def __call__(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor: ...

    def attention_layers(self) -> Sequence[AttentionLayer]: ...

    def linear_shards(self) -> list[LinearShards]: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def init_rotary(self, context_len: int, device: torch.device, hf_config: Callable[[], Any]) -> None: ...


_MODELS: dict[str, type] = {}
# model_type -> architecture, for configs that name no architecture.
_MODEL_TYPES: dict[str, str] = {}

T = TypeVar("T", bound=type)


def register(*architectures: str, model_types: Sequence[str] = ()) -> Callable[[T], T]:
    """Class decorator: `cls` serves these architecture names (and configs of these model_types)."""

    def decorate(cls: T) -> T:
        for name in architectures:
            if name in _MODELS and _MODELS[name] is not cls:
                raise ValueError(f"architecture {name!r} is registered twice")
            _MODELS[name] = cls
        for model_type in model_types:
            _MODEL_TYPES[model_type] = architectures[0]
        return cls

    return decorate


def _import_families() -> None:
    """Imports every module of the package (the others register nothing), so a new family module is
    found without being listed anywhere."""
    package = importlib.import_module("radixlm_runtime.models")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"radixlm_runtime.models.{module.name}")


def supported_architectures() -> list[str]:
    _import_families()
    return sorted(_MODELS)


def resolve_architecture(architectures: Sequence[str], model_type: str | None) -> str:
    """The served architecture a config names, inferred from `model_type` when it names none; a
    ValueError listing what is supported otherwise."""
    _import_families()
    supported = ", ".join(sorted(_MODELS))
    if architectures:
        for name in architectures:
            if name in _MODELS:
                return name
        raise ValueError(f"unsupported architecture {', '.join(architectures)}; supported: {supported}")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"unsupported architecture (model_type {model_type!r}); supported: {supported}")


def model_class(architecture: str) -> type:
    _import_families()
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_MODELS))}"
        )
    return _MODELS[architecture]
