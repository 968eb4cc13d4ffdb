"""`verispec serve --replicas N` / `--ray-address ADDR`: the same server as N replicas on Ray Serve.

The flags here add placement and scale to `verispec serve`'s own (which every replica keeps: limits, API key,
speculation); server/scale/ does the work (docs/server.md, "Scaling out").
"""

from __future__ import annotations

import argparse
import socket
import sys

from . import CliError
from .bench_serve import fixed_threads
from .common import positive_int


def add_scale_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("replicas on Ray Serve (docs/server.md, \"Scaling out\"; needs verispec[ray])")
    r.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="serve through N replicas on Ray Serve, each one engine (default: one process, no Ray)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="deploy the replicas on this existing Ray cluster (e.g. ray://head:10001 or auto) "
                        "instead of a local Ray started on loopback")
    r.add_argument("--min-replicas", type=positive_int, default=None, metavar="N",
                   help="autoscaling lower bound (default: --replicas, a fixed count)")
    r.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                   help="autoscaling upper bound (default: --replicas, a fixed count)")
    r.add_argument("--replica-cpus", type=float, default=None, metavar="CPUS",
                   help="Ray CPUs reserved per replica (default: --threads, else 1)")
    r.add_argument("--replica-gpus", type=float, default=0.0, metavar="GPUS",
                   help="Ray GPUs reserved per replica (default 0)")
    r.add_argument("--no-failover", dest="failover", action="store_false",
                   help="a stream whose replica dies ends with a retryable error event instead of going on in "
                        "another replica from where it was (default: failover on)")
    r.add_argument("--ray-dashboard", action="store_true",
                   help="with a local Ray, start its dashboard too (off by default: it costs ~ 300 MB)")


def wants_replicas(args: argparse.Namespace) -> bool:
    return args.replicas is not None or args.ray_address is not None or \
        args.min_replicas is not None or args.max_replicas is not None


def run_replicas(args: argparse.Namespace, config) -> int:
    """Serve `config` through replicas until SIGTERM / SIGINT (drained), then exit 0."""
    from ..server.scale.config import ScaleConfig

    try:
        scale = ScaleConfig(
            replicas=args.replicas or args.min_replicas or 1, min_replicas=args.min_replicas,
            max_replicas=args.max_replicas, ray_address=args.ray_address,
            replica_cpus=args.replica_cpus or float(fixed_threads(args) or 1), replica_gpus=args.replica_gpus,
            threads=fixed_threads(args), dashboard=args.ray_dashboard, failover=args.failover,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        from ..server.scale import launch
    except ImportError as exc:
        raise CliError(f"--replicas needs Ray Serve ({exc}): pip install \"verispec[ray]\"") from None
    port = _free_port(args.host, args.port)
    where = f"the Ray cluster at {scale.ray_address}" if scale.ray_address else "a local Ray on loopback"
    low, high = scale.bounds
    count = f"{scale.replicas} replicas" if low == high else f"{scale.replicas} replicas ({low}..{high})"

    def ready() -> None:
        auth = "API key required" if config.api_key else "no API key"
        print(f"[verispec] serving {config.model_id} on http://{args.host}:{port}/v1 through {count} on Ray Serve "
              f"({where}); {auth}", file=sys.stderr, flush=True)

    print(f"[verispec] starting {count} on {where}: each loads the model", file=sys.stderr, flush=True)
    launch.serve_replicas(config, scale, args.host, port, on_ready=ready)
    return 0


def _free_port(host: str, port: int) -> int:
    """A taken port fails now, before Ray starts (Serve binds it itself); 0 picks a free one."""
    if not 0 <= port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {port}")
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CliError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from None
        return sock.getsockname()[1]
