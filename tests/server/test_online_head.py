"""Online training's pieces on the engine (server/online.py; the server end to end: tests/server/test_server_online.py).

What a key's head records is what the offline training reads: each finished request's prompt and committed tokens
with the target's own feature at every position (checked against a teacher-forced target pass, and shifted by one as
the negative control). A forked head drafts exactly as its base until it swaps; a swap changes the fork's drafts,
never its base's, and never the output.
"""

from __future__ import annotations

import copy

import torch

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.distill.head import HeadNet
from verispec.drafters.head import HeadDrafter, load_head, pack_head
from verispec.engine import SpeculativeEngine
from verispec.server.online import KeyHead

PROMPTS = ["the cat sat on", "one two three four five", "Paris is"]
PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)
SPEC = SpeculativeConfig(num_draft_tokens=4)


def base_head(trained_pair, trained_head) -> HeadDrafter:
    target, _ = trained_pair
    config, weights = load_head(trained_head)
    return HeadDrafter(config, weights, target, 300)


def test_a_keys_head_records_the_targets_features_at_the_committed_positions(trained_pair, tokenizer, trained_head):
    # A copy: the features are held to the fp32 forward, and the shared target's native twin may have been put on a
    # draft's Q8_0 blocks by an earlier test that let it draft for itself (twins.py keeps one twin per model object).
    target = copy.deepcopy(trained_pair[0])
    recorded = []
    head = KeyHead(base_head(trained_pair, trained_head), recorded.append)
    engine = SpeculativeEngine(target, tokenizer, head, spec=SPEC, max_len=256, max_batch_size=3)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    results = engine.generate_batch(prompts, PARAMS)
    assert len(recorded) == 3
    by_prompt = {tuple(t.prompt_ids.tolist()): t for t in recorded}
    for prompt, result in zip(prompts, results):
        traffic = by_prompt[tuple(prompt)]
        tokens = torch.cat([traffic.prompt_ids, traffic.response_ids])
        # The last round's features never reach the drafter (the sequence finished): at most K + 1 answer tokens short.
        assert len(prompt) + PARAMS.max_new_tokens - SPEC.num_draft_tokens - 1 <= len(tokens)
        assert tokens.tolist() == (prompt + result.token_ids)[: len(tokens)]
        with torch.no_grad():
            wanted = target.model(input_ids=tokens.unsqueeze(0)).last_hidden_state[0]  # [n, hidden]
        assert traffic.features.shape == wanted.shape
        gap = (traffic.features.float() - wanted).abs().max()
        assert gap < 2e-2, gap
        assert not torch.allclose(traffic.features[1:].float(), wanted[:-1], atol=2e-2)  # one position off: caught


def test_a_fork_drafts_as_its_base_until_it_swaps_and_never_changes_the_output(trained_pair, tokenizer, trained_head):
    target, _ = trained_pair
    base = base_head(trained_pair, trained_head)
    fork = KeyHead(base, lambda traffic: None)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]

    def run(drafter):
        engine = SpeculativeEngine(target, tokenizer, drafter, spec=SPEC, max_len=256, max_batch_size=3)
        results = engine.generate_batch(prompts, PARAMS)
        return [r.token_ids for r in results], [r.stats.accepted_tokens for r in results]

    alone = [r.token_ids for r in SpeculativeEngine(target, tokenizer, None, max_len=256, max_batch_size=3)
             .generate_batch(prompts, PARAMS, use_drafter=False)]
    as_base, as_fork = run(base), run(fork)
    assert as_base == as_fork and as_base[0] == alone
    # Other weights (the trained head's, perturbed), packed as the trainer publishes them, swapped into the fork.
    config, weights = load_head(trained_head)
    net = HeadNet.from_weights(config, weights, base.embed.detach().float(), torch.zeros(1), base.cos, base.sin)
    exported = net.export()
    assert all(torch.equal(exported[k], weights[k].float()) for k in weights)  # from_weights -> export: as loaded
    generator = torch.Generator().manual_seed(0)
    moved = {k: v if k == "vocab" else v + 0.05 * torch.randn(v.shape, generator=generator)
             for k, v in exported.items()}
    norm = base.norm.clone()
    fork.swap_weights(pack_head(base.spec, moved, base.dtype, base.device))
    swapped = run(fork)
    assert swapped[0] == alone and swapped[1] != as_base[1]  # drafts changed, output did not
    assert torch.equal(base.norm, norm) and run(base) == as_base  # the base never saw the swap
