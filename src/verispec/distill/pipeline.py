"""The `verispec distill` pipeline: documents -> prompts -> teacher answers -> training -> export -> evaluation.

Each stage writes its result into the work folder and is skipped when it is already there, so `resume=True`
continues an interrupted run from its last finished stage (and from the last checkpoint within training):

    work/settings.json    the recipe the data was built with (a resumed run must match it)
    work/documents.jsonl  documents the target wrote (sampled), material for summarisation and retrieval prompts
    work/prompts.jsonl    the prompt list: {"category", "text"}
    work/answers/*.pt     teacher samples (greedy answers + top-k log-probs), one file per chunk of prompts
    work/checkpoint.pt    draft weights, optimiser state and step
"""

from __future__ import annotations

import json
import platform
import random
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

import verispec
from verispec.distill import evaluate as ev
from verispec.distill.head import draft_vocab_stage
from verispec.distill.prompts import Prompt, build_prompts, material_requests
from verispec.distill.recipe import DistillRecipe
from verispec.distill.shard_data import ShardDataError, held_apart, load_shard_samples, write_curve
from verispec.distill.student import build_draft, draft_config, export_draft
from verispec.distill.teacher import Sample, engine_answers, generate_batch, length_batches
from verispec.engine import SpeculativeEngine
from verispec.distill.train import TrainSettings, train
from verispec.runtime.model.loading import load_model, load_tokenizer

CHUNK_PROMPTS = 192  # prompts per answers file: the unit of resumption while generating
# Settings that change the teacher data; a resumed run must keep them. (`tokens` may change: answers are generated
# chunk by chunk in a fixed prompt order, so a larger budget extends the data and a smaller one uses a prefix.)
DATA_FIELDS = ("target", "corpus", "seed", "max_new_tokens", "documents", "document_tokens",
               "document_temperature", "topk", "max_length", "teacher_dtype", "shards", "heldout_fraction",
               "shard_limit", "draft_vocab")


class DistillError(ValueError):
    """A run that cannot start as asked (e.g. a work folder from another recipe); the message says what to do."""


def run_distill(recipe: DistillRecipe, out_dir: Path, work_dir: Path, resume: bool = False,
                eval_data: Path | None = None, progress: bool = True, log=print, device: str = "cpu") -> dict:
    """Run every stage; returns the report also written into `out_dir/distill_recipe.json` (a draft head's run:
    head_pipeline.py, when recipe.head). device: where the teacher writes its data and the draft trains (a GPU:
    Hugging Face generation in batches of `gen_batch_size`; the CPU: verispec's own engine); the evaluation runs on
    the CPU."""
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    if recipe.head and torch.device(device).type != "cpu":  # before any stage runs
        raise DistillError("a draft head distils on the CPU only: drop --device, or distil a draft model")
    heldout: list[Sample] = []
    data_summary = None
    if recipe.shards:
        tokenizer, samples, heldout, pad_id, timings, clock, data_summary, apart = shard_data(
            recipe, work_dir, resume, progress, log)
        if recipe.head:
            from .head_pipeline import run_head_shards

            return run_head_shards(recipe, out_dir, work_dir, tokenizer, samples, heldout, apart, data_summary,
                                   timings, clock, eval_data, progress, log)
    else:
        tokenizer, samples, pad_id, timings, clock = teacher_data(recipe, work_dir, resume, progress, log, device)
    if recipe.head:
        from .head_pipeline import run_head_distill

        return run_head_distill(recipe, out_dir, work_dir, tokenizer, samples, timings, clock, eval_data,
                                progress, log)

    target = load_model(recipe.target, dtype=torch.float32)
    config = draft_config(target.config, recipe.hidden_size, recipe.num_layers, recipe.intermediate_size,
                          recipe.num_heads, recipe.num_kv_heads, recipe.max_positions)
    draft = build_draft(target, config, recipe.seed)
    vocab_ids = None
    if recipe.draft_vocab:
        vocab_ids, coverage = draft_vocab_stage(work_dir, samples, recipe.draft_vocab, config.vocab_size,
                                                set(ev._eos_ids(target, tokenizer)))
        draft.config.draft_vocab = vocab_ids.tolist()  # exported in config.json: the drafter's d2t map
        log(f"draft vocabulary: the {len(vocab_ids):,} most frequent answer tokens cover {coverage:.2%} of them")
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {n_params / 1e6:.2f}M parameters, hidden {recipe.hidden_size}, {recipe.num_layers} layers; "
        f"training {recipe.steps} steps on {len(samples)} samples ({len(heldout)} held apart)")
    settings = TrainSettings(steps=recipe.steps, lr=recipe.lr, batch_tokens=recipe.batch_tokens,
                             max_length=recipe.train_length, kd_weight=recipe.kd_weight,
                             weight_decay=recipe.weight_decay, seed=recipe.seed,
                             checkpoint_every=recipe.checkpoint_every, bf16=recipe.train_bf16,
                             negatives=0 if recipe.draft_vocab else recipe.negatives,
                             copy_weight=recipe.copy_weight, draft_vocab=len(vocab_ids) if recipe.draft_vocab else 0)
    try:
        train_stats = train(draft, samples, settings, pad_id, work_dir / "checkpoint.pt", resume=True,
                            progress=progress, device=device, heldout=heldout, vocab_ids=vocab_ids,
                            on_checkpoint=lambda curve: write_curve(work_dir, curve))
    except ValueError as exc:
        raise DistillError(str(exc)) from None
    timings["train"] = time.perf_counter() - clock - sum(timings.values())
    if recipe.draft_vocab:
        train_stats["draft_vocab_coverage"] = coverage

    report = {
        "settings": recipe.to_dict(),
        "versions": {"verispec": verispec.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "teacher_data": data_summary or {
            "samples": len(samples),
            "answer_tokens": sum(len(s.response_ids) for s in samples),
            "prompt_tokens": sum(len(s.prompt_ids) for s in samples),
            "per_category": dict(sorted(Counter(s.category for s in samples).items())),
        },
        "draft": {"parameters": n_params},
        "train": train_stats,
        "device": str(device),
        "timings_s": timings,
    }
    export_draft(draft, tokenizer, out_dir, getattr(torch, recipe.storage_dtype), report,
                 target.generation_config)
    if train_stats.get("curve"):
        write_curve(out_dir, train_stats["curve"])
    report["draft"]["disk_bytes"] = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    exported = load_model(out_dir)
    report["draft"]["decode_ms_per_token"] = ev.decode_cost_ms(exported)
    log(f"wrote {out_dir} ({report['draft']['disk_bytes'] / 1e6:.1f} MB)")

    if recipe.eval_prompts and eval_data is not None:
        report["evaluation"] = _evaluate_stage(recipe, target, tokenizer, exported, eval_data, work_dir,
                                               report["draft"]["decode_ms_per_token"], progress, log)
        timings["evaluate"] = time.perf_counter() - clock - sum(timings.values())
    elif recipe.eval_prompts:
        log("evaluation skipped: no benchmark prompts file (pass --eval-data)")
    timings["total"] = time.perf_counter() - clock
    (out_dir / "distill_recipe.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def teacher_data(recipe: DistillRecipe, work_dir: Path, resume: bool, progress: bool, log, device: str = "cpu"):
    """The shared data stages (documents, prompts, the target's answers), resumable in `work_dir`; the teacher runs
    on `device`. -> (tokenizer, samples, pad id, timings so far, clock start)."""
    _prepare_work_dir(recipe, work_dir, resume)
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    log(f"loading target {recipe.target}")
    tokenizer = load_tokenizer(recipe.target)
    teacher = load_model(recipe.target, dtype=getattr(torch, recipe.teacher_dtype), device=device)
    eos = ev._eos_ids(teacher, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    documents = _documents_stage(recipe, work_dir, teacher, tokenizer, eos, pad_id, progress, log)
    timings["documents"] = time.perf_counter() - clock
    prompts = _prompts_stage(recipe, work_dir, documents, log)
    samples = _answers_stage(recipe, work_dir, prompts, teacher, tokenizer, eos, pad_id, progress, log)
    timings["answers"] = time.perf_counter() - clock - sum(timings.values())
    return tokenizer, samples, pad_id, timings, clock


def shard_data(recipe: DistillRecipe, work_dir: Path, resume: bool, progress: bool, log):
    """The data of a `--shards` run: the teacher shards' answers (with the target's top-k where the loss uses it,
    computed once into `work_dir/topk`), split into training and held-apart samples by conversation
    (shard_data.py). -> (tokenizer, training samples, held-apart samples, pad id, timings, clock start, summary,
    whether each of the shards' samples, in order, is held apart)."""
    _prepare_work_dir(recipe, work_dir, resume)
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    tokenizer = load_tokenizer(recipe.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    k = recipe.topk if recipe.kd_weight > 0 and not recipe.head else 0  # a head learns from the target's features
    try:
        samples, conversations, summary = load_shard_samples(
            [Path(f) for f in recipe.shards], recipe.target, work_dir / "topk", k, progress, log, recipe.shard_limit)
    except ShardDataError as exc:
        raise DistillError(str(exc)) from None
    apart = [held_apart(c, recipe.heldout_fraction) for c in conversations]
    train_samples = [s for s, a in zip(samples, apart) if not a]
    heldout = [s for s, a in zip(samples, apart) if a]
    summary["heldout"] = {"samples": len(heldout), "answer_tokens": sum(len(s.response_ids) for s in heldout)}
    timings["topk"] = time.perf_counter() - clock
    log(f"teacher shards: {summary['samples']:,} answers, {summary['answer_tokens']:,} answer tokens; "
        f"{len(heldout):,} answers held apart")
    return tokenizer, train_samples, heldout, pad_id, timings, clock, summary, apart


def _prepare_work_dir(recipe: DistillRecipe, work_dir: Path, resume: bool) -> None:
    settings_file = work_dir / "settings.json"
    if work_dir.exists() and any(work_dir.iterdir()):
        if not resume:
            raise DistillError(f"work folder {work_dir} already holds a run: pass --resume to continue it, or "
                               f"choose another --out / --work-dir")
        if settings_file.is_file():
            saved = json.loads(settings_file.read_text())
            changed = [k for k in DATA_FIELDS if saved.get(k) != recipe.to_dict()[k]]
            if changed:
                raise DistillError(f"cannot resume {work_dir}: its teacher data was built with different "
                                   f"{', '.join(changed)}; use the same settings or a new --work-dir")
    work_dir.mkdir(parents=True, exist_ok=True)
    settings_file.write_text(json.dumps(recipe.to_dict(), indent=2) + "\n")


def _documents_stage(recipe, work_dir, teacher, tokenizer, eos, pad_id, progress, log) -> list[str]:
    path = work_dir / "documents.jsonl"
    if path.is_file():
        return [json.loads(line)["text"] for line in path.read_text().splitlines()]
    if "builtin" not in recipe.corpus or recipe.documents == 0:
        path.write_text("")
        return []
    requests = material_requests(recipe.documents, recipe.seed)
    encoded = [ev.chat_ids(tokenizer, text) for text in requests]
    generator = torch.Generator(device=teacher.device).manual_seed(recipe.seed)
    texts: list[str] = [""] * len(requests)
    bar = tqdm(total=len(requests), desc="documents", unit="doc", disable=not progress, dynamic_ncols=True)
    for batch in length_batches([len(e) for e in encoded], recipe.gen_batch_size, recipe.gen_batch_tokens):
        results = generate_batch(teacher, [encoded[i] for i in batch], recipe.document_tokens, eos, pad_id,
                                 topk=1, temperature=recipe.document_temperature, generator=generator)
        for i, (ids, _, _) in zip(batch, results):
            texts[i] = tokenizer.decode(ids.tolist(), skip_special_tokens=True).strip()
        bar.update(len(batch))
    bar.close()
    _write_jsonl(path, [{"text": t} for t in texts])
    log(f"documents: {len(texts)} written by the target")
    return texts


def _prompts_stage(recipe, work_dir, documents, log) -> list[Prompt]:
    path = work_dir / "prompts.jsonl"
    if path.is_file():
        return [Prompt(**json.loads(line)) for line in path.read_text().splitlines()]
    prompts: list[Prompt] = []
    for source in recipe.corpus:
        if source != "builtin":
            prompts.extend(read_prompt_file(Path(source)))
    if "builtin" in recipe.corpus:
        # Over-provisioned: answers stop at the token budget; the list order is already shuffled.
        builtin = build_prompts(max(64, recipe.tokens // 30), recipe.seed, documents)
        prompts = _interleave(prompts, builtin, recipe.seed)
    _write_jsonl(path, [asdict(p) for p in prompts])
    counts = Counter(p.category for p in prompts).most_common()
    log(f"prompts: {len(prompts)} ({', '.join(f'{k} {v}' for k, v in counts)})")
    return prompts


def _answers_stage(recipe, work_dir, prompts, teacher, tokenizer, eos, pad_id, progress, log) -> list[Sample]:
    folder = work_dir / "answers"
    folder.mkdir(exist_ok=True)
    samples: list[Sample] = []
    tokens = 0
    skipped = 0
    engine = None  # built on first use: a resumed run whose answers exist never needs it
    bar = tqdm(total=recipe.tokens, desc="teacher answers", unit="tok", disable=not progress, dynamic_ncols=True)
    for chunk_index, start in enumerate(range(0, len(prompts), CHUNK_PROMPTS)):
        if tokens >= recipe.tokens:
            break
        path = folder / f"{chunk_index:05d}.pt"
        if path.is_file():
            chunk = [Sample(**row) for row in torch.load(path, weights_only=False)]
        else:
            chunk = []
            items = prompts[start:start + CHUNK_PROMPTS]
            encoded = [ev.chat_ids(tokenizer, p.text) for p in items]
            keep = [i for i, e in enumerate(encoded) if len(e) + recipe.max_new_tokens <= recipe.max_length]
            skipped += len(items) - len(keep)
            if teacher.device.type != "cpu":  # HF generation in large batches: a GPU's step costs ~ the same at any
                results = []                    # batch size, and the engine's per-row Python would dominate
                kept = [encoded[i] for i in keep]
                for batch in length_batches([len(e) for e in kept], recipe.gen_batch_size, recipe.gen_batch_tokens):
                    answers = generate_batch(teacher, [kept[i] for i in batch], recipe.max_new_tokens, eos, pad_id,
                                             topk=recipe.topk)
                    results.extend(zip(batch, answers))
                    bar.update(sum(len(a[0]) for a in answers))
                results = [answer for _, answer in sorted(results, key=lambda pair: pair[0])]
            else:
                if engine is None:
                    engine = SpeculativeEngine(teacher, tokenizer, None, max_len=recipe.max_length,
                                               max_batch_size=recipe.gen_batch_size)
                results = engine_answers(engine, [encoded[i] for i in keep], recipe.max_new_tokens, recipe.topk,
                                         on_step=bar.update)
            for i, (ids, top_ids, top_lp) in zip(keep, results):
                chunk.append(Sample(items[i].category, torch.tensor(encoded[i], dtype=torch.int32), ids,
                                    top_ids, top_lp))
            torch.save([asdict(s) for s in chunk], path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        samples.extend(chunk)
        tokens += sum(len(s.response_ids) for s in chunk)
        bar.n = min(tokens, recipe.tokens)
        bar.refresh()
    bar.close()
    if skipped:
        log(f"skipped {skipped} prompts longer than max-length - max-new-tokens")
    if not samples:
        raise DistillError("no teacher samples: the corpus gave no usable prompts")
    log(f"teacher answers: {len(samples)} samples, {tokens} answer tokens")
    return samples


def _evaluate_stage(recipe, target, tokenizer, draft, eval_data, work_dir, decode_ms, progress, log) -> dict:
    rows = ev.load_eval_prompts(eval_data, recipe.eval_prompts)
    references = ev.reference_continuations(
        target, tokenizer, [text for _, text in rows], recipe.eval_max_new_tokens, cache_dir=work_dir / "eval",
        cache_key=str(recipe.target), progress=progress)
    result = ev.evaluate_draft(draft, references, [category for category, _ in rows], k=recipe.eval_k)
    log(ev.format_report(result, decode_ms))
    return ev.result_to_dict(result)


def read_prompt_file(path: Path) -> list[Prompt]:
    """Prompts from a `.txt` file (one per line) or `.jsonl` (`text`/`prompt`, or `turns[0]`; optional `category`)."""
    if not path.is_file():
        raise DistillError(f"corpus file {path} does not exist: pass 'builtin' or a .txt/.jsonl prompt file")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        out = []
        for number, line in enumerate(lines, start=1):
            try:
                row = json.loads(line)
                text = row.get("text") or row.get("prompt") or row["turns"][0]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
                raise DistillError(
                    f"{path}:{number}: expected a JSON object with 'text', 'prompt' or 'turns'") from None
            out.append(Prompt(str(row.get("category", path.stem)), str(text)))
        return out
    return [Prompt(path.stem, line.strip()) for line in lines]


def _interleave(first: list[Prompt], second: list[Prompt], seed: int) -> list[Prompt]:
    merged = first + second
    random.Random(seed).shuffle(merged)
    return merged


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)
