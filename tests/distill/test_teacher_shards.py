"""The teacher shard format (distill/shards.py): exact round trips, bytes that depend on the data alone, and damaged
files refused with the file's name."""

from __future__ import annotations

import numpy as np
import pytest

from verispec.distill.shards import ShardError, TeacherSample, decode_shard, encode_shard, write_atomic

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


def samples(high: int = 49_152) -> list[TeacherSample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(5):
        prompt = rng.integers(0, high, size=int(rng.integers(1, 40)))
        answer = rng.integers(0, high, size=int(rng.integers(0, 30)))  # an empty answer too (EOS-only is 1)
        out.append(TeacherSample(10 + i // 2, i % 2, ["qa", "composed", "qa", "rag", "qa"][i], prompt, answer,
                                 ["stop", "length"][i % 2]))
    return out


@pytest.mark.parametrize("vocab", [49_152, 1 << 16, 100_000])
def test_round_trip_is_exact(vocab):
    rows = samples(vocab)
    data = encode_shard(rows, vocab)
    back = decode_shard(data)
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        assert (a.conversation, a.turn, a.category, a.finish_reason) == (b.conversation, b.turn, b.category,
                                                                          b.finish_reason)
        assert a.prompt_ids.tolist() == b.prompt_ids.tolist() and a.answer_ids.tolist() == b.answer_ids.tolist()
    assert encode_shard(back, vocab) == data  # the bytes are a function of the data alone


def test_empty_shard_round_trips():
    assert decode_shard(encode_shard([], 100)) == []


def test_byte_planes_compress_repeated_ids():
    """Ids above 255 whose high bytes repeat: the planes let xz see the repetition (sanity bound, not a figure)."""
    ids = np.tile(np.arange(30_000, 30_200), 50)
    row = TeacherSample(0, 0, "x", ids[:10], ids, "length")
    assert len(encode_shard([row], 49_152)) < ids.size // 10


def test_damaged_shards_are_refused_with_their_name(tmp_path):
    data = encode_shard(samples(), 49_152)
    for bad in (data[:-7], b"NOTASHARD" + data[9:], data[:10]):
        with pytest.raises(ShardError, match="shard-x"):
            decode_shard(bad, "shard-x")


def test_write_atomic_replaces_whole(tmp_path):
    path = tmp_path / "f.bin"
    write_atomic(path, b"one")
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two" and not list(tmp_path.glob("*.tmp"))
