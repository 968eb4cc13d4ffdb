"""Teacher data on disk: compact shards of token ids (the target's greedy answers and the prompts they answer) and
the manifest that lists them.

A shard holds the answers to one fixed range of conversations and is a pure function of that range and the
target, so a killed run that writes it again writes the same bytes. Its layout (little-endian):

    b"VSTEACH1"                  magic, format version 1
    uint32 header length, header JSON (sorted keys): samples, token dtype, categories, stream lengths
    xz (lzma, preset 9) of the streams, back to back:
        conversation  uint32 [n]   index of the conversation in the run's prompt order
        turn          uint8  [n]   the user turn answered (0: the first)
        category      uint8  [n]   index into header["categories"]
        finish        uint8  [n]   0: the answer ended with an end-of-sequence token, 1: at max_new_tokens
        prompt_len    uint32 [n]
        answer_len    uint32 [n]
        prompt ids    uint16 [sum prompt_len] as two byte planes (all low bytes, then all high bytes)
        answer ids    uint16 [sum answer_len] the same
    (vocabularies past 65,536 ids use uint32, four planes.)

Byte planes and separate prompt/answer streams are what make ids compress: the high bytes repeat, and prompts share
templates. No timestamps or timings go into a shard (they live in the manifest), so its bytes depend on the data
alone. Teacher probabilities are not stored (top-8 ids and fp16 log-probs would take ~30x the bytes): training
recomputes them by a teacher-forced batched prefill over prompt + answer (`teacher_forced.py`).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"VSTEACH1"
FINISH_REASONS = ("stop", "length")  # the codes of the `finish` stream
SHARD_NAME = "shard-{:05d}.vst"
MANIFEST = "manifest.json"


@dataclass
class TeacherSample:
    """One answer: `answer_ids` are the target's greedy tokens after `prompt_ids` (the chat-templated conversation
    up to this user turn); the end-of-sequence token is included when the answer ended on it."""

    conversation: int
    turn: int
    category: str
    prompt_ids: np.ndarray  # [P] int64
    answer_ids: np.ndarray  # [R] int64
    finish_reason: str  # 'stop' or 'length'


class ShardError(ValueError):
    """A shard file that is not one (truncated, another format): the message names the file."""


def encode_shard(samples: list[TeacherSample], vocab_size: int) -> bytes:
    """The shard's bytes (module docstring); a pure function of `samples` and the token width."""
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
    categories = list(dict.fromkeys(s.category for s in samples))
    if len(categories) > 255:
        raise ValueError(f"a shard holds at most 255 categories, got {len(categories)}")
    prompts = np.concatenate([s.prompt_ids for s in samples] or [np.zeros(0)]).astype(dtype)
    answers = np.concatenate([s.answer_ids for s in samples] or [np.zeros(0)]).astype(dtype)
    streams = [
        np.array([s.conversation for s in samples], dtype="<u4"),
        np.array([s.turn for s in samples], dtype="u1"),
        np.array([categories.index(s.category) for s in samples], dtype="u1"),
        np.array([FINISH_REASONS.index(s.finish_reason) for s in samples], dtype="u1"),
        np.array([len(s.prompt_ids) for s in samples], dtype="<u4"),
        np.array([len(s.answer_ids) for s in samples], dtype="<u4"),
        _planes(prompts), _planes(answers),
    ]
    header = json.dumps({"samples": len(samples), "dtype": dtype.str, "categories": categories,
                         "prompt_tokens": int(prompts.size), "answer_tokens": int(answers.size)},
                        sort_keys=True).encode()
    payload = lzma.compress(b"".join(s.tobytes() for s in streams), format=lzma.FORMAT_XZ, preset=9)
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_shard(data: bytes, name: str = "shard") -> list[TeacherSample]:
    """`encode_shard`'s inverse; ShardError naming `name` for bytes that are not a whole shard."""
    try:
        if data[:8] != MAGIC:
            raise ValueError("not a teacher shard (bad magic)")
        (size,) = struct.unpack("<I", data[8:12])
        header = json.loads(data[12:12 + size])
        raw = lzma.decompress(data[12 + size:], format=lzma.FORMAT_XZ)
        n, dtype = header["samples"], np.dtype(header["dtype"])
        offsets = [0]
        shapes = [(n, "<u4"), (n, "u1"), (n, "u1"), (n, "u1"), (n, "<u4"), (n, "<u4")]
        columns = []
        for count, kind in shapes:
            width = np.dtype(kind).itemsize * count
            columns.append(np.frombuffer(raw, dtype=kind, count=count, offset=offsets[-1]))
            offsets.append(offsets[-1] + width)
        conv, turn, category, finish, prompt_len, answer_len = columns
        prompts = _unplanes(raw[offsets[-1]:offsets[-1] + dtype.itemsize * header["prompt_tokens"]], dtype)
        start = offsets[-1] + dtype.itemsize * header["prompt_tokens"]
        answers = _unplanes(raw[start:start + dtype.itemsize * header["answer_tokens"]], dtype)
        if start + dtype.itemsize * header["answer_tokens"] != len(raw):
            raise ValueError("the streams do not add up to the payload")
    except (ValueError, KeyError, struct.error, lzma.LZMAError, json.JSONDecodeError) as exc:
        raise ShardError(f"{name}: {exc}") from None
    p_ends, a_ends = np.cumsum(prompt_len), np.cumsum(answer_len)
    return [TeacherSample(int(conv[i]), int(turn[i]), header["categories"][category[i]],
                          prompts[p_ends[i] - prompt_len[i]:p_ends[i]].astype(np.int64),
                          answers[a_ends[i] - answer_len[i]:a_ends[i]].astype(np.int64),
                          FINISH_REASONS[finish[i]]) for i in range(n)]


def read_shard(path: Path) -> list[TeacherSample]:
    return decode_shard(Path(path).read_bytes(), str(path))


def read_shards(folder: Path) -> list[TeacherSample]:
    """Every sample of the shards the manifest in `folder` lists, in order."""
    manifest = read_manifest(folder)
    return [s for entry in manifest.get("shards", []) for s in read_shard(Path(folder) / entry["file"])]


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a kill at any point leaves either the old file or the whole new one: a
    temporary file beside it, flushed to disk, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def write_manifest(folder: Path, manifest: dict) -> None:
    write_atomic(Path(folder) / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _planes(ids: np.ndarray) -> np.ndarray:
    """[n] little-endian ids -> their bytes as planes: byte 0 of every id, then byte 1, ..."""
    return np.ascontiguousarray(ids.view(np.uint8).reshape(-1, ids.itemsize).T)


def _unplanes(raw: bytes, dtype: np.dtype) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(dtype.itemsize, -1)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(-1)
