"""The draft head (drafters/head.py, distill/head.py) and token trees in the engine.

Level (a): the training module and the drafter compute the same head (teacher-forced and unrolled steps against the
drafter's cache), a tree's accepted path moved into place by keep_path leaves the cache as a chain would.
Level (c): greedy output with the head, as chains, trees, batches and in a cascade, equals the target alone; a head
trained for a few seconds on a tiny target really accepts (so the equality is not vacuous).
Level (b), sampling with trees, is in test_sampling_exactness.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.distill.head import HeadNet, extract_features
from verispec.distill.teacher import Sample
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.build import build_drafter
from verispec.drafters.head import HeadConfig, HeadDrafter, load_head, save_head
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.runners.select import make_runner


def random_head(target, vocab=None, seed=0):
    vocab = torch.arange(target.config.vocab_size) if vocab is None else vocab
    config = HeadConfig.for_target(target.config, "tiny", len(vocab))
    return config, HeadNet(config, target, vocab, seed=seed)


def test_feature_cache_redoes_a_chunk_that_grew(trained_pair, tmp_path):
    """A resumed run with more samples: the cached chunk holding fewer samples is extracted again, not reused."""
    target, _ = trained_pair
    samples = [Sample("x", torch.arange(3 + i, dtype=torch.int32), torch.arange(5, dtype=torch.int32) + i,
                      torch.zeros(0), torch.zeros(0)) for i in range(6)]
    first = extract_features(target, samples[:4], tmp_path, progress=False)
    grown = extract_features(target, samples, tmp_path, progress=False)
    fresh = extract_features(target, samples, tmp_path / "fresh", progress=False)
    assert len(first) == 4 and [len(f) for f in grown] == [len(f) for f in fresh] == [8 + i for i in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(grown, fresh))


def test_training_module_and_drafter_compute_the_same_head(trained_pair):
    """Step 0 (real features) at every position, and step 1 (the head's own predicted feature at i - 1) against
    the drafter's cache holding the real pairs before i: the unrolled training sees exactly what drafting sees."""
    target, _ = trained_pair
    torch.manual_seed(0)
    config, net = random_head(target, torch.arange(0, target.config.vocab_size, 2))
    drafter = HeadDrafter(config, net.export(), target, 64)
    t = 10
    tokens = torch.randint(0, target.config.vocab_size, (1, t))
    features = torch.randn(1, t, config.hidden_size)
    with torch.no_grad():
        step0, step1 = net.unrolled(tokens, features, 2)
        index = torch.arange(t).view(1, t)
        causal = torch.arange(t).view(1, 1, t) <= index.unsqueeze(-1)
        hidden, _ = drafter._forward(tokens, features, index, index, causal)
        assert torch.allclose(hidden, step0, atol=1e-4)
        for i in range(1, t):  # cache: real pairs [0, i) are there (written above); feed (f^_i, x_{i+1}) at i
            visible = torch.arange(t).view(1, 1, t) < i
            visible[0, 0, i] = True
            pos = torch.tensor([[i]])
            out, _ = drafter._forward(tokens[:, i : i + 1], step0[:, i - 1 : i], pos, pos, visible)
            assert torch.allclose(out[0, 0], step1[0, i], atol=1e-4), i
            drafter._forward(tokens[:, i : i + 1], features[:, i : i + 1], pos, pos,
                             torch.arange(t).view(1, 1, t) <= i)  # restore the real pair at i


def test_save_load_and_named_drafters(trained_pair, tokenizer, tmp_path):
    target, _ = trained_pair
    config, net = random_head(target)
    save_head(tmp_path / "h", config, net.export(), torch.float16)
    loaded, weights = load_head(tmp_path / "h")
    assert loaded == config and weights["vocab"].dtype == torch.int32
    head = build_drafter(f"head:{tmp_path / 'h'}", target, tokenizer, 128).drafter
    assert isinstance(head, HeadDrafter)
    cascade = build_drafter(f"ngram+head:{tmp_path / 'h'}", target, tokenizer, 128).drafter
    assert isinstance(cascade, CascadeDrafter) and cascade.wants_features
    with pytest.raises(ValueError, match="holds no draft head"):
        build_drafter(f"head:{tmp_path}", target, tokenizer, 128).drafter
    other = tiny_llama(3, hidden=48)
    with pytest.raises(ValueError, match="trained for a target with hidden size"):
        HeadDrafter(config, weights, other, 64)


def test_keep_path_leaves_the_cache_as_a_chain_would(trained_pair):
    """A tree fed at scattered indices, its accepted path moved into place: the next forward's logits equal those
    after feeding the path as a chain (native and Hugging Face runners)."""
    from verispec.config import RunnerOptions
    from verispec.engine.acceptance import TreeDraft

    target, _ = trained_pair
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    #         root  a  b  c  d  e      path: root -> b -> e
    tree = TreeDraft.from_lists([9], [[11, 12, 13, 14, 15]], [[0, 0, 1, 2, 2]])
    for backend in ("native", "hf"):
        runner = make_runner(target, 64, 2, RunnerOptions(backend=backend))
        for slot in (0, 1):
            runner.forward(prompt, start_slot=slot)
            runner.truncate(4, slot)  # the prompt's last token is the root
        base = 4
        positions = base + tree.depths()
        runner.forward(tree.token_ids, start_slot=0, positions=positions, tree_mask=tree.ancestor_mask())
        runner.keep_path(0, base, [0, 2, 5])
        runner.forward(torch.tensor([[9, 12, 15]]), start_slot=1)
        after_tree = runner.forward(torch.tensor([[20]]), start_slot=0).logits
        after_chain = runner.forward(torch.tensor([[20]]), start_slot=1).logits
        assert runner.lengths[0] == runner.lengths[1] == 8
        assert torch.allclose(after_tree, after_chain, atol=1e-5), backend


@pytest.mark.parametrize("tree_nodes, adaptive", [(0, False), (10, False), (10, True)])
def test_greedy_with_the_head_equals_the_target_alone(trained_pair, tokenizer, trained_head, tree_nodes, adaptive):
    """Chains and trees, a batch of ragged prompts, and the head behind the n-gram drafter: token-identical to the
    target alone; the trained head accepts, and trees accept more per round than the chain."""
    target, _ = trained_pair
    config, weights = load_head(trained_head)
    head = HeadDrafter(config, weights, target, 300)
    prompts = [tokenizer(t)["input_ids"] for t in ["the cat sat on", "one two three", "Paris is the", "a"]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    spec = SpeculativeConfig(num_draft_tokens=4, tree_nodes=tree_nodes, adaptive=adaptive)  # adaptive: trees sized
    for drafter in (head, CascadeDrafter([NgramDrafter(), head])):  # by the measured verify cost of each width
        engine = SpeculativeEngine(target, tokenizer, drafter, spec=spec, max_len=256, max_batch_size=3)
        alone = engine.generate_batch(prompts, params, use_drafter=False)
        spec_out = engine.generate_batch(prompts, params)
        assert [r.token_ids for r in spec_out] == [r.token_ids for r in alone]
    single = SpeculativeEngine(target, tokenizer, head, spec=spec, max_len=256, max_batch_size=1)
    result = single.generate(prompts[0], params)
    assert result.token_ids == alone[0].token_ids
    if not adaptive:  # (adaptive K may rightly switch a tiny model's drafting off: its target pass costs nothing)
        assert result.stats.mean_accepted_length > (2.0 if tree_nodes else 1.8), result.stats.mean_accepted_length
        assert result.stats.accepted_by_position[1] > 0  # the unrolled training reaches depth 2


def test_trees_fall_back_to_chains_where_processing_depends_on_the_draft(trained_pair, tokenizer, trained_head):
    """A penalised row (its logits depend on the draft tokens before each position) drafts chains, beside a tree row
    of the same step; both stay equal to the target alone."""
    target, _ = trained_pair
    config, weights = load_head(trained_head)
    head = HeadDrafter(config, weights, target, 300)
    engine = SpeculativeEngine(target, tokenizer, head, spec=SpeculativeConfig(num_draft_tokens=4, tree_nodes=10),
                               max_len=256, max_batch_size=2)
    prompts = [tokenizer("the cat sat on")["input_ids"], tokenizer("one two three")["input_ids"]]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True),
              SamplingParams(max_new_tokens=30, ignore_eos=True, repetition_penalty=1.3)]
    seen = []
    propose = head.propose
    head.propose = lambda batch: seen.append([p.is_tree for p in propose(batch)]) or propose_log[-1]
    propose_log = []

    def logged(batch):
        proposals = propose(batch)
        propose_log.append(proposals)
        seen.append([p.is_tree for p in proposals])
        return proposals

    head.propose = logged
    spec_out = engine.generate_batch(prompts, params)
    head.propose = propose
    alone = engine.generate_batch(prompts, params, use_drafter=False)
    assert [r.token_ids for r in spec_out] == [r.token_ids for r in alone]
    assert any(row[0] for row in seen) and not any(len(row) > 1 and row[1] for row in seen)


def test_server_drafts_with_a_head_per_request(model_dirs, trained_head):
    """A request names the head (allowed by the operator under a short name) and token trees; its output equals the
    same request without speculation, with speculative metrics showing the head accepted tokens."""
    import openai

    from test_server import MODEL, ServerThread
    from test_server_batching import body, metrics, texts
    from verispec.server import ServerConfig, create_app

    config = ServerConfig(model=str(model_dirs["target"]), draft_model="ngram", enable_speculative=True,
                          spec=SpeculativeConfig(num_draft_tokens=4), max_len=256, max_num_seqs=2,
                          allowed_draft_models=(f"tinyhead=head:{trained_head}",))
    with ServerThread(create_app(config)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)
        request = dict(prompt="the cat sat on", max_tokens=40)
        off = client.completions.create(**body({**request, "speculative": False}))
        for tree_nodes in (0, 10):
            on = client.completions.create(**body({**request, "speculative": {"draft_model": "tinyhead",
                                                                               "tree_nodes": tree_nodes}}))
            assert texts(on) == texts(off)
            assert metrics(on)["mean_accepted_length"] > 1.5, metrics(on)
        with pytest.raises(openai.BadRequestError, match="tree_nodes"):
            client.completions.create(**body({**request, "speculative": {"tree_nodes": 65}}))
    assert MODEL


def test_token_origins_of_tree_rounds(trained_pair, tokenizer, trained_head):
    """The per-token origins the engine hands out (the server's `speculative.annotate`) with a cascade drafting
    token trees: each round commits its accepted draft tokens, then a bonus token when the accepted path ended on a
    leaf, else a recovered one; the counts agree with the request's statistics."""
    target, _ = trained_pair
    config, weights = load_head(trained_head)
    drafter = CascadeDrafter([NgramDrafter(), HeadDrafter(config, weights, target, 300)])
    engine = SpeculativeEngine(target, tokenizer, drafter, spec=SpeculativeConfig(num_draft_tokens=4, tree_nodes=10),
                               max_len=256, max_batch_size=1)
    chunks = list(engine.generate_iter(tokenizer("the cat sat on")["input_ids"],
                                       SamplingParams(max_new_tokens=40, ignore_eos=True)))
    stats = chunks[-1].stats
    origins = [o for chunk in chunks for o in chunk.origins]
    assert len(origins) == sum(len(chunk.token_ids) for chunk in chunks) == stats.generated_tokens == 40
    assert [o.round for o in origins] == sorted(o.round for o in origins) and origins[-1].round == stats.rounds
    assert sum(o.origin == "accepted" for o in origins) == stats.accepted_tokens
    assert sum(o.drafted for o in {o.round: o for o in origins}.values()) == stats.draft_tokens
    assert {o.stage for o in origins if o.origin == "accepted"} <= {"ngram", "head"}
    kinds = set()
    for chunk in chunks:  # one round per chunk (a batch of one)
        *accepted, last = [o.origin for o in chunk.origins]
        assert set(accepted) <= {"accepted"} and len({o.round for o in chunk.origins}) == 1
        drafted = chunk.origins[0].drafted
        if drafted == 0:
            assert last == "target"
        elif not accepted:
            assert last == "recovered"  # the root of a tree or chain always has a child
        elif len(accepted) == drafted:
            assert last == "bonus"  # every draft token accepted: the path ends on a leaf
        kinds.add((chunk.origins[0].stage, last))
    assert {("head", "bonus"), ("head", "recovered")} <= kinds  # trees that were accepted in part and to a leaf
