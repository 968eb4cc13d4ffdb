"""Predicted outputs in the library and the CLI: `generate(..., prediction=text)`, `stream`, a batch with one
prediction per prompt, `verispec generate --prediction FILE`; each output the target alone's; bad input a
ValueError naming the fix, or exit 2 with a message."""

import json

import pytest

from verispec.cli import main
from verispec.generator import SpeculativeGenerator

PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def generator(trained_pair, tokenizer):
    return SpeculativeGenerator(trained_pair[0], None, tokenizer, max_len=256)


def test_generate_stream_and_batch_with_a_prediction(generator):
    plain = generator.generate(PROMPT, max_new_tokens=40, ignore_eos=True, speculative=False)
    edited = plain[:12] + "ZZ" + plain[16:]
    result = generator.generate(PROMPT, max_new_tokens=40, ignore_eos=True, prediction=edited, return_dict=True)
    assert result.text == plain and result.stats.accepted_by_stage["prediction"] > 20
    assert "".join(generator.stream(PROMPT, max_new_tokens=40, ignore_eos=True, prediction=edited)) == plain
    assert generator.last_stats.accepted_by_stage["prediction"] > 20
    other = generator.generate("one two", max_new_tokens=40, ignore_eos=True, speculative=False)
    assert generator.generate([PROMPT, "one two"], max_new_tokens=40, ignore_eos=True,
                              prediction=[edited, None]) == [plain, other]
    ignored = generator.generate(PROMPT, max_new_tokens=40, ignore_eos=True, prediction=edited, speculative=False,
                                 return_dict=True)
    assert ignored.text == plain and not ignored.stats.draft_tokens_by_stage


def test_library_refuses_bad_predictions_naming_the_fix(generator):
    with pytest.raises(ValueError, match="one per prompt"):
        generator.generate([PROMPT, "one"], max_new_tokens=4, prediction=["a"])
    with pytest.raises(ValueError, match="shorten the prediction"):
        generator.generate(PROMPT, max_new_tokens=4, prediction="the cat " * 40)
    with pytest.raises(ValueError, match="prediction is empty"):
        generator.generate(PROMPT, max_new_tokens=4, prediction=[])


def run_cli(capsys, *args):
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prediction_file_equals_target_alone(capsys, model_dirs, tmp_path):
    common = ["--model", model_dirs["target"], "--prompt", PROMPT, "--max-new-tokens", 30, "--json",
              "--draft-model", "none"]
    code, out, _ = run_cli(capsys, *common)
    alone = json.loads(out)
    prediction = tmp_path / "prediction.txt"
    prediction.write_text(alone["text"][:10] + "ZZZ" + alone["text"][10:], encoding="utf-8")
    # --no-adaptive: K must not follow measured costs (a busy machine could set it to 0 and leave the answer undrafted)
    code2, out2, _ = run_cli(capsys, *common, "--prediction", prediction, "--no-adaptive")
    predicted = json.loads(out2)
    assert code == code2 == 0 and predicted["token_ids"] == alone["token_ids"]
    assert predicted["stats"]["accepted_by_stage"]["prediction"] > 10
    code3, out3, err3 = run_cli(capsys, "--model", model_dirs["target"], "--prompt", PROMPT, "--max-new-tokens", 30,
                                "--draft-model", "ngram", "--prediction", prediction)
    assert code3 == 0 and out3.strip() == alone["text"].strip() and "[verispec]" in err3


@pytest.mark.parametrize("make, extra, message", [
    (None, [], "cannot read it"),
    ("", [], "is empty"),
    ("the cat " * 40, ["--max-len", 64], "shorten the prediction"),
    ("text", ["--prompts-file", "PROMPTS"], "goes with --prompt"),
])
def test_cli_bad_prediction_exits_2(capsys, model_dirs, tmp_path, make, extra, message):
    path = tmp_path / "prediction.txt"
    if make is not None:
        path.write_text(make, encoding="utf-8")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the"}\n', encoding="utf-8")
    source = ["--prompts-file", str(prompts)] if "--prompts-file" in extra else ["--prompt", PROMPT]
    extra = [e for e in extra if e not in ("--prompts-file", "PROMPTS")]
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(model_dirs["target"]), *source, "--max-new-tokens", "8",
              "--prediction", str(path), *map(str, extra)])
    assert info.value.code == 2 and message in capsys.readouterr().err
