"""kernels/native.py: a library is rebuilt when any file its source includes changes (the one-call
decoder is a unity build of other kernels' sources), and reused while none does; every kernel source
ships in the wheel (they are compiled on the user's machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

import radixlm_runtime
from radixlm_runtime.kernels import native


def test_rebuilds_when_an_included_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(native.KERNEL_CACHE_ENV, str(cache))
    (tmp_path / "inner").mkdir()
    value = tmp_path / "inner" / "value.h"
    (tmp_path / "inner" / "body.cpp").write_text(
        '#include "value.h"\nextern "C" int answer(void) { return VALUE; }\n'
    )
    source = tmp_path / "top.cpp"
    source.write_text('#include "inner/body.cpp"\n#include "simd.h"\n')
    value.write_text("#define VALUE 1\n")
    assert native._quoted_includes(source) == sorted(
        [
            (tmp_path / "inner" / "body.cpp").resolve(),
            value.resolve(),
            (native.INCLUDE_DIR / "simd.h").resolve(),
        ]
    )
    build = native.load_library.__wrapped__  # past the per-process cache
    assert build(source).answer() == 1
    assert build(source).answer() == 1
    assert len(list(cache.glob("top-*.so"))) == 1  # the second load reused the first build
    value.write_text("#define VALUE 2\n")
    assert build(source).answer() == 2
    assert len(list(cache.glob("top-*.so"))) == 2


def test_every_kernel_source_is_package_data() -> None:
    """A source left out of pyproject's package-data is missing from an installed wheel, and the kernel
    built from it fails on the user's first request."""
    root = Path(radixlm_runtime.__file__).parent
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["radixlm_runtime"]
    shipped = {path for pattern in globs for path in root.glob(pattern)}
    sources = {path for suffix in ("*.cpp", "*.h") for path in root.rglob(suffix)}
    assert sources and sources <= shipped, sorted(str(p.relative_to(root)) for p in sources - shipped)
