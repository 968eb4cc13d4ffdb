"""vLLM beside verispec in one benchmark run: the same prompts (token ids), the same greedy length, batch 1.

`verispec bench --vllm-python PY` runs `vllm_driver.py` with a vLLM virtualenv's python (see README, "Side by
side with vLLM"; ../shared/peers/setup_vllm_cpu.sh makes one), target alone and with vLLM's prompt-lookup
speculation, after verispec's own methods, and adds one table: tokens/s of each engine, target alone and
speculative, and the ratios.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from .aggregate import BASELINE, OVERALL

DRIVER = Path(__file__).with_name("vllm_driver.py")
VLLM_SPECS = ("none", "ngram")


def run_vllm(python: str, model_dir: Path, dtype: str, spec: str, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, k: int = 4, timeout_s: int = 3600) -> dict:
    """One vLLM process over the prompts; -> the driver's output (rows, load_s, spec_counters)."""
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp, "job.json"), Path(tmp, "out.json")
        job.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "spec": spec, "k": k,
                                   "max_new_tokens": max_new_tokens, "prompts": [list(p) for p in prompts]}))
        proc = subprocess.run([python, str(DRIVER), str(job), str(out)], capture_output=True, text=True,
                              timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM ({python}) failed with exit code {proc.returncode}: {proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def _ours(run: dict) -> tuple[float, str, float]:
    """verispec's target-alone tok/s and its best speculative method (name, tok/s) in a run."""
    overall = run["results"][OVERALL]
    speculative = {name: row["tokens_per_s"] for name, row in overall.items()
                   if name != BASELINE and not name.startswith("hf")}
    best = "adaptive" if "adaptive" in speculative else max(speculative, key=speculative.get, default="")
    return overall[BASELINE]["tokens_per_s"], best, speculative.get(best, 0.0)


def run_peers(config, dtype: str, encoded, run: dict, log: Callable[[str], None] = print,
              target_ids: dict | None = None) -> dict:
    """vLLM on the run's prompts; -> the run's "peers" section: per engine, target-alone and speculative tok/s."""
    from ..models import resolve_model_path

    model_dir = resolve_model_path(config.target)
    prompts = [p.token_ids for p in encoded]
    max_new = config.settings.max_new_tokens
    section: dict = {"vllm": {}}
    for spec in VLLM_SPECS:
        log(f"[bench] vLLM {dtype} spec={spec}: {len(prompts)} prompts (loading and compiling takes a few minutes)")
        try:
            result = run_vllm(config.vllm_python, model_dir, dtype, spec, prompts, max_new)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            log(f"[bench] note: vLLM {spec} did not run: {str(exc)[:500]}")
            section["vllm"][spec] = {"error": str(exc)[:2000]}
            continue
        rows = result["rows"]
        tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        entry = {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens, "seconds": round(seconds, 3),
                 "load_s": round(result["load_s"], 1), "spec_counters": result["spec_counters"]}
        if target_ids is not None:
            entry["equal_to_verispec_target"] = sum(
                r["token_ids"] == target_ids.get(i) for i, r in enumerate(rows))
        section["vllm"][spec] = entry
    target, best, spec_tps = _ours(run)
    section["verispec"] = {"target_tokens_per_s": target, "speculative_method": best,
                           "speculative_tokens_per_s": spec_tps}
    vllm_target = section["vllm"].get("none", {}).get("tokens_per_s")
    vllm_spec = section["vllm"].get("ngram", {}).get("tokens_per_s")
    if vllm_target:
        section["target_vs_vllm_target"] = round(target / vllm_target, 2)
    if vllm_spec and vllm_target:
        vllm_best = max(vllm_target, vllm_spec)
        section["speculative_vs_vllm_best"] = round(spec_tps / vllm_best, 2)
    for line in peer_table(section):
        log(line)
    return section


def peer_table(section: dict) -> list[str]:
    """Markdown lines: one row per engine, target alone and speculative tok/s."""
    ours = section["verispec"]
    lines = ["| engine | target alone tok/s | speculative tok/s | speculative / target |", "|---|---|---|---|"]
    target, spec = ours["target_tokens_per_s"], ours["speculative_tokens_per_s"]
    lines.append(f"| verispec ({ours['speculative_method']}) | {target:.1f} | {spec:.1f} | {spec / target:.2f}x |")
    vllm = section["vllm"]
    vt, vs = vllm.get("none", {}).get("tokens_per_s"), vllm.get("ngram", {}).get("tokens_per_s")
    if vt:
        speculative = f"{vs:.1f} | {vs / vt:.2f}x" if vs else "- | -"
        lines.append(f"| vLLM-CPU{' (ngram)' if vs else ''} | {vt:.1f} | {speculative} |")
    if "target_vs_vllm_target" in section:
        lines.append(f"verispec / vLLM: target alone {section['target_vs_vllm_target']:.2f}x"
                     + (f", speculative vs vLLM's best {section['speculative_vs_vllm_best']:.2f}x"
                        if "speculative_vs_vllm_best" in section else ""))
    return lines
