"""The draft head trained on teacher shards (distill/head_shards.py, head_pipeline.run_head_shards): the features cache
against a direct forward, the held-apart split against the draft model's path, the accepted-length metric by hand,
and a run that resumes after a kill to the same weights."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import CORPUS, tiny_llama

from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig, cache_len
from verispec.distill import head_pipeline, head_shards, pipeline, shard_data
from verispec.distill.head import HeadNet
from verispec.distill.head_shards import heldout_head_metrics, load_shard_features
from verispec.distill.recipe import DistillRecipe
from verispec.distill.shard_data import held_apart
from verispec.distill.shards import TeacherSample, encode_shard, read_shard, sha256, write_manifest
from verispec.drafters.head import HeadDrafter, load_head
from verispec.engine import SpeculativeEngine
from verispec.runtime.runners.select import make_runner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shard_dir(trained_pair, tokenizer, model_dirs, tmp_path_factory):
    """Two shards of the tiny target's greedy answers: 24 conversations of one or two turns (a second turn's prompt
    holds the first answer), as `verispec distill teacher` writes them."""
    target, _ = trained_pair
    ids = tokenizer(CORPUS)["input_ids"]
    folder = tmp_path_factory.mktemp("shards")
    entries = []
    with torch.no_grad():
        for shard in range(2):
            samples = []
            for c in range(12 * shard, 12 * shard + 12):
                prompt = ids[5 * c: 5 * c + 10]
                for turn in range(1 + c % 2):
                    answer = target.generate(torch.tensor([prompt]), max_new_tokens=12 + c % 5,
                                             do_sample=False)[0, len(prompt):].tolist()
                    samples.append(TeacherSample(c, turn, "corpus", np.array(prompt), np.array(answer), "length"))
                    prompt = prompt + answer + ids[c: c + 3]
            data = encode_shard(samples, len(tokenizer))
            name = f"shard-{shard:05d}.vst"
            (folder / name).write_bytes(data)
            entries.append({"file": name, "samples": len(samples), "sha256": sha256(data),
                            "answer_tokens": sum(len(s.answer_ids) for s in samples),
                            "prompt_tokens": sum(len(s.prompt_ids) for s in samples)})
    write_manifest(folder, {"identity": {"target": str(model_dirs["target"]), "weights": "fp32",
                                         "activations": "fp32", "dtype": "float32"}, "shards": entries})
    return folder


def one_row_features(target, sample) -> torch.Tensor:
    """The target's features of one sample, alone in its own forward."""
    ids = torch.cat([torch.as_tensor(sample.prompt_ids), torch.as_tensor(sample.answer_ids)]).long()[None]
    runner = make_runner(target, cache_len(ids.shape[1]), 1, RunnerOptions())
    with torch.inference_mode():
        return runner.forward(ids, all_hidden=True).hidden[0].to(torch.float16)


def test_features_cache_equals_a_direct_forward(trained_pair, shard_dir, model_dirs, tmp_path, monkeypatch):
    """Each cached answer's features (computed with its neighbours, right-padded in one batch) are bit for bit its
    own one-row forward's; a second load reads the cache and never loads the target."""
    target, _ = trained_pair
    loads = []
    monkeypatch.setattr(head_shards, "_teacher", lambda name, ident: loads.append(name) or (target, RunnerOptions()))
    features, summary = load_shard_features([shard_dir], str(model_dirs["target"]), tmp_path, progress=False,
                                            log=lambda *_: None)
    rows = [s for f in sorted(shard_dir.glob("*.vst")) for s in read_shard(f)]
    assert len(features) == len(rows) and len(loads) == 1
    assert all(torch.equal(f, one_row_features(target, s)) for f, s in zip(features, rows))  # bitwise
    assert summary["bytes"] == sum(p.stat().st_size for p in tmp_path.glob("*-features.pt"))
    # Cached: a second load reads the files back and never loads the target.
    again, _ = load_shard_features([shard_dir], str(model_dirs["target"]), tmp_path, progress=False,
                                   log=lambda *_: None)
    assert len(loads) == 1 and all(torch.equal(a, b) for a, b in zip(features, again))
    # Negative control: the check sees another target's features (same shape).
    other = tiny_llama(13, hidden=64, layers=2)
    assert not torch.equal(features[0], one_row_features(other, rows[0]))


def recipe_for(shard_dir, model_dirs, head: bool, steps: int = 6) -> DistillRecipe:
    """A tiny run on the shards: a head, or a draft model, checkpointing every 2 steps, a quarter held apart."""
    return DistillRecipe(target=str(model_dirs["target"]), shards=[str(shard_dir)], heldout_fraction=0.25,
                         head=head, head_vocab=40, head_unroll=2, draft_vocab=0 if head else 40, steps=steps,
                         checkpoint_every=2, lr=3e-3, batch_tokens=96, train_length=48, max_new_tokens=20,
                         kd_weight=0.0, copy_weight=0.0, hidden_size=32, num_layers=1, intermediate_size=64,
                         num_heads=2, num_kv_heads=1, train_bf16=False, eval_prompts=0)


class Stop(Exception):
    pass


def test_held_apart_split_equals_the_draft_models(shard_dir, model_dirs, tmp_path, monkeypatch):
    """Both paths score the same held-apart answers: those of the conversations `held_apart` picks, and the head's
    features are those answers' own."""
    seen = {}

    def draft_train(draft, samples, settings, pad_id, checkpoint, resume, heldout=None, **_):
        seen["draft"] = heldout
        raise Stop

    def head_metrics(net, samples, features, k=4):
        seen["head"], seen["features"] = samples, features
        raise Stop

    monkeypatch.setattr(pipeline, "train", draft_train)
    monkeypatch.setattr(head_pipeline, "heldout_head_metrics", head_metrics)
    for head_ in (False, True):
        with pytest.raises(Stop):
            pipeline.run_distill(recipe_for(shard_dir, model_dirs, head_), tmp_path / f"out{head_}",
                                 tmp_path / f"work{head_}", progress=False, log=lambda *_: None)
    rows = [s for f in sorted(shard_dir.glob("*.vst")) for s in read_shard(f)]
    expected = [(s.prompt_ids.tolist(), s.answer_ids.tolist()) for s in rows if held_apart(s.conversation, 0.25)]
    as_lists = lambda samples: [(s.prompt_ids.tolist(), s.response_ids.tolist()) for s in samples]  # noqa: E731
    assert 0 < len(expected) < len(rows)
    assert as_lists(seen["draft"]) == as_lists(seen["head"]) == expected
    assert [len(f) for f in seen["features"]] == [len(p) + len(a) for p, a in expected]


def _head_run(shard_dir, model_dirs, tmp_path, monkeypatch, name: str, steps: int = 6, kill_at: int | None = None,
              resume: bool = False):
    """A tiny head run on the shards (checkpoints every 2 steps); `kill_at`: it dies right after that checkpoint.
    -> (the exported weights, the report) or None when killed."""
    write_curve = shard_data.write_curve

    def checkpointed(folder, curve):
        write_curve(folder, curve)
        if curve[-1]["step"] == kill_at:
            raise Stop

    monkeypatch.setattr(head_pipeline, "write_curve", checkpointed)
    try:
        report = pipeline.run_distill(recipe_for(shard_dir, model_dirs, True, steps), tmp_path / name,
                                      tmp_path / f"{name}.work", resume=resume, progress=False, log=lambda *_: None)
    except Stop:
        return None
    return load_head(tmp_path / name)[1], report


def test_head_on_shards_is_deterministic_and_resumes_to_the_same_weights(shard_dir, model_dirs, tmp_path,
                                                                          monkeypatch):
    whole, report = _head_run(shard_dir, model_dirs, tmp_path, monkeypatch, "a")
    again, _ = _head_run(shard_dir, model_dirs, tmp_path, monkeypatch, "b")
    same = lambda x, y: all(torch.equal(x[k], y[k]) for k in x)  # noqa: E731
    assert same(whole, again)
    curve = report["train"]["curve"]
    assert [p["step"] for p in curve] == [2, 4, 6]
    assert all(1.0 <= p["accepted_length_k4"] <= 5.0 and 0.0 <= p["agreement"] <= 1.0 for p in curve)
    assert (tmp_path / "a" / "curve.json").is_file() and report["features"]["bytes"] > 0
    assert _head_run(shard_dir, model_dirs, tmp_path, monkeypatch, "c", kill_at=4) is None
    killed = torch.load(tmp_path / "c.work" / "head.pt", weights_only=False)
    assert (killed["step"], killed["epoch"], killed["done"]) == (4, 0, 4)  # mid-epoch: the replay matters
    resumed, resumed_report = _head_run(shard_dir, model_dirs, tmp_path, monkeypatch, "c", resume=True)
    assert same(whole, resumed)
    held = ["step", "loss", "agreement", "accepted_length_k4"]
    assert [[p[k] for k in held] for p in resumed_report["train"]["curve"]] == [[p[k] for k in held] for p in curve]
    # Negative controls: a resume that replays its epoch from the first batch, and another schedule, differ.
    del killed["done"]
    torch.save(killed, tmp_path / "c.work" / "head.pt")
    replayed, _ = _head_run(shard_dir, model_dirs, tmp_path, monkeypatch, "c", resume=True)
    assert not same(whole, replayed)
    other, _ = _head_run(shard_dir, model_dirs, tmp_path, monkeypatch, "d", steps=4)
    assert not same(whole, other)


def test_accepted_length_by_hand():
    """A stand-in head whose draft at each (unroll step, position) is chosen: prompt of 3 tokens, answer of 5. Step s
    at position P + a - 2 + s drafts answer token a + s; the chains accepted from each first draft token a are
    counted by hand."""
    answer = [5, 6, 7, 8, 9]
    k, n, p = 4, len(answer), 3
    hits = [[1, 1, 0, 1, 1],  # step 0 (first draft token) right at answer tokens 0, 1, 3, 4
            [1, 1, 1, 0],  # step 1 right when drafting answer tokens 1, 2, 3 (from first tokens a = 0, 1, 2)
            [1, 0, 1],  # step 2: from a = 0 and a = 2
            [1, 1]]  # step 3: from a = 0, 1
    vocab = 12
    outputs = torch.zeros(k, 1, p + n - 1, vocab)  # one-hot drafts [steps, 1, T, V']
    for s, row in enumerate(hits):
        for a, hit in enumerate(row):
            token = answer[a + s] if hit else 0
            outputs[s, 0, p + a - 2 + s, token] = 1.0
    net = SimpleNamespace(training=False, eval=lambda: None, train=lambda: None, embed=torch.zeros(vocab, 1),
                          vocab=torch.arange(vocab), lm=torch.eye(vocab), config=SimpleNamespace(hidden_size=vocab),
                          unrolled=lambda tokens, feats, steps: [outputs[s] for s in range(steps)])
    sample = SimpleNamespace(prompt_ids=torch.tensor([1, 2, 3]), response_ids=torch.tensor(answer))
    got = heldout_head_metrics(net, [sample], [torch.zeros(p + n, vocab)], k)
    # From a = 0: steps 0, 1, 2, 3 hit -> 4 accepted; a = 1: step 0, 1 hit, step 2 misses -> 2; a = 2: step 0 misses
    # -> 0; a = 3: step 0 hits, step 1 misses -> 1; a = 4: step 0 hits, then the answer ends -> 1.
    assert got["accepted_length_k4"] == pytest.approx(sum(1 + r for r in [4, 2, 0, 1, 1]) / n)
    assert got["agreement"] == pytest.approx(4 / 5) and got["tokens"] == n
    miss = float(torch.log_softmax(torch.eye(vocab)[0], -1)[answer[2]])  # the miss drafted token 0
    hit = float(torch.log_softmax(torch.eye(vocab)[0], -1)[0])
    assert got["loss"] == pytest.approx(-(4 * hit + miss) / n)
    # Negative control: the same hits without the unrolled steps (every step counted as the first) count more.
    flat = SimpleNamespace(**{**vars(net), "unrolled": lambda tokens, feats, steps: [outputs[0]] * steps})
    assert heldout_head_metrics(flat, [sample], [torch.zeros(p + n, vocab)], k)["accepted_length_k4"] != \
        got["accepted_length_k4"]


def test_accepted_length_is_the_engines(trained_pair, tokenizer, trained_head):
    """The metric's accepted draft tokens from each first draft token, read at the rounds the engine really ran
    (greedy chains of 4 with the same head on the same target), are the tokens each round accepted; the
    teacher-forced proxy (no unrolled chain) is not."""
    target, _ = trained_pair
    config, weights = load_head(trained_head)
    net = HeadNet(config, target, weights["vocab"].long())
    net.load_export(weights)
    drafter = HeadDrafter(config, weights, target, 300)
    engine = SpeculativeEngine(target, tokenizer, drafter, max_len=256, max_batch_size=1,
                               spec=SpeculativeConfig(num_draft_tokens=4))
    ids = tokenizer(CORPUS)["input_ids"]
    unrolled = net.unrolled
    teacher_forced = SimpleNamespace(**{**{k: getattr(net, k) for k in ("embed", "vocab", "lm", "config")},
                                        "training": False, "eval": lambda: None, "train": lambda: None,
                                        "unrolled": lambda t, f, steps: unrolled(t, f, 1) * steps})
    compared = accepted_total = differ = 0
    for start in (3, 40, 77):
        prompt = ids[start: start + 12]
        origins, answer = [], []
        for chunk in engine.generate_iter(prompt, SamplingParams(max_new_tokens=40)):
            origins += chunk.origins
            answer += chunk.token_ids
        sample = SimpleNamespace(prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(answer), answer_ids=answer)
        runs, proxy = {}, {}
        heldout_head_metrics(net, [sample], [one_row_features(target, sample)], 4, runs=runs)
        heldout_head_metrics(teacher_forced, [sample], [one_row_features(target, sample)], 4, runs=proxy)
        firsts = [a for a in range(len(answer)) if a == 0 or origins[a].round != origins[a - 1].round]
        for a, nxt in zip(firsts, firsts[1:]):  # whole rounds (the last may be cut by max_new_tokens)
            if origins[a].drafted:
                accepted = sum(o.origin == "accepted" for o in origins[a:nxt])
                assert int(runs[0][a]) == accepted, (start, a, runs[0].tolist(), origins[a:nxt])
                compared += 1
                accepted_total += accepted
                differ += int(proxy[0][a]) != accepted
    assert compared > 10 and accepted_total > 0
    # Negative control: the teacher-forced proxy (every draft step on the target's real features) misses rounds.
    assert differ > 0, (compared, accepted_total)
