"""No training prompt of the teacher overlaps an evaluation prompt: word 8-grams shared with Spec-Bench (its MT-bench
categories included, both turns), the packaged bench workloads, the demo prompts and the bench's system prompt."""

from __future__ import annotations

import pytest

from verispec.bench.prompts import default_prompts_path
from verispec.distill import styles as S
from verispec.distill import topics as T
from verispec.distill.conversations import Material, conversation
from verispec.distill.overlap import N, evaluation_texts, ngrams, overlapping
from verispec.distill.prompts import build_prompts

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

CONVERSATIONS = 12_000  # of seed 0, the sequence the committed data starts with (a shard holds 256)


@pytest.fixture(scope="module")
def evaluation() -> list[str]:
    path = default_prompts_path()
    assert path is not None and path.is_file(), (
        "shared/data/spec_bench_dev.jsonl not found above the checkout or the package: the overlap test needs it")
    texts = evaluation_texts(path)
    assert len(texts) > 280  # 240 Spec-Bench prompts, 40 with a second turn, and the packaged sets
    return texts


def test_ngrams_by_hand():
    assert N == 8
    assert ngrams("One, two THREE four-five six seven eight nine!") == {
        ("one", "two", "three", "four", "five", "six", "seven", "eight"),
        ("two", "three", "four", "five", "six", "seven", "eight", "nine")}
    assert ngrams("Name a city.") == {("name", "a", "city")}  # shorter than n: the whole text
    assert ngrams("  ,  ") == set()


def test_overlap_check_catches_a_copied_clause(evaluation):
    """The negative control: a prompt that quotes eight words of a benchmark prompt, in other case and
    punctuation, inside a prompt of our own, is caught; the same words shuffled are not."""
    source = next(t for t in evaluation if len(t.split()) > 20)
    clause = " ".join(source.split()[5:13]).upper()
    planted = f"Please help me: {clause} -- and answer briefly."
    assert overlapping([planted], evaluation)
    shuffled = " ".join(reversed(clause.split()))
    assert not overlapping([f"Please help me: {shuffled}"], [source])


@pytest.mark.slow  # .ci/run runs it (make test's 5 minutes)
def test_teacher_conversations_never_overlap_the_evaluation(evaluation):
    material = Material.local(0)
    texts: set[str] = set()
    for i in range(CONVERSATIONS):
        conv = conversation(0, i, material)
        texts.update(conv.turns)
        if conv.system:
            texts.add(conv.system)
    assert len(texts) > CONVERSATIONS // 2
    hits = overlapping(sorted(texts), evaluation)
    assert not hits, f"{len(hits)} training prompts overlap the evaluation, e.g. {hits[0]}"


@pytest.mark.slow  # .ci/run runs it (make test's 5 minutes)
def test_template_lists_and_builtin_prompts_never_overlap_the_evaluation(evaluation):
    """Every fixed string a prompt is made of (the lists beyond what the sample above drew), and the legacy
    pipeline's built-in prompts."""
    lists = [S.TASKS, S.SUBJECTS, S.SYSTEM_PROMPTS, S.FOLLOW_UPS, S.AUDIENCES, S.LENGTHS, S.FORMATS, S.TONES,
             T.TOPICS, T.SCIENCE_CONCEPTS, T.CODING_TASKS, T.PERSONAS, T.EVENTS]
    fixed = [text for items in lists for text in items if text.strip()]
    assert not overlapping(fixed, evaluation)
    legacy = [p.text for p in build_prompts(3000, 0, [])]
    hits = overlapping(legacy, evaluation)
    assert not hits, hits[:3]
