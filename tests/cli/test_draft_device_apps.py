"""`--draft-device` in the apps: `verispec generate` and `verispec serve` (the real `openai` client) with the draft
model on its own device give the target alone's greedy output; a device this machine lacks exits 2 naming the fix.

This machine has no accelerator: the device is "cpu" here (tests/drafters/test_draft_device.py counts what crosses).
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from conftest import machine_reason
from test_server import ServerThread
from verispec.cli import main
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason=machine_reason("has CUDA; the test checks the error without it"))


def test_generate_with_a_draft_device_equals_the_target_alone(capsys, model_dirs):
    common = ["generate", "--model", str(model_dirs["target"]), "--prompt", "the cat sat", "--max-new-tokens", "24",
              "--json"]
    assert main([*common, "--draft-model", str(model_dirs["draft"]), "--draft-device", "cpu"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert main([*common, "--draft-model", "none"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert placed["token_ids"] == alone["token_ids"]
    assert placed["stats"]["draft_tokens"] > 0


@NO_CUDA
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_cuda_draft_device_without_cuda_exits_2(capsys, model_dirs, command):
    argv = [command, "--model", str(model_dirs["target"]), "--draft-model", str(model_dirs["draft"]),
            "--draft-device", "cuda:1"]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--prompt", "hi"] if command == "generate" else argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--draft-device 'cuda:1': no CUDA device is available here; use 'cpu'" in err
    assert "Traceback" not in err


@NO_CUDA
def test_server_config_refuses_a_missing_draft_device(model_dirs):
    with pytest.raises(ValueError, match="draft_device 'cuda'.*no CUDA device"):
        ServerConfig(model=str(model_dirs["target"]), draft_device="cuda")


def test_served_with_a_draft_device_speculation_equals_the_target_alone(model_dirs):
    config = ServerConfig(model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]),
                          enable_speculative=True, spec=SpeculativeConfig(num_draft_tokens=4, adaptive=False),
                          max_len=256, draft_device="cpu")
    app = create_app(config)
    with ServerThread(app) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)

        def chat(enabled: bool):
            return client.chat.completions.create(
                model="target", messages=[{"role": "user", "content": "the cat sat on the mat"}], max_tokens=24,
                temperature=0, extra_body={"ignore_eos": True, "speculative": {"enabled": enabled}})

        on, off = chat(True), chat(False)
        assert on.choices[0].message.content == off.choices[0].message.content
        assert on.model_extra["speculative_metrics"]["draft_tokens"] > 0
        drafter = app.state.server.served._default[1]
        assert drafter.runner.device == torch.device("cpu")
