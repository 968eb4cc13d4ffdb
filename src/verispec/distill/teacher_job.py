"""`verispec distill teacher`: the target's greedy answers at scale, written by verispec's own batched engine.

The conversations (`conversations.py`, seeded) are cut into shards of `shard_conversations` consecutive indices;
shard k holds every answer to conversations [k * S, (k + 1) * S), all turns, in (conversation, turn) order
(`shards.py`). The engine runs them with continuous batching: up to `batch_size` sequences decode together, a
finished one's slot goes to the next turn or conversation at once (the next shard's too, so no batch waits on its
longest row), prompts are prefilled in chunks, and the prefix cache shares system prompts' and chat templates' KV.

Exact and deterministic: the target alone decodes greedily, and on verispec's native runner a row's logits depend
on nothing beside it (docs/runner.md: q8 activations and the batch-invariant kernels), so an answer is a pure
function of its prompt whatever the batch, slot, prefill chunking or prefix-cache hits. Hence a shard's bytes are a
pure function of (target, seed, settings), and:
- resumable after a kill at any point: shards and the manifest are written atomically (`shards.write_atomic`); a
  resumed run keeps the whole shards on disk and continues at the first missing one, writing what the killed run
  would have written;
- the token budget only decides how many shards are made: a larger one extends the data.
Wall time includes time the process spent stopped (SIGSTOP); the manifest also records CPU seconds.
"""

from __future__ import annotations

import datetime
import hashlib
import platform
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import verispec
from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig
from verispec.drafters.base import Drafter
from verispec.distill import conversations as C
from verispec.distill import shards as D
from verispec.engine import SpeculativeEngine
from verispec.engine.scheduler import SchedulerConfig

FORMAT = "verispec-teacher-shards/1"
# Settings that decide the data: a resumed run must keep them (tokens, batch size, prefill chunk and threads may
# change, as the answers do not depend on them).
DATA_FIELDS = ("seed", "max_new_tokens", "max_len", "shard_conversations")


class TeacherError(ValueError):
    """A teacher run that cannot start as asked (e.g. a folder holding other data); the message says what to do."""


@dataclass
class TeacherConfig:
    """Settings of one teacher run (`verispec distill teacher`)."""

    seed: int = 0  # names the conversation sequence (conversations.py)
    tokens: int = 1_000_000  # answer tokens to reach; whole shards are written, so the data ends past it
    max_new_tokens: int = 384  # longest answer per turn
    max_len: int = 1536  # longest prompt + answer: a turn whose prompt leaves less room is skipped (with later turns)
    shard_conversations: int = 256  # conversations per shard (~50-100k answer tokens): a kill loses at most a few
    batch_size: int = 32  # sequences decoding together (the engine's max_batch_size)
    prefill_chunk_tokens: int = 512  # most prompt tokens per prefill forward
    prefix_cache_tokens: int = 8192  # KV entries the prefix cache keeps (system prompts, chat templates)

    def __post_init__(self):
        for name in ("tokens", "max_new_tokens", "max_len", "shard_conversations", "batch_size",
                     "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix-cache-tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.max_len <= self.max_new_tokens:
            raise ValueError(f"max-len {self.max_len} must exceed max-new-tokens {self.max_new_tokens}")


@dataclass
class _Shard:
    """A shard being made: its conversations' answers so far and how many turns are still running or queued."""

    index: int
    samples: list[D.TeacherSample]
    open_turns: int = 0  # requests queued or decoding
    fed: bool = False  # every conversation of the shard has been queued


# What an identity field meant before it was recorded: a manifest without it was made so.
LEGACY_IDENTITY = {"kv_cache_dtype": "float32"}  # before --kv-cache-dtype, every KV cache held fp32 entries


def identity(tokenizer, target_name: str, weights: str, activations: str, dtype: str, material: C.Material,
             kv_cache_dtype: str = "float32") -> dict:
    """What the data depends on beside the settings: the target's weights and arithmetic (its KV cache's entries
    included), its tokenizer, the prompt builder's version and material. A resumed run must match it."""
    from verispec.runtime.model.loading import resolve_model_path

    path = Path(resolve_model_path(target_name))
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".gguf", ".safetensors",
                                                                                         ".bin", ".json"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    material_digest = hashlib.sha256("\0".join(material.docs + ["\1"] + material.functions).encode()).hexdigest()
    return {"target": target_name, "target_sha256": digest.hexdigest(), "weights": weights,
            "activations": activations, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
            "vocab_size": len(tokenizer), "chat_template_sha256": hashlib.sha256(
                str(getattr(tokenizer, "chat_template", "")).encode()).hexdigest(),
            "conversations_version": C.VERSION, "material_sha256": material_digest}


def run_teacher(config: TeacherConfig, out_dir: Path, target, tokenizer, ident: dict, material: C.Material,
                progress: bool = True, log=print, device_note: str = "", runner: RunnerOptions | None = None,
                drafter: Drafter | None = None, drafter_name: str = "none") -> dict:
    """Make shards in `out_dir` until their answers reach `config.tokens` (continuing a run found there); returns
    the manifest (also written there). drafter: speculation with adaptive K (e.g. suffix decoding, which drafts
    from earlier answers); greedy verification keeps every answer the target's own, so the data is the same with
    any drafter or none (tested), only the speed differs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _open_manifest(out_dir, config, ident)
    written = manifest["shards"]
    total = sum(e["answer_tokens"] for e in written)
    if total >= config.tokens:
        log(f"{out_dir}: {len(written)} shards, {total:,} answer tokens: the budget of {config.tokens:,} is met")
        return manifest
    run = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "batch_size": config.batch_size, "prefill_chunk_tokens": config.prefill_chunk_tokens,
           "threads": torch.get_num_threads(), "device": device_note or "cpu", "machine": platform.processor()
           or platform.machine(), "verispec": verispec.__version__, "torch": torch.__version__,
           "drafter": drafter_name, "first_shard": len(written), "shards": 0, "answer_tokens": 0, "seconds": 0.0,
           "cpu_seconds": 0.0}
    manifest["runs"].append(run)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(adaptive=True),
                               max_len=config.max_len, max_batch_size=config.batch_size,
                               scheduler=SchedulerConfig(prefill_chunk_tokens=config.prefill_chunk_tokens),
                               prefix_cache_tokens=config.prefix_cache_tokens, runner=runner)
    feed = _ConversationFeed(config, material, start_shard=len(written))
    params = SamplingParams(max_new_tokens=config.max_new_tokens)
    requests: dict[int, tuple[int, int, list[int]]] = {}  # seq_id -> (conversation, turn, prompt ids)
    shards: dict[int, _Shard] = {}  # shards being made, by index
    answers: dict[int, list[str]] = {}  # conversation -> its answers' texts so far (for the next turn's prompt)
    follow_ups: deque[tuple[int, int]] = deque()  # (conversation, turn) ready to queue, before new conversations
    bar = tqdm(initial=total, desc="teacher", unit="tok", disable=not progress, dynamic_ncols=True, smoothing=0.05)
    clock, cpu = time.perf_counter(), time.process_time()
    shard_clock = clock
    made = 0  # answer tokens decoded in this run (in shards written or not)
    size = config.shard_conversations

    def queue(conv_index: int, turn: int) -> None:
        conv = feed.get(conv_index)
        ids = _chat_ids(tokenizer, C.chat_messages(conv, turn, answers.get(conv_index, [])))
        if len(ids) + config.max_new_tokens > config.max_len:
            answers.pop(conv_index, None)  # this turn and the later ones are skipped
            return
        shards[conv_index // size].open_turns += 1
        requests[engine.add_request(ids, params, use_drafter=drafter is not None).seq_id] = (conv_index, turn, ids)

    def new_shard_wanted() -> bool:
        # Shards are opened before the earlier ones are written (no batch waits on a shard's longest answer), as
        # long as the expected tokens stay under the budget; those past it are dropped unwritten. Before a shard
        # is written, an answer is guessed at half of max_new_tokens.
        average = total / len(written) if written else size * config.max_new_tokens / 2
        return total + len(shards) * average < config.tokens

    while total < config.tokens:
        while len(engine.waiting) < config.batch_size:  # the queue one batch deep: follow-up turns first
            if follow_ups:
                queue(*follow_ups.popleft())
                continue
            index = feed.index
            if index % size == 0 and not new_shard_wanted():
                break
            shards.setdefault(index // size, _Shard(index // size, []))
            if feed.next() is not None:
                queue(index, 0)
            shards[index // size].fed = (index + 1) % size == 0
        for seq in engine.step() if engine.has_unfinished else []:
            new_ids, _ = seq.take()
            made += len(new_ids)
            bar.update(len(new_ids))
            if not seq.finished:
                continue
            conv_index, turn, prompt = requests.pop(seq.seq_id)
            shard = shards[conv_index // size]
            shard.open_turns -= 1
            conv = feed.get(conv_index)
            ids = list(seq.stopper.token_ids)
            shard.samples.append(D.TeacherSample(conv_index, turn, conv.category, np.array(prompt, dtype=np.int64),
                                                 np.array(ids, dtype=np.int64), seq.finish_reason))
            if turn + 1 < len(conv.turns):
                answers.setdefault(conv_index, []).append(tokenizer.decode(ids, skip_special_tokens=True).strip())
                follow_ups.append((conv_index, turn + 1))
            else:
                answers.pop(conv_index, None)
        pending = {c // size for c, _ in follow_ups}
        while shards and total < config.tokens:  # whole shards, in order
            first = shards[min(shards)]
            if not first.fed or first.open_turns or first.index in pending:
                break
            del shards[first.index]
            feed.forget(first.index * size, (first.index + 1) * size)
            now = time.perf_counter()
            entry = _write_shard(out_dir, first, len(tokenizer), now - shard_clock)
            shard_clock = now
            written.append(entry)
            total += entry["answer_tokens"]
            run.update(shards=run["shards"] + 1, answer_tokens=run["answer_tokens"] + entry["answer_tokens"],
                       decoded_tokens=made, seconds=round(now - clock, 2),
                       cpu_seconds=round(time.process_time() - cpu, 2),
                       tokens_per_s=round(made / max(now - clock, 1e-9), 1), **_engine_figures(engine.total))
            manifest["totals"] = _totals(written)
            D.write_manifest(out_dir, manifest)
            bar.set_postfix_str(f"{run['tokens_per_s']:.0f} tok/s", refresh=True)
            log(f"{entry['file']}: {entry['samples']} answers, {entry['answer_tokens']:,} answer tokens, "
                f"{entry['bytes'] / 1e3:.0f} kB; {total:,} answer tokens in all; {run['tokens_per_s']:.0f} tok/s "
                f"decoded this run")
    bar.close()
    return manifest


class _ConversationFeed:
    """The conversation sequence from a shard's first index on, duplicates removed: a conversation whose (system
    prompt, first turn) an earlier one had is None (no answers; the shard keeps its place). A resumed run rebuilds
    the earlier ones to know them (~30 us each)."""

    def __init__(self, config: TeacherConfig, material: C.Material, start_shard: int) -> None:
        self.seed, self.material = config.seed, material
        self.index = start_shard * config.shard_conversations  # the next conversation to hand out
        self.seen: set[bytes] = set()
        for i in range(self.index):
            self._unique(i)
        self.handed: dict[int, C.Conversation] = {}  # conversations handed out whose shard is not written yet

    def next(self) -> C.Conversation | None:
        conv = self._unique(self.index)
        if conv is not None:
            self.handed[self.index] = conv
        self.index += 1
        return conv

    def get(self, index: int) -> C.Conversation:
        return self.handed[index]

    def forget(self, start: int, end: int) -> None:
        for i in range(start, end):
            self.handed.pop(i, None)

    def _unique(self, index: int) -> C.Conversation | None:
        conv = C.conversation(self.seed, index, self.material)
        key = hashlib.blake2b(f"{conv.system}\0{conv.turns[0]}".encode(), digest_size=16).digest()
        if key in self.seen:
            return None
        self.seen.add(key)
        return conv


def _engine_figures(stats) -> dict:
    """What the engine's finished requests say: prefix-cache hits and, with a drafter, speculation."""
    return {"prompt_tokens": stats.prompt_tokens, "prefix_cached_tokens": stats.cached_tokens,
            "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
            "mean_accepted_length": round(stats.mean_accepted_length, 3) if stats.rounds else None}


def _write_shard(out_dir: Path, shard: _Shard, vocab_size: int, seconds: float) -> dict:
    samples = sorted(shard.samples, key=lambda s: (s.conversation, s.turn))
    data = D.encode_shard(samples, vocab_size)
    name = D.SHARD_NAME.format(shard.index)
    D.write_atomic(out_dir / name, data)
    answer_tokens = sum(len(s.answer_ids) for s in samples)
    return {**_entry(name, samples, data), "seconds": round(seconds, 2),
            "tokens_per_s": round(answer_tokens / max(seconds, 1e-9), 1)}


def _entry(name: str, samples: list[D.TeacherSample], data: bytes) -> dict:
    return {"file": name, "samples": len(samples), "answer_tokens": sum(len(s.answer_ids) for s in samples),
            "prompt_tokens": sum(len(s.prompt_ids) for s in samples), "bytes": len(data), "sha256": D.sha256(data)}


def _open_manifest(out_dir: Path, config: TeacherConfig, ident: dict) -> dict:
    """The manifest of the run in `out_dir` (a new one for an empty folder), its shard list made to match the whole
    shards on disk: a run killed between a shard and the manifest has that shard listed again (without timings)."""
    manifest = D.read_manifest(out_dir)
    settings = {k: getattr(config, k) for k in DATA_FIELDS}
    if not manifest:
        if any(out_dir.glob("shard-*.vst")):
            raise TeacherError(f"{out_dir} holds shards but no {D.MANIFEST}: choose an empty --out folder")
        manifest = {"format": FORMAT, "identity": ident, "settings": settings, "shards": [], "runs": [],
                    "totals": {}, "config": asdict(config)}
    else:
        if manifest.get("format") != FORMAT:
            raise TeacherError(f"{out_dir}/{D.MANIFEST} is not a teacher manifest ({manifest.get('format')!r})")
        changed = [k for k in settings if manifest["settings"].get(k) != settings[k]]
        changed += [k for k in ident if manifest["identity"].get(k, LEGACY_IDENTITY.get(k)) != ident[k]]
        if changed:
            raise TeacherError(f"cannot continue {out_dir}: its data was made with different {', '.join(changed)}; "
                               f"use the same settings and target, or another --out folder")
    manifest["config"] = asdict(config)
    for stray in out_dir.glob("*.tmp"):
        stray.unlink()
    listed = {e["file"]: e for e in manifest["shards"]}
    entries = []
    for k in range(len(listed) + 1 + len(list(out_dir.glob("shard-*.vst")))):
        name = D.SHARD_NAME.format(k)
        path = out_dir / name
        if not path.is_file():
            break
        data = path.read_bytes()
        if name in listed and listed[name]["sha256"] == D.sha256(data):
            entries.append(listed[name])
            continue
        entries.append(_entry(name, D.decode_shard(data, str(path)), data))  # raises on a damaged shard
    manifest["shards"] = entries
    manifest["totals"] = _totals(entries)
    D.write_manifest(out_dir, manifest)
    return manifest


def _totals(entries: list[dict]) -> dict:
    answer = sum(e["answer_tokens"] for e in entries)
    size = sum(e["bytes"] for e in entries)
    return {"shards": len(entries), "samples": sum(e["samples"] for e in entries), "answer_tokens": answer,
            "prompt_tokens": sum(e["prompt_tokens"] for e in entries), "bytes": size,
            "bytes_per_million_answer_tokens": round(size / answer * 1e6) if answer else None}


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]
