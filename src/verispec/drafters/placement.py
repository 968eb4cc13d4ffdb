"""Where a draft model runs (`--draft-device`, `draft_device=`): its own device, checked before anything loads.

A draft model (model.py) may live on another device than the target: per round, the committed tokens it feeds
cross to it once, and its draft tokens and q come back once (ModelDrafter's docstring). Drafters that read or share
the target's own tensors stay on the target's device: a draft head (the target's hidden states and embedding) and
the twin (the target's embedding; its quantized kernels run on the CPU). `check_device` also checks the target's
`--device` in the CLI.
"""

from __future__ import annotations

import torch

from ..runtime.model.twins import model_device


DRAFT_HINT = "leave it out to run the drafter on the target's device"


def check_device(device: str | torch.device, name: str = "draft_device", hint: str = DRAFT_HINT) -> torch.device:
    """`device` as a torch.device this machine has; ValueError naming the fix otherwise (`name`: how the caller
    calls it, e.g. '--draft-device' or '--device'; `hint`: a way out besides another device, '' for none)."""
    other = f", or {hint}" if hint else ""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} {device!r} is not a torch device: give e.g. 'cpu', 'cuda' or 'cuda:1'") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device!r}: no CUDA device is available here; use 'cpu'{other}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return dev
    available = getattr(getattr(torch, dev.type, None), "is_available", None)
    if available is None or not available():
        raise ValueError(f"{name} {device!r}: no {dev.type} device is available here; use 'cpu' or "
                         f"'cuda[:N]'{other}")
    return dev


def on_target_device(kind: str, name: str, device: str | torch.device, target) -> None:
    """ValueError when a drafter that shares the target's tensors (`kind`: 'draft head' or 'twin') is asked to run
    on another `device` than the target's."""
    target_device = model_device(target)  # (a target on GGUF weights holds meta tensors: its twin's device)
    if not same_device(device, target_device):
        raise ValueError(f"{name}: a {kind} shares the target's tensors, so it runs on the target's device "
                         f"({target_device}), not {device}: leave the draft device out, or draft with a draft model")


def same_device(a: str | torch.device, b: str | torch.device) -> bool:
    """'cuda' and 'cuda:0' are the same device where the current CUDA device is 0."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index or a.type == "cpu"
