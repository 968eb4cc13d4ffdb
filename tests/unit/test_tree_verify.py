"""Level (a) and (b) for token trees: the tree bookkeeping and both tree verifiers on hand-written tensors, their
equality with the chain verifiers on chains, and the statistics of tree rejection sampling against enumeration."""

import itertools
import math

import pytest
import torch

from verispec.engine import acceptance as verify
from verispec.engine.acceptance import (
    SpecDecodeMetadata,
    TreeDraft,
    greedy_tree_verify,
    greedy_verify,
    path_tokens,
    rejection_verify,
    tree_rejection_verify,
)


def one_hot_logits(argmaxes, vocab):
    """[batch, n, vocab] logits whose argmax at [b, i] is argmaxes[b][i]."""
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()


class PathTable:
    """Distributions keyed by a token path (the root's token first), for every path of 1..depth + 1 tokens.

    The target (and a drafter) of the statistical tests: p after a node depends on the node's whole path, as a
    language model's would. Row k of `logits` belongs to path `paths[k]`; `child[k, t]` is the row of path + (t,).
    """

    def __init__(self, vocab: int, depth: int, seed: int, scale: float = 1.0):
        self.vocab = vocab
        self.paths = [()] + [p for d in range(1, depth + 2) for p in itertools.product(range(vocab), repeat=d)]
        index = {p: k for k, p in enumerate(self.paths)}
        self.child = torch.full((len(self.paths), vocab), -1, dtype=torch.long)  # [paths, vocab]
        for p, k in index.items():
            if len(p) <= depth:
                self.child[k] = torch.tensor([index[p + (t,)] for t in range(vocab)])
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(len(self.paths), vocab, generator=gen, dtype=torch.float64) * scale

    def probs(self) -> torch.Tensor:
        return self.logits.softmax(dim=-1)  # [paths, vocab]

    def node_rows(self, tree: TreeDraft) -> torch.Tensor:
        """[batch, n] long: each node's path row (its ancestors' tokens and its own, the root's first)."""
        rows = torch.zeros_like(tree.token_ids)
        rows[:, 0] = self.child[0, tree.token_ids[:, 0]]
        for i in range(1, tree.n):
            rows[:, i] = self.child[rows.gather(1, tree.parents[:, i : i + 1]).squeeze(1), tree.token_ids[:, i]]
        return rows


# --- (a) the tree bookkeeping -------------------------------------------------------------------------------------

# Row 0: root 7 with children 1 and 3; node 1 has children 2 and 4 (siblings not adjacent). Row 1: a chain of two.
ROOTS, TOKENS, PARENTS = [7, 8], [[1, 2, 3, 4], [5, 6]], [[0, 1, 0, 1], [0, 1]]


def test_from_lists_pads_and_numbers_nodes():
    tree = TreeDraft.from_lists(ROOTS, TOKENS, PARENTS)
    assert tree.token_ids.tolist() == [[7, 1, 2, 3, 4], [8, 5, 6, 0, 0]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 1], [-1, 0, 1, -1, -1]]
    assert tree.num_nodes.tolist() == [5, 3]
    assert tree.valid().tolist() == [[True] * 5, [True, True, True, False, False]]


def test_depths_and_ancestor_mask_by_hand():
    tree = TreeDraft.from_lists(ROOTS, TOKENS, PARENTS)
    assert tree.depths().tolist() == [[0, 1, 2, 1, 2], [0, 1, 2, 0, 0]]
    expected = torch.tensor([
        [[1, 0, 0, 0, 0],
         [1, 1, 0, 0, 0],
         [1, 1, 1, 0, 0],
         [1, 0, 0, 1, 0],
         [1, 1, 0, 0, 1]],
        [[1, 0, 0, 0, 0],
         [1, 1, 0, 0, 0],
         [1, 1, 1, 0, 0],
         [0, 0, 0, 1, 0],  # padding sees only itself
         [0, 0, 0, 0, 1]],
    ], dtype=torch.bool)  # [batch, n, n]
    assert torch.equal(tree.ancestor_mask(), expected)


def test_root_only_trees():
    tree = TreeDraft.from_lists([3, 4], [[], []], [[], []])
    assert tree.n == 1 and tree.depths().tolist() == [[0], [0]]
    assert tree.ancestor_mask().tolist() == [[[True]], [[True]]]


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([[1, 2]], [[0, 2]], "node 2 .* has parent 2"),  # its own index
        ([[1, 2]], [[0, 3]], "node 2 .* has parent 3"),  # a later node
        ([[1]], [[-1]], "node 1 .* has parent -1"),
        ([[1, 2]], [[0]], "2 tokens but 1 parents"),
    ],
)
def test_from_lists_rejects_bad_parents(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TreeDraft.from_lists([0], tokens, parents)


def test_chain_equals_from_lists_of_the_same_chain():
    meta = SpecDecodeMetadata(torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0]]), torch.tensor([3, 1, 0]))
    chain = TreeDraft.chain(torch.tensor([7, 8, 9]), meta)
    listed = TreeDraft.from_lists([7, 8, 9], [[1, 2, 3], [4], []], [[0, 1, 2], [0], []])
    for field in ("token_ids", "parents", "num_nodes"):
        assert torch.equal(getattr(chain, field), getattr(listed, field)), field
    assert chain.depths().tolist() == [[0, 1, 2, 3], [0, 1, 0, 0], [0, 0, 0, 0]]


# --- (a) greedy tree verification ---------------------------------------------------------------------------------


def test_greedy_tree_verify_hand_built():
    vocab = 10
    tree = TreeDraft.from_lists(
        [0, 0, 0, 0, 0],
        [
            [3, 5, 7, 2, 7, 7],  # the path 0 -> 2 -> 3 -> 4 (second sibling first), node 4 a leaf
            [3, 5],  # no child of the root matches
            [3, 4, 6],  # node 1 accepted; neither of its children matches
            [],  # root only; its padding will look like a match
            [2, 9],  # node 1 accepted; node 2 will be padding that looks like its matching child
        ],
        [[0, 0, 2, 3, 1, 2], [0, 0], [0, 1, 1], [], [0, 1]],
    )
    tree.num_nodes[4] = 2  # node 2 of row 4 becomes padding
    tree.token_ids[3, 1:] = 2  # padding tokens equal to the root's argmax ...
    tree.parents[3, 1:] = 0  # ... with parents pointing at the current node (junk; padding is any value)
    argmax = [
        [5, 7, 7, 2, 9, 0, 0],  # node 1's argmax 7 is node 5's token: another branch, never visited
        [4, 0, 0, 0, 0, 0, 0],
        [3, 8, 0, 0, 0, 0, 0],
        [2, 0, 0, 0, 0, 0, 0],
        [2, 9, 0, 0, 0, 0, 0],
    ]
    out = greedy_tree_verify(tree, one_hot_logits(argmax, vocab))
    assert out.num_accepted.tolist() == [3, 0, 1, 0, 1]
    # bonus after the leaf; the root's argmax; the recovered token at node 1; the root's argmax; node 1's argmax
    assert out.next_token.tolist() == [9, 4, 8, 2, 9]
    assert out.path.tolist() == [[0, 2, 3, 4], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]]
    chain = path_tokens(tree, out)
    assert chain.draft_token_ids.tolist() == [[5, 7, 2], [0, 0, 0], [3, 0, 0], [0, 0, 0], [2, 0, 0]]
    assert chain.num_draft_tokens.tolist() == [3, 0, 1, 0, 1]


def random_chains(gen: torch.Generator, batch: int, vocab: int):
    """A ragged batch of chains: (root [batch], SpecDecodeMetadata), max_k in 0..5, lengths 0..max_k."""
    max_k = int(torch.randint(0, 6, (), generator=gen))
    lengths = torch.randint(0, max_k + 1, (batch,), generator=gen)
    draft = torch.randint(0, vocab, (batch, max_k), generator=gen)
    return torch.randint(0, vocab, (batch,), generator=gen), SpecDecodeMetadata(draft, lengths)


@pytest.mark.parametrize("seed", range(40))
def test_greedy_tree_verify_on_a_chain_equals_greedy_verify(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 3  # small: long accepted runs are common
    root, meta = random_chains(gen, 16, vocab)
    logits = torch.randn(16, meta.max_k + 1, vocab, generator=gen)  # [batch, max_k + 1, vocab]
    chain = greedy_verify(meta, logits)
    tree = TreeDraft.chain(root, meta)
    out = greedy_tree_verify(tree, logits)
    assert torch.equal(out.num_accepted, chain.num_accepted)
    assert torch.equal(out.next_token, chain.next_token)
    depth = out.path.shape[1] - 1
    assert depth == int(meta.num_draft_tokens.max())  # the deepest chain in the batch
    steps = torch.arange(depth + 1)  # the path of a chain is 0, 1, ..., num_accepted
    assert torch.equal(out.path, torch.where(steps <= out.num_accepted.unsqueeze(-1), steps, 0))
    accepted = path_tokens(tree, out)
    assert torch.equal(accepted.num_draft_tokens, chain.num_accepted)
    valid = accepted.valid()
    assert torch.equal(accepted.draft_token_ids[valid], meta.draft_token_ids[:, :depth][valid])


# --- (a) tree rejection sampling on chains ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("with_q", ["none", "all", "some"])
def test_tree_rejection_verify_on_a_chain_equals_rejection_verify(seed, with_q):
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 16, 4
    root, meta = random_chains(gen, batch, vocab)
    k = meta.max_k
    p = torch.randn(batch, k + 1, vocab, generator=gen).mul(2).softmax(-1)  # [batch, k + 1, vocab]
    p = p * (torch.rand(batch, k + 1, vocab, generator=gen) > 0.2)  # zeros, as top-k / top-p leave them
    p[..., 0] += 1e-3  # every row keeps some mass
    p = p / p.sum(-1, keepdim=True)
    q = torch.randn(batch, k, vocab, generator=gen).softmax(-1)  # [batch, k, vocab]
    if with_q != "none":  # draft tokens drawn from q, as a sampling drafter's are
        drawn = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(batch, k)
        meta.draft_token_ids = torch.where(meta.valid(), drawn, meta.draft_token_ids)
    u_accept = torch.rand(batch, k, generator=gen)  # [batch, k]
    u_sample = torch.rand(batch, generator=gen)  # [batch]
    draft_probs = None if with_q == "none" else q
    has_q = torch.rand(batch, generator=gen) < 0.5 if with_q == "some" else None
    chain = rejection_verify(meta, draft_probs, has_q, p, u_accept, u_sample)

    tree_q = None if draft_probs is None else torch.cat([torch.zeros(batch, 1, vocab), q], dim=1)  # node 0 unused
    out = tree_rejection_verify(TreeDraft.chain(root, meta), tree_q, has_q, p,
                                torch.cat([torch.zeros(batch, 1), u_accept], dim=1), u_sample)
    assert torch.equal(out.num_accepted, chain.num_accepted)
    assert torch.equal(out.next_token, chain.next_token)


def test_tree_rejection_verify_point_mass_siblings_by_hand():
    """Root with children 0, 1, 2 (point masses) under p = [0.5, 0.3, 0.2, 0, 0]; u = 0.99 rejects each in turn."""
    tree = TreeDraft.from_lists([4], [[0, 1, 2, 3]], [[0, 0, 0, 3]])
    p = torch.zeros(1, 5, 5)
    p[0, 0] = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    p[0, 3] = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])  # below node 3 (token 2): node 4 (token 3) is sure to pass
    u_sample = torch.tensor([0.5])
    # Node 1: 0.99 * 1 >= 0.5 rejects, r = [0, .6, .4]; node 2: rejected, r = [0, 0, 1]; node 3 accepted (r(2) = 1).
    out = tree_rejection_verify(tree, None, None, p, torch.tensor([[0.0, 0.99, 0.99, 0.99, 0.0]]), u_sample)
    assert out.num_accepted.tolist() == [2] and out.path.tolist() == [[0, 3, 4]]
    # Node 1 accepted at once (0 < 0.5): its siblings and their subtree are skipped; bonus from p at node 1.
    p[0, 1] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    out = tree_rejection_verify(tree, None, None, p, torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]]), u_sample)
    assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [4]
    # Node 1 rejected by 0.6 * 1 >= 0.5; node 2 (token 1) tested against r = [0, .6, .4]: 0.6 < 0.6 fails,
    # r = [0, 0, 1]; node 3 (token 2) accepted with 0.99 < 1.
    out = tree_rejection_verify(tree, None, None, p, torch.tensor([[0.0, 0.6, 0.6, 0.99, 0.0]]), u_sample)
    assert out.num_accepted.tolist() == [2] and out.path.tolist() == [[0, 3, 4]]


# --- (b) statistics: tree rejection sampling follows p ------------------------------------------------------------

VOCAB = 5
TRIALS = 40_000
# Root with children 1, 2, 5; node 1: 3, 6; node 2: 4, 8; node 3: 7, 9; node 4: 10. Depth 3, siblings interleaved.
STAT_PARENTS = [-1, 0, 0, 1, 2, 0, 1, 3, 2, 3, 4]
# Total variation bound for an empirical distribution of N draws over K cells: E||p_hat - p||_1 <= sqrt(K / N)
# (Cauchy-Schwarz), and ||p_hat - p||_1 changes by at most 2 / N per draw, so by McDiarmid
# P(||p_hat - p||_1 >= sqrt(K / N) + t) <= exp(-N t^2 / 2). With delta = 1e-6 (K = 25, N = 40k): TVD < 0.026.
CELLS = VOCAB * VOCAB
TVD_BOUND = 0.5 * (math.sqrt(CELLS / TRIALS) + math.sqrt(2 * math.log(1e6) / TRIALS))


def statistical_round(drafting: str, seed: int = 0) -> float:
    """One round of TRIALS independent rows over the fixed tree; -> TVD of the first two committed tokens.

    drafting: "top_k" (distinct point masses, the drafter's top tokens per sibling group, the same in every row),
    "iid" (each sibling group drawn i.i.d. from the drafter's q, resampled per row), or "without_replacement"
    (each child drawn from q with its earlier siblings' tokens removed, and carrying that q).
    """
    gen = torch.Generator().manual_seed(seed)
    target = PathTable(VOCAB, 3, seed=1, scale=1.5)
    noise = torch.randn(target.logits.shape, generator=gen, dtype=torch.float64)
    p_table, q_table = target.probs(), (target.logits + noise).softmax(-1)  # [paths, vocab]: the drafter errs
    n = len(STAT_PARENTS)
    parents = torch.tensor(STAT_PARENTS).expand(TRIALS, n)
    tree = TreeDraft(torch.zeros(TRIALS, n, dtype=torch.long), parents.clone(), torch.full((TRIALS,), n))
    rows = torch.zeros(TRIALS, n, dtype=torch.long)  # [trials, n]: each node's path row
    rows[:, 0] = target.child[0, 0]  # the root's token is 0
    draft_probs = torch.zeros(TRIALS, n, VOCAB, dtype=torch.float64)  # [trials, n, vocab]
    taken = torch.zeros(TRIALS, n, VOCAB, dtype=torch.bool)  # [trials, n, vocab]: tokens of each node's children
    for i in range(1, n):
        parent = STAT_PARENTS[i]
        q = q_table[rows[:, parent]]  # [trials, vocab]
        if drafting == "top_k":
            rank = STAT_PARENTS[1:i].count(parent)
            token = q.topk(rank + 1, dim=-1).indices[:, rank]
        else:
            if drafting == "without_replacement":
                q = torch.where(taken[:, parent], 0.0, q)
                q = q / q.sum(-1, keepdim=True)
            token = torch.multinomial(q, 1, generator=gen).squeeze(1)
        taken[torch.arange(TRIALS), parent, token] = True
        draft_probs[:, i] = q
        tree.token_ids[:, i] = token
        rows[:, i] = target.child[rows[:, parent], token]
    target_probs = p_table[rows]  # [trials, n, vocab]
    out = tree_rejection_verify(tree, None if drafting == "top_k" else draft_probs, None, target_probs,
                                torch.rand(TRIALS, n, generator=gen), torch.rand(TRIALS, generator=gen))

    accepted = path_tokens(tree, out).draft_token_ids  # [trials, max_depth]
    first = torch.where(out.num_accepted >= 1, accepted[:, 0], out.next_token)
    # A row that accepted nothing committed one token this round: its second is drawn from p after it (the table).
    after_first = p_table[target.child[rows[:, 0], first]]  # [trials, vocab]
    later = torch.multinomial(after_first, 1, generator=gen).squeeze(1)
    second = torch.where(out.num_accepted == 1, out.next_token, later)
    second = torch.where(out.num_accepted >= 2, accepted[:, 1], second)
    empirical = torch.bincount(first * VOCAB + second, minlength=CELLS).double() / TRIALS
    root_row = int(target.child[0, 0])
    exact = (p_table[root_row].unsqueeze(1) * p_table[target.child[root_row]]).flatten()  # [vocab * vocab]
    assert math.isclose(float(exact.sum()), 1.0)
    assert (out.num_accepted >= 2).float().mean() > 0.1  # the check reaches below the first level
    return 0.5 * float((empirical - exact).abs().sum())


@pytest.mark.parametrize("drafting", ["top_k", "iid", "without_replacement"])
def test_tree_rejection_verify_follows_p(drafting):
    assert statistical_round(drafting) < TVD_BOUND  # measured 0.006 to 0.010 over seeds 0..5


@pytest.mark.parametrize("drafting", ["top_k", "iid", "without_replacement"])
def test_statistical_check_catches_a_residual_not_updated_after_a_rejected_sibling(monkeypatch, drafting):
    """Negative control: later siblings tested against (and the next token sampled from) the unreduced r."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    assert statistical_round(drafting) > TVD_BOUND  # measured 0.16 to 0.20


# --- (c) greedy trees commit what target-only greedy decoding would -----------------------------------------------


@pytest.mark.parametrize("noise", [0.0, 1.0, 3.0])
def test_greedy_top2_tree_accepts_at_least_the_top1_chain(noise):
    """A binary tree of the drafter's top-2 per node (depth 3) against the drafter's top-1 chain (its first-child
    path): both commit a prefix of target-only greedy decoding, the tree at least as long. The drafter is the
    target plus noise; noise 0 is the target's own top-2, accepted to the full depth."""
    vocab, depth, batch = 8, 3, 512
    gen = torch.Generator().manual_seed(0)
    target = PathTable(vocab, depth, seed=3)
    drafter_logits = target.logits + noise * torch.randn(target.logits.shape, generator=gen, dtype=torch.float64)
    n = 2 ** (depth + 1) - 1  # breadth-first: node i's children are 2i + 1 and 2i + 2
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    tree = TreeDraft(torch.zeros(batch, n, dtype=torch.long), torch.tensor(parents).expand(batch, n).clone(),
                     torch.full((batch,), n))
    tree.token_ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)  # each row its own context
    rows = torch.zeros(batch, n, dtype=torch.long)
    rows[:, 0] = target.child[0, tree.token_ids[:, 0]]
    for i in range(1, n):
        parent = parents[i]
        tree.token_ids[:, i] = drafter_logits[rows[:, parent]].topk(2, dim=-1).indices[:, (i - 1) % 2]
        rows[:, i] = target.child[rows[:, parent], tree.token_ids[:, i]]
    target_logits = target.logits[rows]  # [batch, n, vocab]
    out = greedy_tree_verify(tree, target_logits)

    first_children = [0, 1, 3, 7]  # the top-1 chain
    chain_meta = SpecDecodeMetadata(tree.token_ids[:, first_children[1:]], torch.full((batch,), depth))
    chain = greedy_verify(chain_meta, target_logits[:, first_children])

    greedy = torch.zeros(batch, depth + 1, dtype=torch.long)  # target-only greedy decoding after the root
    at = rows[:, 0]
    for j in range(depth + 1):
        greedy[:, j] = target.logits[at].argmax(-1)
        if j < depth:
            at = target.child[at, greedy[:, j]]
    committed = torch.cat([path_tokens(tree, out).draft_token_ids, torch.zeros(batch, 1, dtype=torch.long)], 1)
    committed.scatter_(1, out.num_accepted.unsqueeze(1), out.next_token.unsqueeze(1))
    steps = torch.arange(committed.shape[1])
    assert torch.equal(torch.where(steps <= out.num_accepted.unsqueeze(1), committed, 0),
                       torch.where(steps <= out.num_accepted.unsqueeze(1), greedy[:, : committed.shape[1]], 0))
    assert (out.num_accepted >= chain.num_accepted).all()
    if noise == 0.0:
        assert (out.num_accepted == depth).all()
    else:
        assert (out.num_accepted > chain.num_accepted).any() and (out.num_accepted < depth).any()
