"""`run_benchmark`: load the pair once per dtype, run the suite, write report.json, report.md and the plots."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..drafters.build import build_drafter, head_ids_for
from ..drafters.model import draft_model_weights
from ..drafters.spec import parse_drafter_spec
from ..config import RunnerOptions
from ..runtime.model.compile import cache_counts
from ..runtime.runners.select import runner_info
from ..runtime.model.loading import model_weight_bytes
from ..runtime.threads import governor
from .aggregate import BASELINE, OVERALL
from .batching import batch_table, run_batch_sweep
from .busy import busy_cores, contention, contention_table
from .machine import decode_floor, describe_machine, floor_line, gguf_step_bytes, machine_line
from .methods import BenchModels
from .peers import run_peers
from .plots import write_plots
from .prompts import BenchPrompt, default_prompts_path, encode_prompts, load_prompts, select_prompts
from .report import text_table, write_reports
from ..stats import process_seconds
from .settings import BenchSettings
from .suite import run_suite


@dataclass
class BenchConfig:
    target: str
    draft: str | None
    prompts_file: str | None = None  # None: the default Spec-Bench dev set
    categories: list[str] | None = None
    limit: int | None = None  # prompts per category
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    device: str = "cpu"
    out: Path = Path("bench-out")
    settings: BenchSettings = field(default_factory=BenchSettings)
    runner: RunnerOptions = field(default_factory=RunnerOptions)  # what runs our engine's models
    vllm_python: str | None = None  # a vLLM virtualenv's python: the same as peers={"vllm": vllm_python}
    peers: dict[str, str] = field(default_factory=dict)  # peer engine -> its virtualenv's python (bench/peers.py)
    weights: str = "fp32"  # the target's weights: the float conversion, or "gguf" (its GGUF file's own blocks)
    weights_reason: str = ""  # why (the CLI resolves --weights auto: target.resolve_weights)
    quantization: str = "none"  # "int8": the target's linears per channel (a different model)
    activations: str = "fp32"  # what GGUF blocks compute with: "fp32" or "q8" (target.resolve_activations)
    activations_reason: str = ""  # why
    chat_template: Path | None = None  # a Jinja chat template file for the prompts (default: the target's own/known)
    workload: dict = field(default_factory=dict)  # a built workload's description (code_workload.describe); {}: none

    def __post_init__(self):
        if self.vllm_python and not self.peers:
            self.peers = {"vllm": self.vllm_python}


def selected_prompts(config: BenchConfig) -> tuple[list[BenchPrompt], str]:
    """The prompts to run and the file they came from (validated before any model is loaded)."""
    path = config.prompts_file or default_prompts_path()
    prompts = load_prompts(path)
    return select_prompts(prompts, config.categories, config.limit), str(path)


def load_models(config: BenchConfig, dtype: str, prompts: Sequence[BenchPrompt]):
    """-> (BenchModels, prompts encoded with the target's tokenizer).

    Our methods draft with the drafter `config.draft` names (a model, 'ngram', 'ngram+MODEL', ...); HF assisted
    generation gets its draft model, when it names one (model-free drafters: our methods only)."""
    from ..runtime.model.loading import load_draft, load_model, load_tokenizer
    from ..runtime.model.target import load_target

    torch_dtype = getattr(torch, dtype)  # 'float32' -> torch.float32
    target = load_target(config.target, config.weights, config.quantization, dtype=torch_dtype, device=config.device,
                         activations=config.activations)
    spec = parse_drafter_spec(config.draft)
    model_name = spec.model
    hf_runs = any(f.startswith("hf") for f in config.settings.families)  # HF assisted generation needs HF's draft
    tokenizer = load_tokenizer(config.target, config.chat_template)
    if model_name is None:
        draft = None
    elif hf_runs:
        draft = load_model(model_name, dtype=torch_dtype, device=config.device)
    else:  # a GGUF draft runs its own blocks (loading.load_draft), its head reduced as the spec says
        draft = load_draft(model_name, dtype=torch_dtype, device=config.device,
                           head_ids=head_ids_for(spec.model_stage, target, tokenizer))
    encoded = encode_prompts(tokenizer, prompts)
    max_len = max(len(p.token_ids) for p in encoded) + config.settings.max_new_tokens + 8
    drafter = build_drafter(spec, target, tokenizer, max_len, draft_model=draft).drafter
    models = BenchModels.build(target, draft, tokenizer, max_len, drafter, config.runner, config.settings.structured)
    return models, encoded


def new_report(config: BenchConfig, prompts_file: str) -> dict:
    machine = describe_machine(config.device)
    settings = {**config.settings.to_dict(), "prompts_file": prompts_file, "categories": config.categories,
                "limit_per_category": config.limit, "dtypes": config.dtypes, "weights": config.weights,
                "weights_reason": config.weights_reason, "activations": config.activations,
                "activations_reason": config.activations_reason,
                "limit_note": "all prompts" if config.limit is None else f"first {config.limit} per category"}
    if config.workload:
        settings["workload"] = config.workload
    return {"machine": machine, "settings": settings,
            "models": {"target": config.target, "draft": config.draft}, "runs": []}


def run_benchmark(config: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark for every dtype in config.dtypes; write reports and plots into config.out."""
    prompts, prompts_file = selected_prompts(config)
    report = new_report(config, prompts_file)
    log(f"[bench] machine: {machine_line(report['machine'])}")
    log(f"[bench] weights: {config.weights_reason or config.weights}; activations: "
        f"{config.activations_reason or config.activations}")
    settings = config.settings
    sweep = (f"batch sizes {','.join(map(str, settings.batch_sizes))}, methods {','.join(settings.batch_methods())}"
             if settings.batch_sizes else
             f"methods {','.join(settings.families)}; K {','.join(map(str, settings.ks))}")
    log(f"[bench] {len(prompts)} prompts from {prompts_file}; {sweep}; {settings.max_new_tokens} new tokens each")
    peer_results: dict = {}  # busy -> what a peer measured that does not depend on the dtype, run once
    for dtype in config.dtypes:
        log(f"[bench] dtype {dtype}: loading {config.target} and {config.draft}")
        start = time.perf_counter()
        models, encoded = load_models(config, dtype, prompts)
        runner = runner_info(models.engine.target)
        # the models' load (target, tokenizer, drafter, runners); the first dtype's also: process start to ready
        runner["load_s"] = round(time.perf_counter() - start, 2)
        if dtype == config.dtypes[0]:
            runner["startup_s"] = round(process_seconds(), 2)
        draft_weights = draft_model_weights(models.engine.drafter)
        kv_cache = f", KV cache {runner['kv_cache_dtype']}" if "kv_cache_dtype" in runner else ""
        log(f"[bench] runner: {runner['backend']}{' compiled' if runner['compiled'] else ''}"
            f"{', weights pre-packed' if runner.get('packed_weights') else ''}{kv_cache}"
            f"{f'; draft model weights: {draft_weights}' if draft_weights else ''}; loaded in {runner['load_s']:.1f} s")
        for busy in settings.busy_conditions():
            with busy_cores(busy):
                if busy:
                    log(f"[bench] dtype {dtype}: beside {busy} busy process(es) (bench/busy.py)")
                run = measure(config, models, encoded, dtype, dict(runner), report, log,
                              peer_results.setdefault(busy, {}), busy)
            report["runs"].append(run)
        del models
        gc.collect()
    if settings.busy:
        report["contention"] = contention(report["runs"])
        for line in text_table(*contention_table(report["contention"])):
            log(line)
    json_path, md_path = write_reports(report, config.out)
    log(f"[bench] wrote {json_path}, {md_path} and {sum(len(r['plots']) for r in report['runs'])} plots")
    return report


def measure(config: BenchConfig, models: BenchModels, encoded: list[BenchPrompt], dtype: str, runner: dict,
            report: dict, log: Callable[[str], None], peer_results: dict, busy: int = 0) -> dict:
    """One run of the loaded models (the K sweep or the batch sweep, then the peers), beside `busy` busy processes
    (started by the caller) -> its section of report.json."""
    settings = config.settings
    records = []
    governor().reset_counts()
    if settings.batch_sizes:
        section, _ = run_batch_sweep(models, encoded, settings)
        base = section["batching"]["results"]["1"][BASELINE]
    else:
        section, records = run_suite(models, encoded, settings)
        base = section["results"][OVERALL][BASELINE]
    runner["compile_s"] = round(models.engine.target.compile_s, 1)  # first calls of new shapes, warm-ups included
    if runner["compiled"]:
        runner["compile_cache"] = cache_counts()  # programs loaded from the disk cache / compiled so far
    weight_bytes, counted = step_weight_bytes(config, models.target)
    run = {"dtype": dtype, "busy": busy, "runner": runner, "threads": governor().report().as_dict(), **section,
           "floor": decode_floor(weight_bytes, report["machine"]["memory_bandwidth_gb_s"], base["tokens"],
                                 base["seconds"], counted)}
    for note in run["notes"]:
        log(f"[bench] note: {note}")
    for line in batch_summary(run) if settings.batch_sizes else overall_summary(run):
        log(line)
    log(f"[bench] {floor_line(run['floor'])}")
    if config.peers:
        order = {p.question_id: i for i, p in enumerate(encoded)}
        target_ids = {order[r.question_id]: list(r.token_ids) for r in records if r.method == BASELINE}
        run["peers"] = run_peers(config, dtype, encoded, run, log, target_ids, peer_results)
    run["plots"] = write_plots(run, config.out)
    return run


def step_weight_bytes(config: BenchConfig, target) -> tuple[int, str]:
    """-> (the bytes a decode step of the target reads, what they are). A GGUF target run on its own blocks: from
    the file's header (`machine.gguf_step_bytes`); any other: the weights as the loaded target holds them."""
    if config.weights == "gguf":
        from .peer_models import target_gguf

        return gguf_step_bytes(target_gguf(config))
    return model_weight_bytes(target), "the loaded target's weights as held, the embedding included"


def batch_summary(run: dict) -> list[str]:
    """The batch-size sweep as an aligned table, one row per batch size."""
    return text_table(*batch_table(run))


def overall_summary(run: dict) -> list[str]:
    """One line per method: tokens/s, speedup, acceptance, equality: what a terminal user reads first."""
    lines = []
    for name, row in run["results"]["overall"].items():
        extra = ""
        if "mean_accepted_length" in row:
            extra = f", mean accepted length {row['mean_accepted_length']:.2f}"
            if row.get("predicted_speedup"):
                extra += f", predicted {row['predicted_speedup']:.2f}x"
        lines.append(f"  {name:<16} {row['tokens_per_s']:8.1f} tok/s  {row['speedup']:5.2f}x{extra}, "
                     f"= target {row['equal_to_target']}/{row['prompts']}")
    return lines

