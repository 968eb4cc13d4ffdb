"""`verispec distill` end to end on a tiny target, its errors, and the exact offline acceptance evaluator."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import machine_reason, make_tokenizer, tiny_llama

from verispec.cli import main
from verispec.distill.evaluate import RoundStats, draft_matches, evaluate_draft, greedy_rounds
from verispec.runtime.model.loading import load_model

# --- the evaluator: hand-built cases ----------------------------------------------------------------------------


def test_identical_draft_commits_k_plus_one_per_round():
    stats = greedy_rounds([True] * 20, k=4)
    assert stats.rounds == 4
    assert stats.mean_accepted_length == 5.0
    assert stats.position_agreement == [1.0, 1.0, 1.0, 1.0]


def test_useless_draft_commits_one_per_round():
    stats = greedy_rounds([False] * 7, k=4)
    assert (stats.rounds, stats.committed) == (7, 7)
    assert stats.mean_accepted_length == 1.0
    assert stats.reached == [7, 0, 0, 0]
    assert stats.acceptance_rate == 0.0


def test_mixed_rounds_by_hand():
    # round 1 at 0: T T F -> accepts 2, commits 3 (position 2 is the recovered token)
    # round 2 at 3: F -> commits 1
    # round 3 at 4: T T T T -> accepts 4, commits 5 (bonus at position 8)
    # round 4 at 9: T, end of continuation -> commits the 1 token left
    match = [True, True, False, False, True, True, True, True, False, True]
    stats = greedy_rounds(match, k=4)
    assert stats.rounds == 4
    assert stats.committed == len(match)
    assert stats.mean_accepted_length == pytest.approx(10 / 4)
    assert stats.reached == [4, 2, 2, 1]
    assert stats.accepted == [3, 2, 1, 1]
    assert stats.position_agreement == pytest.approx([0.75, 1.0, 0.5, 1.0])


def test_merge_adds_counts():
    a, b = greedy_rounds([True] * 5, k=2), greedy_rounds([False] * 2, k=2)
    a.merge(b)
    assert isinstance(a, RoundStats)
    assert (a.rounds, a.committed) == (4, 7)


def test_draft_equal_to_target_matches_its_greedy_continuation():
    target = tiny_llama(seed=1)
    prompt = [5, 9, 11, 3]
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    continuation = out[0, len(prompt):].tolist()
    assert bool(draft_matches(target, prompt, continuation).all())
    result = evaluate_draft(target, [(prompt, continuation)], ["demo"], k=4)
    assert result["overall"].mean_accepted_length == pytest.approx(12 / 3)  # rounds of 5, 5, then the last 2
    assert result["_agreement"] == 1.0
    other = tiny_llama(seed=2)
    assert evaluate_draft(other, [(prompt, continuation)], ["demo"], k=4)["overall"].mean_accepted_length < 4


# --- the CLI on a tiny target -----------------------------------------------------------------------------------


@pytest.fixture
def tiny_setup(tmp_path):
    target_dir = tmp_path / "target"
    tiny_llama(seed=0).save_pretrained(target_dir)
    make_tokenizer().save_pretrained(target_dir)
    corpus = tmp_path / "prompts.txt"
    corpus.write_text("the cat sat on\nname a capital city\none two three\nParis is the capital of\n")
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n"
                                 for c, t in [("qa", "what is a dog"), ("writing", "write a line")]))
    return tmp_path, target_dir, corpus, eval_data


def _argv(tmp_path, target_dir, corpus, eval_data, steps):
    return ["distill", "--target", str(target_dir), "--out", str(tmp_path / "draft"), "--corpus", str(corpus),
            "--tokens", "40", "--max-new-tokens", "6", "--steps", str(steps), "--hidden-size", "16",
            "--layers", "1", "--intermediate-size", "32", "--heads", "2", "--kv-heads", "1", "--max-length", "64", "--train-length", "48",
            "--batch-tokens", "128", "--eval-data", str(eval_data), "--eval-prompts", "2", "--no-progress"]


def test_cli_distills_a_loadable_draft_and_resumes(tiny_setup, capsys):
    tmp_path, target_dir, corpus, eval_data = tiny_setup
    assert main(_argv(tmp_path, target_dir, corpus, eval_data, steps=3)) == 0
    out = tmp_path / "draft"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "distill_recipe.json"):
        assert (out / name).is_file(), name
    draft = load_model(out)
    assert draft.config.vocab_size == tiny_llama(seed=0).config.vocab_size
    assert draft.config.hidden_size == 16
    report = json.loads((out / "distill_recipe.json").read_text())
    assert report["settings"]["steps"] == 3
    assert report["settings"]["storage_dtype"] == "float16"
    assert "overall" in report["evaluation"]
    assert "mean accepted length" in capsys.readouterr().out
    work = tmp_path / "draft.work"
    assert torch.load(work / "checkpoint.pt", weights_only=False)["step"] == 3
    answers = sorted((work / "answers").iterdir())
    stamps = [p.stat().st_mtime_ns for p in answers]

    # Resuming with more steps continues from the checkpoint and reuses the teacher data.
    assert main(_argv(tmp_path, target_dir, corpus, eval_data, steps=5) + ["--resume"]) == 0
    assert torch.load(work / "checkpoint.pt", weights_only=False)["step"] == 5
    assert [p.stat().st_mtime_ns for p in sorted((work / "answers").iterdir())] == stamps
    assert json.loads((out / "distill_recipe.json").read_text())["settings"]["steps"] == 5

    # Without --resume an existing run is refused.
    with pytest.raises(SystemExit) as exc:
        main(_argv(tmp_path, target_dir, corpus, eval_data, steps=5))
    assert exc.value.code == 2
    assert "--resume" in capsys.readouterr().err


def test_cli_distills_a_head_that_drafts_and_resumes(tiny_setup, capsys):
    """`distill --head`: the same teacher stages, the target's features, a head written as a loadable drafter with
    its report (training figures, evaluation by depth for a chain and a tree), and a resumed run continuing."""
    from verispec.drafters.build import build_drafter
    from verispec.drafters.head import HeadDrafter

    tmp_path, target_dir, corpus, eval_data = tiny_setup
    argv = _argv(tmp_path, target_dir, corpus, eval_data, steps=3) + ["--head", "--head-vocab", "30",
                                                                      "--head-tree-nodes", "6"]
    assert main(argv) == 0
    out = tmp_path / "draft"
    report = json.loads((out / "head_recipe.json").read_text())
    assert report["head"]["draft_vocab"] == 30 and report["train"]["steps"] == 3
    evaluation = report["evaluation"]
    assert {"chain_k4", "tree_k6_n6"} <= set(evaluation)
    assert evaluation["chain_k4"]["identical_to_target"] == "2/2"
    assert evaluation["tree_k6_n6"]["identical_to_target"] == "2/2"
    assert "acceptance by depth" in capsys.readouterr().out
    assert isinstance(build_drafter(f"head:{out}", tiny_llama(seed=0), make_tokenizer(), 64).drafter, HeadDrafter)
    work = tmp_path / "draft.work"
    assert sorted(p.name for p in (work / "features").iterdir())
    assert main(argv[: argv.index("--steps") + 1] + ["5"] + argv[argv.index("--steps") + 2 :] + ["--resume"]) == 0
    assert torch.load(work / "head.pt", weights_only=False)["step"] == 5


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason=machine_reason("needs a CUDA device"))


@pytest.mark.cuda
@CUDA
def test_cli_distills_on_a_gpu(tiny_setup):
    """--device cuda: the teacher's answers by HF generation on the GPU, training there; the draft comes back."""
    tmp_path, target_dir, corpus, eval_data = tiny_setup
    assert main(_argv(tmp_path, target_dir, corpus, eval_data, steps=3) + ["--device", "cuda"]) == 0
    assert json.loads((tmp_path / "draft" / "distill_recipe.json").read_text())["device"] == "cuda"
    assert load_model(tmp_path / "draft").config.hidden_size == 16


def test_hf_teacher_answers_equal_the_engines(tiny_setup):
    """The answers a GPU's teacher writes (HF generation, `generate_batch`) are the engine's (`engine_answers`, the
    CPU's): the same greedy tokens and top-k, so a draft distilled on either device learns the same data."""
    from verispec.distill.evaluate import _eos_ids
    from verispec.distill.teacher import engine_answers, generate_batch
    from verispec.engine import SpeculativeEngine

    _, target_dir, _, _ = tiny_setup
    target = load_model(target_dir, dtype=torch.float32)
    prompts = [[5, 9, 13, 2 + i, 40 - i] for i in range(3)] + [[7, 7]]
    tokenizer = make_tokenizer()
    eos = _eos_ids(target, tokenizer)
    hf = generate_batch(target, prompts, 8, eos_ids=eos, pad_id=min(eos), topk=3)
    engine = SpeculativeEngine(target, tokenizer, None, max_len=64, max_batch_size=4)
    ours = engine_answers(engine, prompts, 8, topk=3)
    for (ids, top, lp), (ids2, top2, lp2) in zip(hf, ours):
        assert ids.tolist() == ids2.tolist()
        assert top[:, 0].tolist() == top2[:, 0].tolist()
        assert torch.allclose(lp.float(), lp2.float(), atol=1e-2)


def test_cli_device_it_lacks_exits_2(tiny_setup, capsys):
    tmp_path, target_dir, corpus, eval_data = tiny_setup
    with pytest.raises(SystemExit) as exc:
        main(_argv(tmp_path, target_dir, corpus, eval_data, steps=1) + ["--device", "nodevice"])
    assert exc.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_cli_missing_target_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["distill", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path / "d"), "--no-progress"])
    assert exc.value.code == 2
    assert "nowhere" in capsys.readouterr().err


def test_cli_zero_steps_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["distill", "--out", str(tmp_path / "d"), "--steps", "0"])
    assert exc.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_cli_bad_shape_exits_2(tiny_setup, capsys):
    tmp_path, target_dir, corpus, eval_data = tiny_setup
    with pytest.raises(SystemExit) as exc:
        main(["distill", "--target", str(target_dir), "--out", str(tmp_path / "d"), "--hidden-size", "30",
              "--heads", "4"])
    assert exc.value.code == 2
    assert "divisible" in capsys.readouterr().err


# --- sampled softmax ------------------------------------------------------------------------------------------


def test_sampled_softmax_with_every_negative_equals_the_full_softmax():
    from verispec.distill.teacher import Sample
    from verispec.distill.train import OutputVocab, collate, draft_loss

    draft = tiny_llama(seed=3)
    vocab = draft.config.vocab_size
    torch.manual_seed(0)
    samples = [Sample("x", torch.randint(0, 20, (6,), dtype=torch.int32), torch.randint(0, 20, (5,), dtype=torch.int32),
                      torch.randint(0, 20, (5, 3), dtype=torch.int32), torch.randn(5, 3).half()) for _ in range(3)]
    batch = collate(samples, max_length=32, pad_id=2)
    full, n, _ = draft_loss(draft, *batch, kd_weight=0.5)
    every = OutputVocab(samples, vocab, negatives=vocab)  # all inactive tokens drawn: correction log(1) = 0
    assert len(every.active) <= 20
    sampled, n2, _ = draft_loss(draft, *batch, kd_weight=0.5, step_vocab=every.draw(torch.Generator().manual_seed(0)))
    assert n == n2
    torch.testing.assert_close(sampled, full)
    some = OutputVocab(samples, vocab, negatives=8)
    ids, correction, index = some.draw(torch.Generator().manual_seed(1))
    assert len(ids) == len(some.active) + 8 and bool((index[ids] == torch.arange(len(ids))).all())
    assert torch.isfinite(draft_loss(draft, *batch, kd_weight=0.5, step_vocab=(ids, correction, index))[0])


def test_copy_batch_labels_repeat_the_span():
    from verispec.distill.copying import copy_batch
    from verispec.distill.teacher import Sample

    torch.manual_seed(0)
    samples = [Sample("x", torch.arange(100, 160, dtype=torch.int32), torch.arange(200, 240, dtype=torch.int32),
                      torch.zeros(40, 2, dtype=torch.int32), torch.zeros(40, 2).half()) for _ in range(2)]
    ids, mask, labels = copy_batch(samples, rows=4, generator=torch.Generator().manual_seed(0), pad_id=2)
    assert ids.shape[0] == 4 and len(labels) == int(mask.sum())
    for row in range(4):
        predicting = mask[row].nonzero().squeeze(1)
        start = int(predicting[0])  # the second span starts here; its first token is not predicted
        span = ids[row, start: int(predicting[-1]) + 2]
        seq = ids[row].tolist()
        first = [i for i in range(start) if seq[i: i + len(span)] == span.tolist()]
        assert first, "the second span repeats an earlier one"


def test_copy_loss_sampled_softmax_with_every_negative_equals_the_full_softmax():
    from verispec.distill.copying import copy_batch
    from verispec.distill.teacher import Sample
    from verispec.distill.train import OutputVocab, copy_loss

    draft = tiny_llama(seed=3)
    samples = [Sample("x", torch.arange(10, 40, dtype=torch.int32), torch.arange(20, 45, dtype=torch.int32),
                      torch.zeros(25, 2, dtype=torch.int32), torch.zeros(25, 2).half()) for _ in range(2)]
    batch = copy_batch(samples, rows=3, generator=torch.Generator().manual_seed(0), pad_id=2, min_span=4, max_span=8)
    every = OutputVocab(samples, draft.config.vocab_size, negatives=draft.config.vocab_size)
    sampled = copy_loss(draft, *batch, step_vocab=every.draw(torch.Generator().manual_seed(0)))
    torch.testing.assert_close(sampled, copy_loss(draft, *batch))
