"""`ScaleConfig`: how `verispec serve --replicas` places and routes replicas. The CLI builds it by keyword."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX_CHARS = 512  # the prompt's leading characters the routing key hashes: a system prompt and then some
IMBALANCE = 4  # a replica this many requests busier than the least busy one loses its prefix affinity


@dataclass(frozen=True)
class ScaleConfig:
    replicas: int = 2
    """Replicas started (each one engine); the autoscaler's initial count when min/max differ."""
    min_replicas: int | None = None
    """Autoscaling lower bound (--min-replicas); None: `replicas` (a fixed count)."""
    max_replicas: int | None = None
    """Autoscaling upper bound (--max-replicas); None: `replicas` (a fixed count)."""
    ray_address: str | None = None
    """An existing Ray cluster to join (--ray-address); None: start a local one on loopback."""
    replica_cpus: float = 1.0
    """Ray CPUs reserved per replica (--replica-cpus)."""
    replica_gpus: float = 0.0
    """Ray GPUs reserved per replica (--replica-gpus)."""
    threads: int | None = None
    """Threads per replica (--threads N); None: 'auto' (runtime/threads.py)."""
    object_store_gb: float = 0.5
    """Object store of a local Ray (it carries only requests and responses here)."""
    dashboard: bool = False
    """Start Ray's dashboard with a local Ray (off: it costs ~ 300 MB; Ray's metrics agent stays on)."""
    prefix_chars: int = PREFIX_CHARS
    """Leading prompt characters the prefix-affinity key hashes."""
    imbalance: int = IMBALANCE
    """Ongoing-request gap at which prefix affinity yields to the least loaded replica."""
    failover: bool = True
    """A stream whose replica dies goes on in another replica from where it was (--no-failover: it ends with a
    retryable error event instead; server/scale/ingress.py)."""
    step_gate: bool = False
    """Tests only: each replica's engine can be parked mid-request on demand (`Replica.hold`, gate.py)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        low, high = self.bounds
        if not 1 <= low <= self.replicas <= high:
            raise ValueError(f"need 1 <= min_replicas ({low}) <= replicas ({self.replicas}) <= max_replicas "
                             f"({high}): change --min-replicas / --max-replicas")
        if self.replica_cpus <= 0 or self.replica_gpus < 0:
            raise ValueError(f"replica_cpus must be > 0 and replica_gpus >= 0, got {self.replica_cpus} and "
                             f"{self.replica_gpus}")
        if self.object_store_gb < 0.08:
            raise ValueError(f"object_store_gb must be >= 0.08 (Ray's minimum), got {self.object_store_gb}")
        if self.prefix_chars < 1 or self.imbalance < 0:
            raise ValueError("prefix_chars must be >= 1 and imbalance >= 0")

    @property
    def bounds(self) -> tuple[int, int]:
        low = self.replicas if self.min_replicas is None else self.min_replicas
        high = self.replicas if self.max_replicas is None else self.max_replicas
        return low, high

    @property
    def autoscaling(self) -> bool:
        low, high = self.bounds
        return low != high
