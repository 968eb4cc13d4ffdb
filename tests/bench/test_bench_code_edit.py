"""`verispec bench --workload code-edit`: prompts built the same way every time from real standard-library source
(none of it in the Spec-Bench evaluation set), the original code in each prompt and as its prediction; the run on
the tiny target, in process and through the server with the openai client, every answer equal to the target
alone's."""

from __future__ import annotations

import json

import pytest

from verispec.bench.code_edit import METHODS, CodeEditConfig, build_edit_prompts, run_code_edit
from verispec.bench.prompts import default_prompts_path
from verispec.cli import main


def test_prompts_are_deterministic_real_source_outside_spec_bench():
    prompts = build_edit_prompts(3, 1, seed=0)
    assert [p.kind for p in prompts] == ["function"] * 3 + ["file"]
    assert [p.text for p in prompts] == [p.text for p in build_edit_prompts(3, 1, seed=0)]
    assert build_edit_prompts(3, 0, seed=1)[0].source != prompts[0].source or len(prompts) == 4
    evaluation = default_prompts_path().read_text(encoding="utf-8")
    for prompt in prompts:
        assert prompt.original in prompt.text and prompt.original.strip() not in evaluation
        first = prompt.original.splitlines()[0]
        assert first.strip() and first not in evaluation


def test_bench_runs_every_method_and_the_server(tmp_path, model_dirs, one_thread):
    """The tiny target (a character a token): short functions only, no file."""
    config = CodeEditConfig(target=str(model_dirs["target"]), out=tmp_path, functions=2, files=0, max_new_tokens=12,
                            max_len=1024, serve=True, max_code_chars=200)
    report = run_code_edit(config, log=lambda line: None)
    assert report == json.loads((tmp_path / "code_edit.json").read_text())
    prompts = report["settings"]["prompts"]
    assert prompts == 2 and list(report["methods"]) == list(METHODS)
    for method, row in report["methods"].items():
        assert row["equal_to_target"] == prompts and row["tokens"] > 0, method
        assert row["speedup"] > 0
    assert report["methods"]["target"]["accepted_prediction_tokens"] == 0
    assert report["serve"]["prediction"]["equal_to_plain"] == prompts
    assert (tmp_path / "code_edit_prompts.jsonl").read_text().count("\n") == prompts


def test_cli_refuses_prompts_of_its_own(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "code-edit", "--prompts", str(tmp_path / "x.jsonl"), "--out", str(tmp_path)])
    assert info.value.code == 2 and "builds its own prompts" in capsys.readouterr().err
