"""Speculation statistics, per call and cumulative, in the project's vocabulary (DEVELOPERS.md)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

_IMPORTED = time.time()  # where the process's own start time cannot be read


def process_seconds() -> float:
    """Seconds since this process started, interpreter start-up and imports included (Linux: the kernel's record of
    the start, to 10 ms; elsewhere, since verispec was first imported). Start-up figures report it once ready."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (their prefill was skipped)
    generated_tokens: int = 0  # committed tokens returned to the caller
    rounds: int = 0
    draft_tokens: int = 0  # draft tokens proposed (positions the target examined)
    accepted_tokens: int = 0
    proposed_by_position: list[int] = field(default_factory=list)  # [position]: rounds with a draft token there
    accepted_by_position: list[int] = field(default_factory=list)  # [position]: ...and it was accepted
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    fallbacks: int = 0  # drafter failures that sent the request on to the target alone
    requests: int = 0
    acceptance_mode: str = "exact"  # verification mode: 'exact' (lossless) or e.g. 'top_k:5' (LOSSY); 'mixed' if both
    lossy: bool = False  # True when a lossy acceptance mode changed the output distribution
    rounds_by_stage: dict[str, int] = field(default_factory=dict)  # drafter (a cascade's stage) -> rounds it drafted
    draft_tokens_by_stage: dict[str, int] = field(default_factory=dict)  # stage -> its draft tokens (as draft_tokens)
    accepted_by_stage: dict[str, int] = field(default_factory=dict)  # stage -> of those, accepted (as accepted_tokens)

    def record_round(self, proposed: int, accepted: int, committed: int, verified: int | None = None) -> None:
        """One round: `proposed` draft positions (a tree's depth), the leading `accepted` of them accepted,
        `committed` tokens kept; `verified` draft tokens (a tree's nodes; default: proposed)."""
        self.rounds += 1
        self.draft_tokens += proposed if verified is None else verified
        self.accepted_tokens += accepted
        self.generated_tokens += committed
        grow = proposed - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for position in range(proposed):
            self.proposed_by_position[position] += 1
            self.accepted_by_position[position] += position < accepted

    def record_stage(self, stage: str, drafted: int, accepted: int) -> None:
        """A round the drafter stage `stage` drafted: `drafted` draft tokens counted, the leading `accepted` kept."""
        self.rounds_by_stage[stage] = self.rounds_by_stage.get(stage, 0) + 1
        self.draft_tokens_by_stage[stage] = self.draft_tokens_by_stage.get(stage, 0) + drafted
        self.accepted_by_stage[stage] = self.accepted_by_stage.get(stage, 0) + accepted

    @property
    def rounds_by_k(self) -> list[int]:
        """[K]: rounds that drafted exactly K tokens (a tree: its depth; K = 0: a plain step of adaptive K)."""
        proposed = [self.rounds, *self.proposed_by_position, 0]
        return [proposed[k] - proposed[k + 1] for k in range(len(proposed) - 1)]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per round, the recovered or bonus token included (1.0: speculation never helped)."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def merge(self, other: GenerationStats) -> None:
        """Add another call's figures into this (cumulative) record."""
        if other.requests:
            self.acceptance_mode = (
                other.acceptance_mode if not self.requests or self.acceptance_mode == other.acceptance_mode else "mixed"
            )
        self.lossy = self.lossy or other.lossy
        for name in ("prompt_tokens", "cached_tokens", "generated_tokens", "rounds", "draft_tokens", "accepted_tokens", "fallbacks",
                     "requests"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("draft_s", "verify_s", "prefill_s", "wall_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.rounds_by_stage, other.rounds_by_stage),
                             (self.draft_tokens_by_stage, other.draft_tokens_by_stage),
                             (self.accepted_by_stage, other.accepted_by_stage)):
            for stage, count in theirs.items():
                mine[stage] = mine.get(stage, 0) + count
        for mine, theirs in (
            (self.proposed_by_position, other.proposed_by_position),
            (self.accepted_by_position, other.accepted_by_position),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for position, count in enumerate(theirs):
                mine[position] += count

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted_length=round(self.mean_accepted_length, 4),
            acceptance_by_position=[round(x, 4) for x in self.acceptance_by_position],
            rounds_by_k=self.rounds_by_k,
            tokens_per_s=round(self.tokens_per_s, 2),
        )
        for name in ("draft_s", "verify_s", "prefill_s", "wall_s"):
            out[name] = round(out[name], 4)
        return out

    def summary(self) -> str:
        by_pos = " ".join(f"{x:.2f}" for x in self.acceptance_by_position) or "-"
        return (
            f"{self.generated_tokens} tokens in {self.wall_s:.2f}s ({self.tokens_per_s:.1f} tok/s) | "
            f"rounds {self.rounds}, mean accepted length {self.mean_accepted_length:.2f}, "
            f"acceptance {self.acceptance_rate:.1%} ({self.accepted_tokens}/{self.draft_tokens}), by position [{by_pos}] | "
            f"draft {self.draft_s:.2f}s, verify {self.verify_s:.2f}s, prefill {self.prefill_s:.2f}s"
            + (f" | fallbacks {self.fallbacks}" if self.fallbacks else "")
            + (f" | LOSSY acceptance {self.acceptance_mode}" if self.lossy else "")
        )
