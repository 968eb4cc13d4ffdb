"""`verispec serve`: an OpenAI-compatible HTTP server (chat and text completions, streaming, /metrics).

Requests may turn speculation on or off and change K per request (`"speculative": {...}`); see docs/server.md.
"""

from __future__ import annotations

import argparse
import logging
import ipaddress
import socket
import sys

from ..runtime import overrides
from . import CliError
from .serve_replicas import add_scale_args, run_replicas, wants_replicas
from .common import (
    positive_int,
    add_draft_device_arg,
    add_model_args,
    draft_device,
    add_speculation_args,
    apply_runtime,
    setup_logging,
    spec_kwargs,
    warn_if_lossy,
    runner_options,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ONLINE_TRAIN = ("off", "head")  # server/config.py's ONLINE_TRAIN (not imported: it loads torch before --help)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__)
    add_model_args(p)
    add_draft_device_arg(p)
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
    b.add_argument("--max-batched-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens fed to the target per step: decoding rows (K + 1 each), then prefill chunks of "
                        "waiting prompts (default: one prefill chunk's worth, at least --max-num-seqs)")
    b.add_argument("--prefill-chunk-tokens", type=positive_int, default=None, metavar="N",
                   help="most prompt tokens per prefill forward, so a long prompt does not stall the batch for "
                        "long (default: measured at start, the widest chunk whose forward costs at most "
                        "--prefill-chunk-steps decode steps; the log says what it chose)")
    b.add_argument("--prefill-chunk-steps", type=float, default=2.0, metavar="X",
                   help="the measured chunk's bound: its forward costs at most X decode steps, so streaming "
                        "clients' inter-token time stays within about (1 + X)x while a long prompt arrives "
                        "(default 2)")
    b.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="bound on the target's KV cache in GiB; each slot holds --max-len tokens, so it caps the "
                        "sequences decoding at once (default: what fits in free memory, up to --max-num-seqs)")
    b.add_argument("--deterministic", action="store_true",
                   help="bit for bit: a request's output and logprobs do not depend on the batch it ran in or on "
                        "speculation (turns on --batch-invariant; docs/speculation.md, 'Bit for bit')")
    g = p.add_argument_group("running it safely (docs/server.md, \"Running it safely\")")
    g.add_argument("--api-key", default=overrides.read("VERISPEC_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every /v1 request (default: $VERISPEC_API_KEY; "
                        "unset: no authentication). /health and /metrics stay open")
    g.add_argument("--allowed-draft-models", type=_name_list, default=None, metavar="LIST",
                   help="comma-separated drafters requests may name in speculative.draft_model: NAME (a drafter "
                        "value such as ngram or a hub id) or NAME=PATH (requests say NAME). The served "
                        "--draft-model and none are always allowed (default: also ngram)")
    g.add_argument("--max-cached-drafters", type=int, default=4, metavar="N",
                   help="request-named drafters kept loaded, least recently used dropped first (default 4)")
    g.add_argument("--max-queued-requests", type=positive_int, default=128, metavar="N",
                   help="requests waiting for a slot; more get 429 with Retry-After (default 128)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a request still running this long after it arrived ends with a 408 error and frees its "
                        "row (default 600; 0: no limit)")
    g.add_argument("--max-request-bytes", type=positive_int, default=4 * 2**20, metavar="N",
                   help="largest request body; larger ones get 413 (default 4194304, 4 MiB)")
    g.add_argument("--suffix-cache-tokens", type=int, default=65536, metavar="N",
                   help="tokens of finished requests the suffix drafter drafts from, least recently added dropped "
                        "first (default 65536; 0: each request's own text only)")
    g.add_argument("--suffix-shared-across-keys", action="store_true",
                   help="one suffix cache for every API key (default: one per key, so that no tenant's text can "
                        "speed up, and so be inferred by, another: docs/server.md)")
    g.add_argument("--max-choices", type=positive_int, default=64, metavar="N",
                   help="most choices per request: n, times the prompts of a completion (default 64)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM / SIGINT: new requests get 503, running ones get this long to finish before "
                        "they are cancelled with an error; then the server exits 0 (default 30)")
    g = p.add_argument_group("online training (docs/server.md, \"Online training\")")
    g.add_argument("--online-train", choices=ONLINE_TRAIN, default="off",
                   help="head: keep training the served draft head (--draft-model head:DIR) from each API key's own "
                        "traffic, one copy per key, swapped in between steps; outputs never change (default off)")
    g.add_argument("--online-train-every", type=positive_int, default=256, metavar="N",
                   help="new answer tokens of a key between its training rounds (default 256)")
    g.add_argument("--online-max-keys", type=positive_int, default=8, metavar="M",
                   help="API keys that keep a trained head; the least recently used one beyond drafts with the "
                        "deployment's head again (default 8)")
    g.add_argument("--online-buffer-tokens", type=positive_int, default=16384, metavar="N",
                   help="tokens of its latest requests each key's training buffer keeps (default 16384)")
    g.add_argument("--online-lr", type=float, default=3e-4, metavar="LR",
                   help="the online trainer's learning rate (default 3e-4)")
    add_scale_args(p)
    p.set_defaults(run=run)


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one drafter name")
    return names


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
    from ..server.shutdown import GracefulServer

    apply_runtime(args)
    setup_logging()
    logging.getLogger("verispec").info("weights %s; activations %s; dtype %s", args.weights_reason,
                                       args.activations_reason, args.dtype_reason)
    spec = SpeculativeConfig(**spec_kwargs(args))
    warn_if_lossy(args)
    config = ServerConfig(
        model=args.model, chat_template=args.chat_template, draft_model=args.draft_model, enable_speculative=args.enable_speculative, spec=spec,
        draft_tokens_from_pair=not getattr(args, "draft_tokens_given", False), served_model_name=args.served_model_name, max_len=args.max_len, dtype=args.torch_dtype, dtype_reason=args.dtype_reason,
        weights=args.weights, weights_reason=args.weights_reason, quantization=args.quantization,
        activations=args.activations, activations_reason=args.activations_reason,
        device=args.device, draft_device=draft_device(args), max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens, prefill_chunk_steps=args.prefill_chunk_steps,
        kv_cache_memory_gb=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        runner=runner_options(args), api_key=args.api_key, allowed_draft_models=args.allowed_draft_models,
        max_cached_drafters=args.max_cached_drafters, max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout or None, max_request_bytes=args.max_request_bytes,
        max_choices=args.max_choices, shutdown_timeout=args.shutdown_timeout,
        suffix_cache_tokens=args.suffix_cache_tokens, suffix_shared_across_keys=args.suffix_shared_across_keys,
        online_train=args.online_train, online_train_every=args.online_train_every,
        online_max_keys=args.online_max_keys, online_buffer_tokens=args.online_buffer_tokens,
        online_lr=args.online_lr,
    )
    if config.api_key is None and not _loopback(args.host):
        print(f"[verispec] warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr, flush=True)
    if wants_replicas(args):
        return run_replicas(args, config)
    sock = _listen(args.host, args.port)
    app = create_app(config)
    port = sock.getsockname()[1]
    spec = app.state.server.served.spec  # K may come from the pair 'auto' picked
    k = f"adaptive K <= {spec.max_speculation_depth}" if spec.adaptive else f"K={spec.num_draft_tokens}"
    speculation = f"on (draft {config.draft_model}, {k})" if config.speculates_by_default \
        else "off unless a request asks for it"
    slots = app.state.server.served.max_num_seqs
    auth = "API key required" if config.api_key else "no API key"
    print(f"[verispec] serving {config.model_id} on http://{args.host}:{port}/v1; speculation {speculation}; "
          f"up to {slots} sequences per batch; {auth}", file=sys.stderr, flush=True)
    print(f"[verispec] playground: open http://{args.host}:{port}/ in a browser", file=sys.stderr, flush=True)
    # The drain (GracefulServer) already let requests finish: uvicorn's own grace period only closes connections.
    server = GracefulServer(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5), app)
    server.run(sockets=[sock])
    return 0


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
