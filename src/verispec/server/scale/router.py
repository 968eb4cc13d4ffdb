"""`PrefixAffinityRouter`: Ray Serve's request-router extension point (`ray.serve.request_router`) with
routing.py's choice: a request's `key` keyword picks its replica by rendezvous hashing, unless that replica is
much busier than the least loaded; a request's `replica` keyword pins it to one replica (the ingress asks each
replica for its metrics that way; the caller bounds the wait for one this router does not know yet); its `avoid`
keyword names replicas the ingress saw die (a failover), which Serve may not have noticed yet: never chosen. Serve then
takes the least loaded replica with room within the first rank offered (its queue lengths: the router's cache,
probed when stale).

No FIFO mixin on purpose: with it, a routing task may hand its replica to an older pending request, which would
break both the pinning and the affinity.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .config import IMBALANCE
from .routing import rank


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = IMBALANCE, **_) -> None:
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = {} if pending_request is None else pending_request.kwargs
        gone = kwargs.get("avoid") or ()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas if r.replica_id.unique_id not in gone}
        if pending_request is not None:
            # No staged tries here (same node first, ...): when no rank has room, Serve backs off before asking
            # again, instead of spinning on the event loop.
            pending_request.routing_context.should_backoff = True
        pinned = kwargs.get("replica")
        if pinned is not None:  # not known here yet: Serve asks again once its replica list changes
            return [[by_id[pinned]]] if pinned in by_id else []
        loads = {rid: self._replica_queue_len_cache.get(r.replica_id) for rid, r in by_id.items()}
        imbalance = getattr(self, "imbalance", IMBALANCE)
        return [[by_id[rid] for rid in ids] for ids in rank(kwargs.get("key"), loads, imbalance)]
