"""`verispec generate`: JSON output equal to `--draft-model none`; bad input exits 2 with a message."""

import json
import subprocess
import sys

import pytest

from verispec.cli import main


def run_cli(capsys, *args):
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_equals_target_alone(capsys, model_dirs):
    common = ["--model", model_dirs["target"], "--prompt", "the cat sat", "--max-new-tokens", 30, "--json"]
    code, out, _ = run_cli(capsys, *common, "--draft-model", model_dirs["draft"], "--draft-tokens", 3)
    spec = json.loads(out)
    code2, out2, _ = run_cli(capsys, *common, "--draft-model", "none")
    alone = json.loads(out2)
    assert code == code2 == 0
    assert spec["token_ids"] == alone["token_ids"] and spec["text"] == alone["text"]
    assert spec["stats"]["draft_tokens"] > 0 and alone["stats"]["draft_tokens"] == 0
    assert set(spec["stats"]) >= {"rounds", "acceptance_rate", "mean_accepted_length", "acceptance_by_position",
                                  "draft_s", "verify_s", "wall_s", "tokens_per_s"}


def test_streams_text_then_stats(capsys, model_dirs):
    code, out, err = run_cli(capsys, "--model", model_dirs["target"], "--draft-model", model_dirs["draft"],
                             "--prompt", "hello", "--chat", "--max-new-tokens", 12, "--temperature", 0.8, "--seed", 3)
    assert code == 0 and out.strip()
    assert "mean accepted length" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "does not exist"),
        (["--draft-model", "odd_vocab"], "vocabulary size"),
        (["--draft-tokens", "0"], "--draft-tokens"),
        (["--max-new-tokens", "5000"], "max_len"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
    ],
)
def test_bad_input_exits_2_with_a_message(model_dirs, args, message):
    args = [str(model_dirs["odd_vocab"]) if a == "odd_vocab" else a for a in args]
    base = {"--model": str(model_dirs["target"]), "--draft-model": str(model_dirs["draft"])}
    for flag, value in base.items():
        if flag not in args:
            args += [flag, value]
    proc = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "--prompt", "hi", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
