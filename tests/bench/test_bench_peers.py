"""`verispec bench --peers`: peer engines beside verispec. No peer needs to be installed: a fake peer python (a
tiny script that answers as a driver would) stands in for each engine's virtualenv; one slow test runs the real
llama.cpp driver where its virtualenv exists. No timing assertions: the fake peers report the seconds they are
told to, so every figure is checked exactly."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from conftest import VOCAB, tiny_llama
from verispec.bench.benchmark import BenchConfig
from verispec.bench.gguf_draft import rotary_to_pairs, write_draft_gguf
from verispec.bench.peer_models import gguf_weights
from verispec.bench.peers import (
    SETUP_SCRIPT,
    default_python,
    peer_table,
    resolve_peers,
    run_driver,
    run_peers,
    vllm_dtype,
)
from verispec.bench.prompts import BenchPrompt
from verispec.bench.suite import BenchSettings
from verispec.cli import main
from verispec.runtime.model.memory import weights_bytes
from verispec.runtime.model.dtype import choose_dtype, dtype_name

AUTO = dtype_name(choose_dtype("cpu")[0])  # what --dtype auto runs the tiny Llama target in here

# A stand-in for a peer's virtualenv python, run as `FAKE DRIVER IN.json OUT.json`: every prompt generates
# max_new_tokens copies of its last token in 0.5 s; the job it got is appended to $FAKE_PEER_LOG.
FAKE_PEER = """#!{python}
import json, os, sys
driver, job_file, out = sys.argv[1:4]
job = json.load(open(job_file))
with open(os.environ["FAKE_PEER_LOG"], "a") as log:
    log.write(json.dumps({{"driver": os.path.basename(driver), **job}}) + "\\n")
if os.environ.get("FAKE_PEER_EXIT"):
    print("no engine here", file=sys.stderr)
    sys.exit(int(os.environ["FAKE_PEER_EXIT"]))
rows = [{{"tokens": job["max_new_tokens"], "seconds": 0.5, "token_ids": [p[-1]] * job["max_new_tokens"]}}
        for p in job["prompts"]]
json.dump({{"rows": rows, "load_s": 1.0, "threads": job["threads"]}}, open(out, "w"))
"""


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    script = tmp_path / "fake-python"
    script.write_text(FAKE_PEER.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "jobs.jsonl"
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    monkeypatch.delenv("FAKE_PEER_EXIT", raising=False)
    return script, log


def jobs(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A GGUF 'target' with a tokenizer and two tensors: 4096 F32 bytes and 64 F16 bytes."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "target.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    writer.add_token_types([1, 1, 1])
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.ones((32, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_run(target_tps: float = 10.0) -> dict:
    """A run section as run_suite and run_benchmark make it: two prompts of 8 tokens, 30 MiB of weights."""
    results = {"target": {"prompts": 2, "tokens": 16, "seconds": 16 / target_tps, "equal_to_target": 2},
               "adaptive": {"prompts": 2, "tokens": 16, "seconds": 0.8, "equal_to_target": 2},
               "hf-target": {"prompts": 2, "tokens": 16, "seconds": 4.0, "equal_to_target": 2}}
    return {"results": {"overall": results},
            "floor": {"target_weight_mb": 30.0, "memory_bandwidth_gb_s": 20.0}}


PROMPTS = [BenchPrompt("1", "a", "x", [5, 6, 7]), BenchPrompt("2", "b", "y", [8, 9])]


def config_for(peers: dict, target, draft=None) -> BenchConfig:
    return BenchConfig(target=str(target), draft=draft, settings=BenchSettings(max_new_tokens=8), peers=peers)


# -- choosing the peers ------------------------------------------------------------------------------------------


def test_resolve_peers_names_defaults_and_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_PEERS_DIR", str(tmp_path))
    python = tmp_path / "py"
    python.write_text("")
    assert resolve_peers("llama.cpp, vllm,llamacpp") == {
        "llama.cpp": str(tmp_path / "llamacpp-venv/bin/python"), "vllm": str(tmp_path / "vllm-venv/bin/python")}
    assert list(resolve_peers("vllm,llama.cpp")) == ["vllm", "llama.cpp"]  # the order given
    assert resolve_peers(None, vllm_python=str(python)) == {"vllm": str(python)}  # --vllm-python alone
    assert resolve_peers(None) == {}
    assert resolve_peers("llama.cpp", llamacpp_python=str(python)) == {"llama.cpp": str(python)}
    assert default_python("vllm") == tmp_path / "vllm-venv/bin/python"
    with pytest.raises(ValueError, match="unknown peer 'tgi' in --peers: choose from vllm, llama.cpp"):
        resolve_peers("vllm,tgi")
    with pytest.raises(ValueError, match=f"--llamacpp-python {tmp_path}/nope: no such file.*{SETUP_SCRIPT}"):
        resolve_peers("llama.cpp", llamacpp_python=str(tmp_path / "nope"))


# -- the drivers' output, through a fake peer python -------------------------------------------------------------


def test_run_driver_reads_the_drivers_output(fake_peer):
    script, log = fake_peer
    job = {"prompts": [[1, 2], [3]], "max_new_tokens": 4, "threads": 2, "spec": "none"}
    out = run_driver("llama.cpp", str(script), job)
    assert out["rows"] == [{"tokens": 4, "seconds": 0.5, "token_ids": [2] * 4},
                           {"tokens": 4, "seconds": 0.5, "token_ids": [3] * 4}]
    assert jobs(log) == [{"driver": "llamacpp_driver.py", **job}]


def test_run_peers_puts_every_engine_and_mode_in_one_table(fake_peer, tiny_gguf):
    script, log = fake_peer
    config = config_for({"llama.cpp": str(script), "vllm": str(script)}, tiny_gguf)
    run = fake_run()
    target_ids = {0: [7] * 8, 1: [1] * 8}  # the fake peers' output equals verispec's target on prompt 0 only
    section = run_peers(config, "float32", PROMPTS, run, log=lambda line: None, target_ids=target_ids)
    # vLLM runs Hugging Face folders: a GGUF target leaves it out, with a note; llama.cpp has no draft model.
    assert any(n.startswith("vllm skipped: vLLM runs Hugging Face folders") for n in section["notes"])
    assert "llama.cpp draft model: not run (the benchmark has no draft model)" in section["notes"]
    rows = {(r["engine"], r["mode"]): r for r in section["rows"]}
    assert list(rows) == [("verispec", "target"), ("verispec", "adaptive"),
                          ("llama.cpp", "target"), ("llama.cpp", "prompt lookup")]
    peer = rows["llama.cpp", "target"]
    assert peer["tokens"] == 16 and peer["seconds"] == 1.0 and peer["tokens_per_s"] == 16.0
    assert peer["ms_per_token"] == 62.5 and peer["equal_to_verispec_target"] == 1 and peer["prompts"] == 2
    weights, weight_bytes = gguf_weights(tiny_gguf)
    assert (weights, weight_bytes) == ("GGUF F32/F16", 32 * 32 * 4 + 32 * 2)
    assert peer["weights"] == "GGUF F32/F16" and peer["weights_mb"] == round(weight_bytes / 2**20, 2)
    assert peer["floor_ms"] == pytest.approx(weight_bytes / 20e9 * 1e3, abs=1e-3)
    ours = rows["verispec", "target"]
    assert ours["tokens_per_s"] == 10.0 and ours["ms_per_token"] == 100.0 and ours["weights"] == "float32"
    assert ours["x_floor"] == pytest.approx(100.0 / (30 * 2**20 / 20e9 * 1e3), abs=0.01)
    assert section["ratios"] == [{"peer": "llama.cpp", "target_vs_target": round(10 / 16, 2),
                                  "speculative_mode": "adaptive", "peer_best_mode": "target",
                                  "speculative_vs_best": round(20 / 16, 2)}]
    sent = jobs(log)
    assert [j["spec"] for j in sent] == ["none", "lookup"]
    assert sent[0]["prompts"] == [[5, 6, 7], [8, 9]] and sent[0]["max_new_tokens"] == 8
    assert sent[0]["gguf"] == str(tiny_gguf) and sent[0]["threads"] == torch.get_num_threads()
    table = "\n".join(peer_table(section))
    assert "| llama.cpp | prompt lookup | GGUF F32/F16 | 0.0 | 16.0 | 62.50 |" in table
    assert "| verispec | adaptive | float32 | 30.0 | 20.0 | 50.00 |" in table and "hf-target" not in table
    assert "verispec / llama.cpp: target alone 0.62x, verispec adaptive vs llama.cpp's best (target) 1.25x" in table


def test_vllm_runs_the_targets_folder_and_the_draft_model(fake_peer, model_dirs):
    script, log = fake_peer
    config = config_for({"vllm": str(script)}, model_dirs["target"], draft=f"ngram+{model_dirs['draft']}")
    section = run_peers(config, "bfloat16", PROMPTS, fake_run(), log=lambda line: None)
    assert [(r["engine"], r["mode"], r["weights"]) for r in section["rows"][2:]] == [
        ("vLLM", "target", "bfloat16"), ("vLLM", "ngram", "bfloat16"), ("vLLM", "draft model", "bfloat16")]
    held = weights_bytes(model_dirs["target"], torch.bfloat16)  # the folder's tensors in vLLM's dtype
    assert section["rows"][2]["weights_mb"] == round(held / 2**20, 2)
    sent = jobs(log)
    assert [j["spec"] for j in sent] == ["none", "ngram", "draft"]
    assert {j["model"] for j in sent} == {str(model_dirs["target"])} and {j["dtype"] for j in sent} == {"bfloat16"}
    assert sent[2]["draft_model"] == str(model_dirs["draft"])


def test_vllm_runs_the_float_conversion_in_the_auto_dtype_beside_gguf_weights(fake_peer, model_dirs):
    """verispec on GGUF blocks computes in float32; vLLM runs the conversion in its fast dtype here, not float32."""
    script, log = fake_peer
    config = config_for({"vllm": str(script)}, model_dirs["target"])
    config.weights = "gguf"
    run_peers(config, "float32", PROMPTS, fake_run(), log=lambda line: None)
    auto = dtype_name(choose_dtype(config.device)[0])
    assert {j["dtype"] for j in jobs(log)} == {auto}
    config.weights = "fp32"
    assert vllm_dtype(config, "float32") == "float32"


def test_llamacpp_results_are_measured_once_for_every_dtype(fake_peer, tiny_gguf):
    script, log = fake_peer
    config, cache = config_for({"llama.cpp": str(script)}, tiny_gguf), {}
    for dtype in ("float32", "bfloat16"):
        section = run_peers(config, dtype, PROMPTS, fake_run(), log=lambda line: None, cache=cache)
        assert [r["mode"] for r in section["rows"] if r["engine"] == "llama.cpp"] == ["target", "prompt lookup"]
    assert len(jobs(log)) == 2


# -- a peer that is not installed --------------------------------------------------------------------------------


def test_a_missing_peer_is_skipped_with_a_note_naming_the_setup_script(tmp_path, tiny_gguf, model_dirs, fake_peer,
                                                                        monkeypatch):
    script, log = fake_peer
    monkeypatch.setenv("VERISPEC_PEERS_DIR", str(tmp_path / "nothing-here"))
    lines = []
    config = config_for(resolve_peers("llama.cpp"), tiny_gguf)
    section = run_peers(config, "float32", PROMPTS, fake_run(), log=lines.append)
    assert [r["engine"] for r in section["rows"]] == ["verispec", "verispec"]
    assert len(section["notes"]) == 1 and not jobs(log)
    missing = section["notes"][0]
    assert missing.startswith(f"llama.cpp skipped: no llama.cpp virtualenv at {tmp_path}/nothing-here/llamacpp-venv")
    assert f"`{SETUP_SCRIPT} llama.cpp`" in missing and f"note: {missing}" in "\n".join(lines)
    # A virtualenv whose engine does not import: the driver exits 3, and the peer is skipped the same way.
    monkeypatch.setenv("FAKE_PEER_EXIT", "3")
    section = run_peers(config_for({"vllm": str(script)}, model_dirs["target"]), "float32", PROMPTS, fake_run(),
                        log=lambda line: None)
    assert [r["engine"] for r in section["rows"]] == ["verispec", "verispec"]
    assert section["notes"][-1] == f"vllm skipped: no engine here; make the virtualenv with `{SETUP_SCRIPT} vllm`"
    assert len(jobs(log)) == 1  # skipped after the first mode, not retried per mode
    # Any other failure is a note for that mode, never a crash.
    monkeypatch.setenv("FAKE_PEER_EXIT", "1")
    section = run_peers(config_for({"vllm": str(script)}, model_dirs["target"]), "float32", PROMPTS, fake_run(),
                        log=lambda line: None)
    assert sum(n.startswith("vllm target did not run: vllm (") for n in section["notes"]) == 1


# -- the CLI ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--peers", "vllm,tgi"], "unknown peer 'tgi' in --peers: choose from vllm, llama.cpp"),
        (["--peers", "llama.cpp", "--llamacpp-python", "/nonexistent/python"],
         "--llamacpp-python /nonexistent/python: no such file"),
        (["--vllm-python", "/nonexistent/python"], "--vllm-python /nonexistent/python: no such file"),
        (["--peers", "llama.cpp", "--batch-sizes", "1,4"], "--peers (and --vllm-python) run with the batch-1 suite"),
    ],
)
def test_bench_bad_peers_exit_2(tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--out", str(tmp_path), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_bench_cli_report_has_the_peers_table(model_dirs, tmp_path, fake_peer):
    script, log = fake_peer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "animals", "turns": ["the cat sat on"]}) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(model_dirs["target"]), "--draft-model", str(model_dirs["draft"]),
               "--prompts", str(prompts), "--max-new-tokens", "6", "--methods", "target,adaptive",
               "--peers", "vllm,llama.cpp", "--vllm-python", str(script), "--llamacpp-python", str(script),
               "--out", str(out), "--threads", "1", "--no-progress", "--warmup-tokens", "2", "--probe-repeats", "0"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["machine"]["cpu_flags"] is not None
    peers = report["runs"][0]["peers"]
    assert [(r["engine"], r["mode"]) for r in peers["rows"]] == [
        ("verispec", "target"), ("verispec", "adaptive"),
        ("vLLM", "target"), ("vLLM", "ngram"), ("vLLM", "draft model")]
    assert all(r["tokens"] == 6 for r in peers["rows"])
    assert [r["equal_to_verispec_target"] for r in peers["rows"]][:2] == [1, 1]
    # llama.cpp runs GGUF files and this target is a folder: a note, not a crash.
    assert any(n.startswith("llama.cpp skipped: llama.cpp runs GGUF files") for n in peers["notes"])
    markdown = (out / "report.md").read_text()
    assert "### Peers: other engines side by side" in markdown and f"| vLLM | draft model | {AUTO} |" in markdown
    assert "CPU flags" in markdown and "GB/s measured" in markdown


# -- the draft model as GGUF --------------------------------------------------------------------------------------


def test_rotary_to_pairs_interleaves_each_heads_halves():
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of 4: halves (0 1 | 2 3), (4 5 | 6 7)
    assert rotary_to_pairs(rows, heads=2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_draft_gguf_is_the_same_model(tmp_path, tiny_gguf):
    """transformers reads a GGUF back into rotate-half order: the logits must be the folder's, bit for bit."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama(3, hidden=32, layers=2)
    model.save_pretrained(tmp_path / "draft")
    out = write_draft_gguf(tmp_path / "draft", tiny_gguf, tmp_path / "draft.gguf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 2, 7]])  # [1, 5]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, back(ids).logits)  # [1, 5, vocab]
    assert back.config.vocab_size == VOCAB


# -- the real llama.cpp driver --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_llamacpp_driver_generates_exactly_the_tokens_asked():
    python = default_python("llama.cpp")
    if not python.is_file():
        pytest.skip(f"no llama.cpp virtualenv at {python} ({SETUP_SCRIPT} llama.cpp makes one)")
    from verispec.runtime.model.loading import smollm2_gguf_path

    gguf_file = smollm2_gguf_path()
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2]
    job = {"gguf": str(gguf_file), "k": 4, "threads": 1, "max_new_tokens": 12, "prompts": [prompt, prompt[:5]]}
    plain = run_driver("llama.cpp", str(python), {**job, "spec": "none"})
    lookup = run_driver("llama.cpp", str(python), {**job, "spec": "lookup"})
    for out in (plain, lookup):
        assert [r["tokens"] for r in out["rows"]] == [12, 12] and out["threads"] == 1
        assert out["weights_bytes"] == gguf_weights(gguf_file)[1]
