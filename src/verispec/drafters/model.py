"""A small causal LM as drafter, with a batched KV cache (one slot per running sequence) kept across rounds."""

from __future__ import annotations

import logging
import time

from typing import TYPE_CHECKING

import torch

from ..config import MAX_DRAFT_TOKENS, RunnerOptions
from ..runtime.caches.prefix_cache import PrefixCache
from ..runtime.model.native_lm import is_causal_lm
from ..runtime.runners import select as runners
from ..runtime.runners.select import make_runner
from ..sampling import check_finite, process_logits, row_choices, sample_from_probs, stable_softmax
from .base import DraftBatch, DraftProposal, DraftRow, Drafter
from .model_tree import grow_trees
from .tree import TREE_BEAM
from ..runtime.model.reduced_head import expand_logits
from ..runtime.model.twins import facts, is_released
from .twin_head import ReducedHead, draft_vocab_ids, restrict_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger("verispec")

# The block type a draft model's linears and LM head run as on the native CPU runner where
# `RunnerOptions.draft_weights` picks blocks (its docstring says why "auto" does wherever the quantized kernel runs).
DRAFT_QTYPE = "Q8_0"


def draft_weights(model: PreTrainedModel, options: RunnerOptions | None) -> str:
    """What `model`'s weights run as under the runner `options`: DRAFT_QTYPE or "float" (`options.draft_weights`)."""
    from ..runtime.kernels import quant
    from ..runtime.model.llama import LlamaSpec, UnsupportedModel
    from ..runtime.model.twins import model_device

    if is_released(model):  # its native twin's weights were chosen at load
        return facts(model).draft_weights or "float"

    options = options or runners.DEFAULT_OPTIONS  # what make_runner will use
    if options.draft_weights == "float" or options.backend == "hf" or options.compile:
        return "float"
    try:
        spec = LlamaSpec.from_config(model.config, 1)
    except UnsupportedModel:
        return "float"
    fits = spec.hidden_size % quant.BLOCK == 0 and spec.intermediate_size % quant.BLOCK == 0
    if not fits or model_device(model).type != "cpu" or quant.kernel() is None:
        return "float"
    return DRAFT_QTYPE


def to_draft_blocks(model: PreTrainedModel, max_len: int, activations: str = "fp32") -> None:
    """Give `model`'s native twin DRAFT_QTYPE blocks for its linears and LM head (where `draft_weights` says so);
    a reduced head (`draft_vocab_ids`) keeps only its rows, so a draft step computes n logits, not the vocabulary's.
    HF keeps its float copies (the bench's HF assisted generation runs them). activations: what the blocks compute
    with (`RunnerOptions.draft_activations`)."""
    from ..runtime.kernels.quant import quantize_linears
    from ..runtime.model.llama import Linear
    from ..runtime.model.build import weights_of
    from ..runtime.model.twins import use_quantized_weights

    native = use_quantized_weights(model, max_len, quantization=DRAFT_QTYPE, release=False,
                                   activations=activations)
    ids = draft_vocab_ids(model)
    if ids is not None:  # set before the twin's first forward, which reads its weights' structure
        head = weights_of(model)["lm_head.weight"]  # [vocab, hidden]
        rows = quantize_linears({"lm_head.weight": head[ids]}, DRAFT_QTYPE, activations)["lm_head.weight"]
        native.lm_head = Linear(ReducedHead(rows, ids, head.shape[0]), None, pack=False)
        facts(model).reduced_head = True
    facts(model).draft_weights = DRAFT_QTYPE
    logger.info("draft model: linears and LM head as %s blocks, %s activations (a draft's numerics move only "
                "acceptance)%s", DRAFT_QTYPE, activations,
                "" if ids is None else f"; head reduced to its {len(ids)} draft-vocabulary tokens")


def _in_blocks(model: PreTrainedModel) -> bool:
    return facts(model).draft_weights == DRAFT_QTYPE


def model_drafters(drafter) -> list[ModelDrafter]:
    """The stages of `drafter` (a cascade's, or itself) that draft with a causal LM of their own, unwrapped from a
    draft across tokenizers; [] for None or a model-free drafter."""
    found = []
    for stage in getattr(drafter, "stages", [drafter]) if drafter is not None else ():
        stage = getattr(stage, "inner", stage)  # a draft across tokenizers wraps its model drafter
        if isinstance(stage, ModelDrafter) and is_causal_lm(stage.model):
            found.append(stage)
    return found


def draft_model_weights(drafter) -> str | None:
    """What the draft models among `drafter`'s stages run as once reserved (DRAFT_QTYPE or "float"; a twin is its own
    format, `self:...`), for --json and bench reports; None where no draft model drafts."""
    return ", ".join(facts(stage.model).draft_weights or "float"
                     for stage in model_drafters(drafter)) or None


def cross(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The one way a tensor moves between the target's device and the draft model's (a no-op where they are the
    same); tests count its calls."""
    return tensor.to(device)


class ModelDrafter(Drafter):
    """Drafts autoregressively with a draft model, all rows of a step in one forward per draft step.

    Cache invariant (per slot of a member sequence with N committed tokens): the draft cache holds a prefix
    seq[:D], D <= N - 1. Nothing runs at `begin`: the prompt's prefill is deferred to the row's first draft, so a
    row that never drafts never runs the draft model and the first token waits for the target alone. A drafting row
    that lags by more than `IN_BATCH` tokens (its first draft, or rounds it sat out) catches up on seq[D:N-1] in
    its own forwards (`CATCH_UP_CHUNK` tokens each; the draft's prefix cache first, at its first draft), never
    padded into the other rows' forward; a row drafting alone (batch 1, or the only drafting row) feeds it in its
    first draft forward instead (`_folded`: one forward less), unless the prefix cache serves its prompt. A round then feeds each drafting row what its cache lacks (seq[D:N]) and
    each idle row that has started up to as many of seq[D:N-1] as the widest drafting row's feed (free inside the
    same forward), then one token per draft step; shorter rows are padded, and every row's kept length is set back
    to what it really holds. `observe` truncates to the part the target kept. Nothing is re-encoded.

    Token trees: a row offered one (`DraftRow.tree_nodes` > k) gets one from `model_tree.grow_trees`, one forward per
    depth over every row's frontier after this first forward; afterwards each slot is set back to seq[:N], so the
    next round feeds the accepted path and the next token (up to `IN_BATCH_TREE` tokens in the batched forward).

    Devices: the draft model may live on another device than the target (`--draft-device`). Per `propose`, the
    committed tokens a round feeds cross to the draft's device in one copy ([batch, width]), the sampled rows'
    uniforms in one ([batch, K]) and the rows' sampling tensors (SamplingBatch.to); the draft tokens ([batch, K])
    and q ([batch, K, vocab]) come back to the target's device in one copy each: proposals are views of those. A
    tree round crosses per depth its fed nodes, positions, mask and the sampled rows' uniforms (one copy each), and
    each sampled row's q comes back in one copy.
    """

    name = "model"
    provides_probs = True
    prefills_lazily = True
    prefix_tokens = 0  # KV of prompt prefixes kept for later prompts (`keep_prefixes`; 0: off)
    _prefix: PrefixCache | None = None
    IN_BATCH = 2  # tokens a drafting row may feed in the batched forward (a round that accepted all: 2)
    IN_BATCH_TREE = MAX_DRAFT_TOKENS + 1  # the same for a row offered trees: its cache keeps only the committed
    # prefix after a tree round (model_tree.py), so the next round feeds the accepted path and the next token
    CATCH_UP_CHUNK = 512  # tokens per forward of a row's own catch-up (a long prompt runs in chunks)

    _runner = None
    _slots = 1
    vocab_ids: torch.Tensor | None = None  # [n]: a reduced head's target ids (twin_head.draft_vocab_ids), or None

    def __init__(self, model: PreTrainedModel, max_len: int, num_slots: int = 1,
                 runner: RunnerOptions | None = None) -> None:
        self.model = model
        self.max_len = max_len
        self.options = runner
        self._slots = num_slots
        # A reduced head (twin_head.draft_vocab_ids): q is 0 outside it on every path (the native Q8_0 twin
        # computes only its rows; float weights and HF modeling compute all and are restricted in `_logits`).
        self.vocab_ids = draft_vocab_ids(model) if is_causal_lm(model) else None

    @property
    def runner(self):
        """The draft model's runner, made on first use: the weights are chosen at the first `reserve`, when the
        engine's runner options are known, so a runner on weights about to be replaced is never built."""
        if self._runner is None:
            self._runner = make_runner(self.model, self.max_len, self._slots, self.options)
        return self._runner

    @runner.setter
    def runner(self, runner) -> None:
        self._runner = runner

    @property
    def _unstarted(self) -> dict[int, int]:
        """slot -> prompt length, for rows whose first draft has yet to prefill the prompt (made on first use:
        a subclass may build its runner without ModelDrafter.__init__, as twin.py does)."""
        return self.__dict__.setdefault("_unstarted_slots", {})

    def reserve(self, num_slots: int, runner: RunnerOptions | None = None) -> None:
        options = runner if runner is not None else self.options
        to_blocks = not _in_blocks(self.model) and draft_weights(self.model, options) == DRAFT_QTYPE
        if to_blocks:
            to_draft_blocks(self.model, self.max_len, (options or runners.DEFAULT_OPTIONS).draft_activations)
        if (runner is not None and runner != self.options) or to_blocks:
            self.options = options
            self.runner = make_runner(self.model, self.max_len, num_slots, options)
        self.runner.reserve(num_slots)  # buffers are allocated on the first forward, so this is cheap

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        # No prefill here: the row's first draft catches its cache up (`_catch_up`), so a sequence joins at the
        # target's cost alone, and one that never drafts never runs the draft model.
        self.runner.reset(slot)
        self._unstarted[slot] = prompt_ids.numel()

    def keep_prefixes(self, tokens: int) -> None:
        if tokens != self.prefix_tokens:  # another size (0 included) starts a new, empty cache
            self._prefix = None
        self.prefix_tokens = tokens

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The draft's own prefix cache (None: off); its `hit_tokens` are the prompt tokens the draft did not prefill."""
        return self._prefix_cache()

    def _catch_up(self, row: DraftRow) -> float:
        """A drafting row's own forwards over what its cache lacks but the last committed token (seq[D:N-1]):
        at its first draft, the prompt's cached prefix copied in first and its blocks stored after. -> seconds."""
        start = time.perf_counter()
        slot, tokens = row.slot, row.token_ids  # [N]
        prompt = self._unstarted.pop(slot, None)
        prefix = self._prefix_cache() if prompt is not None else None
        prompt_ids = tokens[: prompt - 1].tolist() if prefix is not None else []  # the prompt's entries, cached
        if prefix is not None:
            prefix.load(slot, prefix.match(prompt_ids))  # a cached prefix is copied in
        device, end = self.runner.device, tokens.numel() - 1
        for begin in range(self.runner.lengths[slot], end, self.CATCH_UP_CHUNK):
            chunk = tokens[begin : min(begin + self.CATCH_UP_CHUNK, end)].unsqueeze(0)  # [1, chunk]
            self.runner.forward(cross(chunk, device), start_slot=slot, last_only=True)
        if prefix is not None:
            prefix.insert(slot, prompt_ids)
        return time.perf_counter() - start

    def _prefix_cache(self) -> PrefixCache | None:
        """The draft model's own prefix cache (runtime/caches/prefix_cache.py), on its current runner's cache."""
        if self.prefix_tokens and (self._prefix is None or self._prefix.cache is not self.runner.cache):
            self._prefix = PrefixCache(self.runner.cache, self.prefix_tokens)
        return self._prefix if self.prefix_tokens else None

    def observe(self, slot: int, committed_length: int, num_accepted: int, num_proposed: int) -> None:
        # The cache holds seq_before + draft[:-1]; of those, seq_before + accepted draft tokens are still valid.
        self.runner.truncate(min(self.runner.lengths[slot], committed_length - 1), slot)

    def move_slot(self, src: int, dst: int) -> None:
        self.runner.move_slot(src, dst)
        self._unstarted.pop(dst, None)
        if src in self._unstarted:
            self._unstarted[dst] = self._unstarted.pop(src)

    def release(self, slot: int) -> None:
        self.runner.reset(slot)
        self._unstarted.pop(slot, None)

    def _logits(self, logits: torch.Tensor, compact: bool = False) -> torch.Tensor:
        """The runner's logits [batch, n, vocab], restricted to a reduced head where the runner ran the full one. A
        compact reduced head's (runtime/model/reduced_head.py: [batch, n, len(vocab_ids)]) are put in their tokens'
        places, or kept as they are with `compact` (the caller maps them: `_greedy_choices`)."""
        if self.vocab_ids is None:
            return logits
        if self.vocab_ids.device != logits.device:
            self.vocab_ids = self.vocab_ids.to(logits.device)
        if logits.shape[-1] == self.vocab_ids.numel() < self.model.config.vocab_size:  # a compact head's subset
            return logits if compact else expand_logits(logits, self.vocab_ids, self.model.config.vocab_size)
        if facts(self.model).reduced_head:
            return logits
        return restrict_logits(logits, self.vocab_ids)

    def _greedy_choices(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Plain greedy rows' draft tokens [batch] from `_logits(..., compact=True)` [batch, 1, n]: the first
        maximum (row_choices' rule), mapped to its token id where the head is compact; the same token as
        process_logits + row_choices give on the vocabulary-wide logits (-inf outside the subset), without them."""
        if self.vocab_ids is not None and logits.shape[-1] == self.vocab_ids.numel():
            return self.vocab_ids[logits[:, 0].max(dim=-1).indices]
        return logits[:, 0, :vocab_size].max(dim=-1).indices

    def _tree_forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
        """One depth of token trees (model_tree.py): tokens, positions [batch, w] and tree_mask [batch, w, m] from
        the host -> the draft's logits [batch, w, vocab]."""
        device = self.runner.device
        out = self.runner.forward(cross(tokens, device), positions=cross(positions, device),
                                  tree_mask=cross(tree_mask, device))
        return self._logits(out.logits)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        rows = batch.rows
        device = self.runner.device  # the draft model's
        home = rows[0].token_ids.device  # the target's: committed tokens live there, and proposals go back there
        lengths = self.runner.lengths
        # Room in the cache: the k draft tokens must fit after the committed sequence.
        ks = [min(row.k, self.max_len - row.token_ids.numel()) if row.member else 0 for row in rows]
        trees = [row.tree_nodes > k > 0 for row, k in zip(rows, ks)]
        in_batch = [self.IN_BATCH_TREE if tree else self.IN_BATCH for tree in trees]
        folded = self._folded(rows, ks, in_batch)  # rows whose catch-up rides in the first draft forward
        catch_up = [self._catch_up(row) if k > 0 and not fold and (row.slot in self._unstarted or
                                                                   row.token_ids.numel() - lengths[row.slot] > most)
                    else 0.0 for row, k, most, fold in zip(rows, ks, in_batch, folded)]  # seconds of own catch-ups
        start = time.perf_counter()
        feeds = [row.token_ids[lengths[row.slot] :] if k > 0 else row.token_ids.new_empty(0)
                 for row, k in zip(rows, ks)]
        width = max(feed.numel() for feed in feeds)
        if width == 0:
            return [DraftProposal(row.token_ids.new_empty(0), None, 0.0) for row in rows]
        idle_width = min(width, max(in_batch))  # (not a folded row's catch-up: an idle row may never draft again)
        for i, row in enumerate(rows):  # idle rows that have started catch up within the drafting rows' width
            if ks[i] == 0 and row.member and row.slot not in self._unstarted:
                end = min(row.token_ids.numel() - 1, lengths[row.slot] + idle_width)
                feeds[i] = row.token_ids[lengths[row.slot] : end]
        kept = [lengths[row.slot] + feed.numel() for row, feed in zip(rows, feeds)]
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=home)  # [batch, width], right-padded
        for i, feed in enumerate(feeds):
            tokens[i, : feed.numel()] = feed
        tokens = cross(tokens, device)  # the committed tokens: one copy to the draft's device
        sampling = batch.sampling.to(device)  # the rows' logits processing, where q is computed
        last = torch.tensor([[max(feed.numel() - 1, 0)] for feed in feeds], device=device)  # [batch, 1]
        # Chains of plain greedy rows take the argmax of the raw logits (a compact head's: [batch, 1, n])
        plain = not any(trees) and plain_greedy(sampling) and not any(row.threshold > 0 for row in rows)
        first = time.perf_counter()
        logits = self._logits(self.runner.forward(tokens, logits_at=last).logits, plain)  # [batch, 1, vocab or n]
        first = time.perf_counter() - first
        for row, length in zip(rows, kept):
            self.runner.truncate(length, row.slot)  # padding dropped: draft tokens go right after the real ones
        # Trees where a row is offered one and every depth's entries fit (each depth feeds <= TREE_BEAM per row).
        if any(trees) and max(kept) + TREE_BEAM * (max(ks) - 1) <= self.max_len:
            proposals = grow_trees(self._tree_forward, DraftBatch(rows, sampling), ks, kept, trees, logits,
                                   lambda probs: cross(probs, home))
            for row, length in zip(rows, kept):
                self.runner.truncate(length, row.slot)  # the committed prefix: tree entries are stale
            fold_s = self._fold_seconds(first, None) if any(folded) else 0.0
            seconds = time.perf_counter() - start - fold_s
            for proposal, own, fold in zip(proposals, catch_up, folded):
                proposal.seconds, proposal.catch_up_s = seconds, own + (fold_s if fold else 0.0)
            return proposals
        drafted_k = max(ks)
        step_s = None  # seconds of the latest one-token draft forward of this call
        drafted: list[torch.Tensor] = []  # per step: [batch]
        probs: list[torch.Tensor | None] = []  # per step: [batch, vocab] or None (all rows greedy)
        steps = [0] * len(rows)  # draft tokens kept per row
        # Rows that sample from q and carry it; greedy and coupled rows draft their own choice (a point mass): the
        # argmax, or argmax(log q + g) with the noise the target's coupled choice uses at that position.
        sampled = [not greedy and not coupled for greedy, coupled in zip(sampling.greedy.tolist(), sampling.coupled)]
        uniforms = step_uniforms(rows, sampled, ks, device) if any(sampled) and drafted_k else None  # [batch, max k]
        for step in range(drafted_k):
            check_finite(logits, "draft")
            q = None
            if plain:
                tokens_now = self._greedy_choices(logits, sampling.vocab_size)  # [batch]
            else:
                pending = torch.stack(drafted, dim=1) if drafted else None  # [batch, step]
                processed = process_logits(logits, sampling, pending, start=step)  # [batch, 1, vocab]
                tokens_now = row_choices(processed, sampling, start=step)[:, 0]  # [batch]
                processed = processed[:, 0]  # [batch, vocab]
            if any(sampled):
                q = stable_softmax(processed)  # [batch, vocab]
                drawn = torch.tensor(sampled, device=device)  # [batch] bool
                tokens_now = torch.where(drawn, sample_from_probs(q, uniforms[:, step]), tokens_now)
            for i, row in enumerate(rows):
                if step < ks[i] and steps[i] == step:
                    if row.threshold > 0 and step > 0:
                        # Draft-confidence cut-off (speculative_threshold): one host sync per row and step, only
                        # when it is on.
                        top = (q[i] if q is not None else stable_softmax(processed[i])).max()
                        if top < row.threshold:
                            continue  # the drafter is unsure: verifying what we have is cheaper than guessing on
                    steps[i] += 1
            drafted.append(tokens_now)
            probs.append(q)
            if step + 1 < drafted_k:
                step_start = time.perf_counter()
                logits = self._logits(self.runner.forward(tokens_now.unsqueeze(1)).logits, plain)  # [batch, 1, ...]
                step_s = time.perf_counter() - step_start
        # Each drafting row keeps seq[:N] plus its fed draft tokens (all but the last); idle rows what they caught up.
        for i, row in enumerate(rows):
            self.runner.truncate(kept[i] + max(steps[i] - 1, 0) if ks[i] > 0 else kept[i], row.slot)
        # Back to the target's device, one copy each (q is computed at every step where any row samples).
        drafted_all = cross(torch.stack(drafted, dim=1), home) if drafted else None  # [batch, max k]
        q_all = cross(torch.stack(probs, dim=1), home) if drafted and any(sampled) else None  # [batch, max k, vocab]
        fold_s = self._fold_seconds(first, step_s) if any(folded) else 0.0
        seconds = time.perf_counter() - start - fold_s
        proposals = []
        for i, row in enumerate(rows):
            n = steps[i]
            token_ids = drafted_all[i, :n] if n else row.token_ids.new_empty(0)  # [n]
            q_rows = q_all[i, :n] if n and sampled[i] else None  # [n, vocab]
            own = catch_up[i] + (fold_s if folded[i] else 0.0)
            proposals.append(DraftProposal(token_ids, q_rows, seconds, catch_up_s=own))
        return proposals

    def _folded(self, rows: list[DraftRow], ks: list[int], in_batch: list[int]) -> list[bool]:
        """Which rows feed their catch-up (more than `in_batch` tokens behind, or their deferred prompt) in the
        round's first draft forward rather than in forwards of their own: a row drafting alone (nothing to pad)
        at most CATCH_UP_CHUNK tokens behind, whose prompt the draft's prefix cache does not serve. One forward
        less a round that follows rounds another stage drafted (a cascade) or sat out (adaptive K at 0)."""
        lengths = self.runner.lengths
        if sum(k > 0 for k in ks) != 1:
            return [False] * len(rows)
        folded = []
        for row, k, most in zip(rows, ks, in_batch):
            behind = row.token_ids.numel() - lengths[row.slot]
            unstarted = row.slot in self._unstarted
            fold = (k > 0 and (unstarted or behind > most) and behind <= self.CATCH_UP_CHUNK
                    and not (unstarted and self._prefix_cache() is not None))
            if fold and unstarted:
                del self._unstarted[row.slot]  # (reset at `begin`: the forward fills it from position 0)
            folded.append(fold)
        return folded

    def _fold_seconds(self, first_s: float, step_s: float | None) -> float:
        """The part of a first draft forward that carried a folded catch-up: its time beyond a one-token draft
        step's (this call's, else the latest measured), so the adaptive policy's draft-step estimate stays a step's
        and the catch-up still counts as draft time in the request's stats."""
        if step_s is not None:
            self._step_s = step_s
        step = getattr(self, "_step_s", None)
        return max(0.0, first_s - step) if step is not None else 0.0


def plain_greedy(sampling) -> bool:
    """Whether every row of a SamplingBatch is greedy without logits processing (no penalties, bias, minimum
    length, grammar or coupled noise): each row's token is then the argmax of the raw logits."""
    return (sampling.all_greedy and sampling.noise_seeds is None and sampling.context_mask is None
            and sampling.output_counts is None and sampling.logit_bias is None and sampling.eos_mask is None
            and not sampling.grammars)


def step_uniforms(rows: list[DraftRow], sampled: list[bool], ks: list[int], device: torch.device | str) -> torch.Tensor:
    """[batch, max k]: U(0, 1) for each sampled row's draft steps (0.5 elsewhere, unused), one draw per step from
    the row's own generator in step order (the draws a step-by-step loop makes), on the generators' device (the
    target's), moved to the draft's device in one copy."""
    steps = max(ks)
    uniform = torch.full((len(rows), steps), 0.5, device=rows[0].generator.device)  # [batch, max k]
    for step in range(steps):
        for i, row in enumerate(rows):
            if sampled[i] and step < ks[i]:
                uniform[i, step : step + 1] = torch.rand(1, generator=row.generator, device=row.generator.device)
    return cross(uniform, device)
