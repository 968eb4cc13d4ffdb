"""`serve_replicas`: start (or join) Ray, run the ingress and the replicas on Serve, wait, drain, stop.

A local Ray listens on loopback only, quietly (warnings and errors), with a small object store (requests and
responses are all it carries) and without its dashboard unless asked (`ScaleConfig.dashboard`: it costs memory;
Ray's metrics agent runs either way and exports Ray's and Serve's own metrics). With `ray_address` the
deployments go to that cluster (every node needs verispec installed and the model reachable at the same path).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from ..config import ServerConfig
from .config import ScaleConfig
from .ingress import APP_NAME, REPLICA_DEPLOYMENT, Ingress
from .replica import Replica
from .router import PrefixAffinityRouter

logger = logging.getLogger("verispec.server")
QUIET = {"log_level": "WARNING", "enable_access_log": False}
HEALTH_CHECK_PERIOD_S = 2.0
SLOT_HEADROOM = 4  # calls a replica takes beyond its batch: metrics and health answers past a full batch


def application(config: ServerConfig, scale: ScaleConfig):
    """The Serve application: one ingress bound to the Replica deployment."""
    low, high = scale.bounds
    count = dict(num_replicas=scale.replicas) if not scale.autoscaling else dict(autoscaling_config=AutoscalingConfig(
        min_replicas=low, max_replicas=high, initial_replicas=scale.replicas,
        target_ongoing_requests=max(1, config.max_num_seqs // 2)))
    replica = serve.deployment(
        Replica, name=REPLICA_DEPLOYMENT,
        ray_actor_options={"num_cpus": scale.replica_cpus, "num_gpus": scale.replica_gpus},
        # Requests past a replica's batch wait at the ingress's router, not inside the replica: they go to
        # whichever replica frees a slot first, and survive a replica's death.
        max_ongoing_requests=config.max_num_seqs + SLOT_HEADROOM,
        graceful_shutdown_timeout_s=config.shutdown_timeout, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs={"imbalance": scale.imbalance}),
        logging_config=QUIET, **count,
    )
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0}, logging_config=QUIET,
                               graceful_shutdown_timeout_s=config.shutdown_timeout)
    return ingress.bind(replica.bind(config, scale.threads, scale.step_gate), config, scale)


def start(config: ServerConfig, scale: ScaleConfig, host: str, port: int) -> None:
    """Ray (local or `scale.ray_address`) and Serve's HTTP proxy on host:port, then the application; returns
    once every replica has loaded its model."""
    if scale.ray_address is None:
        low, high = scale.bounds
        cpus = max(os.cpu_count() or 1, int(high * scale.replica_cpus + 0.999))  # logical CPUs Ray hands out
        ray.init(address="local", num_cpus=cpus, include_dashboard=scale.dashboard,
                 object_store_memory=int(scale.object_store_gb * 2**30), _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING, log_to_driver=True)
    else:
        ray.init(address=scale.ray_address, logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port}, logging_config=QUIET)
    serve.run(application(config, scale), name=APP_NAME, route_prefix="/")


def drain_and_stop(config: ServerConfig) -> None:
    """Graceful stop: the ingress refuses new requests and waits for those in flight (shutdown_timeout), then
    Serve stops the replicas (each waits for its own ongoing calls first) and a local Ray ends."""
    try:
        left = serve.get_app_handle(APP_NAME).drain.remote(config.shutdown_timeout).result(
            timeout_s=config.shutdown_timeout + 10)
        if left:
            logger.warning("shutting down with %d request(s) still in flight", left)
    finally:
        serve.shutdown()
        ray.shutdown()


def serve_replicas(config: ServerConfig, scale: ScaleConfig, host: str, port: int, on_ready=None) -> None:
    """Run until SIGTERM / SIGINT, then drain and stop. `on_ready()` is called once requests are answered."""
    stop = threading.Event()
    try:
        start(config, scale, host, port)
    except BaseException:
        ray.shutdown()
        raise
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if on_ready is not None:
            on_ready()
        stop.wait()
        drain_and_stop(config)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
