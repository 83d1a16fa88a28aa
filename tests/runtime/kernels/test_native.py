"""kernels/native.py: a library is rebuilt when any file its source includes changes (the one-call
decoder is a unity build of other kernels' sources), and reused while none does; every library can be
built at once, ahead of its first use, a failure reported rather than raised; every kernel source
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


def test_build_all_builds_every_source_and_reports_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(native.KERNEL_CACHE_ENV, str(cache))
    good = [tmp_path / f"k{i}.cpp" for i in range(3)]
    for i, source in enumerate(good):
        source.write_text(f'extern "C" int answer(void) {{ return {i}; }}\n')
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    failed = native.build_all([*good, broken])
    assert list(failed) == [broken] and "broken.cpp" in str(failed[broken])
    assert sorted(p.name.split("-")[0] for p in cache.glob("*.so")) == ["k0", "k1", "k2"]
    # Loading finds what was built (no second build) and raises where the build failed.
    assert native.load_library.__wrapped__(good[2]).answer() == 2
    assert len(list(cache.glob("*.so"))) == 3
    with pytest.raises(native.KernelBuildError, match="broken.cpp"):
        native.load_library.__wrapped__(broken)


def test_the_command_builds_the_package_kernels_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m radixlm_runtime.kernels.native` (scripts/install.sh) builds what build_all builds, here
    the package's sources with the compiler stubbed to record them (the real builds take a minute)."""
    monkeypatch.setenv(native.KERNEL_CACHE_ENV, str(tmp_path))
    compiled: list[str] = []

    def fake_build(source: Path, target: Path, flags: tuple[str, ...]) -> None:
        compiled.append(source.name)
        target.write_bytes(b"")

    monkeypatch.setattr(native, "_build", fake_build)
    assert native.main() == 0
    assert sorted(compiled) == sorted(p.name for p in native.PACKAGE_DIR.rglob("*.cpp"))
    assert {"cpu_attention.cpp", "linear_cpu.cpp", "llama_cpu.cpp"} <= set(compiled)
    assert str(tmp_path) in capsys.readouterr().out

    def no_compiler(source: Path, target: Path, flags: tuple[str, ...]) -> None:
        raise native.KernelBuildError("no compiler")

    monkeypatch.setattr(native, "_build", no_compiler)
    for library in tmp_path.glob("*.so"):
        library.unlink()
    assert native.main() == 1
    assert "not built: no compiler" in capsys.readouterr().out
