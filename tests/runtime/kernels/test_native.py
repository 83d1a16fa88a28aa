"""kernels/native.py: a library is rebuilt when any file its source includes changes (the one-call
decoder is a unity build of other kernels' sources), and reused while none does."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    source.write_text('#include "inner/body.cpp"\n#include "simd_avx2.h"\n')
    value.write_text("#define VALUE 1\n")
    assert native._quoted_includes(source) == sorted(
        [
            (tmp_path / "inner" / "body.cpp").resolve(),
            value.resolve(),
            (native.INCLUDE_DIR / "simd_avx2.h").resolve(),
        ]
    )
    build = native.load_library.__wrapped__  # past the per-process cache
    assert build(source).answer() == 1
    assert build(source).answer() == 1
    assert len(list(cache.glob("top-*.so"))) == 1  # the second load reused the first build
    value.write_text("#define VALUE 2\n")
    assert build(source).answer() == 2
    assert len(list(cache.glob("top-*.so"))) == 2
