"""Every runtime flag in one place: the per-layer configs (config.py) composed into one set of
flat CLI flags and keyword arguments (`Engine(max_total_tokens=...)`, `Runtime(port=...)`)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from radixlm_runtime.config import EngineConfig, SchedulerConfig, ServerConfig, flag

_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerArgs:
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    log_level: str = flag("info", "Logging level.", _LOG_LEVELS)

    def __post_init__(self) -> None:
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {list(_LOG_LEVELS)}, got {self.log_level!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Routes flat flag names to the config that owns each; unknown names are an error."""
        known = {*_OWNER, "log_level"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        parts: dict[str, dict[str, Any]] = {name: {} for name in _LAYERS}
        for key, value in kwargs.items():
            if key != "log_level":
                parts[_OWNER[key]][key] = value
        layers = {name: config(**parts[name]) for name, config in _LAYERS.items()}
        return cls(**layers, log_level=kwargs.get("log_level", "info"))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for config in (*_LAYERS.values(), cls):
            add_config_args(parser, config, skip=tuple(_LAYERS))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls.from_kwargs(**{name: getattr(args, name) for name in (*_OWNER, "log_level")})


_LAYERS: dict[str, type] = {"engine": EngineConfig, "scheduler": SchedulerConfig, "server": ServerConfig}
_OWNER: dict[str, str] = {
    f.name: name for name, config in _LAYERS.items() for f in dataclasses.fields(config)
}


def add_config_args(parser: argparse.ArgumentParser, config: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of a config dataclass, its help from the field's `flag(...)` metadata; a
    tuple field takes one or more values."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if f.name in skip:
            continue
        flag_name = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if typing.get_origin(hints[f.name]) is tuple:
            parser.add_argument(flag_name, nargs="+", default=list(f.default), help=help_text)
            continue
        kind = _scalar_type(hints[f.name])
        if kind is bool:
            parser.add_argument(flag_name, action="store_true", help=help_text)
            continue
        parser.add_argument(
            flag_name,
            type=kind,
            default=f.default,
            choices=f.metadata.get("choices"),
            help=f"{help_text} (default: {f.default})",
        )


def _scalar_type(hint: Any) -> type:
    """The CLI type of a field: `int | None` parses as int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
