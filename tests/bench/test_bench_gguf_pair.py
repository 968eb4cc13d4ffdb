"""A GGUF target and a GGUF draft in `verispec bench`: the bandwidth floor read from the target's GGUF header, and
the peers on the same two files (llama.cpp drafts with the draft's GGUF file as it is; vLLM says in the table why it
has no row). The peers are the fake peer python of test_bench_peers.py: no engine needs to be installed."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from test_bench_peers import PROMPTS, config_for, fake_peer, fake_run, jobs  # noqa: F401 (fixture)
from verispec.bench.benchmark import BenchConfig, step_weight_bytes
from verispec.bench.machine import decode_floor, floor_line, gguf_step_bytes
from verispec.bench.peer_models import VLLM_GGUF
from verispec.bench.peers import peer_table, run_peers


def write_gguf(path, head: bool) -> None:
    """A small Qwen2-shaped GGUF: an F32 [64, 16] embedding (4096 B), an F16 layer weight [16, 16] (512 B), an F32
    norm (64 B), and with `head` a separate F16 LM head [64, 16] (2048 B)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(64)])
    writer.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((16, 16), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    if head:
        writer.add_tensor("output.weight", np.ones((64, 16), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """A GGUF target with its own LM head, a tied one, and a GGUF 'draft' file."""
    root = tmp_path_factory.mktemp("gguf-pair")
    write_gguf(root / "target.gguf", head=True)
    write_gguf(root / "tied.gguf", head=False)
    shutil.copy(root / "tied.gguf", root / "draft.gguf")
    return {"target": root / "target.gguf", "tied": root / "tied.gguf", "draft": root / "draft.gguf"}


# -- the floor ----------------------------------------------------------------------------------------------------


def test_step_bytes_leave_out_the_embedding_unless_the_head_is_tied_to_it(pair):
    step, how = gguf_step_bytes(pair["target"])
    assert step == 512 + 64 + 2048  # layer, norm, head: a step reads one row of the embedding, not 4096 bytes
    assert how.startswith("the GGUF file's tensors as stored but the token embedding")
    tied, how = gguf_step_bytes(pair["tied"])
    assert tied == 4096 + 512 + 64 and "tied LM head" in how  # the head reads the whole table


def test_the_floor_of_a_gguf_target_comes_from_its_header(pair):
    config = BenchConfig(target=str(pair["target"]), draft=None, weights="gguf")
    assert step_weight_bytes(config, target=None) == gguf_step_bytes(pair["target"])
    # 2624 bytes at 0.001 GB/s: 2.624 ms a step, a ceiling of 381.1 tok/s; measured 10 tokens in 0.1 s
    floor = decode_floor(2624, 0.001, tokens=10, seconds=0.1, weights="as stored")
    assert floor["floor_ms_per_token"] == pytest.approx(2.624) and floor["ceiling_tokens_per_s"] == 381.1
    assert floor["target_ms_per_token"] == 10.0 and floor["target_tokens_per_s"] == 100.0
    assert floor["x_floor"] == pytest.approx(10 / 2.624, abs=0.01)
    line = floor_line(floor)
    assert "a ceiling of 381.1 tok/s against 100 tok/s measured" in line and "per step: as stored" in line


# -- the peers on the same two files ------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["{draft}", "ngram+{draft}", "{folder}"])
def test_llamacpp_drafts_with_the_gguf_draft_file_as_it_is(fake_peer, pair, tmp_path, monkeypatch, drafter):
    """A GGUF draft (alone, as a cascade's model stage, or the one .gguf of a folder) goes to llama.cpp's draft-model
    mode untouched: nothing is converted."""
    from verispec.bench import gguf_draft

    def convert(*args, **kwargs):
        raise AssertionError("a GGUF draft was converted")

    monkeypatch.setattr(gguf_draft, "cached_draft_gguf", convert)
    folder = tmp_path / "draft-folder"
    folder.mkdir()
    shutil.copy(pair["draft"], folder / "model.gguf")
    draft_file = folder / "model.gguf" if drafter == "{folder}" else pair["draft"]
    script, log = fake_peer
    config = config_for({"llama.cpp": str(script)}, pair["target"],
                        draft=drafter.format(draft=pair["draft"], folder=folder))
    section = run_peers(config, "float32", PROMPTS, fake_run(), log=lambda line: None)
    sent = {j["spec"]: j for j in jobs(log)}
    assert list(sent) == ["none", "lookup", "draft"]
    assert sent["draft"]["draft_gguf"] == str(draft_file) and sent["draft"]["gguf"] == str(pair["target"])
    assert {j["weights_bytes"] for j in sent.values()} == {gguf_step_bytes(pair["target"])[0]}
    modes = [r["mode"] for r in section["rows"] if r["engine"] == "llama.cpp"]
    assert modes == ["target", "prompt lookup", "draft model"] and not section["not_run"]


def test_vllm_says_in_the_table_why_it_does_not_run_a_gguf_target(fake_peer, pair, tmp_path):
    script, log = fake_peer
    config = config_for({"vllm": str(script)}, pair["target"], draft=str(pair["draft"]))
    section = run_peers(config, "float32", PROMPTS, fake_run(), log=lambda line: None)
    assert not jobs(log) and [r["engine"] for r in section["rows"]] == ["verispec", "verispec"]
    assert section["not_run"] == [{"engine": "vLLM", "reason": section["not_run"][0]["reason"]}]
    assert VLLM_GGUF in section["not_run"][0]["reason"]
    table = "\n".join(peer_table(section))
    assert f"| vLLM | - | - | - | - | - | - | not run: vLLM runs Hugging Face folders here" in table
    assert section["ratios"] == []  # a row that did not run is no one's best mode
    # without vLLM's virtualenv the row still gives the reason that holds on any machine
    config = config_for({"vllm": str(tmp_path / "no-venv" / "python")}, pair["target"])
    section = run_peers(config, "float32", PROMPTS, fake_run(), log=lambda line: None)
    assert VLLM_GGUF in section["not_run"][0]["reason"]
