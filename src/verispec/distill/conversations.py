"""Conversations for the teacher at scale: an unbounded, seeded sequence of diverse user requests.

Conversation i is a pure function of (seed, i, the material): its randomness comes from its own
`random.Random(f"{seed}:{i}")`, so any range of the sequence is built without the ones before it (shards are ranges)
and a larger token budget only extends the sequence. The mix:
- `domain_prompt` (prompts.py): the Spec-Bench domains (translation, summarisation, QA, math word problems,
  retrieval, and the MT-bench categories), from verispec's own templates and word lists, never the benchmark's text;
- composed instructions: a task x a subject x an audience, a length, a format and a tone (`styles.py`): millions
  of combinations across styles and lengths;
- some conversations carry a system prompt (a few fixed ones, so the engine's prefix cache shares their KV) and
  some continue for one or two more user turns that refer to the assistant's answer (multi-turn).

The material (stdlib prose and function sources, read from the local Python install without importing it) is
built once per run: `Material.local(seed)`.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from verispec.distill import styles as S
from verispec.distill import topics as T
from verispec.distill.prompts import domain_prompt, stdlib_functions, stdlib_prose

VERSION = 1  # bump when conversation(seed, i) changes: a resumed run refuses data made by another version
COMPOSED_SHARE = 0.45  # conversations with a composed instruction; the rest are domain prompts
SYSTEM_SHARE = 0.25  # conversations that start with one of styles.SYSTEM_PROMPTS
MULTI_TURN_SHARE = 0.25  # conversations with follow-up turns (one or two)


@dataclass(frozen=True)
class Conversation:
    """User turns to answer in order (turn j's prompt holds turns < j and the target's answers to them)."""

    category: str
    turns: tuple[str, ...]
    system: str | None = None  # None: the chat template's default system prompt


@dataclass(frozen=True)
class Material:
    """Texts that prompts quote: `docs` to summarise, retrieve from and extract from; `functions` to explain."""

    docs: list[str] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)

    @classmethod
    def local(cls, seed: int) -> Material:
        """From the local Python install (parsed once per process and seed: a few seconds)."""
        return _local_material(seed)


@functools.lru_cache(maxsize=4)
def _local_material(seed: int) -> Material:
    return Material(stdlib_prose(seed, limit=2000), stdlib_functions(seed, limit=2000))


def conversation(seed: int, index: int, material: Material) -> Conversation:
    """The `index`-th conversation of the sequence `seed` names (module docstring)."""
    rng = random.Random(f"{seed}:{index}")
    if rng.random() < COMPOSED_SHARE or not material.docs:
        category, first = "composed", composed_instruction(rng)
    else:
        prompt = domain_prompt(rng, material.docs, material.functions)
        category, first = prompt.category, prompt.text
    system = rng.choice(S.SYSTEM_PROMPTS) if rng.random() < SYSTEM_SHARE else None
    turns = [first]
    if rng.random() < MULTI_TURN_SHARE:
        turns += rng.sample(S.FOLLOW_UPS, rng.choice([1, 1, 2]))
    return Conversation(category, tuple(turns), system)


def composed_instruction(rng: random.Random) -> str:
    """A task about a subject, for an audience, at a length, in a format and a tone (each maybe unstated)."""
    subject = rng.choice(S.SUBJECTS + T.TOPICS + T.SCIENCE_CONCEPTS)
    task = rng.choice(S.TASKS).format(s=subject)
    audience = rng.choice(S.AUDIENCES)
    if audience and task.endswith("."):
        task = task[:-1] + audience + "."
    elif audience and task.endswith("?"):
        task = task[:-1] + audience + "?"
    return task + rng.choice(S.LENGTHS) + rng.choice(S.FORMATS) + rng.choice(S.TONES)


def chat_messages(conv: Conversation, turn: int, answers: list[str]) -> list[dict]:
    """The messages of `conv` up to user turn `turn`, with the assistant's earlier `answers` (texts) between."""
    assert len(answers) >= turn, "earlier turns are answered first"
    messages = [{"role": "system", "content": conv.system}] if conv.system is not None else []
    for j in range(turn + 1):
        messages.append({"role": "user", "content": conv.turns[j]})
        if j < turn:
            messages.append({"role": "assistant", "content": answers[j]})
    return messages
