"""A trained feature-level draft head (EAGLE-style) as drafter, proposing chains or token trees.

The head is one Llama decoder layer plus a projection, run on the TARGET's own last hidden states ("features":
the post-norm states its LM head reads) and the target's frozen embeddings and LM head (restricted to a reduced
draft vocabulary of frequent tokens, mapped back to target ids). Position i of the head holds the pair
(f_i, x_{i+1}): the target's feature at position i and the token that followed it; its output there predicts
f_{i+1}, and through the LM head the token x_{i+2}. Drafting feeds the head its own predicted features.

Features come from the engine at no extra target pass (`observe_features`): the prefill's and each verify pass's
hidden states at the committed positions.

The head's KV lives in runtime's slot cache (`SlotCache`, one layer; rollback moves its lengths, as the target's).
Cache invariant (per member slot, a sequence with N committed tokens): the head cache holds the pairs [0, D) and
the drafter keeps the target features f_D .. f_{N-2} it has not fed yet (`pending`), so D + len(pending) = N - 1
after every `observe_features`. A round feeds the pending pairs (real features; rows that do not draft catch up in
the same forward), then draft nodes at cache indices N - 1 + node; afterwards the slot's length is set back to
N - 1: draft entries are stale, and the accepted ones come back with the target's real features next round.

Trees (EAGLE-2's dynamic shape): each depth expands the `beam` highest-scoring nodes of the previous depth into
their `branch` most likely tokens (one head forward per depth, tree attention over the head's own cache); a node's
score is the product of the draft confidences on its path, an estimate of the chance that the target accepts it.
The tree proposed is the `N` best nodes (closed under ancestors, since scores only fall along a path), with N
chosen up to the row's node budget to maximise (1 + sum of scores) / verify cost(N + 1) when the engine passes the
measured verify costs. Tree nodes are point masses (distinct top tokens), verified exactly by recursive rejection
over siblings; a chain (budget <= depth) samples its tokens from q under sampling and carries q. A coupled row
(sampling/noise.py) drafts its coupled choice argmax(log q + g) as a point mass (in a tree: the first child).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import MAX_DRAFT_TOKENS, RunnerOptions
from ..runtime.caches.kv_cache import SlotCache
from ..runtime.model.llama import Block, LlamaSpec, Linear, layer_step, rms_norm
from ..sampling import check_finite, process_logits, row_choices, sample_from_probs, stable_softmax
from .base import DraftBatch, DraftProposal, Drafter, row_uniforms
from .tree import TREE_BEAM, TREE_BRANCH, as_tree, best_nodes

HEAD_CONFIG = "head_config.json"
HEAD_WEIGHTS = "head.safetensors"
HEAD_PREFIX = "head:"
# The head's own slack past the cache length it is given, for its token trees' draft nodes (the engine's CACHE_SLACK
# is the verify pass's): a round feeds the pending pairs (below the committed length), then per depth below the
# deepest one forward of at most TREE_BEAM expanded nodes (rows padded to the widest), so draft nodes take at most
# (K - 1) x TREE_BEAM entries, K <= MAX_DRAFT_TOKENS (config.py).
TREE_SLACK = (MAX_DRAFT_TOKENS - 1) * TREE_BEAM


@dataclass(frozen=True)
class HeadConfig:
    """The shape of a draft head (one decoder layer of the target's width) and what it was trained for."""

    target: str  # the target it reads (name or path, informative)
    target_vocab_size: int  # the target's vocabulary: the head's token ids are the target's
    hidden_size: int  # the target's hidden size (features, embeddings)
    intermediate_size: int  # the decoder layer's MLP width
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    draft_vocab_size: int  # tokens the head can propose (the reduced vocabulary)

    def spec(self) -> LlamaSpec:
        return LlamaSpec(vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                         intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                         qkv_bias=False)

    @classmethod
    def for_target(cls, target_config, target: str, draft_vocab_size: int) -> HeadConfig:
        c = target_config.get_text_config()
        heads = c.num_attention_heads
        return cls(target=target, target_vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   intermediate_size=c.intermediate_size, num_heads=heads,
                   num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, rms_norm_eps=c.rms_norm_eps,
                   draft_vocab_size=draft_vocab_size)


def is_head_folder(path: str | Path) -> bool:
    return (Path(path) / HEAD_CONFIG).is_file()


def save_head(folder: Path, config: HeadConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Write a head: head_config.json + head.safetensors (float weights in `dtype`, the vocabulary as int32)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.int32) if k == "vocab" else v.to(dtype)).contiguous() for k, v in weights.items()}
    save_file(tensors, str(folder / HEAD_WEIGHTS))
    (folder / HEAD_CONFIG).write_text(json.dumps({"format": "verispec-head", **asdict(config)}, indent=2) + "\n")


def load_head(folder: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """A head's config and weights (ValueError naming the fix when the folder is not a head)."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not is_head_folder(folder):
        raise ValueError(f"{folder} is not a draft head folder (no {HEAD_CONFIG}); make one with "
                         f"`verispec distill --head --target MODEL --out DIR`")
    raw = json.loads((folder / HEAD_CONFIG).read_text())
    raw.pop("format", None)
    return HeadConfig(**raw), load_file(str(folder / HEAD_WEIGHTS))


class HeadDrafter(Drafter):
    """Drafts with a trained head on the target's features; one head forward per draft depth for all rows."""

    name = "head"
    provides_probs = True
    wants_features = True

    def __init__(self, config: HeadConfig, weights: dict[str, torch.Tensor], target, max_len: int,
                 num_slots: int = 1, name: str = "head") -> None:
        embed = target.get_input_embeddings().weight
        if embed.device.type == "meta":  # the target runs on quantized weights (target.quantize_target)
            raise ValueError("a draft head reads the target's float embedding and LM head, which a target on "
                             "quantized weights (--weights gguf, --quantization) no longer holds: load the target "
                             "with --weights fp32, or draft with another drafter")
        if embed.shape[0] < config.target_vocab_size or embed.shape[1] != config.hidden_size:
            raise ValueError(f"this draft head was trained for a target with hidden size {config.hidden_size} and "
                             f"{config.target_vocab_size} tokens ({config.target}); the target has "
                             f"{embed.shape[1]} and {embed.shape[0]}: pick the head made for this target")
        self.config = config
        self.name = name
        self.max_len = max_len + TREE_SLACK
        self.spec = config.spec()
        self.device, self.dtype = embed.device, embed.dtype
        w = {k: v.to(self.device) for k, v in weights.items()}
        self.vocab = w["vocab"].long()  # [draft_vocab] target ids
        self.embed = embed  # the target's (shared, frozen)
        lm = target.get_output_embeddings().weight.detach()[self.vocab]  # [draft_vocab, hidden]
        self.lm_head = Linear(lm.to(self.dtype), None, pack=True)
        self.swap_weights(pack_head(self.spec, w, self.dtype, self.device))
        from ..runtime.model.build import rope_table

        cos, sin = rope_table(target, self.max_len)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)  # [max_len, head_dim]
        self.cache = SlotCache(1, 0, self.max_len)  # lengths[slot]: pairs in the head cache (D)
        self.pending: list[list[torch.Tensor]] = []  # [slot]: target features not fed yet, in order
        self.reserve(num_slots)

    # -- slots ---------------------------------------------------------------------------------------------------

    def reserve(self, num_slots: int, runner: RunnerOptions | None = None) -> None:
        self.pending += [[] for _ in range(num_slots - len(self.pending))]
        self.cache.reserve(num_slots)  # buffers are made on the first forward that uses a slot

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        self.cache.set_length(slot, 0)
        self.pending[slot] = []

    def observe_features(self, slot: int, features: torch.Tensor) -> None:
        """The target's features at the next committed positions ([m, hidden], in order)."""
        self.pending[slot].append(features.detach())

    @torch.inference_mode()  # the buffers were made under inference mode (`propose`): in-place writes must be too
    def move_slot(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)
        self.pending[dst], self.pending[src] = self.pending[src], []

    def release(self, slot: int) -> None:
        self._clear(slot)

    def rebind_embeddings(self, embed: torch.Tensor) -> None:
        """Use another copy of the target's embedding matrix (the native twin's, once HF's copy is freed)."""
        self.embed = embed

    # -- weights that change while serving (server/online.py) ----------------------------------------------------

    def swap_weights(self, weights: HeadWeights) -> None:
        """Draft with other trained weights from the next forward on. The caller swaps between engine steps, never
        during one; the pairs already in the head cache keep the keys and values the old weights made (a draft's
        numerics move only acceptance, never the output)."""
        self.fc, self.block, self.norm = weights.fc, weights.block, weights.norm

    def fork(self) -> HeadDrafter:
        """A drafter on the same weights (shared until one of them swaps) and the same frozen target tensors, with
        slots of its own: the per-API-key copy an online-trained deployment drafts with."""
        twin = copy.copy(self)
        twin.cache = SlotCache(1, 0, self.max_len)
        twin.pending = []
        twin.reserve(len(self.pending))
        return twin

    # -- the head ------------------------------------------------------------------------------------------------

    def _forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 write_index: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass over slots [0, b). tokens, positions, write_index [b, n]; features [b, n, hidden]; visible
        [b, n, L] bool (the cache entries each fed pair sees: the kept pairs, and a tree node's ancestors, which
        sit at the head's own node indices, so not `kv_cache.attention_mask`'s layout) -> predicted features
        [b, n, hidden], draft logits [b, n, V']."""
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~visible, torch.finfo(self.dtype).min).unsqueeze(1)  # [b, 1, n, L]
        x = self.fc(torch.cat([F.embedding(tokens, self.embed), features.to(self.dtype)], dim=-1))  # [b, n, hidden]
        cos = self.cos[positions].unsqueeze(1).to(self.dtype)  # [b, 1, n, d]
        sin = self.sin[positions].unsqueeze(1).to(self.dtype)
        keys, values = self.cache.buffers(0, tokens.shape[0], x.new_empty(0, self.spec.num_kv_heads, 0,
                                                                            self.spec.head_dim))
        x = layer_step(x, cos, sin, keys, values, write_index.view(*tokens.shape, 1).unsqueeze(1),
                       mask, self.block.weights(), self.spec, self.block.packed)
        hidden = rms_norm(x, self.norm, self.spec.rms_norm_eps)
        return hidden, self.lm_head(hidden)

    def _full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits [..., V'] -> target-vocabulary logits [..., vocab] (-inf outside the draft vocab)."""
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, logits)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        start = time.perf_counter()
        rows = batch.rows
        b = len(rows)
        device = self.device
        feeds = [torch.cat(self.pending[r.slot]) if r.member and self.pending[r.slot] else None for r in rows]
        counts = [0 if f is None else f.shape[0] for f in feeds]
        width = max(counts)
        bases = [self.cache.lengths[r.slot] for r in rows]  # D per row
        # A row drafts from the output of its newest real pair, so it needs at least one pair fed now.
        ks = [min(r.k, self.max_len - TREE_SLACK - r.token_ids.numel()) if r.member and counts[i] > 0 else 0
              for i, r in enumerate(rows)]
        if width == 0:  # nothing to feed, so nothing to draft from (a row drafts only after a pair is fed)
            return [DraftProposal(r.token_ids.new_empty(0), None, 0.0) for r in rows]
        assert all(r.slot == i for i, r in enumerate(rows))
        # 1. the pending real pairs (f_i, x_{i+1}), i = D .. N-2, ragged and right-padded
        kept = [bases[i] + counts[i] for i in range(b)]  # N - 1 for members
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)  # [b, width]
        features = torch.zeros(b, width, self.spec.hidden_size, dtype=self.dtype, device=device)
        for i, row in enumerate(rows):
            if counts[i]:
                tokens[i, : counts[i]] = row.token_ids[bases[i] + 1 : kept[i] + 1]
                features[i, : counts[i]] = feeds[i]
        write_index = torch.tensor(bases, device=device).unsqueeze(1) + torch.arange(width, device=device)  # [b, w]
        visible = torch.arange(max(kept), device=device).view(1, 1, -1) <= write_index.unsqueeze(-1)  # [b, w, L]
        hidden, logits = self._forward(tokens, features, write_index, write_index, visible)
        at = torch.tensor([max(c - 1, 0) for c in counts], device=device)  # [b]: each row's newest real pair
        for i, row in enumerate(rows):
            if row.member:
                self.cache.lengths[row.slot] = kept[i]
                self.pending[row.slot] = []
        if not any(ks):
            return [DraftProposal(r.token_ids.new_empty(0), None, time.perf_counter() - start) for r in rows]
        every = torch.arange(b, device=device)
        proposals = self._draft(batch, ks, kept, hidden[every, at], logits[every, at])
        seconds = time.perf_counter() - start
        for p in proposals:
            p.seconds = seconds
        return proposals

    def _draft(self, batch: DraftBatch, ks: list[int], kept: list[int], root_hidden: torch.Tensor,
               root_logits: torch.Tensor) -> list[DraftProposal]:
        """Chains or trees from each drafting row's root output (root_hidden [b, hidden], root_logits [b, V'])."""
        rows = batch.rows
        b, device, vocab = len(rows), self.device, batch.sampling.vocab_size
        trees = [rows[i].tree_nodes > ks[i] and ks[i] > 0 for i in range(b)]
        coupled = batch.sampling.coupled
        chain_sampled = [not greedy and not tree and not c
                         for greedy, tree, c in zip(batch.sampling.greedy.tolist(), trees, coupled)]
        branch = [TREE_BRANCH if trees[i] else 1 for i in range(b)]
        # Per row: nodes as (token, parent node index in this list + 1 (0 = root), log score, depth, q or None)
        nodes: list[list[tuple]] = [[] for _ in range(b)]
        frontier_hidden = root_hidden.unsqueeze(1)  # [b, F, hidden]: the features their children read
        frontier_logits = root_logits.unsqueeze(1)  # [b, F, V']
        parents_of = [[0] for _ in range(b)]  # per row, per frontier entry: its node number (0 = root)
        score_of = [[0.0] for _ in range(b)]
        fed_ids: list[list[int]] = [[] for _ in range(b)]  # node numbers in the order they were fed (cache order)
        ancestors: list[dict[int, list[int]]] = [{0: []} for _ in range(b)]  # node number -> fed ancestors + self
        stopped = [False] * b
        for depth in range(1, max(ks) + 1):
            check_finite(frontier_logits, "draft head")
            full = self._full_logits(frontier_logits.float(), vocab)  # [b, F, vocab]
            processed = process_logits(full, batch.sampling, None, start=depth - 1)  # [b, F, vocab]
            q = stable_softmax(processed)  # [b, F, vocab]
            top_p, top_ids = q.topk(TREE_BRANCH, dim=-1)  # [b, F, branch]
            if any(coupled):
                # A coupled row's first child is its coupled choice, argmax(log q + g) with the target's noise at
                # that output position (every frontier node is at this depth); its top tokens follow in a tree.
                at_depth = torch.zeros(q.shape[:2], dtype=torch.long, device=device)  # [b, F]
                choice = row_choices(processed, batch.sampling, start=depth - 1, depths=at_depth)  # [b, F]
                top_ids = torch.cat([choice.unsqueeze(-1), top_ids], dim=-1)  # [b, F, 1 + branch]
                top_p = torch.cat([q.gather(-1, choice.unsqueeze(-1)), top_p], dim=-1)
            sampled_ids = None
            if any(chain_sampled):
                uniform = row_uniforms(rows, [chain_sampled[i] and depth <= ks[i] and not stopped[i] for i in range(b)],
                                       device)  # [b]
                sampled_ids = sample_from_probs(q[:, 0], uniform).tolist()  # [b]
            top_p, top_ids = top_p.tolist(), top_ids.tolist()  # one host sync per depth
            children: list[list[int]] = [[] for _ in range(b)]
            for i in range(b):
                if depth > ks[i] or stopped[i]:
                    continue
                for f, parent in enumerate(parents_of[i]):
                    if parent < 0:  # padding of the frontier
                        continue
                    if chain_sampled[i]:
                        token = sampled_ids[i]
                        options = [(token, q[i, f, token].item(), q[i, f])]
                    else:
                        options = [(token, prob, None) for token, prob in zip(top_ids[i][f], top_p[i][f])]
                        if coupled[i]:  # the choice, then the other top tokens
                            options = options[:1] + [o for o in options[1:] if o[0] != options[0][0]]
                        options = options[: branch[i]]
                    for token, prob, q_row in options:
                        if prob <= 0.0:
                            continue
                        if not trees[i] and rows[i].threshold > 0 and depth > 1 and max(top_p[i][f]) < rows[i].threshold:
                            stopped[i] = True  # the draft is unsure: verifying what we have is cheaper
                            break
                        nodes[i].append((token, parent, score_of[i][f] + math.log(prob), depth,
                                         q_row if chain_sampled[i] else None))
                        children[i].append(len(nodes[i]))  # node number (1-based)
            if depth == max(ks):
                break
            # Expand the best `beam` children of this depth (all of a chain's one) in one head forward.
            chosen = [sorted(children[i], key=lambda n: -nodes[i][n - 1][2])[: (TREE_BEAM if trees[i] else 1)]
                      if depth < ks[i] else [] for i in range(b)]
            if not any(chosen):
                break
            width = max(len(c) for c in chosen)
            tokens = torch.zeros(b, width, dtype=torch.long, device=device)
            features = torch.zeros(b, width, self.spec.hidden_size, dtype=self.dtype, device=device)
            positions = torch.zeros(b, width, dtype=torch.long, device=device)
            write_index = torch.zeros(b, width, dtype=torch.long, device=device)
            kv_len = max(kept[i] + len(fed_ids[i]) + len(chosen[i]) for i in range(b))
            visible = torch.zeros(b, width, kv_len, dtype=torch.bool, device=device)
            for i in range(b):
                visible[i, :, : kept[i]] = True
                for t, n in enumerate(chosen[i]):
                    token, parent, _, d, _ = nodes[i][n - 1]
                    f = parents_of[i].index(parent)
                    tokens[i, t] = token
                    features[i, t] = frontier_hidden[i, f]
                    positions[i, t] = kept[i] - 1 + d
                    slot_index = kept[i] + len(fed_ids[i])
                    write_index[i, t] = slot_index
                    fed_ids[i].append(n)
                    ancestors[i][n] = ancestors[i][parent] + [slot_index]
                    visible[i, t, ancestors[i][n]] = True
                for t in range(len(chosen[i]), width):  # padding: sees the prefix, writes past the real nodes
                    write_index[i, t] = kept[i] + len(fed_ids[i]) + (t - len(chosen[i]))
                    visible[i, t, : kept[i]] = True
                    positions[i, t] = max(kept[i] - 1, 0)
            frontier_hidden, frontier_logits = self._forward(tokens, features, positions, write_index,
                                                             visible | _self_visible(write_index, kv_len))
            parents_of = [list(c) for c in chosen]
            score_of = [[nodes[i][n - 1][2] for n in chosen[i]] for i in range(b)]
            for i in range(b):
                parents_of[i] += [-1] * (width - len(parents_of[i]))
        return [self._proposal(rows[i], nodes[i], trees[i]) for i in range(b)]

    def _proposal(self, row, nodes: list[tuple], tree: bool) -> DraftProposal:
        if not nodes:
            return DraftProposal(row.token_ids.new_empty(0), None)
        if not tree:  # a chain: nodes are in depth order, each the child of the previous
            tokens = torch.tensor([n[0] for n in nodes], dtype=torch.long, device=row.token_ids.device)
            # Sampled rows carry q (their tokens were drawn from it); greedy verification needs none.
            probs = torch.stack([n[4] for n in nodes]) if nodes[0][4] is not None else None  # [k, vocab]
            return DraftProposal(tokens, probs)
        keep = best_nodes([n[2] for n in nodes], [n[3] for n in nodes], row.tree_nodes, row.verify_cost)
        return as_tree(row, [n[0] for n in nodes], [n[1] for n in nodes], keep)


@dataclass(frozen=True)
class HeadWeights:
    """A head's trained weights as its forward runs them (packed linears): made off the engine thread (packing takes
    a while), then swapped into a drafter between steps (`HeadDrafter.swap_weights`)."""

    fc: Linear
    block: Block
    norm: torch.Tensor  # [hidden]


def pack_head(spec: LlamaSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
              device: torch.device) -> HeadWeights:
    """The trainable weights of a head's weight dict (`load_head`'s names; `vocab` is not read) in `dtype`."""
    w = {k: v.detach().to(device=device, dtype=dtype) for k, v in weights.items() if k != "vocab"}
    return HeadWeights(Linear(w["fc.weight"], None, pack=True),
                       Block(spec, {k.removeprefix("layer."): v for k, v in w.items() if k.startswith("layer.")},
                             pack=True),
                       w["norm.weight"])


def _self_visible(write_index: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[b, n, L] bool: each fed entry sees itself (padding entries too, so no query sees nothing)."""
    return torch.arange(kv_len, device=write_index.device).view(1, 1, -1) == write_index.unsqueeze(-1)


def head_drafter(path: str | Path, target, max_len: int, name: str | None = None) -> HeadDrafter:
    """The drafter of the head in `path` for `target` (ValueError when it does not fit)."""
    config, weights = load_head(path)
    return HeadDrafter(config, weights, target, max_len, name=name or f"{HEAD_PREFIX}{Path(path).name}")
