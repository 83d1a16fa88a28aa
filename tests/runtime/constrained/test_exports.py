"""The package's lazy exports: every name in __all__ resolves to its defining module's object."""

from __future__ import annotations

import importlib

import pytest

import radixlm_runtime.constrained as constrained


def test_every_export_resolves_to_its_module() -> None:
    assert sorted(constrained.__all__) == sorted(constrained._EXPORTS)
    for name in constrained.__all__:
        module = importlib.import_module(constrained._EXPORTS[name])
        assert getattr(constrained, name) is getattr(module, name)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'RegexGuider'"):
        constrained.RegexGuider  # noqa: B018
