"""A description of the machine a benchmark ran on, for the report header."""

from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(device: torch.device | str) -> dict:
    import transformers

    device = torch.device(device)
    info = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    return info


def machine_line(info: dict) -> str:
    where = info["gpu"] or f"{info['cpu']} ({info['logical_cpus']} logical CPUs, {info['torch_threads']} torch threads)"
    load = "" if info.get("load_average_1m") is None else f" | load average {info['load_average_1m']} at start"
    return f"{where} | torch {info['torch']} | transformers {info['transformers']} | Python {info['python']}{load}"
