"""Training a draft on teacher shards (distill/shard_data.py, train.py): the held-apart split, the acceptance proxy
by hand and against real speculation's rule, the reduced-vocabulary loss, and a training run that is deterministic
and resumes after a kill to the same weights and curve."""

import math

import pytest
import torch
from conftest import CORPUS, tiny_llama

from verispec.distill.shard_data import held_apart
from verispec.distill.teacher import Sample
from verispec.distill.train import (TrainSettings, _committed, collate, draft_loss, heldout_metrics, reduced_vocab,
                                    train)

pytestmark = pytest.mark.usefixtures("one_thread")


def samples_of(tokenizer, n: int = 12) -> list[Sample]:
    ids = tokenizer(CORPUS)["input_ids"]
    out = []
    for i in range(n):
        start = 7 * i
        answer = torch.tensor(ids[start + 10: start + 30], dtype=torch.int32)
        out.append(Sample("corpus", torch.tensor(ids[start: start + 10], dtype=torch.int32), answer,
                          answer[:, None], torch.zeros(len(answer), 1, dtype=torch.float16)))
    return out


def test_committed_by_hand():
    hit = torch.tensor([True, True, False, True, True, True, True, True])
    # runs of matches from each start: 2 1 0 5 4 3 2 1 -> capped at K=4: 2 1 0 4 4 3 2 1, plus one token a round
    assert _committed(hit, 4) == sum(1 + r for r in [2, 1, 0, 4, 4, 3, 2, 1])
    assert _committed(torch.zeros(5, dtype=torch.bool), 4) == 5  # nothing accepted: one token a round
    assert _committed(torch.ones(5, dtype=torch.bool), 8) == sum(1 + r for r in [5, 4, 3, 2, 1])


def test_accepted_length_of_the_target_itself_is_k_plus_one_less_the_tail(trained_pair, tokenizer):
    """A draft that is the target, on the target's own greedy answers, agrees everywhere: each start position j of
    an answer of n tokens commits 1 + min(K, n - j); another model commits less (negative control)."""
    target, draft = trained_pair
    prompt = tokenizer(CORPUS[:40])["input_ids"]
    with torch.no_grad():
        answer = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
    sample = Sample("x", torch.tensor(prompt, dtype=torch.int32), answer.to(torch.int32),
                    answer[:, None].to(torch.int32), torch.zeros(len(answer), 1, dtype=torch.float16))
    own = heldout_metrics(target, [sample], 2, 128, 4)
    n = len(answer)
    assert own["agreement"] == 1.0
    assert own["accepted_length_k4"] == pytest.approx(sum(1 + min(4, n - j) for j in range(n)) / n)
    other = heldout_metrics(draft, [sample], 2, 128, 4)
    assert other["agreement"] < 1.0 and other["accepted_length_k4"] < own["accepted_length_k4"]


def test_reduced_vocab_loss_is_the_softmax_over_the_subset_and_ignores_labels_outside(tokenizer):
    model = tiny_llama(5)
    batch = collate(samples_of(tokenizer, 3), 64, 2)
    ids = torch.tensor(sorted(set(batch[2].tolist()))[:-2])  # the two largest label ids left out
    vocab = reduced_vocab(ids, model.config.vocab_size)
    loss, n, correct = draft_loss(model, *batch, kd_weight=0.0, step_vocab=vocab)
    ids_, mask, labels = batch[0], batch[1], batch[2]
    with torch.no_grad():
        logits = model(input_ids=ids_).logits[mask][:, ids]  # [N, n]
    index = vocab[2][labels]
    keep = index >= 0
    assert 0 < int(keep.sum()) < len(labels)  # some labels fall outside: they add no loss
    expected = torch.nn.functional.cross_entropy(logits[keep], index[keep])
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)
    assert n == len(labels)


def test_held_apart_is_stable_and_about_the_fraction():
    chosen = [c for c in range(4000) if held_apart(c, 0.05)]
    assert chosen == [c for c in range(4000) if held_apart(c, 0.05)]
    assert 150 < len(chosen) < 250


class Killed(Exception):
    pass


def _run(tmp_path, tokenizer, resume: bool, name: str, kill_at: int | None = None, steps: int = 6):
    """Train a tiny draft for `steps` (checkpoints every 2); `kill_at`: the run dies right after that checkpoint."""
    model = tiny_llama(7)
    data = samples_of(tokenizer)
    vocab_ids = torch.tensor(sorted({int(t) for s in data for t in s.response_ids}))
    settings = TrainSettings(steps=steps, lr=3e-3, batch_tokens=96, max_length=48, kd_weight=0.0, weight_decay=0.01,
                             seed=3, checkpoint_every=2, bf16=False, draft_vocab=len(vocab_ids))

    def checkpointed(curve):
        if curve[-1]["step"] == kill_at:
            raise Killed

    try:
        stats = train(model, data[:10], settings, 2, tmp_path / name, resume=resume, progress=False,
                      heldout=data[10:], vocab_ids=vocab_ids, on_checkpoint=checkpointed)
    except Killed:
        return None, None
    return model, stats


def test_training_is_deterministic_and_resumes_to_the_same_weights_and_curve(tmp_path, tokenizer):
    whole, stats = _run(tmp_path, tokenizer, resume=False, name="a.pt")
    again, _ = _run(tmp_path, tokenizer, resume=False, name="b.pt")
    assert all(torch.equal(p, q) for p, q in zip(whole.state_dict().values(), again.state_dict().values()))
    assert [p["step"] for p in stats["curve"]] == [2, 4, 6]
    assert all(math.isfinite(p["loss"]) and 1.0 <= p["accepted_length_k4"] <= 5.0 for p in stats["curve"])
    assert _run(tmp_path, tokenizer, resume=False, name="c.pt", kill_at=4) == (None, None)  # dies after step 4
    resumed, resumed_stats = _run(tmp_path, tokenizer, resume=True, name="c.pt")
    assert all(torch.equal(p, q) for p, q in zip(whole.state_dict().values(), resumed.state_dict().values()))
    held = ["step", "loss", "agreement", "accepted_length_k4"]
    assert [[p[k] for k in held] for p in resumed_stats["curve"]] == [[p[k] for k in held] for p in stats["curve"]]
    other, _ = _run(tmp_path, tokenizer, resume=False, name="d.pt", steps=4)  # negative control: another schedule
    assert not all(torch.equal(p, q) for p, q in zip(whole.state_dict().values(), other.state_dict().values()))
