"""`verispec serve`: an OpenAI-compatible HTTP server (chat and text completions, streaming, /metrics).

Requests may turn speculation on or off and change K per request (`"speculative": {...}`); see docs/server.md.
"""

from __future__ import annotations

import argparse
import socket
import sys

from . import CliError
from .common import (
    DTYPES,
    positive_int,
    add_model_args,
    add_speculation_args,
    apply_runtime,
    setup_logging,
    spec_kwargs,
    warn_if_lossy,
    runner_options,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__)
    add_model_args(p)
    add_speculation_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--enable-speculative", action="store_true",
                   help="speculate by default (requests may still turn it off); without it only requests that ask "
                        "for speculation use the draft model")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=52415, help="port to listen on (default 52415; 0 picks a free one)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model id to list in /v1/models (default: the model's folder name or name)")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    b = p.add_argument_group("continuous batching (docs/server.md, \"Concurrency\")")
    b.add_argument("--max-num-seqs", type=positive_int, default=16, metavar="N",
                   help="sequences (choices) decoding together in one batch; more wait in a FIFO queue (default 16)")
    b.add_argument("--max-batched-tokens", type=positive_int, default=256, metavar="N",
                   help="tokens fed to the target per step: decoding rows (K + 1 each), then prefill chunks of "
                        "waiting prompts (default 256; at least --max-num-seqs)")
    b.add_argument("--prefill-chunk-tokens", type=positive_int, default=128, metavar="N",
                   help="most prompt tokens per prefill forward, so a long prompt does not stall the batch for "
                        "long (default 128)")
    b.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="bound on the target's KV cache in GiB; each slot holds --max-len tokens, so it caps the "
                        "sequences decoding at once (default: no bound beyond --max-num-seqs)")
    p.set_defaults(run=run)


def _listen(host: str, port: int) -> socket.socket:
    """Bind before the (slow) model load, so a taken port fails at once."""
    if not 0 <= port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..config import SpeculativeConfig
    from ..server import ServerConfig, create_app

    apply_runtime(args)
    setup_logging()
    spec = SpeculativeConfig(**spec_kwargs(args))
    warn_if_lossy(args)
    config = ServerConfig(
        model=args.model, draft_model=args.draft_model, enable_speculative=args.enable_speculative, spec=spec,
        draft_tokens_from_pair=not getattr(args, "draft_tokens_given", False), served_model_name=args.served_model_name, max_len=args.max_len, dtype=DTYPES[args.dtype],
        device=args.device, max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens, kv_cache_memory_gb=args.kv_cache_memory,
        runner=runner_options(args),
    )
    sock = _listen(args.host, args.port)
    app = create_app(config)
    port = sock.getsockname()[1]
    spec = app.state.server.served.spec  # K may come from the pair 'auto' picked
    k = f"adaptive K <= {spec.max_speculation_depth}" if spec.adaptive else f"K={spec.num_draft_tokens}"
    speculation = f"on (draft {config.draft_model}, {k})" if config.speculates_by_default \
        else "off unless a request asks for it"
    slots = app.state.server.served.max_num_seqs
    print(f"[verispec] serving {config.model_id} on http://{args.host}:{port}/v1; speculation {speculation}; "
          f"up to {slots} sequences per batch", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a deliberate stop, not a failure
        pass
    return 0
