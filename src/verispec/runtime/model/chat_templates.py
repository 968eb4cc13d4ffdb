"""A chat template for every model: the tokenizer's own (`tokenizer.chat_template`, from its folder or its GGUF
file's `tokenizer.chat_template`) where it carries one, else the known template of its architecture (`KNOWN`), or
the Jinja file the user names (`--chat-template FILE`, which takes precedence). `load_tokenizer` applies it, so
everything that formats chats (`generate --chat`, the server's chat API, the bench's prompts) reads
`tokenizer.chat_template` as before. `end_of_turn_ids`: the tokens that close a turn in the template, which the
engine stops at (Gemma 3's `<end_of_turn>` is not its EOS token).
"""

from __future__ import annotations

from pathlib import Path

# Gemma 3's turn format: `<start_of_turn>ROLE\n` + text + `<end_of_turn>\n`, the assistant's role named "model",
# a system message (Gemma has no system turn) put before the first user message's text, and `<start_of_turn>model\n`
# as the generation prompt. Written for verispec from the format's description.
GEMMA3 = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] ~ '\\n\\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ system if loop.first and role == 'user' else '' }}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# architecture (a GGUF file's general.architecture, or a config's model_type) -> its known chat template
KNOWN = {"gemma3": GEMMA3, "gemma3_text": GEMMA3}
# tokens that end a turn in the chat templates verispec knows of; a template that writes one makes it a stop token
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


def read_template(path: str | Path) -> str:
    """The Jinja chat template in the file at `path`, checked to compile. ValueError naming the file and the fix
    where it cannot be read, is empty or is not a Jinja template."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template file {path}: {exc}") from None
    if not text.strip():
        raise ValueError(f"the chat template file {path} is empty: give a Jinja chat template")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"the chat template file {path} is not a Jinja template (line {exc.lineno}: "
                         f"{exc.message})") from None
    return text


def use_chat_template(tokenizer, architecture: str | None, template_file: str | Path | None = None) -> str:
    """Give `tokenizer` its chat template: `template_file`'s (read_template) where given, else its own, else its
    architecture's known one; -> where it came from, for the log (and 'none' where it has none)."""
    if template_file is not None:
        tokenizer.chat_template = read_template(template_file)
        return f"--chat-template {template_file}"
    if getattr(tokenizer, "chat_template", None):
        return "the model's own"
    if architecture in KNOWN:
        tokenizer.chat_template = KNOWN[architecture]
        return f"verispec's {architecture} template (the model carries none)"
    return "none"


def end_of_turn_ids(tokenizer) -> set[int]:
    """The ids of the `END_OF_TURN` tokens the tokenizer's chat template writes (and its vocabulary has)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return set()
    ids = set()
    for token in END_OF_TURN:
        if token in template:
            index = tokenizer.convert_tokens_to_ids(token)
            if isinstance(index, int) and index != tokenizer.unk_token_id:
                ids.add(index)
    return ids
