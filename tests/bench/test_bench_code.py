"""`verispec bench --workload code`: the prompts are built the same way every time from real standard-library
source, span the four categories, share nothing with the Spec-Bench evaluation set, and run through the bench on the
tiny pair with per-category figures."""

from __future__ import annotations

import ast
import json

import pytest
import torch

from verispec.bench.code_workload import (
    CATEGORIES,
    PER_CATEGORY,
    build_prompts,
    describe,
    module_source,
)
from verispec.bench.prompts import default_prompts_path, load_prompts, select_prompts
from verispec.cli import main

EDITS = {"rename-parameter", "type-hints", "validate", "comments", "rename-local"}
FAST = ["--threads", "1", "--no-progress", "--warmup-tokens", "2", "--probe-repeats", "0"]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return build_prompts(0)


def _code(turn: str) -> str:
    return turn.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_code_prompts_build_deterministically_with_every_category(records):
    assert build_prompts(0) == records  # same seed, same interpreter: the same prompts, byte for byte
    assert [r["category"] for r in records] == [c for c in CATEGORIES for _ in range(PER_CATEGORY)]
    assert len({r["source"] for r in records}) == len(records)  # each function once
    assert len({r["question_id"] for r in records}) == len(records)
    assert {r["source"] for r in build_prompts(1)} != {r["source"] for r in records}  # the seed picks them
    assert describe(0, records)["sha256"] == describe(0, build_prompts(0))["sha256"]
    assert describe(0, records)["modules_without_source"] == []
    assert {r["task"] for r in records if r["category"] == "edit"} <= EDITS
    assert {r["task"] for r in records if r["category"] != "edit"} == set(CATEGORIES) - {"edit"}


def test_code_prompts_quote_real_functions(records):
    """Every explain / test / edit prompt quotes a whole function exactly as its module's file has it; a write
    prompt gives that function's signature and docstring and no code."""
    for r in records:
        module, name = r["source"].rsplit(".", 1)
        turn = r["turns"][0]
        if r["category"] == "write":
            assert "```" not in turn and f"`{name}(" in turn and not name.startswith("_")
            continue
        code = _code(turn)
        assert code in module_source(module)
        tree = ast.parse(code)
        assert isinstance(tree.body[0], ast.FunctionDef) and tree.body[0].name == name
        if r["category"] == "edit":
            assert turn.endswith("Return the whole function.")
        if r["category"] == "test":
            assert f"from {module} import {name}" in turn


def test_code_prompts_share_nothing_with_the_spec_bench_set(records):
    from verispec.distill.overlap import overlapping

    path = default_prompts_path()
    assert path is not None and path.is_file(), (
        "shared/data/spec_bench_dev.jsonl not found above the checkout or the package: the overlap test needs it")
    evaluation = [turn for line in path.read_text().splitlines() if line.strip()
                  for turn in json.loads(line)["turns"]]
    for seed in (0, 1):
        texts = [r["turns"][0] for r in (records if seed == 0 else build_prompts(seed))]
        assert not overlapping(texts, evaluation)
    # the negative control: eight words of a Spec-Bench prompt inside a code prompt are caught
    planted = records[0]["turns"][0] + "\n" + " ".join(evaluation[0].split()[:12])
    assert overlapping([planted], evaluation)


def test_bench_runs_the_code_workload_by_category(model_dirs, tmp_path):
    out = tmp_path / "out"
    rc = main(["bench", "--workload", "code", "--model", str(model_dirs["target"]), "--draft-model",
               str(model_dirs["draft"]), "--limit", "1", "--max-new-tokens", "4", "--methods", "target,verispec",
               "--k", "2", "--dtype", "float32", "--out", str(out), *FAST])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    settings = report["settings"]
    assert settings["prompts_file"] == str(out / "code_prompts.jsonl")
    assert settings["workload"]["name"] == "code" and settings["workload"]["seed"] == 0
    written = load_prompts(out / "code_prompts.jsonl")
    assert [p.text for p in written] == [r["turns"][0] for r in build_prompts(0)]
    assert [p.category for p in select_prompts(written, None, 2)] == [c for c in CATEGORIES for _ in range(2)]
    run = report["runs"][0]
    assert set(run["results"]) == {*CATEGORIES, "overall"}
    for category in CATEGORIES:
        assert run["results"][category]["target"]["prompts"] == 1
    overall = run["results"]["overall"]
    assert overall["verispec-k2"]["equal_to_target"] == 4 and overall["target"]["tokens"] == 4 * 4
    markdown = (out / "report.md").read_text()
    assert "workload code: module-level functions of" in markdown and "| edit |" in markdown


def test_bench_code_workload_refuses_a_prompts_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--workload", "code", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--workload code builds its own prompts: drop --prompts" in capsys.readouterr().err
