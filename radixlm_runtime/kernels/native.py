"""Builds and loads the project's C++ CPU kernels.

Each source is compiled once per machine with the system C++ compiler into a shared library cached
under ~/.cache/radixlm/kernels (or $RADIXLM_KERNEL_CACHE_DIR), keyed by the hash of the source and of
what it includes, and called through ctypes: no torch headers, so a build takes seconds, and ctypes
releases the GIL during a call.
The libraries link the OpenMP runtime torch already loaded (libgomp.so.1), so all share one thread
pool. SIMD paths are picked at run time by asking the CPU (`__builtin_cpu_supports`), never assumed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

KERNEL_CACHE_ENV = "RADIXLM_KERNEL_CACHE_DIR"
# "address": builds instrumented with AddressSanitizer, for the tests that run the kernels under it
# (the process must preload libasan).
SANITIZE_ENV = "RADIXLM_KERNEL_SANITIZE"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp")
SANITIZE_FLAGS = ("-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer")
# The helpers the kernels share (simd.h): on every build's include path.
INCLUDE_DIR = Path(__file__).parent
# Every kernel library's source is a .cpp file in the package.
PACKAGE_DIR = INCLUDE_DIR.parent
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class KernelBuildError(RuntimeError):
    """A C++ kernel library cannot be built or loaded on this machine."""


def _cache_dir() -> Path:
    env = os.environ.get(KERNEL_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixlm" / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError(
        "the CPU kernels need a C++ compiler (g++ or clang++) to build once; install one "
        "(e.g. `apt-get install g++`)"
    )


def _flags() -> tuple[str, ...]:
    sanitize = os.environ.get(SANITIZE_ENV, "")
    if sanitize not in ("", "address"):
        raise KernelBuildError(f"{SANITIZE_ENV}: expected 'address' or nothing, got {sanitize!r}")
    return FLAGS + SANITIZE_FLAGS if sanitize else FLAGS


def _build(source: Path, target: Path, flags: tuple[str, ...]) -> None:
    compiler = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building %s into %s (once per machine)", source.name, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        command = [compiler, *flags, "-I", str(INCLUDE_DIR), str(source), "-o", str(staged)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"building {source.name} with {compiler} failed:\n{result.stderr[-4000:]}")
        # Atomic: a concurrent builder's identical library may already be there, either is fine.
        os.replace(staged, target)


def _quoted_includes(source: Path) -> list[Path]:
    """Every file `source` pulls in with #include "...", transitively (a unity build includes other
    kernels' .cpp files), resolved as the compiler does: beside the including file, then INCLUDE_DIR."""
    seen: list[Path] = []
    stack = [source]
    while stack:
        current = stack.pop()
        for match in _INCLUDE.finditer(current.read_text()):
            for base in (current.parent, INCLUDE_DIR):
                path = (base / match.group(1)).resolve()
                if path.is_file():
                    if path not in seen:
                        seen.append(path)
                        stack.append(path)
                    break
    return sorted(seen)


def built(source: Path) -> Path:
    """The compiled library of `source` (a .cpp file), built now if this machine has none for it as it
    is: rebuilt when it or anything it includes changes."""
    flags = _flags()
    hashed = [source.read_bytes(), *(h.read_bytes() for h in _quoted_includes(source))]
    digest = hashlib.sha256(b"".join(hashed) + " ".join(flags).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{source.stem}-{digest}.so"
    if not path.is_file():
        _build(source, path, flags)
    return path


def build_all(sources: list[Path] | None = None) -> dict[Path, KernelBuildError]:
    """Builds every kernel library (`sources`, default: every .cpp of the package) that is not built
    yet, one compiler per core at once: on a machine that has none, a first start or test run would
    otherwise build them one after another as each is first loaded (the one-call decoder, a unity
    build of the others, takes ~20 s alone at -O3 on a 2-core Zen 4, ~1 minute under AddressSanitizer:
    28 s and 117 s for all four one after another, 23 s and 66 s at once). Returns the sources that
    failed, with why; each fails again, with its fallback, where it is loaded."""
    sources = sorted(PACKAGE_DIR.rglob("*.cpp")) if sources is None else sources
    failed: dict[Path, KernelBuildError] = {}

    def build(source: Path) -> None:
        try:
            built(source)
        except KernelBuildError as e:
            failed[source] = e

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(build, sources))
    return failed


@functools.cache
def load_library(source: Path) -> ctypes.CDLL:
    """The compiled library of `source` (a .cpp file), built on first use (see `built`)."""
    path = built(source)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e


def main() -> int:
    """`python -m radixlm_runtime.kernels.native`: builds every kernel library now (scripts/install.sh
    runs it), so the first start does not; 1 where one cannot be built (the engine then runs its torch
    fallbacks, slower)."""
    t0 = time.perf_counter()
    failed = build_all()
    for source, error in failed.items():
        print(f"radixlm kernels: {source.name} not built: {error}")
    print(f"radixlm kernels: built in {_cache_dir()} ({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
