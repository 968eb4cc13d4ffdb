"""A chat template for every model (runtime/model/chat_templates.py): the tokenizer's own is kept, a model without
one gets its architecture's known template (Gemma 3's turn format, its <end_of_turn> a stop token), a file the user
names replaces either, and a file that cannot be used is refused with its reason; `load_tokenizer` applies it."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verispec.runtime.model.chat_templates import GEMMA3, end_of_turn_ids, read_template, use_chat_template

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

OWN = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def gemma_like_tokenizer(template: str | None = None) -> PreTrainedTokenizerFast:
    """Word-level, Gemma's special tokens (<start_of_turn> and <end_of_turn> single tokens), no template."""
    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "user", "model", "hi", "yo"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                  pad_token="<pad>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tok.chat_template = template
    return tok


def render(tok, messages) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_a_model_without_a_template_gets_gemma3s_turn_format_and_its_end_of_turn_stop():
    tok = gemma_like_tokenizer()
    assert use_chat_template(tok, "gemma3_text").startswith("verispec's gemma3_text template")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert render(tok, messages) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                                     "<start_of_turn>model\nHello<end_of_turn>\n"
                                     "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert end_of_turn_ids(tok) == {tok.convert_tokens_to_ids("<end_of_turn>")}


def test_the_models_own_template_is_kept_and_an_unknown_architecture_gets_none():
    tok = gemma_like_tokenizer(OWN)
    assert use_chat_template(tok, "gemma3_text") == "the model's own" and tok.chat_template == OWN
    tok = gemma_like_tokenizer()
    assert use_chat_template(tok, "llama") == "none" and tok.chat_template is None
    assert end_of_turn_ids(tok) == set()


def test_a_template_file_replaces_the_models_own(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['content'] }}{% endfor %}")
    tok = gemma_like_tokenizer(OWN)
    assert use_chat_template(tok, "gemma3_text", path) == f"--chat-template {path}"
    assert render(tok, [{"role": "user", "content": "hi"}]) == "<bos><start_of_turn>hi"
    assert tok.chat_template != GEMMA3


@pytest.mark.parametrize("content, message", [
    (None, "cannot read the chat template file"),
    ("  \n", "is empty"),
    ("{% for m in messages %}unclosed", "is not a Jinja template"),
    (b"\xff\xfe\x00bad", "cannot read the chat template file"),
])
def test_a_file_that_cannot_be_used_is_refused_with_its_reason(tmp_path, content, message):
    path = tmp_path / "template.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_template(path)
    tok = gemma_like_tokenizer(OWN)
    with pytest.raises(ValueError, match=message):
        use_chat_template(tok, None, path)
    assert tok.chat_template == OWN  # left as it was


def test_load_tokenizer_gives_a_folder_model_without_a_template_its_architectures(tmp_path):
    """A Gemma 3 folder (config.json's model_type) whose tokenizer has no template: `load_tokenizer` applies Gemma
    3's; a Llama folder's stays without one."""
    import json

    from verispec.runtime.model.loading import load_tokenizer

    for kind, expected in (("gemma3_text", GEMMA3), ("llama", None)):
        folder = tmp_path / kind
        gemma_like_tokenizer().save_pretrained(folder)
        (folder / "config.json").write_text(json.dumps({"model_type": kind}))
        assert load_tokenizer(folder).chat_template == expected
