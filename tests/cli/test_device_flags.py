"""`--device` in `verispec generate`, `serve` and `bench`: a device this machine lacks (no CUDA, an index past the
last GPU, another device type, a name torch does not know) exits 2 with `placement.check_device`'s message, before
any model loads (the model and prompts named here do not exist). This machine has no accelerator; the index range is checked with a CUDA count the test sets."""

from __future__ import annotations

import pytest
import torch

from conftest import machine_reason
from verispec.cli import main

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason=machine_reason("has CUDA; the test checks the error without it"))
NO_XPU = pytest.mark.skipif(getattr(getattr(torch, "xpu", None), "is_available", lambda: False)(),
                            reason=machine_reason("has an xpu device; the test checks the error without it"))
COMMANDS = ["generate", "serve", "bench"]


def _exits_2(capsys, tmp_path, command: str, device: str) -> str:
    argv = [command, "--model", str(tmp_path / "no-model"), "--device", device]
    argv += {"generate": ["--prompt", "hi"], "serve": [],
             "bench": ["--prompts", str(tmp_path / "no-prompts.jsonl"), "--out", str(tmp_path / "out")]}[command]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "Traceback" not in err and "\n" not in err, err
    assert "drafter" not in err  # the draft device's hint ("leave it out ...") is not the target's
    return err


@NO_CUDA
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_cuda_without_cuda_exits_2(capsys, tmp_path, command, device):
    err = _exits_2(capsys, tmp_path, command, device)
    assert f"--device {device!r}: no CUDA device is available here; use 'cpu'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_cuda_index_past_the_last_gpu_exits_2(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = _exits_2(capsys, tmp_path, command, "cuda:3")
    assert "--device 'cuda:3': this machine has 2 CUDA device(s), cuda:0..cuda:1" in err


@NO_XPU
@pytest.mark.parametrize("command", COMMANDS)
def test_another_device_type_this_machine_lacks_exits_2(capsys, tmp_path, command):
    err = _exits_2(capsys, tmp_path, command, "xpu")
    assert "--device 'xpu': no xpu device is available here; use 'cpu' or 'cuda[:N]'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_name_torch_does_not_know_exits_2(capsys, tmp_path, command):
    err = _exits_2(capsys, tmp_path, command, "nonsense")
    assert "--device 'nonsense' is not a torch device: give e.g. 'cpu', 'cuda' or 'cuda:1'" in err
