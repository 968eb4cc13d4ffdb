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


def test_the_targets_twin_as_drafter_equals_target_alone(capsys, model_dirs):
    common = ["--model", model_dirs["target"], "--prompt", "the cat sat", "--max-new-tokens", 24, "--json",
              "--dtype", "float32"]
    outs = {}
    for drafter in ("self:int8", "ngram+self:int4", "none"):
        code, out, _ = run_cli(capsys, *common, "--draft-model", drafter)
        assert code == 0
        outs[drafter] = json.loads(out)
    assert outs["self:int8"]["token_ids"] == outs["ngram+self:int4"]["token_ids"] == outs["none"]["token_ids"]
    assert outs["self:int8"]["draft_model"] == "self:int8" and outs["self:int8"]["stats"]["accepted_tokens"] > 0


def test_json_says_which_dtype_auto_chose_and_why(capsys, model_dirs):
    from verispec.runtime.model.dtype import choose_dtype, dtype_name

    code, out, _ = run_cli(capsys, "--model", model_dirs["target"], "--prompt", "hi", "--max-new-tokens", 2, "--json",
                           "--draft-model", "none")
    runner = json.loads(out)["runner"]
    chosen, why = choose_dtype("cpu")
    assert code == 0 and runner["dtype"] == dtype_name(chosen) and runner["dtype_reason"] == why
    code, out, _ = run_cli(capsys, "--model", model_dirs["target"], "--prompt", "hi", "--max-new-tokens", 2, "--json",
                           "--draft-model", "none", "--dtype", "bfloat16")
    runner = json.loads(out)["runner"]
    assert runner["dtype"] == "bfloat16" and runner["dtype_reason"] == "bfloat16: asked for"


def test_json_says_which_kv_cache_dtype_ran(capsys, model_dirs):
    """--kv-cache-dtype reaches the runner and --json; float weights keep the model's dtype under 'auto'."""
    common = ["--model", model_dirs["target"], "--prompt", "hi", "--max-new-tokens", 2, "--json", "--draft-model",
              "none", "--dtype", "float32"]
    code, out, _ = run_cli(capsys, *common)
    runner = json.loads(out)["runner"]
    assert code == 0 and runner["kv_cache_dtype"] == "float32" and "model's dtype" in runner["kv_cache_dtype_reason"]
    code, out, _ = run_cli(capsys, *common, "--kv-cache-dtype", "float16")
    runner = json.loads(out)["runner"]
    assert code == 0 and runner["kv_cache_dtype"] == "float16" and runner["kv_cache_dtype_reason"] == "float16: asked for"


def test_json_says_which_threads_ran(capsys, model_dirs):
    """--threads reaches the governor and --json: a fixed N, and 'auto' (the default) with its steps counted."""
    common = ["--model", model_dirs["target"], "--prompt", "hi", "--max-new-tokens", 2, "--json", "--draft-model",
              "none"]
    code, out, _ = run_cli(capsys, *common, "--threads", "1")
    threads = json.loads(out)["threads"]
    assert code == 0 and threads["setting"] == 1 and threads["threads"] == 1 and threads["reason"] == "--threads 1"
    code, out, _ = run_cli(capsys, *common)
    threads = json.loads(out)["threads"]
    assert code == 0 and threads["setting"] == "auto" and threads["reason"].startswith("auto")
    assert sum(threads["steps_by_threads"].values()) >= 1


def test_streams_text_then_stats(capsys, model_dirs):
    code, out, err = run_cli(capsys, "--model", model_dirs["target"], "--draft-model", model_dirs["draft"],
                             "--prompt", "hello", "--chat", "--max-new-tokens", 12, "--temperature", 0.8, "--seed", 3)
    assert code == 0 and out.strip()
    assert "mean accepted length" in err


BAD_INPUT = [
    (["--model", "/no/such/model"], "does not exist"),
    (["--draft-model", "odd_vocab"], "vocabulary size"),
    (["--draft-tokens", "0"], "--draft-tokens"),
    (["--max-new-tokens", "5000"], "max_len"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--tree-nodes", "99"], "tree_nodes"),
    (["--draft-model", "ngram+head:/no/such/head"], "holds no draft head"),
    (["--draft-model", "self:int3"], "unknown twin format 'int3'; choose from self:int8"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    (["--threads", "0"], "'auto' or a positive integer"),
    (["--chat-template", "/no/such/template.jinja"], "cannot read the chat template file"),
]


def bad_input_argv(model_dirs, args) -> list[str]:
    args = [str(model_dirs["odd_vocab"]) if a == "odd_vocab" else a for a in args]
    base = {"--model": str(model_dirs["target"]), "--draft-model": str(model_dirs["draft"])}
    for flag, value in base.items():
        if flag not in args:
            args += [flag, value]
    return ["generate", "--prompt", "hi", *args]


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_exits_2_with_a_message(model_dirs, args, message, capsys):
    """In process (`main`): exit status 2 and the message, no traceback; the one real process is the next test."""
    try:
        code = main(bad_input_argv(model_dirs, args))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err


def test_bad_input_exits_2_from_the_command(model_dirs):
    """`python -m verispec.cli generate` as a user runs it: the exit status and message reach the shell."""
    args, message = BAD_INPUT[4]  # --temperature -1
    proc = subprocess.run([sys.executable, "-m", "verispec.cli", *bad_input_argv(model_dirs, args)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_prompts_file_runs_a_batch_equal_to_each_prompt_alone(capsys, model_dirs, tmp_path):
    rows = [{"id": "a", "prompt": "the cat sat"}, {"prompt": "one two", "max_new_tokens": 8},
            {"id": 7, "messages": [{"role": "user", "content": "hello"}], "temperature": 0.9, "seed": 4},
            {"prompt_token_ids": [30, 31, 32], "stop_token_ids": [5]}]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out_path = tmp_path / "out.jsonl"
    # Fixed K: adaptive K follows measured costs, which differ between a batch and one prompt, and a sampled row's
    # tokens depend on its K sequence (same distribution, other draws).
    common = ["--model", model_dirs["target"], "--draft-model", model_dirs["draft"], "--max-new-tokens", 16,
              "--no-adaptive"]
    code, _, err = run_cli(capsys, *common, "--prompts-file", source, "--output", out_path, "--max-batch-size", 3)
    assert code == 0 and "4 prompts" in err
    lines = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["a", 1, 7, 3] and [line["index"] for line in lines] == [0, 1, 2, 3]
    assert len(lines[1]["token_ids"]) <= 8
    # Each row equals that prompt run alone through --prompt (greedy rows) with the same settings.
    code, out, _ = run_cli(capsys, *common, "--prompt", "the cat sat", "--json", "--draft-model", "none")
    assert json.loads(out)["token_ids"] == lines[0]["token_ids"]
    code, out, _ = run_cli(capsys, *common, "--prompt", "hello", "--chat", "--json", "--temperature", 0.9,
                           "--seed", 4)
    assert json.loads(out)["token_ids"] == lines[2]["token_ids"]


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not valid JSON"),
    ('{"prompt": "a", "messages": []}', "exactly one of"),
    ('{"prompt": "a", "temprature": 1}', "unknown field(s) temprature"),
    ('{"prompt": "a", "top_p": 3}', "line 1: top_p"),
    ('{"prompt_token_ids": "abc"}', "list of ints"),
])
def test_bad_prompts_file_exits_2(capsys, model_dirs, tmp_path, line, message):
    source = tmp_path / "bad.jsonl"
    source.write_text(line + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(model_dirs["target"]), "--prompts-file", str(source)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_chat_template_file_formats_the_chat_prompt(capsys, model_dirs, tmp_path):
    """--chat-template FILE replaces the model's own template for --chat: the prompt is the file's rendering."""
    from transformers import AutoTokenizer

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}answer:{% endif %}")
    common = ["--model", model_dirs["target"], "--draft-model", "none", "--prompt", "hello", "--chat",
              "--max-new-tokens", 4, "--json"]
    code, out, _ = run_cli(capsys, *common, "--chat-template", template)
    assert code == 0
    rendered = AutoTokenizer.from_pretrained(model_dirs["target"])("user: hello\nanswer:", add_special_tokens=False)
    assert json.loads(out)["stats"]["prompt_tokens"] == len(rendered["input_ids"])
    code, own, _ = run_cli(capsys, *common)
    assert json.loads(own)["stats"]["prompt_tokens"] != len(rendered["input_ids"])  # the model's own differs


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_serve_and_bench_refuse_a_bad_chat_template_file(command, tmp_path, capsys):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    with pytest.raises(SystemExit) as exc:
        main([command, "--chat-template", str(bad)])
    assert exc.value.code == 2
    assert "is not a Jinja template" in capsys.readouterr().err
