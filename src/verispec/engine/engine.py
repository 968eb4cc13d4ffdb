"""The speculative engine: many sequences advance together, one batched target forward per step.

    step() = schedule -> propose -> verify -> commit

- schedule (scheduler.py): waiting sequences take free slots (up to max_batch_size) in arrival order and their
  prompts are prefilled into their slots (prefill.py), in chunks within the step's token budget; a sequence whose prompt is
  complete joins the batch and decodes in the same step.
- propose (proposer.py): per running row, K from its routed drafter's policy, forced tokens of a grammar, one
  propose call per drafter, padded into the verify pass's inputs (`StepDrafts`).
- verify (verifier.py): ONE target forward over [batch, max_k + 1] (a chain is a one-branch tree), each row's
  own logits processing and randomness; acceptance.py's math decides accepted tokens and the recovered or bonus token
  (`Verdict`, one host sync).
- commit (output.py): stop checks, rollback by moving per-slot lengths, drafter observe, stats; finished
  sequences leave and the last running sequence moves into the freed slot (slots stay contiguous).

Cache invariant (DEVELOPERS.md): for a running sequence with committed tokens seq (length N), the target cache
slot holds seq[:N-1]; the last committed token is fed at the start of the next round.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..config import MAX_VERIFY_WIDTH, RunnerOptions, SamplingParams, SpeculativeConfig, cache_len
from ..drafters.base import Drafter
from ..drafters.prediction import with_prediction
from ..sampling import Grammar
from ..runtime.caches.prefix_cache import PrefixCache
from ..runtime.runners.select import make_runner
from ..runtime.threads import governor
from ..stats import GenerationStats
from .drafter_calls import DrafterCalls, wants_features
from .grammar_rows import row_grammar
from .output import OutputStep, final_result, stream_chunk
from .policy import DraftPolicies
from .prefill import Prefill
from .proposer import Proposer
from .requests import acceptance_label, model_eos_ids, new_sequence
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Continuation, GenerationChunk, GenerationResult, Sequence, SequenceStatus
from .verifier import Verifier

if TYPE_CHECKING:  # (a type only: importing Hugging Face modeling costs ~1.5 s of start-up)
    from transformers import PreTrainedModel

logger = logging.getLogger("verispec")

# Room past a request's tokens for the positions a verify pass writes beyond them (the runner's cache gets the same
# room through config.cache_len): a row near max_len is padded to the widest row's width, which the validated
# limits bound (config.MAX_VERIFY_WIDTH).
CACHE_SLACK = MAX_VERIFY_WIDTH


@dataclass
class StepReport:
    """What the latest step did (the server's metrics read it); step() writes it, once per step."""

    rows: int = 0  # decoding rows verified
    tokens_fed: int = 0  # tokens of the verify pass: rows x (max K + 1)
    prefill_tokens: int = 0  # prompt tokens prefilled before it
    speculative_ks: list[int] = field(default_factory=list)  # K of each row that speculates (0: switched off)
    prefix_queried_tokens: int = 0  # prompt tokens of sequences admitted this step, looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, found there (their prefill skipped)
    started: list[Sequence] = field(default_factory=list)  # sequences that took a slot this step (their
    # generation began: the server counts them running from here)


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
        enable_prefix_caching: bool = True,
        prefix_cache_tokens: int | None = None,
    ) -> None:
        """enable_prefix_caching: keep the KV of prompt prefixes for later requests that start the same
        (runtime/caches/prefix_cache.py); prefix_cache_tokens: how many tokens it keeps (LRU beyond; None: as many as
        the slot cache holds, max_batch_size x max_len)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0 (or None), got {prefix_cache_tokens}")
        self.runner_options = runner
        self.target = make_runner(target, cache_len(max_len), max_batch_size, self.runner_options)
        self.tokenizer = tokenizer
        if prefix_cache_tokens is None:
            prefix_cache_tokens = max_batch_size * max_len
        self.prefix_cache = (PrefixCache(self.target.cache, prefix_cache_tokens)
                             if enable_prefix_caching and prefix_cache_tokens > 0 else None)
        self.drafter = drafter
        if drafter is not None:
            drafter.reserve(max_batch_size, self.runner_options)
            self._share_prefix_cache(drafter)
        self.spec = spec or SpeculativeConfig()
        self.max_len = max_len
        self.max_batch_size = max_batch_size
        self.eos_token_ids = model_eos_ids(target, tokenizer)
        self.scheduler = Scheduler(scheduler, max_batch_size, self.target, self.prefix_cache)
        self.calls = DrafterCalls()  # failure back-off per drafter, kept across requests
        self.policies = DraftPolicies()  # adaptive estimates per drafter, kept across requests
        self.proposer = Proposer(self.target, self.calls, self.policies)
        self.verifier = Verifier(self.target)
        self.output = OutputStep(self.target, self.scheduler, self.calls)
        self.prefill = Prefill(self.target, self.scheduler, self.calls)
        self.last_step = StepReport()
        self._last_width = 1  # tokens per row of the latest verify pass (max K + 1): the next step's budget guess
        self._warned_lossy = False

    @property
    def running(self) -> list[Sequence]:
        """Decoding sequences; index == slot."""
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Sequence]:
        """FIFO of sequences not yet admitted (those being prefilled are not in it)."""
        return self.scheduler.waiting

    @property
    def total(self) -> GenerationStats:
        """Cumulative over finished (and cancelled) requests."""
        return self.output.total

    @property
    def last_stats(self) -> GenerationStats:
        """The latest finished (or cancelled) request's."""
        return self.output.last_stats

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.scheduler)

    # -- requests ------------------------------------------------------------------------------------------------

    def check_request(self, prompt_len: int, params: SamplingParams, prediction_len: int | None = None) -> None:
        """Raises ValueError naming the fix for a request that cannot run: an empty prompt, a prompt and answer
        longer than max_len, or (prediction_len: its tokens) an empty prediction, or one the context cannot hold
        after the prompt."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if prompt_len + params.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds max_len "
                f"({self.max_len}); shorten the prompt, lower max_new_tokens or raise max_len"
            )
        if prediction_len is not None and prediction_len < 1:
            raise ValueError("the prediction is empty: give its text, or leave prediction out")
        if prediction_len is not None and prompt_len + prediction_len > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus prediction ({prediction_len} tokens) exceeds max_len "
                f"({self.max_len}): no answer could use all of it; shorten the prediction or raise max_len"
            )

    def new_grammar(self, params: SamplingParams) -> Grammar | None:
        """A fresh grammar state for `params.structured` (None without one), for one sequence. Safe on any thread:
        it reads only the tokenizer and fixed sizes (the compiled-grammar cache is locked).

        Raises ValueError when the constraint does not compile."""
        return row_grammar(params, self.tokenizer, self.target.vocab_size, self.eos_token_ids)

    def add_request(
        self,
        prompt_ids: Seq[int] | torch.Tensor,
        params: SamplingParams,
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
        drafter: Drafter | None = None,
        grammar: Grammar | None = None,
        scope: str | None = None,
        resume: Continuation | None = None,
        prediction: Seq[int] | None = None,
    ) -> Sequence:
        """Queue a request; it starts at the next step with a free slot. prompt_ids is copied, never written to.

        `spec` overrides the engine's speculation config, `drafter` replaces the engine's drafter, and
        `use_drafter=False` runs the target alone through the same step. `grammar`: the request's own grammar
        state from `new_grammar(params)`, compiled beforehand (the server compiles off the engine thread);
        by default it is compiled here. `scope`: whose earlier requests a drafter that learns across requests may
        draft from (the server: a hash of the API key; None: the default scope). `resume`: output the request already
        generated and handed out (a failover, server/scale/ingress.py): it goes on after it as one uninterrupted
        request, handing out only what follows (requests.resume_output; output that ends the request leaves it
        finished at once, queued nowhere); ValueError where that output is not one this request could have
        generated. `prediction`: token ids of the answer the caller expects (OpenAI's predicted outputs): they draft
        first, in front of the request's drafter, or alone with use_drafter=False (drafters/prediction.py); the
        output is the target's all the same."""
        spec = spec or self.spec
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()  # [n]
        self.check_request(prompt.numel(), params, None if prediction is None else len(prediction))
        if not spec.lossless and not self._warned_lossy:
            self._warned_lossy = True
            logger.warning("acceptance %s is LOSSY: outputs no longer follow the target's distribution",
                           acceptance_label(spec))
        drafter = (drafter or self.drafter) if use_drafter else None
        if drafter is not None and not self.calls.backoff(drafter).should_try():
            logger.info("drafter %s skipped for this request (back-off after failures)", drafter.name)
            drafter = None
        if prediction is not None:
            drafter = with_prediction(prediction, drafter)
        if drafter is not None:
            drafter.reserve(self.max_batch_size, self.runner_options)  # idempotent: a request-named drafter gets its slots here
            self._share_prefix_cache(drafter)
        if grammar is None:
            grammar = self.new_grammar(params)
        assert grammar is None or grammar.structured == params.structured, "a grammar compiled for other params"
        seq = new_sequence(prompt, params, spec, drafter, self.tokenizer, self.target.vocab_size, self.target.device,
                           self.eos_token_ids, CACHE_SLACK, grammar, resume)
        seq.scope = scope
        if seq.finished:  # resumed after its last token: nothing to run (its status said so by the scheduler's rule)
            seq.status = SequenceStatus.FINISHED
            return seq
        # A draft head needs the prompt's hidden states, which a cached prefix lacks: such a request computes it.
        self.scheduler.enqueue(seq, seq.committed.tolist(), cacheable=not wants_features(drafter))
        return seq

    def _share_prefix_cache(self, drafter: Drafter) -> None:
        """A drafter with its own KV keeps its own prompt prefixes when the engine does, as many tokens."""
        prefix = self.prefix_cache
        drafter.keep_prefixes(0 if prefix is None else prefix.capacity * prefix.block_size)

    def abort(self, seq: Sequence) -> None:
        """Stop a request now (a client went away); its figures still count. A decoding sequence's row leaves the
        batch at once (the next step runs without it)."""
        if 0 <= seq.slot < len(self.running) and self.running[seq.slot] is seq:
            self.output.finish(seq)
        elif self.scheduler.remove(seq):
            self.output.close(seq)

    # -- the step ------------------------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Advance every running sequence by one round. -> the sequences that committed tokens (finished ones too).
        `last_step` reports it, written as it goes: a step that raised still says which sequences it started."""
        report = self.last_step = StepReport()
        with governor().step() as threads:
            rows = self._step(report)
            if rows and not report.prefill_tokens:  # a decode / verify step: judged against its shape's recent ones
                threads["key"] = (report.rows, report.tokens_fed)
        return rows

    def _step(self, report: StepReport) -> list[Sequence]:
        prefix = self.prefix_cache
        queried, hits = (prefix.queried_tokens, prefix.hit_tokens) if prefix is not None else (0, 0)
        chunks = self.scheduler.admit(self._last_width)
        # A sequence's first chunk takes its slot (a step may run several chunks of one prompt).
        report.started = list({c.seq.seq_id: c.seq for c in chunks if c.seq.slot < 0}.values())
        for chunk in chunks:
            self.prefill.run(chunk)
        report.prefill_tokens = sum(c.end - c.start for c in chunks)
        if prefix is not None:
            report.prefix_queried_tokens = prefix.queried_tokens - queried
            report.prefix_hit_tokens = prefix.hit_tokens - hits
        rows = self.running
        if rows:
            drafts = self.proposer.propose(rows)
            verdict = self.verifier.verify(rows, drafts)
            rows = self.output.commit(rows, drafts, verdict)
            self._last_width = drafts.width
            report.rows, report.tokens_fed = len(rows), len(rows) * drafts.width
            report.speculative_ks = drafts.speculative_ks
        return list(rows)

    # -- convenience ---------------------------------------------------------------------------------------------

    def generate_iter(
        self,
        prompt_ids: Seq[int] | torch.Tensor,
        params: SamplingParams,
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
        drafter: Drafter | None = None,
        resume: Continuation | None = None,
        prediction: Seq[int] | None = None,
    ) -> Iterator[GenerationChunk]:
        """One request through the step loop: a chunk per round; the last chunk carries the request's stats.
        `resume`: output it already generated, `prediction`: the answer's expected token ids (`add_request`): the
        chunks hand out only what follows.

        Closing the iterator early (a client went away) aborts the request; its figures still count."""
        seq = self.add_request(prompt_ids, params, spec, use_drafter, drafter, resume=resume, prediction=prediction)
        try:
            while not seq.finished:
                if seq in self.step():
                    yield stream_chunk(seq)
        finally:
            if not seq.finished:
                self.abort(seq)

    def generate(self, prompt_ids: Seq[int] | torch.Tensor, params: SamplingParams,
                 prediction: Seq[int] | None = None, **kwargs) -> GenerationResult:
        return self.generate_batch([prompt_ids], [params], predictions=[prediction], **kwargs)[0]

    def generate_batch(
        self,
        prompts: Seq[Seq[int] | torch.Tensor],
        params: SamplingParams | Seq[SamplingParams],
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
        drafter: Drafter | None = None,
        predictions: Seq[Seq[int] | None] | None = None,
    ) -> list[GenerationResult]:
        """Run many prompts together (up to max_batch_size at once, the rest as slots free up), each with its
        own SamplingParams; -> one result per prompt, in order. `predictions`: per prompt, the token ids of its
        expected answer, or None (`add_request`)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams: give one per prompt")
        predictions = [None] * len(prompts) if predictions is None else list(predictions)
        if len(predictions) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(predictions)} predictions: give one per prompt "
                             "(None for a prompt without one)")
        seqs = [self.add_request(ids, p, spec, use_drafter, drafter, prediction=prediction)
                for ids, p, prediction in zip(prompts, params, predictions)]
        try:
            while any(not seq.finished for seq in seqs):
                self.step()
        finally:
            for seq in seqs:
                if not seq.finished:
                    self.abort(seq)
        return [final_result(seq) for seq in seqs]

    def draft_policy(self, spec: SpeculativeConfig, drafter: Drafter | None = None):
        """The draft-length policy for a request: fixed K, or with `spec.adaptive` the drafter's AdaptivePolicy,
        whose estimates persist across this engine's requests."""
        return self.policies.get(spec, drafter or self.drafter)
