"""`python -m radixlm.eval`: prompt building and grading at unit level, and a tiny real run of each
task against the shared server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixlm.eval.cli import build_parser, gsm8k_items, is_correct, main, mmlu_items
from radixlm.eval.data import gsm8k_fewshot_prefix, mmlu_subjects


def test_gsm8k_items_share_the_prefix_and_carry_labels() -> None:
    args = build_parser().parse_args(["gsm8k", "--num-questions", "3", "--num-shots", "2"])
    items = gsm8k_items(args)
    prefix = gsm8k_fewshot_prefix(2)
    assert len(items) == 3 and all(it.prompt.startswith(prefix) for it in items)
    assert all(it.prompt.endswith("\nAnswer:") and it.label.lstrip("-").isdigit() for it in items)


def test_mmlu_items_cover_the_subjects() -> None:
    subjects = mmlu_subjects()[:2]
    args = build_parser().parse_args(["mmlu", "--num-questions", "2", "--subjects", *subjects])
    items = mmlu_items(args)
    assert [it.subject for it in items] == [subjects[0]] * 2 + [subjects[1]] * 2
    assert all(it.label in "ABCD" and it.prompt.endswith("\nD. " + it.arguments["choices"][3] + "\nAnswer:")
               for it in items)  # fmt: skip


def test_grading() -> None:
    assert is_correct("gsm8k", " She pays 5 + 3 = 8 dollars.\n#### 8\n\n", "8")
    assert not is_correct("gsm8k", " 7 dollars.\nQuestion: 8", "8")
    assert is_correct("mmlu", "B", "B") and not is_correct("mmlu", "A", "B")


@pytest.mark.parametrize("flag", ["--num-questions", "--parallel", "--max-new-tokens"])
def test_bad_sizes_are_rejected(flag: str) -> None:
    with pytest.raises(SystemExit, match=f"{flag} must be positive"):
        main(["gsm8k", flag, "0"])


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gsm8k", "mmlu"])
def test_tiny_run_writes_a_result(task: str, runtime, tmp_path: Path, capsys) -> None:
    out = tmp_path / f"{task}.json"
    argv = [task, "--backend", runtime.url, "--num-questions", "3", "--num-shots", "2"]
    argv += ["--num-subjects", "1", "--max-new-tokens", "48", "--output", str(out)]
    result = main(argv)
    saved = json.loads(out.read_text())
    assert saved["num_questions"] == 3 and len(saved["predictions"]) == 3
    assert saved["accuracy"] == sum(saved["correct"]) / 3 == result["accuracy"]
    assert 0.3 < saved["cache_hit_rate"] <= 1.0 and saved["questions_per_s"] > 0
    assert f"{task}: accuracy" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gsm8k", "mmlu"])
def test_accuracy_matches_the_transformers_baseline(task: str, runtime, tmp_path: Path) -> None:
    """Greedy on the same weights: radixlm's accuracy equals plain transformers' within one question
    per hundred (rounded up: none at this size), and the JSON records both."""
    out = tmp_path / f"{task}.json"
    argv = [task, "--backend", runtime.url, "--num-questions", "4", "--num-shots", "3", "--num-subjects", "2"]
    argv += ["--max-new-tokens", "64", "--baseline", "transformers", "--output", str(out)]
    main(argv)
    saved = json.loads(out.read_text())
    n = saved["num_questions"]
    assert saved["baseline"]["system"] == "transformers" and len(saved["baseline"]["predictions"]) == n
    assert abs(sum(saved["correct"]) - sum(saved["baseline"]["correct"])) <= -(-n // 100)
    assert saved["accuracy_gap"] == abs(saved["accuracy"] - saved["baseline"]["accuracy"])
    assert saved["answers_agree"] >= 0.75
