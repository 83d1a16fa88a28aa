"""benchmarks/bench_moe.py at --tiny, as run_all.py runs it: the JSON's structure and the arithmetic
between its figures, never how the timings compare (on a loaded machine the router alone may time
slower than the layer that contains it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_moe_tiny(tmp_path: Path) -> None:
    path = os.environ.get("PYTHONPATH")
    env = os.environ | {
        "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        "CUDA_VISIBLE_DEVICES": "",
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_moe.py"), "--tiny", "--out-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "moe.json").read_text())
    assert result["name"] == "moe"
    assert result["command"].startswith("python benchmarks/bench_moe.py --tiny")
    assert result["shape"] == {"hidden": 64, "intermediate": 32, "experts": 8, "top_k": 2}
    assert [r["tokens"] for r in result["results"]] == [1, 16]
    for r in result["results"]:
        for key in ("moe", "experts", "router", "dense"):
            assert r[f"{key}_us_per_token"] > 0
        assert r["moe_over_dense"] == pytest.approx(r["moe_us_per_token"] / r["dense_us_per_token"])
        expected_share = 1 - r["experts_us_per_token"] / r["moe_us_per_token"]
        assert r["overhead_share"] == pytest.approx(expected_share)
        assert r["router_share"] == pytest.approx(r["router_us_per_token"] / r["moe_us_per_token"])
    # One token picks exactly top_k experts.
    assert result["results"][0]["active_experts"] == 2
    (table,) = result["tables"]
    assert [row[0] for row in table["rows"]] == ["1", "16"]
    assert all(len(row) == len(table["headers"]) for row in table["rows"])
    assert (tmp_path / "moe.png").read_bytes()[:8] == PNG_MAGIC
