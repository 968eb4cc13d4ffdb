"""`verispec distill teacher` on a tiny target: its answers are the engine's target-alone greedy tokens, a killed
run resumes to the same bytes, a seed names the data, and bad input exits 2."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tokenizer, tiny_llama

from verispec.cli import main
from verispec.config import SamplingParams
from verispec.distill import conversations, shards
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.loading import load_model

# Short texts in the tiny tokenizer's alphabet: the material that summarisation, retrieval and code prompts quote.
DOCS = ["the river runs past the old mill. people come to see the wheel turn in spring. " * 2,
        "a small town holds a fair each year, with music, food and a race for children. " * 2]
FUNCTIONS = ["def add(a, b):\n    total = a + b\n    return total\n"]


@pytest.fixture(autouse=True)
def small_material(monkeypatch):
    """The conversations quote these texts instead of the stdlib's (a few seconds to parse, and mostly characters
    the tiny tokenizer lacks)."""
    monkeypatch.setattr(conversations, "_local_material", lambda seed: conversations.Material(DOCS, FUNCTIONS))


@pytest.fixture
def target_dir(tmp_path):
    folder = tmp_path / "target"
    tiny_llama(seed=0).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def teacher(target_dir, out, *extra):
    return main(["distill", "teacher", "--target", str(target_dir), "--out", str(out), "--max-new-tokens", "6",
                 "--max-len", "400", "--shard-conversations", "6", "--batch-size", "4", "--no-progress", *extra])


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.vst"))}


def target_alone(model_dir_or_model, samples, max_new_tokens=6):
    """Each sample's prompt through the engine's target alone, one at a time: the greedy tokens."""
    model = load_model(model_dir_or_model) if not isinstance(model_dir_or_model, torch.nn.Module) else \
        model_dir_or_model
    engine = SpeculativeEngine(model, make_tokenizer(), None, max_len=512, max_batch_size=1)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [engine.generate(s.prompt_ids.tolist(), params, use_drafter=False).token_ids for s in samples]


def test_teacher_answers_equal_the_engines_target_alone(target_dir, tmp_path):
    """Batched (4 rows, continuous, prefix cache) answers = the target alone at batch 1, token for token; the
    negative control: another model's greedy tokens differ, so the comparison can fail."""
    out = tmp_path / "data"
    assert teacher(target_dir, out, "--tokens", "60") == 0
    samples = shards.read_shards(out)
    assert len(samples) >= 6 and any(s.turn > 0 for s in samples)  # multi-turn conversations answered
    assert [s.answer_ids.tolist() for s in samples] == target_alone(target_dir, samples)
    other = target_alone(tiny_llama(seed=1), samples)
    assert sum(a != s.answer_ids.tolist() for a, s in zip(other, samples)) > len(samples) // 2


@pytest.mark.parametrize("drafter", ["suffix", "ngram"])
def test_speculating_teacher_writes_the_same_bytes(target_dir, tmp_path, drafter):
    """Speculation (adaptive K) changes the speed only: greedy verification keeps every answer the target's."""
    assert teacher(target_dir, tmp_path / "alone", "--tokens", "60") == 0
    assert teacher(target_dir, tmp_path / "spec", "--tokens", "60", "--draft-model", drafter) == 0
    assert shard_bytes(tmp_path / "spec") == shard_bytes(tmp_path / "alone")
    run = json.loads((tmp_path / "spec" / "manifest.json").read_text())["runs"][0]
    assert run["drafter"] == drafter and run["draft_tokens"] > 0  # it drafted
    alone = json.loads((tmp_path / "alone" / "manifest.json").read_text())["runs"][0]
    assert alone["draft_tokens"] == 0 and alone["prefix_cached_tokens"] >= 0


def test_killed_run_resumes_to_the_same_bytes(target_dir, tmp_path, monkeypatch):
    """One run straight through vs one extended from a smaller budget, killed between a shard's write and the
    manifest's (a partial temporary file left behind), and resumed at another batch size: the same shards."""
    straight = tmp_path / "straight"
    assert teacher(target_dir, straight, "--tokens", "120") == 0
    expected = shard_bytes(straight)
    assert len(expected) >= 3
    manifest = json.loads((straight / "manifest.json").read_text())
    assert manifest["totals"]["answer_tokens"] >= 120 and manifest["runs"][0]["tokens_per_s"] > 0

    resumed = tmp_path / "resumed"
    assert teacher(target_dir, resumed, "--tokens", "1") == 0  # one shard
    assert shard_bytes(resumed) == {k: v for k, v in expected.items() if k == "shard-00000.vst"}

    real_write = shards.write_manifest
    calls = []

    def killed_after_a_shard(folder, data):
        calls.append(1)
        if len(calls) == 2:  # the manifest at start, then the kill before shard 1's entry
            (folder / "shard-00002.vst.tmp").write_bytes(b"VSTEACH1 half a shard")
            raise KeyboardInterrupt
        real_write(folder, data)

    monkeypatch.setattr(shards, "write_manifest", killed_after_a_shard)
    assert teacher(target_dir, resumed, "--tokens", "120") == 130  # the CLI's exit status for an interrupt
    listed = json.loads((resumed / "manifest.json").read_text())["shards"]
    assert [e["file"] for e in listed] == ["shard-00000.vst"]
    assert (resumed / "shard-00001.vst").is_file()  # written, not yet listed
    monkeypatch.setattr(shards, "write_manifest", real_write)

    assert teacher(target_dir, resumed, "--tokens", "120", "--batch-size", "2") == 0
    assert shard_bytes(resumed) == expected
    assert not list(resumed.glob("*.tmp"))
    again = json.loads((resumed / "manifest.json").read_text())
    assert [e["sha256"] for e in again["shards"]] == [e["sha256"] for e in manifest["shards"]]
    assert [run["first_shard"] for run in again["runs"]] == [0, 2]  # the killed run's record died with it
    assert again["runs"][-1]["batch_size"] == 2 and again["runs"][-1]["shards"] == 1


def test_a_seed_names_the_data(target_dir, tmp_path):
    assert teacher(target_dir, tmp_path / "a", "--tokens", "1") == 0
    assert teacher(target_dir, tmp_path / "b", "--tokens", "1", "--batch-size", "1") == 0
    assert teacher(target_dir, tmp_path / "c", "--tokens", "1", "--seed", "1") == 0
    a, b, c = (shard_bytes(tmp_path / name) for name in "abc")
    assert a == b
    assert a != c
    first = [s.prompt_ids.tolist() for s in shards.read_shards(tmp_path / "a")]
    assert first != [s.prompt_ids.tolist() for s in shards.read_shards(tmp_path / "c")]


def test_resume_with_other_settings_exits_2(target_dir, tmp_path, capsys):
    out = tmp_path / "data"
    assert teacher(target_dir, out, "--tokens", "1") == 0
    with pytest.raises(SystemExit) as exc:
        teacher(target_dir, out, "--tokens", "100", "--seed", "3")
    assert exc.value.code == 2
    assert "seed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # the KV cache's entries decide the answers too
        teacher(target_dir, out, "--tokens", "100", "--kv-cache-dtype", "float16")
    assert exc.value.code == 2
    assert "kv_cache_dtype" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "--tokens"),
    (["--max-len", "6"], "max-len 6 must exceed max-new-tokens 6"),
    (["--prefix-cache-tokens", "-1"], "--prefix-cache-tokens"),
])
def test_bad_input_exits_2(target_dir, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        teacher(target_dir, tmp_path / "data", *args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_that_is_a_file_or_missing_target_exits_2(target_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        teacher(target_dir, tmp_path / "file")
    assert exc.value.code == 2 and "is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        teacher(tmp_path / "nowhere", tmp_path / "data")
    assert exc.value.code == 2 and "nowhere" in capsys.readouterr().err


def test_teacher_forced_prefill_gives_back_the_answers(target_dir, tmp_path):
    """The loss's top-k, recomputed by one batched teacher-forced prefill over prompt + answer: its top-1 at every
    answer position is the stored greedy token (rows of different lengths padded together); the negative control,
    another model's prefill over the same data, mostly disagrees."""
    from verispec.distill.teacher_forced import to_samples

    out = tmp_path / "data"
    assert teacher(target_dir, out, "--tokens", "40") == 0
    samples = shards.read_shards(out)
    model = load_model(target_dir)
    converted = to_samples(model, samples, k=3, batch_size=3)
    assert len({len(s.prompt_ids) + len(s.answer_ids) for s in samples}) > 1  # ragged batches
    for s, c in zip(samples, converted):
        assert c.response_ids.tolist() == s.answer_ids.tolist() and c.topk_ids.shape == (len(s.answer_ids), 3)
        assert c.topk_ids[:, 0].tolist() == s.answer_ids.tolist()
        assert bool((c.topk_logprobs <= 0).all()) and bool((c.topk_logprobs[:, :-1] >= c.topk_logprobs[:, 1:]).all())
    wrong = to_samples(tiny_llama(seed=1), samples, k=1, batch_size=3)  # another target: not its answers
    agree = sum(int((c.topk_ids[:, 0] == torch.as_tensor(s.answer_ids)).sum()) for s, c in zip(samples, wrong))
    assert agree < sum(len(s.answer_ids) for s in samples) // 2


def _distill_shards(target_dir, data, tmp_path, *extra):
    return main(["distill", "--target", str(target_dir), "--shards", str(data), "--out", str(tmp_path / "draft"),
                 "--steps", "4", "--checkpoint-every", "2", "--hidden-size", "32", "--layers", "1",
                 "--intermediate-size", "64", "--heads", "2", "--kv-heads", "1", "--draft-vocab", "40",
                 "--batch-tokens", "512", "--train-length", "400", "--heldout-fraction", "0.3", "--eval-prompts", "0",
                 "--no-train-bf16", "--no-progress", *extra])


def test_distill_on_shards_trains_a_reduced_head_draft_with_a_curve_and_resumes(target_dir, tmp_path, capsys):
    """`verispec distill --shards`: the top-k pass runs once into the work folder (a resumed run reads it back), the
    exported draft lists its draft vocabulary, the curve has a point per checkpoint, and a bad folder exits 2."""
    data = tmp_path / "data"
    assert teacher(target_dir, data, "--tokens", "60") == 0
    assert _distill_shards(target_dir, data, tmp_path, "--kd-weight", "0.5") == 0
    out, work = tmp_path / "draft", tmp_path / "draft.work"
    draft = load_model(out)
    vocab = draft.config.draft_vocab
    assert vocab == sorted(vocab) and len(vocab) == 40 and make_tokenizer().eos_token_id in vocab
    curve = json.loads((out / "curve.json").read_text())
    assert [p["step"] for p in curve] == [2, 4] and all(1.0 <= p["accepted_length_k4"] <= 5.0 for p in curve)
    report = json.loads((out / "distill_recipe.json").read_text())
    assert report["teacher_data"]["heldout"]["samples"] > 0 and report["teacher_data"]["topk_pass"]["tokens"] > 0
    caches = sorted((work / "topk").iterdir())
    stamps = [p.stat().st_mtime_ns for p in caches]
    assert len(caches) == len(shards.read_manifest(data)["shards"])
    assert _distill_shards(target_dir, data, tmp_path, "--kd-weight", "0.5", "--steps", "6", "--resume") == 0
    assert [p.stat().st_mtime_ns for p in sorted((work / "topk").iterdir())] == stamps  # computed once
    assert [p["step"] for p in json.loads((out / "curve.json").read_text())] == [2, 4, 6]
    assert "topk_pass" not in json.loads((out / "distill_recipe.json").read_text())["teacher_data"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        _distill_shards(target_dir, tmp_path / "nowhere", tmp_path)
    assert exc.value.code == 2 and "no teacher shards" in capsys.readouterr().err
