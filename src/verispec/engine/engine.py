"""The speculative engine: many sequences advance together, one batched target forward per step.

    step() = admit -> propose -> verify -> commit

- admit: the scheduler (scheduler.py) lets waiting sequences take free slots (up to max_batch_size) in arrival
  order and prefills their prompts into their slots, in chunks within the step's token budget; a sequence whose
  prompt is complete joins the batch and decodes in the same step.
- propose: per running row, its drafter's routed stage and that stage's draft-length policy give K (0 for the
  target alone); every drafter proposes for its rows in one call (DraftBatch).
- verify: the target scores every row's last committed token plus its draft tokens in ONE forward over
  [batch, max_k + 1] (rows with shorter drafts are padded, their padding hidden by the 4D mask); logits are
  processed with each row's own sampling parameters; `verify.py` decides, per row, how many draft tokens are
  accepted and draws the recovered or bonus token from the row's own generator.
- commit: committed tokens go through each row's stop checks; caches roll back by moving per-slot lengths;
  finished sequences leave and the last running sequence moves into the freed slot (slots stay contiguous).

Cache invariant (DEVELOPERS.md): for a running sequence with committed tokens seq (length N), the target cache
slot holds seq[:N-1]; the last committed token is fed at the start of the next round.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..adaptive import AdaptivePolicy, FixedK
from ..config import MAX_FORCED_DRAFT, MAX_VERIFY_WIDTH, RunnerOptions, SamplingParams, SpeculativeConfig
from ..detokenize import StopChecker
from ..drafters.base import DraftBatch, Drafter, DraftProposal, DraftRow
from ..fallback import DrafterBackoff
from ..sampling import Grammar, RowSamplingState, SamplingBatch, check_finite, process_logits, stable_softmax
from ..stats import GenerationStats
from ..verify import (SpecDecodeMetadata, TreeDraft, VerifyResult, greedy_tree_verify, greedy_verify, path_tokens,
                      rejection_verify, top_n_accept, tree_rejection_verify)
from ..runtime.runner import make_runner
from .scheduler import PrefillChunk, Scheduler, SchedulerConfig
from .logprobs import round_logprobs
from .sequence import GenerationChunk, GenerationResult, Sequence, TokenLogprob, round_origins

logger = logging.getLogger("verispec")

# Room past max_len for the positions a verify pass writes beyond the committed sequence: a row near max_len is
# padded to the widest row's width, which the validated limits bound (config.MAX_VERIFY_WIDTH).
CACHE_SLACK = MAX_VERIFY_WIDTH


def model_eos_ids(model: PreTrainedModel, tokenizer=None) -> set[int]:
    """All EOS ids of the model's generation config (one or several), plus the tokenizer's EOS id."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class StepPlan:
    """The proposals of one step, row by row (rows = running sequences in slot order)."""

    ks: list[int]  # [batch]: draft tokens asked per row
    policies: list  # [batch]: the draft-length policy of each row (FixedK(0) for the target alone)
    proposals: list[DraftProposal]  # [batch]
    meta: SpecDecodeMetadata  # padded drafts and per-row draft lengths
    draft_probs: torch.Tensor | None  # [batch, max_k, vocab] q of rows that carry it, zeros elsewhere; None if none
    has_draft_probs: torch.Tensor  # [batch] bool
    sampling: SamplingBatch
    tree: TreeDraft | None = None  # set when a row proposed a token tree: every row is verified as a tree
    # (draft_probs is then [batch, nodes, vocab], q of node i at index i, zeros at the root)
    wants_features: bool = False  # a row's drafter reads the target's hidden states


@dataclass
class RoundOutcome:
    """What one verify pass decided, per row (host lists: the commit branches on them)."""

    accepted: list[list[int]]  # [batch][a]: the accepted draft tokens
    path: list[list[int]] | None  # [batch][a + 1]: a tree's accepted nodes, root (0) first; None for chains
    next_token: list[int]  # [batch]: the recovered or bonus token
    logprobs: dict[int, list[TokenLogprob]]
    verify_s: float
    hidden: torch.Tensor | None  # [batch, width, hidden]: the target's hidden states, when a drafter reads them


@dataclass
class StepReport:
    """What the latest step did (the server's metrics read it)."""

    rows: int = 0  # decoding rows verified
    tokens_fed: int = 0  # tokens of the verify pass: rows x (max K + 1)
    prefill_tokens: int = 0  # prompt tokens prefilled before it
    speculative_ks: list[int] = field(default_factory=list)  # K of each row that speculates (0: switched off)
    stages: list[str | None] = field(default_factory=list)  # [batch]: who drafts each row (None: the target alone)


class SpeculativeEngine:
    """Runs requests on one target, up to `max_batch_size` at a time in one batched step."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer,
        drafter: Drafter | None = None,
        spec: SpeculativeConfig | None = None,
        max_len: int = 2048,
        max_batch_size: int = 16,
        runner: RunnerOptions | None = None,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.runner_options = runner
        self.target = make_runner(target, max_len + CACHE_SLACK, max_batch_size, self.runner_options)
        self.tokenizer = tokenizer
        self.drafter = drafter
        if drafter is not None:
            drafter.reserve(max_batch_size, self.runner_options)
        self.spec = spec or SpeculativeConfig()
        self.max_len = max_len
        self.max_batch_size = max_batch_size
        self.eos_token_ids = model_eos_ids(target, tokenizer)
        self.running: list[Sequence] = []  # decoding sequences; index == slot
        self.scheduler = Scheduler(scheduler)
        self.waiting: deque[Sequence] = self.scheduler.waiting  # FIFO; sequences being prefilled are not in it
        self._staged: list[Sequence] = []  # being prefilled: each holds a slot past the decoding rows
        self.last_step = StepReport()
        self._last_width = 1  # tokens per row of the latest verify pass (max K + 1): the next step's budget guess
        self.total = GenerationStats()  # cumulative over finished requests
        self.last_stats = GenerationStats()  # the latest finished (or cancelled) request's
        # Per drafter, kept across requests: adaptive estimates (keyed by max depth) and failure back-off.
        self._policies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._backoffs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned_lossy = False

    # -- requests ------------------------------------------------------------------------------------------------

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if prompt_len + params.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds max_len "
                f"({self.max_len}); shorten the prompt, lower max_new_tokens or raise max_len"
            )

    def add_request(
        self,
        prompt_ids: Seq[int] | torch.Tensor,
        params: SamplingParams,
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
        drafter: Drafter | None = None,
    ) -> Sequence:
        """Queue a request; it starts at the next step with a free slot. prompt_ids is copied, never written to.

        `spec` overrides the engine's speculation config, `drafter` replaces the engine's drafter, and
        `use_drafter=False` runs the target alone through the same step."""
        spec = spec or self.spec
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()  # [n]
        self.check_request(prompt.numel(), params)
        if not spec.lossless and not self._warned_lossy:
            self._warned_lossy = True
            logger.warning("acceptance %s is LOSSY: outputs no longer follow the target's distribution",
                           acceptance_label(spec))
        device = self.target.device
        drafter = (drafter or self.drafter) if use_drafter else None
        if drafter is not None and not self._backoff(drafter).should_try():
            logger.info("drafter %s skipped for this request (back-off after failures)", drafter.name)
            drafter = None
        if drafter is not None:
            drafter.reserve(self.max_batch_size, self.runner_options)  # idempotent: a request-named drafter gets its slots here
        tokens = torch.empty(prompt.numel() + params.max_new_tokens + CACHE_SLACK, dtype=torch.long, device=device)
        tokens[: prompt.numel()] = prompt.to(device)
        generator = torch.Generator(device=device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        eos = self.eos_token_ids | set(params.stop_token_ids)
        grammar = None
        if params.structured is not None:
            grammar = Grammar(params.structured, self.tokenizer, self.target.vocab_size, self.eos_token_ids)
        seq = Sequence(
            tokens=tokens,
            length=prompt.numel(),
            prompt_len=prompt.numel(),
            params=params,
            spec=spec,
            sampling=RowSamplingState(params, eos, prompt.tolist(), self.target.vocab_size, device, grammar),
            generator=generator,
            stopper=StopChecker(params, self.eos_token_ids, self.tokenizer, params.max_new_tokens),
            drafter=drafter,
            stats=GenerationStats(prompt_tokens=prompt.numel(), requests=1, acceptance_mode=acceptance_label(spec),
                                  lossy=not spec.lossless),
            wall_start=time.perf_counter(),
            logprobs=None if params.logprobs is None else [],
        )
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now (a client went away); its figures still count. A decoding sequence's row leaves the
        batch at once (the next step runs without it)."""
        if seq.slot >= 0 and seq.slot < len(self.running) and self.running[seq.slot] is seq:
            self._finish(seq)
        elif self.scheduler.remove(seq):
            if seq in self._staged:  # it was being prefilled: its slot is free again
                self._staged.remove(seq)
                self.target.reset(seq.slot)
                seq.slot = -1
            self._close(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.scheduler)

    # -- the step ------------------------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Advance every running sequence by one round. -> the sequences that committed tokens (finished ones too)."""
        self._admit()
        if not self.running:
            return []
        plan = self._propose()
        outcome = self._verify_tree(plan) if plan.tree is not None else self._verify(plan)
        return self._commit(plan, outcome)

    def _admit(self) -> None:
        chunks = self.scheduler.schedule(decode_tokens=len(self.running) * self._last_width,
                                         free_slots=self.max_batch_size - len(self.running) - len(self._staged))
        self.last_step = StepReport(prefill_tokens=sum(c.end - c.start for c in chunks))
        for chunk in chunks:
            self._prefill(chunk)

    def _prefill(self, chunk: PrefillChunk) -> None:
        seq = chunk.seq
        if seq.slot < 0:
            self._stage(seq)
        if chunk.end > chunk.start:
            # Each chunk is its own forward, with boundaries set by the prompt alone: no padding, and the same
            # numbers as when the request runs alone.
            start = time.perf_counter()
            features = _wants_features(seq.drafter)  # a draft head reads the prompt's hidden states
            out = self.target.forward(seq.committed[chunk.start : chunk.end].unsqueeze(0), start_slot=seq.slot,
                                      last_only=True, all_hidden=features)
            if features:
                seq.features.append(out.hidden[0])  # [chunk, hidden]
            seq.stats.prefill_s += time.perf_counter() - start
        if chunk.joins:
            self._join(seq)

    def _stage(self, seq: Sequence) -> None:
        """Give a sequence about to be prefilled a free slot past the decoding rows. The first takes the lowest,
        where it will decode; one prefilled beside it takes the highest, out of the way."""
        held = {s.slot for s in self._staged}
        free = [slot for slot in range(len(self.running), self.max_batch_size) if slot not in held]
        seq.slot = free[-1] if self._staged else free[0]
        self._staged.append(seq)
        self.target.reset(seq.slot)

    def _join(self, seq: Sequence) -> None:
        """A sequence whose prompt is complete decodes from now on, in slot len(running) (slots stay contiguous)."""
        slot = len(self.running)
        if seq.slot != slot:
            # One copy of its prompt's entries. A prompt still being prefilled in that slot steps aside first, into
            # the slot the scheduler keeps free (its buffers exist: a second prompt was prefilled at the top).
            blocker = next((s for s in self._staged if s.slot == slot), None)
            if blocker is not None:
                held = {s.slot for s in self._staged}
                blocker_slot = max(s for s in range(slot, self.max_batch_size) if s not in held)
                self.target.move_slot(slot, blocker_slot)
                blocker.slot = blocker_slot
            self.target.move_slot(seq.slot, slot)
            seq.slot = slot
        self._staged.remove(seq)
        self.running.append(seq)
        if seq.drafter is not None:
            seq.drafter = self._safe(seq.drafter, seq.stats, lambda d: d.begin(seq.slot, seq.committed))
        if _wants_features(seq.drafter) and seq.features:
            features = torch.cat(seq.features)  # [prompt - 1, hidden]
            seq.drafter = self._safe(seq.drafter, seq.stats, lambda d: d.observe_features(seq.slot, features))
        seq.features = []

    def _propose(self) -> StepPlan:
        rows = self.running
        batch = len(rows)
        sampling = SamplingBatch.stack([seq.sampling for seq in rows], self.target.vocab_size, self.target.device)
        # K per row, from the policy of whoever drafts it (a cascade's stage has its own estimates); each policy
        # chooses once per step, knowing the batch size and how many of its rows it drafts for.
        routed, policies = [], []
        for seq in rows:
            active = None
            if seq.drafter is not None:
                active = self._safe(seq.drafter, seq.stats, lambda d: d.route(seq.committed), returns=True)
                if active is None:
                    seq.drafter = None
            routed.append(active)
            policies.append(self.draft_policy(seq.spec, active) if active is not None else FixedK(0))
        rows_of = Counter(map(id, policies))  # id(policy) -> rows it drafts for
        chosen = {id(policy): policy.choose(batch, rows_of[id(policy)]) for policy in policies}
        ks = [max(0, min(chosen[id(policy)], seq.remaining - 1)) for seq, policy in zip(rows, policies)]
        proposals = [DraftProposal(seq.committed.new_empty(0), None) for seq in rows]
        # A speculating row whose grammar forces the next tokens drafts them first (they are the only tokens its mask
        # allows); a drafter without probabilities (n-gram) continues after them, from the context extended by them.
        # A model drafter only catches up on them this round: its q would need the grammar state after them. Its
        # cache then holds tokens of the verified sequence only, so `observe` rolls it back as usual.
        forced = {i: draft for i, (seq, k) in enumerate(zip(rows, ks)) if k > 0
                  and (draft := _forced_draft(seq)) is not None}
        contexts = [torch.cat([seq.committed, forced[i]]) if i in forced else seq.committed
                    for i, seq in enumerate(rows)]
        draft_ks = [k if i not in forced else 0 if routed[i].provides_probs else
                    max(0, min(k, rows[i].remaining - 1 - forced[i].numel())) for i, k in enumerate(ks)]
        trees = self._tree_budgets(rows, policies)
        for drafter in {id(seq.drafter): seq.drafter for seq, k in zip(rows, ks) if k > 0}.values():
            members = [seq.drafter is drafter for seq in rows]
            draft_batch = DraftBatch([
                DraftRow(context, k if member else 0, seq.slot, seq.generator, member,
                         seq.spec.speculative_threshold, stage, nodes, cost)
                for seq, context, k, member, stage, (nodes, cost) in zip(rows, contexts, draft_ks, members, routed,
                                                                        trees)
            ], sampling)
            made = self._safe(drafter, None, lambda d: d.propose(draft_batch), returns=True, rows=[
                seq for seq, member in zip(rows, members) if member])
            if made is None:  # the drafter failed: its rows finish on the target alone
                continue
            for i, member in enumerate(members):
                if member:
                    proposals[i] = made[i]
        proposals = [_after_forced(forced[i], p) if i in forced else p for i, p in enumerate(proposals)]
        for i, seq in enumerate(rows):
            proposals[i] = _grammar_cut(seq, proposals[i])
        self.last_step.rows = batch
        self.last_step.speculative_ks = [k for k, stage in zip(ks, routed) if stage is not None]
        self.last_step.stages = [None if stage is None else stage.name for stage in routed]
        wants = any(_wants_features(seq.drafter) for seq in rows)
        if any(p.is_tree for p in proposals):
            return self._tree_plan(ks, policies, proposals, sampling, wants)
        max_k = max(p.token_ids.numel() for p in proposals)
        device = self.target.device
        draft_ids = torch.zeros(batch, max_k, dtype=torch.long, device=device)  # [batch, max_k], padded
        has_probs = [p.probs is not None and p.token_ids.numel() > 0 for p in proposals]
        draft_probs = None
        if any(has_probs):
            draft_probs = torch.zeros(batch, max_k, self.target.vocab_size, device=device)  # [batch, max_k, vocab]
        for i, proposal in enumerate(proposals):
            n = proposal.token_ids.numel()
            draft_ids[i, :n] = proposal.token_ids.to(device)
            if has_probs[i]:
                draft_probs[i, :n] = proposal.probs[:, : self.target.vocab_size].to(device)
        meta = SpecDecodeMetadata(draft_ids, torch.tensor([p.token_ids.numel() for p in proposals], device=device))
        self.last_step.tokens_fed = batch * (max_k + 1)
        return StepPlan(ks, policies, proposals, meta, draft_probs, torch.tensor(has_probs, device=device), sampling,
                        wants_features=wants)

    def _tree_budgets(self, rows: list[Sequence], policies: list) -> list[tuple[int, object]]:
        """[batch]: (tree node budget, verify cost of a width) per row. Trees need position-independent logits
        processing (no penalties or grammar) and exact acceptance; the adaptive policy's measured verify costs let
        the drafter size each tree (rows x width tokens fed: a wide tree costs every row of the step)."""
        if any(not seq.spec.lossless for seq in rows):
            return [(0, None)] * len(rows)
        budgets = []
        for seq, policy in zip(rows, policies):
            nodes = seq.spec.tree_nodes if seq.sampling.allows_trees else 0
            cost = None
            if nodes and isinstance(policy, AdaptivePolicy):
                cost = (lambda width, p=policy, b=len(rows): p.verify_cost(b * width))
            budgets.append((nodes, cost))
        return budgets

    def _tree_plan(self, ks: list[int], policies: list, proposals: list[DraftProposal], sampling: SamplingBatch,
                   wants: bool) -> StepPlan:
        """A step where some row proposed a token tree: every row's draft becomes a tree (a chain: node j's parent
        is node j - 1), verified together in one pass with a tree mask and tree positions."""
        rows = self.running
        device = self.target.device
        roots = torch.stack([seq.tokens[seq.length - 1] for seq in rows]).tolist()
        tokens = [p.token_ids.tolist() for p in proposals]
        parents = [p.parents.tolist() if p.is_tree else list(range(p.token_ids.numel())) for p in proposals]
        tree = TreeDraft.from_lists(roots, tokens, parents, device=device)
        n = tree.token_ids.shape[1]
        has_probs = [p.probs is not None and p.token_ids.numel() > 0 for p in proposals]
        draft_probs = None
        if any(has_probs):
            draft_probs = torch.zeros(len(rows), n, self.target.vocab_size, device=device)  # [batch, nodes, vocab]
            for i, p in enumerate(proposals):
                if has_probs[i]:
                    draft_probs[i, 1 : 1 + p.token_ids.numel()] = p.probs[:, : self.target.vocab_size].to(device)
        chain = SpecDecodeMetadata(tree.token_ids[:, 1:], tree.num_nodes - 1)  # node order: a chain row's draft
        self.last_step.tokens_fed = len(rows) * n
        return StepPlan(ks, policies, proposals, chain, draft_probs, torch.tensor(has_probs, device=device), sampling,
                        tree=tree, wants_features=wants)

    def _verify(self, plan: StepPlan) -> RoundOutcome:
        rows = self.running
        start = time.perf_counter()
        last = torch.stack([seq.tokens[seq.length - 1] for seq in rows]).unsqueeze(1)  # [batch, 1]
        fed = torch.cat([last, plan.meta.draft_token_ids], dim=1)  # [batch, max_k + 1]
        out = self.target.forward(fed, want_hidden=plan.wants_features)
        logits = out.logits  # [batch, max_k + 1, vocab]
        check_finite(logits, "target")
        processed = process_logits(logits, plan.sampling, plan.meta.draft_token_ids, start=0)  # [batch, max_k+1, V]
        extra = self._lossy_accept(plan, processed)
        result = greedy_verify(plan.meta, processed, extra)
        sampled = [seq for seq in rows if not seq.params.greedy]
        if sampled:
            # The noise comes from each row's own generator, k + 1 draws per row: a seeded request draws the same
            # numbers alone or beside others.
            max_k = plan.meta.draft_token_ids.shape[1]
            uniform_accept = torch.zeros(len(rows), max_k, device=logits.device)  # [batch, max_k]
            uniform_sample = torch.zeros(len(rows), device=logits.device)  # [batch]
            for seq in sampled:
                n = plan.proposals[seq.slot].token_ids.numel()
                u = seq.uniform(n + 1)
                uniform_accept[seq.slot, :n] = u[:n]
                uniform_sample[seq.slot] = u[n]
            drawn = rejection_verify(plan.meta, plan.draft_probs, plan.has_draft_probs, stable_softmax(processed),
                                     uniform_accept, uniform_sample, extra)
            greedy = plan.sampling.greedy.to(logits.device)
            result.num_accepted = torch.where(greedy, result.num_accepted, drawn.num_accepted)
            result.next_token = torch.where(greedy, result.next_token, drawn.next_token)
        # The one host sync of the step: the loop branches on how many tokens each row accepted.
        packed = torch.cat([result.num_accepted, result.next_token]).tolist()
        logprobs = round_logprobs(rows, plan.meta, processed, result)
        verify_s = time.perf_counter() - start
        accepted = [p.token_ids[:a].tolist() for p, a in zip(plan.proposals, packed[: len(rows)])]
        return RoundOutcome(accepted, None, packed[len(rows) :], logprobs, verify_s, out.hidden)

    def _verify_tree(self, plan: StepPlan) -> RoundOutcome:
        """Verify every row's token tree in one target pass: nodes at positions length + depth under the ancestor
        mask; greedy rows walk the argmax path, sampled rows recursive rejection over siblings (verify.py)."""
        rows = self.running
        start = time.perf_counter()
        tree = plan.tree
        device = self.target.device
        lengths = torch.tensor([self.target.lengths[seq.slot] for seq in rows], device=device)  # [batch]
        depths = tree.depths()  # [batch, nodes]
        positions = lengths.unsqueeze(1) + depths
        out = self.target.forward(tree.token_ids, positions=positions, tree_mask=tree.ancestor_mask(),
                                  want_hidden=plan.wants_features)
        logits = out.logits  # [batch, nodes, vocab]
        check_finite(logits, "target")
        # A tree row's processing depends on a node's depth alone (min_tokens' EOS mask); a chain row's (penalties,
        # grammar) on its drafts before each position, which are its nodes in order.
        processed = process_logits(logits, plan.sampling, plan.meta.draft_token_ids, start=0,
                                   depths=depths)  # [batch, nodes, vocab]
        result = greedy_tree_verify(tree, processed)
        sampled = [seq for seq in rows if not seq.params.greedy]
        if sampled:
            n = tree.token_ids.shape[1]
            uniform_accept = torch.zeros(len(rows), n, device=device)  # [batch, nodes]; index 0 unused
            uniform_sample = torch.zeros(len(rows), device=device)  # [batch]
            for seq in sampled:
                m = plan.proposals[seq.slot].token_ids.numel()
                u = seq.uniform(m + 1)  # as many draws as a chain of m tokens
                uniform_accept[seq.slot, 1 : m + 1] = u[:m]
                uniform_sample[seq.slot] = u[m]
            drawn = tree_rejection_verify(tree, plan.draft_probs, plan.has_draft_probs, stable_softmax(processed),
                                          uniform_accept, uniform_sample)
            greedy = plan.sampling.greedy.to(device)
            depth = max(result.path.shape[1], drawn.path.shape[1])
            result.path = torch.where(greedy.unsqueeze(1), _pad_to(result.path, depth), _pad_to(drawn.path, depth))
            result.num_accepted = torch.where(greedy, result.num_accepted, drawn.num_accepted)
            result.next_token = torch.where(greedy, result.next_token, drawn.next_token)
        # The one host sync of the step.
        batch = len(rows)
        packed = torch.cat([result.num_accepted, result.next_token, result.path.flatten()]).tolist()
        num_accepted, next_token = packed[:batch], packed[batch : 2 * batch]
        width = result.path.shape[1]
        paths = [packed[2 * batch + i * width : 2 * batch + i * width + a + 1] for i, a in enumerate(num_accepted)]
        tokens = tree.token_ids.tolist() if batch else []
        accepted = [[tokens[i][node] for node in path[1:]] for i, path in enumerate(paths)]
        logprobs = {}
        if any(seq.params.logprobs is not None for seq in rows):  # the path's processed logits, as a chain's
            along = result.path.unsqueeze(-1).expand(-1, -1, processed.shape[-1])  # [batch, depth + 1, vocab]
            logprobs = round_logprobs(rows, path_tokens(tree, result), processed.gather(1, along),
                                      VerifyResult(result.num_accepted, result.next_token))
        verify_s = time.perf_counter() - start
        return RoundOutcome(accepted, paths, next_token, logprobs, verify_s, out.hidden)

    def _commit(self, plan: StepPlan, outcome: RoundOutcome) -> list[Sequence]:
        rows = list(self.running)
        self._last_width = (plan.tree.token_ids.shape[1] if plan.tree is not None
                            else plan.meta.draft_token_ids.shape[1] + 1)
        tokens_fed = len(rows) * self._last_width
        verify_s = outcome.verify_s
        by_policy: dict[int, tuple] = {}
        for i, (seq, proposal, token, policy, k) in enumerate(zip(rows, plan.proposals, outcome.next_token,
                                                                  plan.policies, plan.ks)):
            draft = proposal.token_ids.tolist()
            accepted = len(outcome.accepted[i])
            committed = outcome.accepted[i] + [token]
            base = seq.length - 1  # the target cache index of the round's first fed token (the root)
            path = outcome.path[i] if outcome.path is not None else list(range(accepted + 1))
            # Stop checks run token by token; tokens after a stop are dropped and never counted.
            kept = 0
            for t in committed:
                kept += 1
                if seq.stopper.push(t) is not None:
                    break
            # Per-token origins (the server's opt-in annotation): a round ends on a bonus token when its accepted
            # path reached a leaf (a chain's last draft token), else on a recovered one.
            parents = proposal.parents.tolist() if proposal.is_tree else range(len(draft))  # chain: node j's is j - 1
            leaf = path[-1] not in parents
            origins = round_origins(self.last_step.stages[i], seq.stats.rounds + 1, len(draft), accepted, leaf, kept)
            seq.append(committed[:kept], outcome.logprobs.get(seq.slot, [])[:kept], origins)
            if path[-1] != len(path) - 1:
                # A tree's accepted path was fed at scattered indices: its entries move into place (the one copy).
                self.target.keep_path(seq.slot, base, path)
            # Rollback is bookkeeping: the slot keeps seq[:length-1] (the last committed token is fed next round).
            self.target.truncate(seq.length - 1, seq.slot)
            # A round cut short by a stop counts only the draft positions in front of the stop.
            depth = proposal.depth
            proposed = depth if kept == len(committed) else min(depth, kept)
            if seq.drafter is not None:
                seq.drafter = self._safe(seq.drafter, seq.stats,
                                         lambda d: d.observe(seq.slot, seq.length, accepted, len(draft)))
                if outcome.hidden is not None and not seq.finished and _wants_features(seq.drafter):
                    features = outcome.hidden[i, path]  # [accepted + 1, hidden]: the committed positions
                    seq.drafter = self._safe(seq.drafter, seq.stats,
                                             lambda d: d.observe_features(seq.slot, features))
                entry = by_policy.setdefault(id(policy), (policy, [], proposal.seconds, k))
                entry[1].append((depth, accepted))
            verified = len(draft) if kept == len(committed) else None
            seq.stats.record_round(proposed, min(accepted, kept), kept, verified)
            seq.stats.draft_s += proposal.seconds
            seq.stats.verify_s += verify_s
        for policy, pairs, draft_s, k in by_policy.values():
            policy.record_step(pairs, draft_s, k, verify_s, tokens_fed)
        for seq in sorted((s for s in rows if s.finished), key=lambda s: -s.slot):
            self._finish(seq)
        return rows

    def _finish(self, seq: Sequence) -> None:
        """Take a finished (or cancelled) sequence out; the last running sequence moves into its slot."""
        slot = seq.slot
        if seq.drafter is not None:
            if seq.finished:
                self._backoff(seq.drafter).succeeded()  # a whole request with the drafter: forget earlier failures
            self._safe(seq.drafter, seq.stats, lambda d: d.release(slot))
        last = self.running.pop()
        if last is not seq:
            self.target.move_slot(last.slot, slot)
            if last.drafter is not None:
                last.drafter = self._safe(last.drafter, last.stats, lambda d: d.move_slot(last.slot, slot))
            last.slot = slot
            self.running[slot] = last
        seq.slot = -1
        self._close(seq)

    def _close(self, seq: Sequence) -> None:
        """A sequence is done (finished or cancelled): its wall time and figures go into the totals."""
        seq.stats.wall_s = time.perf_counter() - seq.wall_start
        self.total.merge(seq.stats)
        self.last_stats = seq.stats

    # -- convenience ---------------------------------------------------------------------------------------------

    def generate_iter(
        self,
        prompt_ids: Seq[int] | torch.Tensor,
        params: SamplingParams,
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
        drafter: Drafter | None = None,
    ) -> Iterator[GenerationChunk]:
        """One request through the step loop: a chunk per round; the last chunk carries the request's stats.

        Closing the iterator early (a client went away) aborts the request; its figures still count."""
        seq = self.add_request(prompt_ids, params, spec, use_drafter, drafter)
        try:
            while not seq.finished:
                if seq in self.step():
                    token_ids, text = seq.take()
                    yield GenerationChunk(token_ids, text, seq.finish_reason, seq.stats if seq.finished else None,
                                          seq.take_logprobs(), seq.take_origins())
        finally:
            if not seq.finished:
                self.abort(seq)

    def generate(self, prompt_ids: Seq[int] | torch.Tensor, params: SamplingParams, **kwargs) -> GenerationResult:
        return self.generate_batch([prompt_ids], [params], **kwargs)[0]

    def generate_batch(
        self,
        prompts: Seq[Seq[int] | torch.Tensor],
        params: SamplingParams | Seq[SamplingParams],
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
        drafter: Drafter | None = None,
    ) -> list[GenerationResult]:
        """Run many prompts together (up to max_batch_size at once, the rest as slots free up), each with its
        own SamplingParams; -> one result per prompt, in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams: give one per prompt")
        seqs = [self.add_request(ids, p, spec, use_drafter, drafter) for ids, p in zip(prompts, params)]
        try:
            while any(not seq.finished for seq in seqs):
                self.step()
        finally:
            for seq in seqs:
                if not seq.finished:
                    self.abort(seq)
        return [GenerationResult(list(seq.stopper.token_ids), seq.take()[1], seq.finish_reason, seq.stats,
                                 seq.logprobs) for seq in seqs]

    def draft_policy(self, spec: SpeculativeConfig, drafter: Drafter | None = None):
        """The draft-length policy for a request: fixed K, or with `spec.adaptive` the drafter's AdaptivePolicy,
        whose estimates persist across this engine's requests."""
        drafter = drafter or self.drafter
        if not spec.adaptive or drafter is None:
            return FixedK(spec.num_draft_tokens)
        by_depth = self._policies.setdefault(drafter, {})
        if spec.max_speculation_depth not in by_depth:
            by_depth[spec.max_speculation_depth] = AdaptivePolicy(spec.max_speculation_depth, spec.num_draft_tokens)
        return by_depth[spec.max_speculation_depth]

    # -- internals -----------------------------------------------------------------------------------------------

    def _lossy_accept(self, plan: StepPlan, processed: torch.Tensor) -> torch.Tensor | None:
        """[batch, max_k] bool: LOSSY extra acceptances of rows whose spec asks for them (None when no row does)."""
        tops = [0 if seq.spec.lossless else seq.spec.acceptance_top_k for seq in self.running]
        return top_n_accept(plan.meta, processed, tops) if any(tops) else None

    def _backoff(self, drafter: Drafter) -> DrafterBackoff:
        return self._backoffs.setdefault(drafter, DrafterBackoff())

    def _safe(self, drafter: Drafter, stats: GenerationStats | None, call, returns: bool = False,
              rows: list[Sequence] | None = None):
        """Run a drafter call; on any exception its rows go on with the target alone (no token lost or repeated).

        -> the call's value (returns=True) or the drafter, or None after a failure."""
        try:
            value = call(drafter)
            return value if returns else drafter
        except Exception as exc:  # noqa: BLE001 - any drafter failure must degrade to the target alone
            # The drafter's state may be half-updated; `begin` resets it before it drafts again (Drafter contract).
            affected = rows if rows is not None else []
            for seq in affected:
                seq.drafter = None
                seq.stats.fallbacks += 1
            if stats is not None:
                stats.fallbacks += 1
            skip = self._backoff(drafter).failed()
            logger.warning("drafter %s failed (%s: %s); its request(s) continue on the target alone, the next %d "
                           "request(s) skip the drafter", drafter.name, type(exc).__name__, exc, skip)
            return None


def _wants_features(drafter: Drafter | None) -> bool:
    return drafter is not None and drafter.wants_features


def _pad_to(path: torch.Tensor, width: int) -> torch.Tensor:
    """[batch, w] -> [batch, width], padded with 0 (the root) as TreeVerifyResult.path is."""
    return torch.nn.functional.pad(path, (0, width - path.shape[1]))


def _grammar_cut(seq: Sequence, proposal: DraftProposal) -> DraftProposal:
    """A structured-output row's draft, cut before the first token its grammar forbids: such a token has p = 0
    and would be rejected anyway, so it is not verified (the recovered token is then drawn from p there)."""
    grammar = seq.sampling.grammar
    n = proposal.token_ids.numel()
    if grammar is None or n == 0:
        return proposal
    valid = grammar.valid_prefix(proposal.token_ids.tolist())
    if valid == n:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:valid]
    return DraftProposal(proposal.token_ids[:valid], probs, proposal.seconds)


def _forced_draft(seq: Sequence) -> torch.Tensor | None:
    """[f] the tokens a structured-output row's grammar forces next (e.g. `","year":` between two JSON values);
    None when nothing is forced."""
    grammar = seq.sampling.grammar
    if grammar is None:
        return None
    tokens = grammar.forced_tokens()[: min(seq.remaining - 1, MAX_FORCED_DRAFT)]
    return torch.tensor(tokens, dtype=torch.long, device=seq.tokens.device) if tokens else None


def _after_forced(forced: torch.Tensor, proposal: DraftProposal) -> DraftProposal:
    """The forced tokens (point masses: q = one-hot) followed by what the drafter proposed after them."""
    tokens = torch.cat([forced, proposal.token_ids.to(forced.device)])
    probs = None
    if proposal.probs is not None and proposal.token_ids.numel():
        one_hot = torch.nn.functional.one_hot(forced, proposal.probs.shape[-1]).to(proposal.probs)
        probs = torch.cat([one_hot.to(proposal.probs.device), proposal.probs])
    return DraftProposal(tokens, probs, proposal.seconds)


def acceptance_label(spec: SpeculativeConfig) -> str:
    """'exact', or 'top_k:N' for the LOSSY mode (as `--acceptance` spells it)."""
    return "exact" if spec.lossless else f"{spec.acceptance}:{spec.acceptance_top_k}"
