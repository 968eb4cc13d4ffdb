"""Adaptive draft length: choose K per round to maximise expected committed tokens per second.

For a round with K draft tokens (terms as in DEVELOPERS.md):

    expected committed tokens   E(K) = 1 + sum_{j=1..K} prod_{i<=j} alpha_i
    expected round time         T(K) = K * c_draft + c_verify(B * (K + 1))

alpha_i is the conditional acceptance rate at draft position i (accepted, given positions 1..i-1 were), c_draft
the time of one draft step and c_verify(t) the time of one target pass over t fed tokens: a step verifies B rows
of K + 1 positions each (rows drafting less are padded), so under load (large B) a wide verify pass costs more
and K falls, down to 0. Of the B rows, the G this policy drafts for commit E(K) tokens each and the others one,
so the step's rate is (G * E(K) + B - G) / T(K): a drafter that serves few rows of a large batch does not get to
widen everyone's verify pass. K = 0 is plain decoding (B tokens in c_verify(B)). The policy picks the K in [0, max_depth] with the highest E(K) / T(K); a K >= 1 must
beat K = 0 by `min_gain`, so a drafter that does not pay is switched off and speculation costs no more than
noise. While K = 0 is chosen, a probe round with K >= 1 runs every `probe_every` rounds (the interval doubles up
to `max_probe_every` while probes keep losing; a step of B rows counts as 1 / B of a round, since a probe widens
every row's verify pass), so the estimates can recover when the text becomes predictable;
a probe costs at most twice a plain step (under load, a narrow one).

Estimates are online and survive across requests (the engine keeps one policy per drafter):
- alpha_i: decayed counts with a prior, (accepted_i + prior_i * w) / (tried_i + w); each observation first
  multiplies position i's counts by `decay`, so old rounds fade (an exponential moving average with a prior).
  prior_1 is `prior_acceptance`; prior_i is the estimate of alpha_{i-1}, so positions a bad drafter never
  reaches do not keep an optimistic prior (a drafter rejected at position 1 is not assumed good at position 2).
- c_draft, c_verify(t): moving averages of measured seconds per draft step and per verify size t (tokens fed =
  rows x width; at batch size 1, t is the width), taken in log
  space (the first sample of each is dropped: first calls of a shape pay one-off allocation and kernel set-up),
  with each sample clipped to within a factor `TIME_CLIP` of the estimate, so one stall of a busy machine
  barely moves them. Unmeasured sizes come from a line c_verify(t) = a + b (t - 1) fitted to the measured ones
  (or, with one size measured, from the prior slope b = verify_slope_prior * a); the curve is made
  non-decreasing in t, which bounds rate(K) / rate(0) by E(K): with acceptance estimates below min_gain - 1,
  K = 0 wins whatever the timing noise.
"""

from __future__ import annotations

import math
import weakref
from itertools import accumulate

TIME_CLIP = 4.0


class FixedK:
    """The draft length policy of a fixed K. Adaptive policies implement the same methods."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, batch_size: int = 1, rows: int | None = None) -> int:
        return self.k

    def record_step(self, rows, draft_s: float, draft_steps: int, verify_s: float, tokens: int) -> None:
        pass


class AdaptivePolicy:
    """Draft-length policy: `choose()` before a round, `record(...)` after it (the engine's two calls)."""

    def __init__(
        self,
        max_depth: int,
        initial_k: int | None = None,
        *,
        prior_acceptance: float = 0.6,
        prior_weight: float = 1.0,
        decay: float = 0.98,
        time_decay: float = 0.8,
        verify_slope_prior: float = 0.05,
        min_gain: float = 1.03,
        probe_every: int = 8,
        max_probe_every: int = 64,
    ) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not 0 < decay <= 1 or not 0 < time_decay < 1:
            raise ValueError(f"decay must be in (0, 1] and time_decay in (0, 1), got {decay}, {time_decay}")
        self.max_depth = max_depth
        self.initial_k = max(1, min(initial_k or max_depth, max_depth))
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.decay = decay
        self.time_decay = time_decay
        self.verify_slope_prior = verify_slope_prior
        self.min_gain = min_gain
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every

        self.accepted = [0.0] * max_depth  # [position]: decayed count of accepted draft tokens
        self.tried = [0.0] * max_depth  # [position]: decayed count of draft tokens the target examined
        self.draft_s: float | None = None  # EMA seconds per draft token
        self.verify_s: dict[int, float] = {}  # tokens fed (rows x width) -> EMA seconds of one target pass
        self._warm: set[int] = set()  # timings whose first (warm-up) sample was dropped: sizes, and 0 for drafts
        self.rounds = 0
        self.chosen: list[int] = [0] * (max_depth + 1)  # [K]: rounds this policy chose K
        self._probe_interval = probe_every
        self._since_probe = 0
        self._rates: dict[tuple, list[float]] = {}  # (batch size, rows) -> rates, dropped by record()
        self._costs_from: AdaptivePolicy | None = None  # whose cost estimates this policy shares (share_costs)

    # -- estimates -----------------------------------------------------------------------------------------------

    @property
    def alpha(self) -> list[float]:
        """[position]: estimated conditional acceptance rate at draft positions 1..max_depth."""
        w, prior = self.prior_weight, self.prior_acceptance
        alpha = []
        for accepted, tried in zip(self.accepted, self.tried):
            prior = (accepted + prior * w) / (tried + w)
            alpha.append(prior)
        return alpha

    def expected_committed(self, k: int) -> float:
        """E(k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i."""
        return 1.0 + sum(accumulate(self.alpha[:k], lambda run, a: run * a))

    def verify_cost(self, tokens: int) -> float | None:
        """Estimated seconds of a target pass over `tokens` fed tokens (None before any measurement)."""
        curve = self._verify_curve([tokens])
        return None if curve is None else curve[0]

    def expected_cost(self, k: int, batch_size: int = 1) -> float | None:
        """T(k) = k * c_draft + c_verify(batch_size * (k + 1)), in seconds (None before any measurement)."""
        verify = self.verify_cost(batch_size * (k + 1))
        if verify is None or (k > 0 and self.draft_s is None):
            return None
        return k * (self.draft_s or 0.0) + verify

    def rates(self, batch_size: int = 1, rows: int | None = None) -> list[float] | None:
        """[K]: expected committed tokens per second of a step for K = 0..max_depth, with this policy drafting for
        `rows` (default all) of `batch_size` rows (None before measurements). Computed once per recorded round:
        `choose` runs every step and must stay cheap."""
        rows = batch_size if rows is None else rows
        key = (batch_size, rows)
        if key not in self._rates:
            curve = self._verify_curve([batch_size * (k + 1) for k in range(self.max_depth + 1)])
            if curve is None or self.draft_s is None:
                return None
            committed = [1.0] + [1.0 + e for e in accumulate(accumulate(self.alpha, lambda run, a: run * a))]
            self._rates[key] = [(rows * committed[k] + batch_size - rows) / max(k * self.draft_s + curve[k], 1e-12)
                                for k in range(self.max_depth + 1)]
        return self._rates[key]

    def best_k(self, batch_size: int = 1, rows: int | None = None) -> int:
        """The K the estimates favour, before probing (initial_k until the costs were measured)."""
        rates = self.rates(batch_size, rows)
        if rates is None:
            return self.initial_k
        k = max(range(1, self.max_depth + 1), key=rates.__getitem__)
        return k if rates[k] > self.min_gain * rates[0] else 0

    # -- the engine's two calls ----------------------------------------------------------------------------------

    def choose(self, batch_size: int = 1, rows: int | None = None) -> int:
        """K for the next step of `batch_size` rows, `rows` of which (default all) this policy drafts for."""
        # Warm-up: draft with initial_k until a draft step was timed, then plain steps time c_verify(batch_size).
        if self.draft_s is None:
            k = self.initial_k
        elif batch_size not in self.verify_s:
            k = 0
        else:
            k = self.best_k(batch_size, rows)
            if k > 0:
                self._probe_interval = self.probe_every
                self._since_probe = 0
            else:
                self._since_probe += 1
                # Under load a probe widens all B rows' verify pass: probe B times less often, so its share of the
                # time does not grow with the batch (at batch size 1, every probe_every rounds).
                if self._since_probe >= self._probe_interval * batch_size:
                    # Probe with the best K >= 1 so the estimates can recover; back off while probes lose. A probe
                    # may cost at most twice a plain step: under load (large batch) that keeps it narrow.
                    rates = self.rates(batch_size, rows)
                    curve = self._verify_curve([batch_size * (k + 1) for k in range(self.max_depth + 1)])
                    affordable = [k for k in range(1, self.max_depth + 1)
                                  if k * self.draft_s + curve[k] <= 2 * curve[0]] or [1]
                    k = max(affordable, key=rates.__getitem__)
                    self._since_probe = 0
                    self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
        self.chosen[k] += 1
        return k

    def record(self, k: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        """One verified round of one row: k draft tokens (verify width k + 1), the leading num_accepted accepted."""
        self.record_step([(k, num_accepted)], draft_s, k, verify_s, k + 1)

    def record_step(self, rows: list[tuple[int, int]], draft_s: float, draft_steps: int, verify_s: float,
                    tokens: int) -> None:
        """One verified step: for each of this policy's rows (k, num_accepted); the draft took `draft_steps` steps
        in `draft_s` seconds; the target pass over `tokens` fed tokens (all rows of the batch) took verify_s."""
        self.rounds += len(rows)
        self._rates = {}
        # Positions 1..num_accepted were accepted; position num_accepted + 1 (if drafted) was rejected; later
        # positions were never examined and say nothing about their conditional rates.
        for k, num_accepted in rows:
            for position in range(min(num_accepted + 1, k, self.max_depth)):
                self.tried[position] = self.decay * self.tried[position] + 1.0
                self.accepted[position] = self.decay * self.accepted[position] + float(position < num_accepted)
        if draft_steps > 0 and self._warmed(0):
            self.draft_s = self._ema(self.draft_s, draft_s / draft_steps)
            if self._costs_from is not None:
                self._costs_from.draft_s = self.draft_s
        if self._warmed(tokens):
            self.verify_s[tokens] = self._ema(self.verify_s.get(tokens), verify_s)

    def share_costs(self, other: AdaptivePolicy) -> None:
        """Measure costs into `other`'s estimates (the same objects) and start from them: its verify passes by width
        and its draft step. Acceptance stays this policy's own."""
        self.verify_s = other.verify_s
        self._warm = other._warm
        self.draft_s = other.draft_s
        self._costs_from = other

    def snapshot(self) -> dict:
        """The current estimates, for benchmarks and metrics."""
        return {
            "alpha": [round(a, 4) for a in self.alpha],
            "draft_s_per_token": self.draft_s,
            "verify_s_by_tokens": dict(sorted(self.verify_s.items())),
            "best_k": self.best_k(),
            "rounds": self.rounds,
            "chosen_k_counts": list(self.chosen),
        }

    # -- internals -----------------------------------------------------------------------------------------------

    def _warmed(self, key: int) -> bool:
        """False the first time `key` is timed (that sample is dropped), True afterwards."""
        if key in self._warm:
            return True
        self._warm.add(key)
        return False

    def _ema(self, old: float | None, new: float) -> float:
        new = max(new, 1e-9)
        if old is None:
            return new
        new = min(max(new, old / TIME_CLIP), old * TIME_CLIP)
        return math.exp(self.time_decay * math.log(old) + (1.0 - self.time_decay) * math.log(new))

    def _verify_curve(self, sizes: list[int]) -> list[float] | None:
        """c_verify(t) for the ascending sizes t: measured where known, else a fitted line, made non-decreasing."""
        if not self.verify_s:
            return None
        points = sorted(self.verify_s.items())
        if len(points) == 1:
            (t0, c0), = points
            a = c0 / (1.0 + self.verify_slope_prior * (t0 - 1))
            b = self.verify_slope_prior * a
        else:  # least squares on x = t - 1
            xs = [t - 1.0 for t, _ in points]
            ys = [c for _, c in points]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            b = max(b, 0.0)
            a = my - b * mx
        floor = 0.25 * min(c for _, c in points)
        curve = []
        for t in sizes:
            estimate = self.verify_s.get(t, max(a + b * (t - 1), floor))
            # A larger pass never costs less than a smaller measured one: noise must not make speculation look free.
            curve.append(max([estimate] + [c for size, c in points if size <= t]))
        return list(accumulate(curve, max))


def stage_gain(policy: FixedK | AdaptivePolicy, batch_size: int) -> float | None:
    """A drafter stage's predicted committed tokens per second at its best K over plain decoding's (>= 1 when
    drafting pays); None before its costs were measured."""
    if not isinstance(policy, AdaptivePolicy):
        return None
    rates = policy.rates(batch_size, 1)
    return None if rates is None else max(rates) / max(rates[0], 1e-12)


class DraftPolicies:
    """The draft-length policy of each request: fixed K, or with `spec.adaptive` its drafter's AdaptivePolicy (one
    per drafter and max depth, kept across an engine's requests so that its estimates persist).

    `route` picks a cascade's stage per row and step by tokens per cost: of the stages that can propose after the
    row's tokens, the one whose own policy predicts the most committed tokens per second (its acceptance by
    position, learned online, against its measured draft cost and the verify cost of the width it would need); a
    stage not yet measured is tried first, so every stage gets estimates, and a stage passed over
    `stage_probe_every` times drafts once, so its estimates stay current. That stage's policy then picks K, which
    is 0 (no draft) when even the best stage does not pay. With a fixed K the cascade keeps its order."""

    def __init__(self, stage_probe_every: int = 16) -> None:
        self._adaptive: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> {max depth: policy}
        self.stage_probe_every = stage_probe_every
        self._passed_over: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stage -> rounds it could
        # have drafted but another stage won since it last drafted
        self._shared_costs: dict[tuple, AdaptivePolicy] = {}  # (per-request drafter's name, depth) -> the policy
        # whose cost estimates its drafters' policies share

    def get(self, spec, drafter) -> FixedK | AdaptivePolicy:
        """A drafter's `max_depth` replaces the request's max_speculation_depth; a `per_request` drafter's policy
        measures its costs into the estimates its class shares, so a new request's prediction knows them already."""
        if not spec.adaptive or drafter is None:
            return FixedK(spec.num_draft_tokens)
        depth = drafter.max_depth or spec.max_speculation_depth
        by_depth = self._adaptive.setdefault(drafter, {})
        if depth not in by_depth:
            policy = by_depth[depth] = AdaptivePolicy(depth, spec.num_draft_tokens)
            if drafter.per_request:
                policy.share_costs(self._shared_costs.setdefault((drafter.name, depth), AdaptivePolicy(depth)))
        return by_depth[depth]

    def route(self, spec, drafter, token_ids, batch_size: int = 1):
        """The drafter (a cascade's stage) that drafts after `token_ids` [n] this step (class docstring)."""
        stages = drafter.stages
        if not spec.adaptive or stages == (drafter,):  # one drafter: nothing to choose between
            return drafter.route(token_ids)
        candidates = [stage for stage in stages if stage.can_propose(token_ids)] or [stages[-1]]
        best, best_gain = candidates[0], None
        for stage in candidates:
            # The stage's own answer to route keys its policy (a prediction's confirmed runs and its guesses differ).
            gain = stage_gain(self.get(spec, stage.route(token_ids)), batch_size)
            if gain is None:  # not measured yet: it drafts, and so gets measured
                best = stage
                break
            if best_gain is None or gain > best_gain:
                best, best_gain = stage, gain
        # A stage that keeps losing is tried once every stage_probe_every rounds it could have drafted, so its
        # estimates follow the text (a suffix cache that filled up, a draft model that became useful).
        for stage in candidates:
            if stage is not best:
                self._passed_over[stage] = self._passed_over.get(stage, 0) + 1
                if self._passed_over[stage] >= self.stage_probe_every:
                    best = stage
                    break
        self._passed_over[best] = 0
        return best.route(token_ids)
