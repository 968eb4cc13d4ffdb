"""A GGUF file's header read once, and only as far as asked: metadata values and tensor infos, the tensors' bytes
memory-mapped where they lie.

The layout (GGUF versions 2 and 3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64;
each metadata entry a string key, a u32 value type and the value (a string is a u64 length and UTF-8 bytes; an
array an element type, a u64 count and the elements); each tensor info its name, u32 dimension count, u64
dimensions (innermost first), u32 GGML type and u64 offset into the data, which starts at the next multiple of
`general.alignment` (32 unless the file says otherwise) after the infos.

Unlike gguf-py's `GGUFReader`, which builds a numpy view of every part of every field when it opens a file (~4 s for
the embedded model: its 49k-token vocabulary and 49k merges, string by string), numeric arrays here are one
`np.frombuffer` each and string arrays are decoded only when read (`GGUFStrings`); skipping one reads only its
lengths. The header is read through a memory map; tensors are read into fresh arrays (`read`). `open_gguf` keeps the last file read, so deciding the weights and loading them parse it once.
"""

from __future__ import annotations

import mmap
from contextlib import contextmanager
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> (struct format, numpy dtype); 8 is a string, 9 an array
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9

# GGML tensor types verispec reads: id -> (name, elements per block, bytes per block). Other ids are named by
# gguf-py when met (`type_name`).
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
              14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands; the message names the file and what is wrong."""


class GGUFStrings:
    """A metadata array of strings, decoded on first read (`list(...)`, indexing, `len`)."""

    def __init__(self, buffer, offset: int, count: int) -> None:
        self._buffer, self._offset, self._count = buffer, offset, count
        self._values: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def _decoded(self) -> list[str]:
        if self._values is None:
            values, at = [], self._offset
            for _ in range(self._count):
                (length,) = struct.unpack_from("<Q", self._buffer, at)
                values.append(bytes(self._buffer[at + 8 : at + 8 + length]).decode("utf-8"))
                at += 8 + length
            self._values = values
        return self._values

    def __getitem__(self, index):
        return self._decoded()[index]

    def __iter__(self):
        return iter(self._decoded())


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: its shape as torch orders it (outermost first: [out, in] for a linear)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # bytes from the start of the file

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (types in GGML_TYPES only)."""
        _, block, size = GGML_TYPES[self.type_id]
        count = int(np.prod(self.shape, dtype=np.int64))
        return count // block * size


def type_name(type_id: int) -> str:
    """A GGML type's name ("Q4_1", "Q6_K", ...)."""
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id][0]
    from gguf import GGMLQuantizationType  # only for types verispec does not read

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


class GGUFFile:
    """The metadata (`metadata`: key -> int, float, bool, str, a numpy array or `GGUFStrings`) and tensor infos
    (`tensors`, in file order) of a GGUF file; `read(info)` reads a tensor's bytes."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFError(f"{self.path}: not a GGUF file (it is empty)") from None
        buffer = self._map
        if buffer[:4] != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (it does not start with {MAGIC!r})")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} (this reader reads versions 2 and 3, little-endian)")
        self.version = version
        at = 24
        self.metadata: dict[str, object] = {}
        try:
            for _ in range(kv_count):
                key, at = self._string(at)
                (kind,), at = struct.unpack_from("<I", buffer, at), at + 4
                self.metadata[key], at = self._value(kind, at)
            tensors = []
            for _ in range(tensor_count):
                name, at = self._string(at)
                (dims,), at = struct.unpack_from("<I", buffer, at), at + 4
                shape, at = struct.unpack_from(f"<{dims}Q", buffer, at), at + 8 * dims
                type_id, offset = struct.unpack_from("<IQ", buffer, at)
                at += 12
                tensors.append((name, tuple(reversed(shape)), type_id, offset))
        except struct.error:
            raise GGUFError(f"{self.path}: the header ends early (a truncated or corrupt GGUF file)") from None
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-at // alignment) * alignment
        self.tensors = [TensorInfo(name, shape, type_id, start + offset) for name, shape, type_id, offset in tensors]

    def _string(self, at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, at)
        return self._map[at + 8 : at + 8 + length].decode("utf-8"), at + 8 + length

    def _value(self, kind: int, at: int):
        """(the value of type `kind` at `at`, the offset after it)."""
        if kind in _SCALARS:
            fmt = _SCALARS[kind][0]
            return struct.unpack_from(fmt, self._map, at)[0], at + struct.calcsize(fmt)
        if kind == _STRING:
            return self._string(at)
        if kind != _ARRAY:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind} at byte {at}")
        item, count = struct.unpack_from("<IQ", self._map, at)
        at += 12
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1])
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=at).copy()
            return values, at + count * dtype.itemsize
        if item == _STRING:
            start = at
            for _ in range(count):  # only the lengths are read: the strings are decoded if asked for
                at += 8 + struct.unpack_from("<Q", self._map, at)[0]
            return GGUFStrings(self._map, start, count), at
        values = []
        for _ in range(count):  # an array of arrays: rare, small
            value, at = self._value(item, at)
            values.append(value)
        return values, at

    def read(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, [nbytes] uint8: a copy read from the file (not through the map, whose touched pages
        would count in the process's resident memory as long as it is open)."""
        out = np.empty(info.nbytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            if f.readinto(memoryview(out)) != info.nbytes:
                raise GGUFError(f"{self.path}: tensor {info.name} ends past the end of the file")
        return out

    @contextmanager
    def mapped(self, info: TensorInfo):
        """The tensor's bytes, [nbytes] uint8, read-only, straight from the file's pages (no copy) for the `with`
        block; afterwards the pages are let go from this process (`MADV_DONTNEED`: they stay in the page cache, out
        of the resident memory), so reading a whole model through the map never holds it all."""
        if info.offset + info.nbytes > len(self._map):
            raise GGUFError(f"{self.path}: tensor {info.name} ends past the end of the file")
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE  # (madvise takes whole pages)
        if hasattr(self._map, "madvise"):  # read ahead in large runs rather than a fault per page
            self._map.madvise(mmap.MADV_WILLNEED, start, info.offset + info.nbytes - start)
        view = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        try:
            yield view
        finally:
            del view
            if hasattr(self._map, "madvise"):
                self._map.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)


_OPEN: dict = {}  # the last file read: (path, size, mtime) -> GGUFFile


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The GGUF file at `path`, parsed once per process while it is unchanged (the last file asked for is kept)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _OPEN:
        _OPEN.clear()
        _OPEN[key] = GGUFFile(path)
    return _OPEN[key]
