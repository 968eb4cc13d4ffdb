"""Arguments and checks shared by the subcommands."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from ..config import DRAFT_ACTIVATIONS, DRAFT_WEIGHTS, KV_CACHE_DTYPES, RUNNER_BACKENDS, RunnerOptions
from ..runtime.model.loading import DEFAULT_DRAFTER, DEFAULT_TARGET
from ..runtime.model.dtype import DTYPE_CHOICES, DTYPES  # noqa: F401 (DTYPES: bench/serve_load.py)
from ..runtime.threads import configure_threads, parse_threads
from ..runtime.weights import hugepages
from . import CliError

def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def threads_arg(text: str) -> int | str:
    """`--threads`: 'auto' or a positive integer (runtime/threads.py)."""
    try:
        return parse_threads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--threads ")) from None


THREADS_HELP = ("CPU threads of a step: N, or 'auto' (default): the cores free now, measured as it runs (fewer "
                "beside busy processes; runtime/threads.py); --json and the bench say what ran")


def apply_threads(args: argparse.Namespace) -> None:
    """The process's threads from --threads (absent: 'auto'), and its huge pages from --no-huge-pages."""
    configure_threads(getattr(args, "threads", None))
    hugepages.configure(getattr(args, "huge_pages", True))


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--model", default=DEFAULT_TARGET,
                   help=f"target model: folder, .gguf file, cached hub id, or {DEFAULT_TARGET!r} (default)")
    g.add_argument("--draft-model", default=DEFAULT_DRAFTER, action=_ExplicitStore,
                   help=f"draft model (same forms), 'none' for the target alone, 'ngram' (prompt lookup, no model), "
                        f"'auto' (the registered draft for the target, see `verispec pairs`), 'self:int8' / "
                        f"'self:int4' (the target's own weights quantized, no training); default {DEFAULT_DRAFTER!r}")
    g.add_argument("--draft-tokens", type=int, default=4, metavar="K", action=_ExplicitStore,
                   help="draft tokens per round (default 4, or the pair's K with --draft-model auto); with adaptive "
                        "speculation, the K of the first rounds")
    g.add_argument("--tree-nodes", type=int, default=0, metavar="N", action=_ExplicitStore,
                   help="token trees for drafters that propose them (a draft head, a draft model): up to N draft "
                        "tokens verified per round as a tree, its shape chosen per round from the draft's confidences "
                        "(default 0: chains of K)")
    g.add_argument("--max-len", type=positive_int, default=2048, help="longest prompt + output in tokens")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights dtype; 'auto' (default): bfloat16 where the device computes it natively and "
                        "speculation stays exact in it, else float32 (the choice and why are logged and in --json)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--threads", type=threads_arg, default="auto", help=THREADS_HELP)
    add_chat_template_arg(g)
    add_runner_args(g)
    add_weights_args(g)


def add_chat_template_arg(group) -> None:
    """--chat-template FILE (runtime/model/chat_templates.py), checked when the arguments are parsed (exit 2)."""
    group.add_argument("--chat-template", type=chat_template_file, default=None, metavar="FILE",
                       help="a Jinja chat template for --chat, the server's chat API and the bench's prompts "
                            "(default: the model's own, else its architecture's known template, e.g. Gemma 3's)")


def chat_template_file(value: str) -> Path:
    """An argparse type: a readable Jinja chat template file (chat_templates.read_template), else a usage error."""
    from ..runtime.model.chat_templates import read_template

    try:
        read_template(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(value)


def add_weights_args(group) -> None:
    """--weights, --activations and --quantization (target.py)."""
    from ..runtime.model.target import ACTIVATIONS, QUANTIZATIONS, WEIGHTS

    group.add_argument("--weights", choices=WEIGHTS, default="auto",
                       help="target weights: 'auto' (default) a GGUF target's own quantized blocks where verispec's "
                            "GGUF kernel runs them (CPU, native runner, Q4_0/Q4_1/Q8_0; the embedded default is a "
                            "Q4_1 file) and --dtype is auto, else the float conversion; 'fp32' the float conversion "
                            "(in --dtype); 'gguf' the GGUF blocks: the same values as the conversion, a quarter of "
                            "the bytes (float32 compute, native runner). The choice and why are logged and in --json")
    group.add_argument("--activations", choices=ACTIVATIONS, default="auto",
                       help="what GGUF blocks compute with: 'q8' the activations quantized to int8 per block of 32 "
                            "and exact integer dot products, as llama.cpp computes (verify passes, batches and "
                            "prefill cost close to one step; another model than the fp32 conversion: "
                            "docs/runner.md); 'fp32' the fp32 conversion's values exactly; 'auto' (default): q8 "
                            "where the kernel is built. The choice and why are logged and in --json")
    group.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                       help="'int8': the target's linears quantized per output channel (weight-only, symmetric): "
                            "a different model than the original (outputs differ from the unquantized target's)")


def add_runner_args(group) -> None:
    """--runner and --compile; build the options with `runner_options(args)`."""
    group.add_argument("--runner", choices=RUNNER_BACKENDS, default="auto",
                       help="model runner: 'native' (verispec's Llama-family module), 'hf' (Hugging Face modeling), "
                            "'auto' (native where the architecture allows; default)")
    group.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="torch.compile the native runner's whole step, one program per shape class, cached "
                            "under ~/.cache/verispec/compile (default: the measured choice for the device, see README)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="keep the KV of prompt prefixes for later prompts that start the same (default on; "
                            "docs/server.md, \"Prefix caching\")")
    group.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="native runner: every attention in one fixed order, long prefill chunks included, so "
                            "logits and logprobs are bit for bit the target's own in any dtype, batch, K and "
                            "prompt chunking (docs/speculation.md, 'Bit for bit'); default: on where verispec's "
                            "C++ kernels are built (free there), off elsewhere")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="native runner: the KV cache's entries. 'float16' / 'bfloat16' halve the bytes attention "
                            "reads a step (each entry rounded once to nearest even: outputs stay exact against the "
                            "target alone with the same cache); 'float32' keeps them as computed; 'auto' (default): "
                            "float16 with integer activations (--activations q8) on the CPU kernels, the model's dtype "
                            "elsewhere "
                            "(logged, and in --json)")
    group.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default="auto",
                       help="native CPU runner: a draft model's linears and LM head as 'Q8_0' blocks (about half a "
                            "draft token's cost; only acceptance moves, never the output) or 'float' (as loaded); "
                            "'auto' (default): Q8_0 where verispec's quantized kernel runs")
    group.add_argument("--draft-activations", choices=DRAFT_ACTIVATIONS, default="fp32",
                       help="what a draft model's Q8_0 blocks compute with: 'fp32' (default) or 'q8' (integer "
                            "activations; only acceptance moves)")
    group.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                       help="KV caches and packed weights on 2 MiB transparent huge pages where Linux gives them "
                            "(default on; the same values, fewer TLB misses: docs/runner.md, 'Huge pages')")


def runner_options(args) -> RunnerOptions:
    invariant = True if getattr(args, "deterministic", False) else args.batch_invariant
    return RunnerOptions(backend=args.runner, compile=args.compile, batch_invariant=invariant,
                         kv_cache_dtype=args.kv_cache_dtype, draft_weights=args.draft_weights,
                         draft_activations=args.draft_activations, huge_pages=args.huge_pages)


class _ExplicitStore(argparse.Action):
    """Store the value and remember that the user gave it (`args.<dest>_given`), so a default can defer."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def parse_acceptance(text: str) -> dict:
    """`exact` or `top_k:N` -> SpeculativeConfig keywords (acceptance, acceptance_top_k)."""
    if text == "exact":
        return {"acceptance": "exact"}
    mode, _, n = text.partition(":")
    if mode == "top_k" and n.isdigit() and int(n) >= 1:
        return {"acceptance": "top_k", "acceptance_top_k": int(n)}
    raise argparse.ArgumentTypeError(f"expected 'exact' or 'top_k:N' with N >= 1, got {text!r}")


def add_speculation_args(parser: argparse.ArgumentParser) -> None:
    """Flags of adaptive speculation and verification; build the config with `SpeculativeConfig(**spec_kwargs(args))`."""
    g = parser.add_argument_group("speculation")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="adaptive speculation (default on): choose K per round in [0, --max-speculation-depth] from "
                        "measured acceptance and draft/verify costs; K = 0 (plain decoding) when drafting would not pay")
    g.add_argument("--max-speculation-depth", type=positive_int, default=8, metavar="K_MAX",
                   help="largest K adaptive speculation may choose (default 8)")
    g.add_argument("--speculative-threshold", type=float, default=0.8, metavar="P",
                   help="draft-confidence cut-off (default 0.8; 0 disables): a model drafter stops drafting within a "
                        "round once its top probability falls below P. Saves wasted draft steps; the output "
                        "distribution is unchanged")
    g.add_argument("--acceptance", type=parse_acceptance, default=parse_acceptance("exact"), metavar="MODE",
                   help="'exact' (default, lossless) or 'top_k:N': LOSSY, also accepts draft tokens among the target's "
                        "N most likely, which CHANGES THE OUTPUT DISTRIBUTION (faster, no longer the target's output)")


def spec_kwargs(args: argparse.Namespace) -> dict:
    """SpeculativeConfig keywords from the model and speculation flags (the adaptive/threshold ones if present)."""
    kwargs = dict(num_draft_tokens=args.draft_tokens, tree_nodes=getattr(args, "tree_nodes", 0))
    if hasattr(args, "adaptive"):
        kwargs.update(adaptive=args.adaptive, max_speculation_depth=args.max_speculation_depth,
                      speculative_threshold=args.speculative_threshold, **args.acceptance)
    return kwargs


def warn_if_lossy(args: argparse.Namespace) -> None:
    acceptance = getattr(args, "acceptance", {"acceptance": "exact"})
    if acceptance["acceptance"] != "exact":
        print(f"verispec: warning: --acceptance {acceptance['acceptance']}:{acceptance.get('acceptance_top_k')} is "
              "LOSSY: the output no longer follows the target model's distribution", file=sys.stderr)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (as logging's last-resort handler does)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def setup_logging() -> None:
    """Show the library's warnings (drafter fallbacks, memory checks) on stderr, once."""
    logger = logging.getLogger("verispec")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("verispec: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if logger.level == logging.NOTSET else logger.level)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--min-new-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--coupled", action=argparse.BooleanOptionalAction, default=None,
                   help="coupled (Gumbel-max) sampling: with --seed, the target alone's output whatever the drafter, "
                        "K or batch; --no-coupled: rejection sampling, the highest acceptance (default: coupled "
                        "with --seed, rejection without)")
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID", help="repeatable")
    g.add_argument("--logit-bias", action="append", type=_bias, default=[], metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit, as OpenAI's logit_bias (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each generated token's logprob and the N (0..20) most likely alternatives")
    s = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    s.add_argument("--json-schema", type=Path, metavar="FILE", help="the output is JSON valid against this schema")
    s.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    s.add_argument("--regex", metavar="REGEX", help="the output matches this regular expression")
    s.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    s.add_argument("--grammar", type=Path, metavar="FILE", help="the output follows this Lark grammar")


def _bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 198=-100), got {text!r}") from None


def structured_output(args: argparse.Namespace):
    """The StructuredOutput the structured-output flags ask for, or None. Raises CliError for an unreadable file."""
    from ..config import StructuredOutput

    def read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CliError(f"cannot read {path}: {exc.strerror}") from None

    if args.json_schema:
        return StructuredOutput("json_schema", read(args.json_schema))
    if args.json_object:
        return StructuredOutput("json_object")
    if args.regex:
        return StructuredOutput("regex", args.regex)
    if args.choice:
        return StructuredOutput("choice", choices=tuple(args.choice))
    if args.grammar:
        return StructuredOutput("grammar", read(args.grammar))
    return None


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, coupled=args.coupled, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
        logit_bias=tuple(args.logit_bias), logprobs=args.logprobs, structured=structured_output(args),
    )


def target_dtype(args: argparse.Namespace, dtype: str) -> tuple[torch.dtype, str]:
    """`dtype` ('auto' or a name) resolved for the target, weights, runner and device the arguments name."""
    from ..runtime.model.target import resolve_target_dtype

    return resolve_target_dtype(dtype, args.device, getattr(args, "model", DEFAULT_TARGET),
                                getattr(args, "weights", "auto"), getattr(args, "quantization", "none"),
                                getattr(args, "runner", "auto"))


def target_plan(args: argparse.Namespace):
    """The target's `TargetPlan` (runtime/model/target.py) for the flags given; CliError naming the fix."""
    from ..drafters.spec import parse_drafter_spec
    from ..runtime.model.target import TargetOptions, resolve_target

    try:
        draft = getattr(args, "draft_model", None)
        reads = draft not in (None, "auto") and parse_drafter_spec(draft).reads_target_weights
        options = TargetOptions(args.weights, getattr(args, "quantization", "none"), args.dtype,
                                getattr(args, "activations", "auto"), args.device, getattr(args, "runner", "auto"),
                                getattr(args, "compile", False), drafter_reads_weights=reads)
        return resolve_target(options, getattr(args, "model", DEFAULT_TARGET))
    except ValueError as exc:
        raise CliError(str(exc)) from None


def target_weights(args: argparse.Namespace, dtype: str, hf_methods: bool = False) -> tuple[str, str]:
    """--weights ('auto' or a name) resolved for the target, dtype, device and runner the arguments name."""
    from ..drafters.spec import parse_drafter_spec
    from ..runtime.model.target import resolve_weights

    try:
        draft = getattr(args, "draft_model", None)
        reads = draft not in (None, "auto") and parse_drafter_spec(draft).reads_target_weights
        return resolve_weights(args.weights, getattr(args, "model", DEFAULT_TARGET), dtype, args.device,
                               getattr(args, "quantization", "none"), getattr(args, "runner", "auto"), hf_methods,
                               reads, getattr(args, "compile", False))
    except ValueError as exc:
        raise CliError(str(exc)) from None


def target_activations(args: argparse.Namespace) -> tuple[str, str]:
    """--activations resolved for the resolved --weights (target.resolve_activations); CliError on a bad pair."""
    from ..runtime.model.target import resolve_activations

    try:
        return resolve_activations(getattr(args, "activations", "auto"), args.weights)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def check_device_flag(flag: str, device: str, hint: str = "") -> str:
    """`device` (the value of `flag`: '--device', '--draft-device') checked by `placement.check_device` (index range,
    other device types); CliError (exit 2) with its message otherwise."""
    from ..drafters.placement import check_device

    try:
        check_device(device, flag, hint)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return device


def apply_runtime(args: argparse.Namespace) -> None:
    check_device_flag("--device", args.device)
    if getattr(args, "weights", None) is not None and getattr(args, "dtype", None) is not None:
        plan = args.target_plan = target_plan(args)  # weights, activations and dtype resolved once, each with why
        args.weights, args.activations, args.torch_dtype = plan.weights, plan.activations, plan.dtype
        args.weights_reason, args.activations_reason = plan.reasons["weights"], plan.reasons["activations"]
        args.dtype_reason = plan.reasons["dtype"]
    elif getattr(args, "dtype", None) is not None:  # 'auto' -> a dtype, once: args.dtype_reason says why
        args.torch_dtype, args.dtype_reason = target_dtype(args, args.dtype)
    apply_threads(args)
    if args.draft_tokens < 1:
        raise CliError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")


def add_draft_device_arg(group) -> None:
    """`--draft-device` (generate, serve): where a draft model runs, apart from the target's --device."""
    group.add_argument("--draft-device", default=None, metavar="DEVICE",
                       help="device of the draft model, e.g. cuda:1 (default: --device): its draft tokens and q "
                            "cross to the target's device once per round; a draft head or twin stays on --device")


def draft_device(args: argparse.Namespace) -> str | None:
    """--draft-device checked (CliError naming the fix for a device this machine lacks), or None: --device."""
    from ..drafters.placement import DRAFT_HINT

    if args.draft_device is None:
        return None
    return check_device_flag("--draft-device", args.draft_device, DRAFT_HINT)
