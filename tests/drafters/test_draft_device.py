"""The draft model on its own device (`draft_device=`, `--draft-device`): what crosses between the target's device
and the draft's, and how often; a device this machine lacks is refused with the fix.

This machine has no accelerator, so both devices are "cpu" here: the crossings are counted through
`drafters.model.cross`, the one way a tensor moves between the two devices, with the shape and dtype of each.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import machine_reason
from test_host_syncs import GREEDY, REJECTION, run_rows

from verispec.config import SpeculativeConfig
from verispec.drafters import model as model_module
from verispec.drafters.build import build_drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.placement import check_device, on_target_device, same_device
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.generator import SpeculativeGenerator

K = 4
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason=machine_reason("has CUDA; the test checks the error without it"))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason=machine_reason("needs a CUDA device"))


def test_greedy_with_a_draft_device_equals_the_target_alone(trained_pair, tokenizer):
    target, draft = trained_pair
    prompt = tokenizer("the cat sat on the mat. the cat")["input_ids"]
    alone = SpeculativeGenerator(target, None, tokenizer, max_len=256)
    placed = SpeculativeGenerator(target, draft, tokenizer, K=K, max_len=256, draft_device="cpu")
    assert placed.engine.drafter.runner.device == torch.device("cpu")
    expected = alone.generate(prompt, max_new_tokens=24, return_dict=True).token_ids
    result = placed.generate(prompt, max_new_tokens=24, return_dict=True)
    assert result.token_ids == expected
    assert result.stats.accepted_tokens > 0  # the drafter did draft


@pytest.mark.parametrize("device, draft_device", [
    ("cpu", "cpu"),
    pytest.param("cpu", "cuda", marks=(CUDA, pytest.mark.cuda)),
    pytest.param("cuda", "cpu", marks=(CUDA, pytest.mark.cuda)),
    pytest.param("cuda", "cuda", marks=(CUDA, pytest.mark.cuda)),
])
def test_rows_with_a_placed_draft_get_the_target_alones_tokens(trained_pair, tokenizer, device, draft_device):
    """The target on `device`, the draft model on `draft_device` (on a machine with CUDA, each way across, and
    both on the GPU): ragged rows in one batch, greedy and seeded samples (coupled: the target alone's tokens for
    the seed) equal the target alone's on the target's device."""
    target, draft = (copy.deepcopy(model) for model in trained_pair)  # .to() moves a module in place
    prompts = [tokenizer(text)["input_ids"] for text in ("the cat sat on the mat. the cat", "a dog", "the mat. the")]
    sampling = [{}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "top_k": 20, "seed": 5}]
    alone = SpeculativeGenerator(copy.deepcopy(target), None, tokenizer, max_len=256, device=device)
    placed = SpeculativeGenerator(target, draft, tokenizer, K=K, max_len=256, device=device,
                                  draft_device=draft_device)
    assert placed.engine.drafter.runner.device.type == draft_device
    expected = alone.generate(prompts, max_new_tokens=24, sampling=sampling, return_dict=True)
    results = placed.generate(prompts, max_new_tokens=24, sampling=sampling, return_dict=True)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert sum(r.stats.accepted_tokens for r in results) > 0  # the drafter did draft


class Crossings:
    """Every `cross` call while on: (dtype, shape, destination device), grouped by propose call."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[list[tuple]] = []
        original_cross, original_propose = model_module.cross, ModelDrafter.propose

        def cross(tensor, device):
            if self.calls:
                self.calls[-1].append((tensor.dtype, tuple(tensor.shape), torch.device(device)))
            return original_cross(tensor, device)

        def propose(drafter, batch):
            self.calls.append([])
            return original_propose(drafter, batch)

        monkeypatch.setattr(model_module, "cross", cross)
        monkeypatch.setattr(ModelDrafter, "propose", propose)


@pytest.mark.parametrize("sampled", [(False, False, False), (False, True, True)])
def test_tokens_and_q_cross_once_each_way_per_step(trained_pair, tokenizer, monkeypatch, sampled):
    """Per step with a model drafter: the fed tokens go over in one copy [batch, width] (and, with sampled rows,
    their uniforms [batch, K]); the draft tokens [batch, K] and q [batch, K, vocab] come back in one copy each;
    a prefill (`begin`) never crosses through propose."""
    target, draft = trained_pair
    drafter = ModelDrafter(draft, 256 + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=K), max_len=256,
                               max_batch_size=len(sampled))
    run_rows(engine, tokenizer, tuple(REJECTION if s else GREEDY for s in sampled))  # admitted and prefilled:
    # the next steps are plain rounds
    crossings = Crossings(monkeypatch)
    vocab = draft.config.vocab_size
    for _ in range(3):
        engine.step()
        assert len(crossings.calls) == 1, crossings.calls  # one propose per step: the engine has one drafter
        calls = crossings.calls.pop()
        batch, fed = len(sampled), calls[0]
        assert fed[0] == torch.long and fed[1][0] == batch and fed[2] == drafter.runner.device, calls
        expected = [fed]  # the committed tokens the round feeds [batch, width]: one copy
        if any(sampled):
            expected.append((torch.float32, (batch, K), drafter.runner.device))  # the rows' uniforms
        expected.append((torch.long, (batch, K), torch.device("cpu")))  # draft tokens, to the target's device
        if any(sampled):
            expected.append((torch.float32, (batch, K, vocab), torch.device("cpu")))  # q
        assert calls == expected, calls


def test_step_uniforms_are_the_draws_of_a_step_by_step_loop():
    """Drawing a propose call's uniforms up front takes each row's generator through the same draws."""
    from verispec.drafters.base import DraftRow
    from verispec.drafters.model import step_uniforms

    def rows(seed):
        return [DraftRow(torch.zeros(3, dtype=torch.long), k, i, torch.Generator().manual_seed(seed + i))
                for i, k in enumerate([3, 0, 2, 3])]

    sampled, ks = [True, True, False, True], [3, 0, 2, 3]
    up_front = step_uniforms(rows(7), sampled, ks, "cpu")  # [batch, max k]
    reference = rows(7)
    for i, row in enumerate(reference):
        for step in range(max(ks)):
            if sampled[i] and step < ks[i]:
                assert up_front[i, step] == torch.rand(1, generator=row.generator)[0]
            else:
                assert up_front[i, step] == 0.5
    ours = rows(7)
    step_uniforms(ours, sampled, ks, "cpu")
    for a, b in zip(ours, reference):  # the generators are left where the loop leaves them
        assert torch.equal(a.generator.get_state(), b.generator.get_state())


@NO_CUDA
def test_a_cuda_draft_device_without_cuda_names_the_fix(trained_pair, tokenizer):
    target, draft = trained_pair
    with pytest.raises(ValueError, match="no CUDA device is available here; use 'cpu'"):
        check_device("cuda:1")
    with pytest.raises(ValueError, match="draft_device 'cuda'.*no CUDA device"):
        SpeculativeGenerator(target, draft, tokenizer, K=K, max_len=256, draft_device="cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        build_drafter("ngram", target, tokenizer, 256, device="cuda")
    with pytest.raises(ValueError, match="not a torch device"):
        check_device("gpu0")


def test_a_twin_or_head_stays_on_the_target_device(trained_pair):
    target, _ = trained_pair
    on_target_device("twin", "self:int8", "cpu", target)  # the same device: fine
    with pytest.raises(ValueError, match="shares the target's tensors, so it runs on the target's device"):
        on_target_device("twin", "self:int8", "cuda:1", target)
    assert same_device("cpu", torch.device("cpu")) and not same_device("cpu", "cuda")
