"""A GGUF file's weights as they are: quantized linears stay in their blocks (`quant.QuantWeight`), the rest float32.

`read_gguf_weights` names them as Hugging Face does (what `LlamaModel` and `GemmaModel` take) by the file's
architecture record (`architectures.py`): it undoes llama.cpp's q/k row permutation where the record says the
converter made one (Llama files: each row is quantized on its own, so permuting rows commutes with dequantizing) and
the offset a record's norms are stored with (Gemma 3's 1 + w), so every weight's values are those of the fp32
conversion transformers makes of the same file. A file whose architecture, metadata or tensors the table does not
know raises `architectures.Unknown`.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..kernels.quant import NATIVE_TYPES, V_LAYOUTS, Deferred, QuantWeight
from ..weights.gguf_file import GGUFFile, open_gguf
from .architectures import Architecture, architecture

_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def file_architecture(file: GGUFFile) -> Architecture:
    """The record of a GGUF file, checked against its metadata keys and tensor names (`Architecture.check`);
    `architectures.Unknown` naming what no record knows."""
    arch = architecture(file.metadata.get("general.architecture"))
    arch.check(file.metadata, [info.name for info in file.tensors])
    return arch


def unsupported_types(path: str | Path) -> tuple[list[str], list[str]]:
    """The block types of a GGUF file's model tensors: (the ones `--weights gguf` runs, the ones it does not),
    read from the file's header (`gguf_file.open_gguf`: parsed once, no tensor read)."""
    file = open_gguf(path)
    kinds = {info.type_name for info in file.tensors}
    return sorted(kinds & set(NATIVE_TYPES)), sorted(kinds - set(NATIVE_TYPES) - set(_FLOAT_TYPES))


def tensor_activations(kind: str, activations: str) -> str:
    """What a tensor of block type `kind` computes with when the model asks for `activations`: integer activations
    ("q8") run the types with an integer layout (quant.V_LAYOUTS: every native type, the K-quants included); a type
    without one would keep fp32 activations (the fp32 conversion's values)."""
    return activations if kind in V_LAYOUTS else "fp32"


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse permutation of llama.cpp's q/k rows, on whole rows: [out, ...] -> [out, ...] (moved in
    numpy: its strided copies of small rows are far faster than torch's)."""
    out = rows.shape[0]
    moved = rows.numpy().reshape(heads, out // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2)
    return torch.from_numpy(np.ascontiguousarray(moved).reshape(rows.shape))


def _tensor(file: GGUFFile, info, heads: int | None) -> torch.Tensor:
    """A tensor's bytes as [out, row_bytes] uint8 (a float tensor's [nbytes]), its q/k rows un-permuted where
    `heads` is given."""
    raw = torch.from_numpy(file.read(info))  # [nbytes] uint8
    if heads is None:
        return raw if len(info.shape) == 1 else raw.view(info.shape[0], -1)
    return _unpermute(raw.view(info.shape[0], -1), heads)


@contextmanager
def _mapped(file: GGUFFile, info):
    """A quantized tensor's [out, row_bytes] bytes straight from the file's pages (`GGUFFile.mapped`), read-only."""
    with file.mapped(info) as raw, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        yield torch.from_numpy(raw).view(info.shape[0], -1)


def read_gguf_weights(path: str | Path, num_heads: int, num_kv_heads: int,
                      activations: str = "fp32") -> dict[str, torch.Tensor | QuantWeight]:
    """-> {Hugging Face name: float32 tensor or QuantWeight (computing with `activations`: quant.py)}. ValueError
    for a tensor type without a kernel, `architectures.Unknown` for a file the table does not know."""
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    file = open_gguf(path)
    arch = file_architecture(file)
    for info in file.tensors:
        name, kind = arch.hf_name(info.name), info.type_name
        if kind not in _FLOAT_TYPES and kind not in NATIVE_TYPES:
            raise ValueError(f"{path}: tensor {info.name} is {kind}, which --weights gguf does not run "
                             f"(it runs {', '.join(NATIVE_TYPES)}): use --weights fp32 (the converted model)")
        heads = None
        if arch.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if ".q_proj." in name else num_kv_heads
        if kind in _FLOAT_TYPES:
            value = _tensor(file, info, heads).view(_FLOAT_TYPES[kind]).float().reshape(info.shape)
            if arch.norm_offset and name.endswith("norm.weight"):  # as transformers' conversion undoes it
                value = value - arch.norm_offset
            weights[name] = value
        else:  # the blocks read when first needed (packing them into place, or a lookup)
            blocks = Deferred((info.shape[0], info.nbytes // info.shape[0]),
                              lambda info=info, heads=heads: _tensor(file, info, heads),
                              None if heads is not None else lambda info=info: _mapped(file, info))
            weights[name] = QuantWeight(kind, blocks, info.shape[-1], activations=tensor_activations(kind, activations))
    return weights


def read_head_rows(path: str | Path, ids: torch.Tensor, activations: str = "fp32") -> QuantWeight | None:
    """The rows `ids` [n] of a GGUF file's LM head (its `output.weight`, or the tied embedding's), as stored: the
    file's own blocks, copied row by row from its pages (a quantized row is independent of the others, so nothing is
    re-quantized) -> a QuantWeight of [n, hidden]; None where the head is not in quantized blocks."""
    file = open_gguf(path)
    infos = {info.name: info for info in file.tensors}
    info = infos.get("output.weight") or infos.get("token_embd.weight")
    if info is None or info.type_name not in NATIVE_TYPES:
        return None
    with _mapped(file, info) as blocks:  # [vocab, row_bytes], the file's pages
        rows = blocks[ids].clone()  # [n, row_bytes]
    return QuantWeight(info.type_name, rows, info.shape[-1], activations=tensor_activations(info.type_name, activations))
