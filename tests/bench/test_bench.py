"""`verispec bench`: the prediction math on hand-built numbers, prompt selection, the CLI end to end on the tiny
pair (reports, plots, greedy equality), the demos, and bad input. No timing assertions: speed is a benchmark
figure, never a test."""

from __future__ import annotations

import json

import pytest
import torch

from verispec.bench.batching import batch_rows, parse_batch_sizes
from verispec.bench.costs import (
    alphas_for_k,
    conditional_acceptance,
    expected_tokens_per_round,
    predicted_speedup,
)
from verispec.bench.machine import decode_floor, measure_bandwidth
from verispec.bench.prompts import PromptError, load_prompts, select_prompts
from verispec.cli import main
from verispec.runtime.model.dtype import choose_dtype, dtype_name

AUTO = dtype_name(choose_dtype("cpu")[0])  # what --dtype auto runs the tiny Llama pair in here (bf16 on native-bf16 CPUs)

# One torch thread: on a shared, loaded machine, two threads contending for two cores are several times slower.
FAST = ["--threads", "1", "--no-progress", "--warmup-tokens", "2"]

PROMPTS = [
    {"question_id": 1, "category": "animals", "turns": ["the cat sat on", "and then?"]},
    {"question_id": 2, "category": "numbers", "turns": ["one two three"]},
    {"question_id": 3, "category": "animals", "turns": ["the dog sat on the"]},
    {"question_id": 4, "category": "capitals", "turns": ["Paris is the capital of"]},
]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


# -- (a) the prediction math, hand-built ------------------------------------------------------------------------


def test_expected_tokens_and_predicted_speedup_by_hand():
    alphas = [0.8, 0.5]  # conditional: position 2 accepted half the time position 1 was
    assert expected_tokens_per_round(alphas) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    c_verify = {1: 1.0, 2: 1.1, 3: 1.2}
    # E = 2.2 tokens per round; a round costs 2 * 0.1 + c_verify(3) = 1.4; the target alone 1.0 per token.
    assert predicted_speedup(alphas, 0.1, c_verify) == pytest.approx(2.2 / 1.4)


def test_predicted_speedup_reduces_to_leviathan_with_flat_verify_cost():
    alpha, k, c = 0.7, 4, 0.05  # c = c_draft / c_verify
    closed_form = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))
    assert predicted_speedup([alpha] * k, c, {w: 1.0 for w in range(1, k + 2)}) == pytest.approx(closed_form)


def test_conditional_acceptance_from_engine_positions():
    # The engine's acceptance_by_position is unconditional: position j counts only if 1..j were all accepted.
    assert conditional_acceptance([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])
    assert conditional_acceptance([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]
    assert alphas_for_k([0.8], 3) == pytest.approx([0.8, 0.0, 0.0])  # positions never proposed: never accepted


def test_select_prompts_limits_each_category(prompts_file):
    prompts = load_prompts(prompts_file)
    assert [p.text for p in prompts][:1] == ["the cat sat on"]  # the first turn only
    kept = select_prompts(prompts, limit=1)
    assert [p.question_id for p in kept] == ["1", "2", "4"]
    assert [p.question_id for p in select_prompts(prompts, ["animals"])] == ["1", "3"]
    with pytest.raises(PromptError, match="unknown category nope"):
        select_prompts(prompts, ["nope"])


def test_the_batch_sweep_runs_the_methods_asked_for():
    from verispec.bench.settings import BenchSettings

    assert BenchSettings(batch_sizes=[1, 16]).batch_methods() == ["target", "adaptive"]  # the default methods
    assert BenchSettings(families=["target"], batch_sizes=[1, 16]).batch_methods() == ["target"]
    assert BenchSettings(families=["adaptive"], batch_sizes=[1, 16]).batch_methods() == ["target", "adaptive"]


def test_batches_are_full_and_cycle_the_prompts():
    assert batch_rows(5, 2) == [[0, 1], [2, 3], [4, 0]]  # the last batch wraps around to stay full
    assert batch_rows(2, 4) == [[0, 1, 0, 1]]  # fewer prompts than B: one batch, the list repeated
    assert batch_rows(3, 1) == [[0], [1], [2]]
    assert parse_batch_sizes("16,1,4,4") == [1, 4, 16]


def test_measure_bandwidth_is_positive_and_quick():
    bandwidth = measure_bandwidth(size_bytes=8 * 2**20, repeats=2)  # bytes/s
    assert 1e8 < bandwidth < 1e14
    floor = decode_floor(weight_bytes=10**9, bandwidth_gb_s=50.0, tokens=100, seconds=4.0)
    assert floor["floor_ms_per_token"] == pytest.approx(20.0)  # 1 GB read per step at 50 GB/s
    assert floor["target_ms_per_token"] == pytest.approx(40.0) and floor["x_floor"] == pytest.approx(2.0)


# -- (c) end to end on the tiny pair -----------------------------------------------------------------------------


def test_bench_cli_end_to_end(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "out"
    rc = main([
        "bench", "--model", str(model_dirs["target"]), "--draft-model", str(model_dirs["draft"]),
        "--prompts", str(prompts_file), "--limit", "1", "--max-new-tokens", "12", "--k", "1,3",
        "--probe-repeats", "1", "--out", str(out), *FAST,
    ])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert {"machine", "settings", "models", "runs"} <= set(report)
    assert report["machine"]["torch_threads"] >= 1 and report["machine"]["transformers"]
    assert report["machine"]["memory_bandwidth_gb_s"] > 0
    run = report["runs"][0]
    assert run["dtype"] == AUTO
    assert run["floor"]["floor_ms_per_token"] > 0 and run["floor"]["x_floor"] > 0
    names = [m["name"] for m in run["methods"]]
    adaptive = ["adaptive"] if "adaptive" in names else []  # until the engine has it: skipped with a note
    assert names == ["target", "verispec-k1", "verispec-k3", *adaptive, "hf-assisted-k1", "hf-assisted-k3",
                     "hf-target"]
    assert adaptive or any(note.startswith("adaptive: skipped") for note in run["notes"])
    assert set(run["results"]) == {"animals", "numbers", "capitals", "overall"}
    overall = run["results"]["overall"]
    for name in names:
        row = overall[name]
        assert row["prompts"] == 3 and row["tokens"] == 3 * 12  # every method generates exactly N tokens
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    assert overall["target"]["speedup"] == pytest.approx(1.0)
    for k in (1, 3):
        row = overall[f"verispec-k{k}"]
        assert row["equal_to_target"] == 3  # lossless greedy: token-identical to the target alone
        assert 1.0 <= row["mean_accepted_length"] <= k + 1
        assert len(row["acceptance_by_position"]) == k and len(row["alpha_by_position"]) == k
        assert row["predicted_speedup"] > 0 and row["efficiency"] > 0
        assert {"draft_s", "verify_s", "prefill_s", "draft_share", "verify_share"} <= set(row)
    assert overall["hf-assisted-k3"]["equal_to_hf_target"] is not None
    probe = run["cost_probes"]["overall"]
    assert set(probe["verify_ms"]) == {"1", "2", "3", "4"}
    # the probe times the engine's own runner at a round's context: the prompt and half the new tokens
    assert probe["runner"] == run["runner"]["backend"] and probe["context_tokens"] == probe["prompt_tokens"] + 6
    for k in (1, 3):  # a fixed K drafts K tokens every round (the n-gram stage may find nothing: K=0 there)
        counts = overall[f"verispec-k{k}"]["rounds_by_k"]
        assert sum(counts) == overall[f"verispec-k{k}"]["rounds"] and len(counts) == k + 1
        row = overall[f"verispec-k{k}"]  # a round's costs, beside the target alone's step
        assert row["draft_tokens_per_round"] == pytest.approx(sum(i * n for i, n in enumerate(counts)) / sum(counts),
                                                              abs=1e-3)
        assert row["verify_ms_per_round"] == pytest.approx(row["verify_s"] / row["rounds"] * 1e3, rel=1e-3, abs=0.1)
        assert row["verify_over_step"] == pytest.approx(row["verify_ms_per_round"] / overall["target"]["step_ms"],
                                                        rel=1e-3)
        assert row["draft_cost_ratio"] > 0
    assert len(run["prompts"]) == 3 * len(names)
    markdown = (out / "report.md").read_text()
    assert f"## {AUTO}" in markdown and "### Speedup by category" in markdown and "verispec-k3" in markdown
    assert "GB/s measured" in markdown and "x the floor" in markdown
    assert "### Draft length by round" in markdown and "verify w=4 ms" in markdown
    assert "### What a round costs" in markdown and "The target alone's decode step:" in markdown
    for plot in (f"speedup_vs_k_{AUTO}.png", f"acceptance_by_position_{AUTO}.png", f"tokens_per_s_{AUTO}.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
        assert plot in run["plots"]


def test_bench_batch_sizes_end_to_end(model_dirs, prompts_file, tmp_path, capsys):
    """`--batch-sizes 1,2`: the target alone and adaptive speculation at both batch sizes, every row token-identical
    to the prompt's batch-1 output of the target alone."""
    out = tmp_path / "out"
    rc = main([
        "bench", "--model", str(model_dirs["target"]), "--draft-model", str(model_dirs["draft"]),
        "--prompts", str(prompts_file), "--limit", "1", "--max-new-tokens", "10", "--batch-sizes", "1,2",
        "--out", str(out), *FAST,
    ])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["batch_sizes"] == [1, 2]
    run = report["runs"][0]
    batching = run["batching"]
    names = ["target", "adaptive"] if "adaptive" in batching["methods"] else ["target"]
    assert names == ["target", "adaptive"] or any(n.startswith("adaptive: skipped") for n in run["notes"])
    assert batching["batch_sizes"] == [1, 2] and set(batching["results"]) == {"1", "2"}
    for size, batches in (("1", 3), ("2", 2)):  # 3 prompts: batches of 2 wrap around to stay full
        for name in names:
            row = batching["results"][size][name]
            assert row["batches"] == batches and row["rows"] == batches * int(size)
            assert row["tokens"] == row["rows"] * 10  # every row generates exactly N tokens
            assert row["equal_to_batch_1_target"] == row["rows"]  # greedy: identical to the target at batch 1
            assert row["tokens_per_s"] > 0 and row["speedup"] > 0 and row["scaling_vs_batch_1"] > 0
            assert row["decode_tokens_per_s"] >= row["tokens_per_s"] and row["prefill_s"] > 0
        assert batching["results"][size]["target"]["speedup"] == pytest.approx(1.0)
    if "adaptive" in names:
        assert batching["results"]["2"]["adaptive"]["mean_accepted_length"] >= 1.0
    assert batching["results"]["1"]["target"]["scaling_vs_batch_1"] == pytest.approx(1.0)
    assert len(batching["batches"]) == (3 + 2) * len(names)
    assert run["floor"]["x_floor"] > 0 and "results" not in run  # the K sweep did not run
    assert (out / f"tokens_per_s_vs_batch_{AUTO}.png").read_bytes()[:4] == b"\x89PNG"
    assert run["plots"] == [f"tokens_per_s_vs_batch_{AUTO}.png"]
    markdown = (out / "report.md").read_text()
    assert "### Tokens/s by batch size" in markdown and "x the floor" in markdown
    printed = capsys.readouterr().out
    assert "target scaling vs 1" in printed and "GB/s measured" in printed


def test_bench_with_a_model_free_drafter(model_dirs, prompts_file, tmp_path):
    """`--draft-model ngram`: our methods run with the n-gram drafter; HF assisted (needs a model) is skipped."""
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dirs["target"]), "--draft-model", "ngram", "--prompts",
               str(prompts_file), "--limit", "1", "--max-new-tokens", "12", "--k", "2", "--methods",
               "target,verispec,hf-assisted,hf-target", "--probe-repeats", "1", "--out", str(out), *FAST])
    assert rc == 0
    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert [m["name"] for m in run["methods"]] == ["target", "verispec-k2", "hf-target"]
    assert any(note.startswith("hf-assisted: skipped") for note in run["notes"])
    assert run["results"]["overall"]["verispec-k2"]["equal_to_target"] == 3


def test_bench_busy_runs_again_beside_busy_processes(model_dirs, prompts_file, tmp_path, monkeypatch):
    """`--busy 1`: each run twice, quiet then beside one spinning process that exists only during the busy run,
    and a busy / quiet row per method in report.json and report.md."""
    from verispec.bench import busy as busy_module

    alive = []  # per run: the busy processes running while it measured
    measure = busy_module.busy_cores

    def watched(n):
        context = measure(n)

        class Watch:
            def __enter__(self):
                procs = context.__enter__()
                alive.append([p.poll() is None for p in procs])
                self.procs = procs
                return procs

            def __exit__(self, *exc):
                context.__exit__(*exc)
                assert all(p.poll() is not None for p in self.procs)  # killed and reaped

        return Watch()

    monkeypatch.setattr("verispec.bench.benchmark.busy_cores", watched)
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dirs["target"]), "--draft-model", "ngram", "--prompts", str(prompts_file),
               "--limit", "1", "--max-new-tokens", "8", "--methods", "target,adaptive", "--probe-repeats", "0",
               "--busy", "1", "--dtypes", "float32", "--out", str(out), *FAST])
    assert rc == 0 and alive == [[], [True]]
    report = json.loads((out / "report.json").read_text())
    assert [run["busy"] for run in report["runs"]] == [0, 1]
    rows = {(r["engine"], r["mode"]): r for r in report["contention"]}
    assert set(rows) == {("verispec", "target"), ("verispec", "adaptive")}
    for row in rows.values():
        assert row["busy_over_quiet"] == pytest.approx(row["busy_tokens_per_s"] / row["quiet_tokens_per_s"], rel=1e-2)
    markdown = (out / "report.md").read_text()
    assert "beside 1 busy process(es)" in markdown and "## Busy / quiet" in markdown


def test_bench_with_the_targets_twin(model_dirs, prompts_file, tmp_path):
    """`--draft-model self:int8 --also-drafters self:int4`: both twins side by side, outputs equal to the target's,
    their quantized weights counted in the method's memory (the embedding is the target's, not counted twice)."""
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dirs["target"]), "--draft-model", "self:int8", "--also-drafters",
               "self:int4", "--prompts", str(prompts_file), "--limit", "1", "--max-new-tokens", "12", "--k", "2",
               "--methods", "target,verispec", "--probe-repeats", "0", "--dtypes", "float32", "--out", str(out),
               *FAST])
    assert rc == 0
    run = json.loads((out / "report.json").read_text())["runs"][0]
    overall = run["results"]["overall"]
    assert [m["name"] for m in run["methods"]] == ["target", "verispec-k2", "adaptive[self:int4]"]
    for name in ("verispec-k2", "adaptive[self:int4]"):
        assert overall[name]["equal_to_target"] == 3 and overall[name]["acceptance_rate"] > 0.5
    fixed = {name: row["memory_mb"] - row["peak_above_baseline_mb"] for name, row in overall.items()}  # peaks vary
    assert fixed["verispec-k2"] > fixed["adaptive[self:int4]"] > fixed["target"]


def test_bench_with_a_json_schema(model_dirs, prompts_file, tmp_path):
    """`--json-schema`: our methods generate under the schema (outputs still equal the target's), HF's are skipped;
    the packaged JSON-extraction workload exists and parses."""
    from verispec.bench.prompts import json_extraction_files, load_prompts

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dirs["target"]), "--draft-model", "ngram", "--prompts",
               str(prompts_file), "--limit", "1", "--max-new-tokens", "12", "--k", "2", "--json-schema", str(schema),
               "--methods", "target,verispec,hf-target", "--probe-repeats", "0", "--out", str(out), *FAST])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    run = report["runs"][0]
    assert [m["name"] for m in run["methods"]] == ["target", "verispec-k2"]
    assert any(note.startswith("hf-target: skipped") for note in run["notes"])
    assert report["settings"]["structured_output"] == "json_schema"
    assert run["results"]["overall"]["verispec-k2"]["equal_to_target"] == 3
    prompts, packaged = json_extraction_files()
    assert len(load_prompts(prompts)) == 8 and json.loads(packaged.read_text())["required"]


def test_bench_demo_basic_prints_side_by_side(model_dirs, tmp_path, capsys):
    rc = main(["bench", "--demo", "basic", "--model", str(model_dirs["target"]), "--draft-model",
               str(model_dirs["draft"]), "--max-new-tokens", "8", "--k", "2", "--out", str(tmp_path), *FAST])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "target alone:" in printed and "verispec K=2:" in printed and "token-identical" in printed
    assert (tmp_path / "demo-basic" / "report.json").is_file()


# -- bad input: exit 2, one line, before any model is loaded ----------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompts", "/nonexistent/prompts.jsonl"], "does not exist"),
        (["--categories", "animals,nope"], "unknown category nope"),
        (["--k", "1,x"], "--k must be a comma-separated list"),
        (["--k", "0"], "--k values must be between 1 and 64"),
        (["--methods", "target,beam"], "unknown method beam"),
        (["--dtypes", "float32,int3"], "unknown dtype int3"),
        (["--batch-sizes", "0,4"], "--batch-sizes values must be between 1 and 256"),
        (["--batch-sizes", "1,257"], "--batch-sizes values must be between 1 and 256"),
        (["--batch-sizes", "1,2.5"], "--batch-sizes must be a comma-separated list"),
        (["--batch-sizes", "4", "--demo", "basic"], "--batch-sizes and --demo do not combine"),
        (["--json-schema", "/nonexistent/schema.json"], "--json-schema /nonexistent/schema.json"),
        (["--busy", "-1"], "--busy takes 0..64"),
        (["--busy", "1", "--demo", "basic"], "--busy runs with the suite"),
    ],
)
def test_bench_bad_input_exits_2(prompts_file, extra, message, capsys, tmp_path, monkeypatch):
    from verispec.runtime.model import loading, target

    def loads(*args, **kwargs):
        raise AssertionError("the target's files were read before the user's input was checked")

    for module in (loading, target):  # target.py decides the weights, with loading's readers imported by name
        for reader in ("load_model", "load_tokenizer", "resolve_weights", "resolve_target_dtype", "target_gguf_file",
                       "load_target"):
            if hasattr(module, reader):
                monkeypatch.setattr(module, reader, loads)
    # without hf-* methods 'auto' weights read the target's file (its GGUF block types): after the checks
    argv = ["bench", "--prompts", str(prompts_file), "--out", str(tmp_path), "--methods", "target,adaptive", *extra]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
