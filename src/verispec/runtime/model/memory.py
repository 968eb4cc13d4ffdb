"""Will the draft model fit? Estimates from files and configs, without loading any weights.

needed = draft weights + KV caches of the target and the draft at max_len, where one model's KV cache is
2 (keys and values) x layers x kv_heads x head_dim x max_len x dtype bytes per slot (the `SlotCache` preallocates
exactly that). It is compared against free memory: `torch.cuda.mem_get_info` on a GPU, psutil's available
memory on the host (else /proc/meminfo MemAvailable). The target is loaded before the draft, so its weights are
already missing from the free figure.

The target's quantized twin (`--draft-model self:FORMAT`, drafters/twin.py) has no files: `twin_bytes` counts its
weights from the target's `LlamaSpec` (its quantized linears and LM head; the embedding is the target's) and its
KV cache (the target's size per slot).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .llama import LlamaSpec
from ..kernels.quant import row_bytes

# Bytes per element of the safetensors dtype names (the header stores these strings).
_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}

HEADROOM = 0.9  # use at most this share of the free memory: activations, logits and the allocator need the rest


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def kv_cache_bytes(config, max_len: int, dtype: torch.dtype = torch.float32) -> int:
    """2 x layers x kv_heads x head_dim x max_len x dtype bytes (batch size 1)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * max_len * dtype_bytes(dtype)


def safetensors_numel(path: Path) -> tuple[int, int]:
    """(elements, stored bytes) of the tensors in one .safetensors file, read from its header only."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    numel = stored = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in info["shape"]:
            count *= dim
        numel += count
        stored += count * _SAFETENSORS_BYTES.get(info["dtype"], 4)
    return numel, stored


def weights_bytes(path: str | os.PathLike, dtype: torch.dtype = torch.float32, stored: bool = False) -> int | None:
    """Bytes the weights in a model folder (or .gguf file) take once loaded in `dtype`; None if unknown.

    safetensors: elements from the headers x dtype bytes. GGUF: its tensors' bytes as stored where `stored` and the
    architecture table knows the file (its blocks run as they are: a draft on the CPU, `loading.load_draft`), else
    elements x dtype bytes (the fp32 conversion); read from verispec's own header parser (gguf-py's reader parses
    every metadata array, seconds for a 151k-token vocabulary). Other formats (.bin): the file sizes, the stored
    dtype being unknown.
    """
    path = Path(path)
    size = dtype_bytes(dtype)
    if path.is_file() and path.suffix == ".gguf":
        from ..weights.gguf_file import open_gguf
        from .gguf_weights import file_architecture

        try:
            file = open_gguf(path)
        except Exception:  # noqa: BLE001 - an unreadable index only means "unknown"; loading will say why
            return None
        if stored:
            try:
                file_architecture(file)
                return sum(t.nbytes for t in file.tensors)
            except ValueError:  # not in the table: converted on load
                pass
        return sum(math.prod(t.shape) for t in file.tensors) * size
    if not path.is_dir():
        return None
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        try:
            return sum(safetensors_numel(shard)[0] for shard in shards) * size
        except (OSError, ValueError, KeyError, struct.error):
            return None
    bins = sorted(path.glob("*.bin"))
    return sum(b.stat().st_size for b in bins) or None


def free_memory_bytes(device: str | torch.device = "cpu") -> int | None:
    """Free memory where the model will live: the GPU's free memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class MemoryCheck:
    fits: bool
    needed_bytes: int | None  # None: the draft's size could not be estimated (the check then passes)
    free_bytes: int | None  # None: free memory unknown (the check then passes)
    detail: str

    def __str__(self) -> str:
        return self.detail


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def check_draft_memory(
    draft_path: str | os.PathLike,
    draft_config,
    target_config,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    free_bytes: int | None = None,
    target_path: str | os.PathLike | None = None,
) -> MemoryCheck:
    """Does loading the draft at `draft_path` fit next to the target?

    needed = draft weights + target KV cache + draft KV cache at max_len, plus the target's weights when
    `target_path` is given (the target is not loaded yet); compared against HEADROOM x free memory (`free_bytes`,
    or measured by `free_memory_bytes(device)`).
    """
    weights = weights_bytes(draft_path, dtype, stored=torch.device(device).type == "cpu")
    if weights is not None and target_path is not None:
        target_weights = weights_bytes(target_path, dtype)
        weights = None if target_weights is None else weights + target_weights
    kv = kv_cache_bytes(target_config, max_len, dtype) + kv_cache_bytes(draft_config, max_len, dtype)
    needed = None if weights is None else weights + kv
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    where = "GPU" if torch.device(device).type == "cuda" else "host"
    if needed is None or free is None:
        return MemoryCheck(True, needed, free, f"memory check skipped: draft size {gib(needed)}, free {gib(free)}")
    fits = needed <= HEADROOM * free
    detail = (
        f"the draft needs {gib(needed)} (weights {gib(weights)} + KV caches {gib(kv)} at max_len {max_len}) and "
        f"{gib(free)} of {where} memory is free"
    )
    return MemoryCheck(fits, needed, free, detail)


def quantized_bytes(out_features: int, in_features: int, qtype: str) -> int:
    """Bytes of one `[out, in]` weight quantized as runtime/kernels/quant.py stores it: "int8" one byte per weight and a
    float32 scale per output channel; a GGUF block type its blocks as the file stores them."""
    if qtype.lower() == "int8":
        return out_features * (in_features + 4)
    return out_features * row_bytes(qtype, in_features)


def twin_weight_bytes(spec, qtype: str, head_tokens: int | None = None) -> int:
    """Bytes of the twin's own weights (drafters/twin.py, `weight_bytes()` once built): every layer's linears and
    the LM head (`head_tokens` rows of it when reduced, plus their ids) in `qtype`, the norms and biases in
    float32; the embedding is the target's. Needs no weights: the shapes are the target's spec (`LlamaSpec` or
    `GemmaSpec`, the one the twin is built on)."""
    hidden, inter, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    attention = spec.num_heads * spec.head_dim
    qkv = attention + 2 * spec.num_kv_heads * spec.head_dim  # the fused q/k/v linear's output width
    layer = (quantized_bytes(qkv, hidden, qtype) + quantized_bytes(hidden, attention, qtype)
             + quantized_bytes(2 * inter, hidden, qtype) + quantized_bytes(hidden, inter, qtype))
    norms = 2 * hidden if isinstance(spec, LlamaSpec) else 4 * hidden + 2 * spec.head_dim  # (Gemma: 4 + q/k)
    small = norms + (qkv if getattr(spec, "qkv_bias", False) else 0)  # norms (+ qkv bias) per layer
    head_rows = vocab if head_tokens is None else min(head_tokens, vocab)
    head = quantized_bytes(head_rows, hidden, qtype) + (0 if head_tokens is None else 8 * head_rows)
    return spec.num_layers * (layer + 4 * small) + 4 * hidden + head


def twin_bytes(target_config, qtype: str, head_tokens: int | None, max_len: int, slots: int,
               dtype: torch.dtype = torch.float32) -> int:
    """What the twin adds beside its target: its weights and its KV cache of `slots` slots of `max_len` entries
    (the target's layers, heads and dtype). UnsupportedModel (a ValueError) where the target is outside the
    native family, which the twin runs on."""
    from ..model.build import model_spec

    spec = model_spec(target_config, max_len)
    return twin_weight_bytes(spec, qtype, head_tokens) + slots * kv_cache_bytes(target_config, max_len, dtype)
