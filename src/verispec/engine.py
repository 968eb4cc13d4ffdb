"""The speculative loop.

One round: the drafter proposes k tokens; the target scores the last committed token plus the k draft tokens in
ONE forward pass (k + 1 positions); `verify` decides how many draft tokens are accepted and draws the recovered
or bonus token; the committed tokens go through the stop checks; both caches roll back to what was kept by
moving a length pointer. With no drafter (or k = 0) the same loop is plain target-only decoding, the baseline.

Cache invariant (DEVELOPERS.md): with seq the committed tokens (length N), the target cache holds seq[:N-1].
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .adaptive import AdaptivePolicy
from .config import SamplingParams, SpeculativeConfig
from .detokenize import StopChecker
from .drafters.base import Drafter, DraftRequest
from .fallback import DrafterBackoff
from .runner import ModelRunner
from .sampling import TokenSampler, check_finite
from .stats import GenerationStats
from .verify import VerifyResult, greedy_verify, speculative_sample, top_n_accept

logger = logging.getLogger("verispec")

# Room past max_len for the k + 1 positions a verify pass writes beyond the committed sequence.
CACHE_SLACK = 66


@dataclass
class GenerationChunk:
    """What one round hands the caller: the newly committed tokens and the text they complete."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # 'stop' | 'length' on the last chunk


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


class FixedK:
    """The draft length policy of a fixed K. Adaptive policies implement the same two methods."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self) -> int:
        return self.k

    def record(self, k: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        pass


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


class SpeculativeEngine:
    """Runs requests one at a time on one target (batch size 1 today; the runner boundary is where batching goes)."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer,
        drafter: Drafter | None = None,
        spec: SpeculativeConfig | None = None,
        max_len: int = 2048,
    ) -> None:
        self.target = ModelRunner(target, max_len + CACHE_SLACK)
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.spec = spec or SpeculativeConfig()
        self.max_len = max_len
        self.eos_token_ids = model_eos_ids(target, tokenizer)
        self.total = GenerationStats()  # cumulative over calls
        self.last_stats = GenerationStats()  # the latest call's, also when it was closed early
        # Per drafter, kept across requests: adaptive estimates (keyed by max depth) and failure back-off.
        self._policies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._backoffs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned_lossy = False

    # -- public --------------------------------------------------------------------------------------------------

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if prompt_len + params.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds max_len "
                f"({self.max_len}); shorten the prompt, lower max_new_tokens or raise max_len"
            )

    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, params: SamplingParams, **kwargs) -> GenerationResult:
        chunks = self.generate_iter(prompt_ids, params, **kwargs)
        token_ids: list[int] = []
        text = []
        finish = "length"
        while True:
            try:
                chunk = next(chunks)
            except StopIteration as done:
                stats = done.value
                break
            token_ids += chunk.token_ids
            text.append(chunk.text)
            finish = chunk.finish_reason or finish
        return GenerationResult(token_ids, "".join(text), finish, stats)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
    ) -> list[GenerationResult]:
        """Run many prompts together, one result per prompt in order (each row with its own SamplingParams).

        TEMPORARY: one prompt after another until the batched core lands (issue 9); same signature."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        return [self.generate(ids, p, spec=spec, use_drafter=use_drafter) for ids, p in zip(prompts, params)]

    def generate_iter(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        params: SamplingParams,
        spec: SpeculativeConfig | None = None,
        use_drafter: bool = True,
        drafter: Drafter | None = None,
    ) -> Iterator[GenerationChunk]:
        """Yield a chunk per round; the generator's return value is this call's GenerationStats.

        prompt_ids is copied, never written to. Per call: `spec` overrides the engine's speculation config,
        `drafter` replaces the engine's drafter, and `use_drafter=False` runs the target alone through the same loop.
        """
        spec = spec or self.spec
        wall_start = time.perf_counter()
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().clone()  # [n]; ours to keep
        self.check_request(prompt.numel(), params)
        stats = GenerationStats(prompt_tokens=prompt.numel(), requests=1, acceptance_mode=acceptance_label(spec),
                                lossy=not spec.lossless)
        if not spec.lossless and not self._warned_lossy:
            self._warned_lossy = True
            logger.warning("acceptance %s is LOSSY: outputs no longer follow the target's distribution",
                           acceptance_label(spec))
        sampler = TokenSampler(
            params, self.target.vocab_size, self.eos_token_ids | set(params.stop_token_ids), prompt.tolist(),
            self.target.device,
        )
        stopper = StopChecker(params, self.eos_token_ids, self.tokenizer, params.max_new_tokens)
        drafter = (drafter or self.drafter) if use_drafter else None
        if drafter is not None and not self._backoff(drafter).should_try():
            logger.info("drafter %s skipped for this request (back-off after failures)", drafter.name)
            drafter = None
        seq = torch.empty(prompt.numel() + params.max_new_tokens + CACHE_SLACK, dtype=torch.long)  # [capacity]
        seq[: prompt.numel()] = prompt
        length = prompt.numel()

        self.target.reset()
        if drafter is not None:
            drafter = self._safe_begin(drafter, prompt, stats)
        if length > 1:
            start = time.perf_counter()
            self.target.forward(prompt[:-1].unsqueeze(0), last_only=True)
            stats.prefill_s = time.perf_counter() - start

        try:
            while stopper.finish_reason is None:
                remaining = params.max_new_tokens - len(stopper.token_ids)
                # K comes from the policy of whoever drafts this round (a cascade's stage has its own estimates).
                active = self._safe_route(drafter, seq[:length], stats) if drafter is not None else None
                if active is None:
                    drafter = None  # a failed route: the rest of this request runs on the target alone
                policy = self.draft_policy(spec, active) if active is not None else FixedK(0)
                k = min(policy.choose(), remaining - 1)
                draft, q, draft_s = seq.new_empty(0), None, 0.0
                if k > 0:
                    request = DraftRequest(seq[:length], k, sampler, spec.speculative_threshold)
                    proposal = self._safe_propose(drafter, request, stats)
                    if proposal is None:
                        drafter = None  # the rest of this request runs on the target alone
                    else:
                        draft, q, draft_s = proposal.token_ids, proposal.probs, proposal.seconds
                verify_start = time.perf_counter()
                result = self._verify(seq[length - 1 : length], draft, q, sampler, spec)
                num_accepted = int(result.num_accepted[0])  # the one host sync per round: the loop branches on it
                committed = draft[:num_accepted].tolist() + [int(result.next_token[0])]
                verify_s = time.perf_counter() - verify_start

                # Stop checks run token by token; tokens after a stop are dropped and never counted.
                kept = 0
                for token in committed:
                    kept += 1
                    if stopper.push(token) is not None:
                        break
                seq[length : length + kept] = torch.tensor(committed[:kept])
                length += kept
                sampler.commit(committed[:kept])
                # Rollback is bookkeeping: the target keeps seq[:length-1] (the last committed token is fed next round).
                self.target.truncate(length - 1)
                # A round cut short by a stop counts only the draft positions in front of the stop.
                proposed = draft.numel() if kept == len(committed) else min(draft.numel(), kept)
                if drafter is not None:
                    drafter = self._safe_observe(drafter, length, num_accepted, draft.numel(), stats)
                    policy.record(draft.numel(), num_accepted, draft_s, verify_s)
                stats.record_round(proposed, min(num_accepted, kept), kept)
                stats.draft_s += draft_s
                stats.verify_s += verify_s
                yield GenerationChunk(committed[:kept], stopper.take_text(), stopper.finish_reason)
            if drafter is not None:
                self._backoff(drafter).succeeded()  # a whole request with the drafter: forget earlier failures
        finally:
            # Also when the caller closes the generator early (a client disconnect): its figures still count.
            stats.wall_s = time.perf_counter() - wall_start
            self.total.merge(stats)
            self.last_stats = stats
        return stats

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

    def _verify(
        self,
        last_token: torch.Tensor,  # [1]
        draft: torch.Tensor,  # [k]
        q: torch.Tensor | None,  # [k, vocab] or None (point mass)
        sampler: TokenSampler,
        spec: SpeculativeConfig,
    ) -> VerifyResult:
        logits = self.target.forward(torch.cat([last_token, draft]).unsqueeze(0))[0]  # [k + 1, vocab]
        check_finite(logits, "target")
        processed = sampler.process(logits, draft, start=0).unsqueeze(0)  # [1, k + 1, vocab]
        batch_draft = draft.unsqueeze(0)  # [1, k]
        extra = None if spec.lossless else top_n_accept(batch_draft, processed, spec.acceptance_top_k)
        if sampler.params.greedy:
            return greedy_verify(batch_draft, processed, extra)
        p = sampler.probs(processed)  # [1, k + 1, vocab]
        return speculative_sample(batch_draft, None if q is None else q.unsqueeze(0), p, sampler.generator, extra)

    def _backoff(self, drafter: Drafter) -> DrafterBackoff:
        return self._backoffs.setdefault(drafter, DrafterBackoff())

    def _safe_begin(self, drafter: Drafter, prompt: torch.Tensor, stats: GenerationStats) -> Drafter | None:
        try:
            drafter.begin(prompt)
            return drafter
        except Exception as exc:  # noqa: BLE001 - any drafter failure must degrade to the target alone
            self._fallback(drafter, exc, stats)
            return None

    def _safe_route(self, drafter: Drafter, token_ids: torch.Tensor, stats: GenerationStats) -> Drafter | None:
        try:
            return drafter.route(token_ids)
        except Exception as exc:  # noqa: BLE001 - any drafter failure must degrade to the target alone
            self._fallback(drafter, exc, stats)
            return None

    def _safe_propose(self, drafter: Drafter, request: DraftRequest, stats: GenerationStats):
        try:
            return drafter.propose(request)
        except Exception as exc:  # noqa: BLE001 - see _safe_begin
            self._fallback(drafter, exc, stats)
            return None

    def _safe_observe(self, drafter: Drafter, length: int, num_accepted: int, num_proposed: int,
                      stats: GenerationStats) -> Drafter | None:
        try:
            drafter.observe(length, num_accepted, num_proposed)
            return drafter
        except Exception as exc:  # noqa: BLE001 - see _safe_begin
            self._fallback(drafter, exc, stats)
            return None

    def _fallback(self, drafter: Drafter, exc: Exception, stats: GenerationStats) -> None:
        # The drafter's state may be half-updated; `begin` resets it before it drafts again (Drafter contract).
        stats.fallbacks += 1
        skip = self._backoff(drafter).failed()
        logger.warning("drafter %s failed (%s: %s); this request continues on the target alone, the next %d "
                       "request(s) skip the drafter", drafter.name, type(exc).__name__, exc, skip)


def acceptance_label(spec: SpeculativeConfig) -> str:
    """'exact', or 'top_k:N' for the LOSSY mode (as `--acceptance` spells it)."""
    return "exact" if spec.lossless else f"{spec.acceptance}:{spec.acceptance_top_k}"
