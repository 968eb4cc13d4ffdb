"""Fixtures: tiny fp32 models built from configs (seeded) and a character-level tokenizer. No downloads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Tests live in one folder per subject (DEVELOPERS.md, "Tests"): unit (the math: sampling, verification, stats; the
# layering rule), kernels, runtime (architectures, GGUF files, loading, runners, caches), engine, drafters, distill,
# server, cli, bench, real (the real shipped models, slow). Each test gets its folder's marker (`-m server`); `unit`
# is also declared by the pure, fast files of other subjects (`pytestmark = pytest.mark.unit`), so `-m unit`
# (make test-unit) is the inner loop. The folders are importable from each other (a drafter test reuses
# server/test_server.py's ServerThread, runtime/gguf_writer.py writes files for kernels/ and drafters/) whichever
# folder pytest was given.
SUBJECTS = ("unit", "kernels", "runtime", "engine", "drafters", "distill", "server", "cli", "bench", "real")
sys.path[:0] = [str(Path(__file__).parent / subject) for subject in SUBJECTS]


def pytest_collection_modifyitems(config, items):
    for item in items:
        subject = Path(str(item.fspath)).parent.name
        if subject in SUBJECTS:
            item.add_marker(getattr(pytest.mark, subject))


# Skips: where CI is set, only a skip for what the machine lacks passes (tests/ci_skips.py; its hooks, taken here).
from ci_skips import machine_reason, pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402, F401


def pytest_runtest_setup(item):
    """`@pytest.mark.kernel("dense" | "layer" | "quant" | "pool")`: the test needs that C++ kernel (runtime/kernels/ext.py).
    Built (or loaded from the disk cache) here, at setup rather than at collection; where it cannot be built the
    test skips, saying so, and under VERISPEC_REQUIRE_KERNELS=1 (make test, .ci/run) the build's error fails it."""
    for mark in item.iter_markers("kernel"):
        from verispec.runtime.kernels import ext

        (name,) = mark.args
        if ext.build(name, ext.KERNELS[name]) is None:  # raises KernelBuildError where required
            pytest.skip(f"verispec's {name} kernel could not be built here (no compiler?); {ext.REQUIRE_ENV}=1 makes "
                        "this an error")


# Tiny models run fastest on one thread, and the machine is shared: training the fixture pair takes ~5 s this
# way and ~95 s with torch's default under load. Set at import so every test file sees the same weights.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _threads_as_the_suite_set_them():
    """A CLI command run in process configures the process's threads (`--threads`, default 'auto': every free core,
    re-measured as it runs: runtime/threads.py); the next test gets back the threads it would have had, and the
    governor unconfigured (following torch's threads, as the API's default does)."""
    before = torch.get_num_threads()
    yield
    from verispec.runtime import threads
    from verispec.runtime.kernels import ext

    if threads.governor().setting is not None:
        threads.configure_threads(None)
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
    if ext._BUILT.get("pool") is not None and not isinstance(ext._BUILT["pool"], Exception):
        ext._BUILT["pool"].set_threads(before)

# VERISPEC_TEST_RUNNER=hf | native | compiled runs the whole suite on that runner (default: "auto", native for the
# Llama family); .ci/run repeats the equality and exactness tests on each.
_RUNNERS = {"hf": dict(backend="hf"), "native": dict(backend="auto", compile=False),
            "compiled": dict(backend="auto", compile=True)}
if os.environ.get("VERISPEC_TEST_RUNNER"):
    from verispec.config import RunnerOptions
    from verispec.runtime.runners import select as _runner

    _runner.DEFAULT_OPTIONS = RunnerOptions(**_RUNNERS[os.environ["VERISPEC_TEST_RUNNER"]])

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHARS = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\n:-")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS_ID = SPECIALS.index("<|im_end|>")
CORPUS = (
    "the cat sat on the mat. the dog sat on the log. a bird sang in the tree.\n"
    "one two three four five six seven eight nine ten.\n"
    "Paris is the capital of France. Rome is the capital of Italy.\n"
) * 4


# Characters JSON needs beyond CHARS: the vocabulary of the structured-output tests (CHARS keep their ids).
JSON_CHARS = CHARS + list('{}"[]_')


def make_tokenizer(chars: list[str] = CHARS) -> PreTrainedTokenizerFast:
    """A character-level byte-level-BPE tokenizer (one token per character, GPT-2's byte-to-unicode alphabet, as
    real BPE tokenizers store it, so grammar engines read it like a real one)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ["".join(alphabet[b] for b in c.encode()) for c in chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="</s>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


VOCAB = len(SPECIALS) + len(CHARS)


def _common(vocab: int) -> dict:
    return dict(vocab_size=vocab, eos_token_id=EOS_ID, bos_token_id=1, pad_token_id=2)


def tiny_llama(seed: int, hidden: int = 32, layers: int = 2, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **_common(vocab))
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int, hidden: int = 32, layers: int = 2, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **_common(vocab))
    return Qwen2ForCausalLM(cfg).eval()


def tiny_gpt2(seed: int, hidden: int = 32, layers: int = 2, vocab: int = VOCAB) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **_common(vocab))
    return GPT2LMHeadModel(cfg).eval()


BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gpt2": tiny_gpt2}


def train_on_corpus(model, tokenizer, steps: int, lr: float = 3e-3, seed: int = 0):
    """A few hundred steps of next-token training, enough to make a model's predictions structured."""
    torch.manual_seed(seed)
    ids = torch.tensor(tokenizer(CORPUS)["input_ids"])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - 65, (8,))
        batch = torch.stack([ids[s : s + 64] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def chisquare_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit of sampled token `counts` [vocab] to probabilities `p` [vocab]: tokens expected
    >= 5 times are tested one by one, the rest pooled into one cell."""
    from scipy.stats import chisquare

    runs = float(counts.sum())
    likely = p * runs >= 5
    observed = torch.cat([counts[likely], counts[~likely].sum().view(1)])
    expected = torch.cat([p[likely] * runs, (p[~likely].sum() * runs).view(1)])
    observed, expected = observed[expected > 0], expected[expected > 0]
    expected = expected * observed.sum() / expected.sum()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def target_probs(params, logits, prompt, eos_token_ids=(), generated=(), pending=None, tokenizer=None):
    """The processed target distribution p of one sequence, through the engine's own processing: logits
    [n, vocab] after `prompt` then `generated` (+ pending draft tokens [m], row i seeing pending[:i]) -> [n, vocab].
    Penalties over the output (presence, frequency) count `generated`, not the prompt; structured output
    (params.structured) compiles its grammar with `tokenizer`."""
    from verispec.sampling import Grammar, RowSamplingState, SamplingBatch, process_logits, stable_softmax

    vocab = logits.shape[-1]
    grammar = None
    if params.structured is not None:
        grammar = Grammar(params.structured, tokenizer, vocab, eos_token_ids)
    state = RowSamplingState(params, set(eos_token_ids), list(prompt), vocab, "cpu", grammar)
    state.commit(list(generated))
    batch = SamplingBatch.stack([state], vocab, "cpu")
    pending = None if pending is None else torch.as_tensor(pending, dtype=torch.long).view(1, -1)
    return stable_softmax(process_logits(logits.unsqueeze(0), batch, pending))[0]


def sample_first_tokens(engine, target, prompt: list[int], temperature: float = 1.5, runs: int = 400):
    """Sample the first generated token `runs` times (seeds 0..runs-1) through `engine`; -> (counts [vocab], the
    target's processed distribution p [vocab] at that position), for `chisquare_pvalue`."""
    from verispec.config import SamplingParams

    with torch.no_grad():
        logits = target(torch.tensor([prompt])).logits[0, -1]  # [vocab]
    params = SamplingParams(max_new_tokens=2, temperature=temperature, ignore_eos=True)
    p = target_probs(params, logits.unsqueeze(0), prompt, engine.eos_token_ids)[0]  # [vocab]
    counts = torch.zeros_like(p)
    for seed in range(runs):
        seeded = SamplingParams(max_new_tokens=2, temperature=temperature, ignore_eos=True, seed=seed, coupled=False)
        counts[engine.generate(prompt, seeded).token_ids[0]] += 1
    return counts, p


def count_stage_rounds(cascade) -> dict[str, int]:
    """Wrap a CascadeDrafter's propose to count, by stage name, the rounds each stage drafted (live dict)."""
    counts = {stage.name: 0 for stage in cascade.stages}
    propose = cascade.propose

    def counting(batch):
        proposals = propose(batch)
        for proposal, stage in zip(proposals, cascade.last_stages):
            if proposal.token_ids.numel():
                counts[stage.name] += 1
        return proposals

    cascade.propose = counting
    return counts


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def trained_pair(tokenizer):
    """(target, draft): a Llama target and a smaller Llama draft, both trained briefly on the same text."""
    target = train_on_corpus(tiny_llama(10, hidden=64, layers=2), tokenizer, steps=150)
    draft = train_on_corpus(tiny_llama(11, hidden=32, layers=1), tokenizer, steps=60)
    return target, draft


@pytest.fixture(scope="session")
def small_pair(tokenizer):
    """(target, draft): a smaller trained Llama pair (hidden 48 / one layer, fewer steps), for tests that build many
    engines. Shared: a test that changes a model (dtype, weights) works on a copy."""
    return (train_on_corpus(tiny_llama(30, hidden=48), tokenizer, steps=60),
            train_on_corpus(tiny_llama(31, layers=1), tokenizer, steps=30))


@pytest.fixture(scope="session")
def trained_head(trained_pair, tokenizer, tmp_path_factory):
    """A head trained for a few seconds on the trained tiny target's own greedy continuations of the corpus (its
    folder, as `save_head` writes it; tests/drafters/test_head.py checks the training's figures here)."""
    from verispec.distill.head import HeadNet, draft_vocabulary, extract_features, heldout_accuracy, train_head
    from verispec.distill.head_pipeline import split_holdout
    from verispec.distill.teacher import Sample
    from verispec.drafters.head import HeadConfig, save_head

    target, _ = trained_pair
    ids = tokenizer(CORPUS)["input_ids"]
    samples = []
    with torch.no_grad():
        for start in range(0, 160, 8):
            prompt = ids[start : start + 12]
            out = target.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt):]
            samples.append(Sample("corpus", torch.tensor(prompt, dtype=torch.int32), out.to(torch.int32),
                                  torch.zeros(0), torch.zeros(0)))
    folder = tmp_path_factory.mktemp("head")
    features = extract_features(target, samples, folder / "features", progress=False)
    vocab, coverage = draft_vocabulary(samples, 40, target.config.vocab_size, {EOS_ID})
    assert coverage == 1.0
    config = HeadConfig.for_target(target.config, "tiny", len(vocab))
    net = HeadNet(config, target, vocab, seed=0)
    train, holdout = split_holdout(samples, features, 2)
    assert len(train[0]) == 18 and len(holdout[0]) == 2 and not {id(s) for s in holdout[0]} & {id(s) for s in train[0]}
    untrained = heldout_accuracy(net, *holdout, unroll=2, train_length=128)
    stats = train_head(net, *train, steps=120, lr=3e-3, batch_tokens=1024, train_length=128, unroll=2,
                       seed=0, checkpoint=folder / "head.pt", holdout=holdout, progress=False, log=lambda *_: None)
    assert stats["final"]["acc0"] > 0.5, stats["final"]
    # Held-out figures at each checkpoint (steps 100 and 120): the samples it never saw, answer positions only.
    heldout = stats["heldout_accuracy_by_step"]
    assert [h["step"] for h in heldout] == [100, 120]
    assert heldout[-1]["accuracy"] == heldout_accuracy(net, *holdout, unroll=2, train_length=128)
    assert heldout[-1]["accuracy"][0] > untrained[0] + 0.2, (untrained, heldout)
    save_head(folder / "out", config, net.export(), torch.float32)
    return folder / "out"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer, trained_pair):
    """The trained pair saved as Hugging Face folders (what the CLI and server load)."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in zip(("target", "draft"), trained_pair):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    odd = tiny_llama(12, vocab=VOCAB + 7)  # a draft whose vocabulary does not match
    odd.save_pretrained(root / "odd_vocab")
    tokenizer.save_pretrained(root / "odd_vocab")
    paths["odd_vocab"] = root / "odd_vocab"
    return paths


@pytest.fixture(scope="session")
def json_dirs(tmp_path_factory):
    """A target and a draft whose vocabulary spells JSON, trained briefly on the usual corpus (saved as folders)."""
    tokenizer = make_tokenizer(JSON_CHARS)
    vocab = len(tokenizer)
    models = {"target": train_on_corpus(tiny_llama(20, hidden=64, vocab=vocab), tokenizer, steps=150),
              "draft": train_on_corpus(tiny_llama(21, hidden=32, layers=1, vocab=vocab), tokenizer, steps=60)}
    root = tmp_path_factory.mktemp("json_models")
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {name: root / name for name in models}


def draft_batch(token_lists, ks, params=None, vocab: int = VOCAB, thresholds=None, seed: int = 0):
    """A DraftBatch of rows (slot i = row i) continuing `token_lists`, asking ks[i] draft tokens of each."""
    from verispec.config import SamplingParams
    from verispec.drafters.base import DraftBatch, DraftRow
    from verispec.sampling import RowSamplingState, SamplingBatch

    params = params or [SamplingParams()] * len(token_lists)
    rows, states = [], []
    for i, (tokens, k, p) in enumerate(zip(token_lists, ks, params)):
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        generator = torch.Generator().manual_seed(seed + i)
        rows.append(DraftRow(tokens, k, i, generator, True, thresholds[i] if thresholds else 0.0))
        states.append(RowSamplingState(p, set(), tokens.tolist(), vocab, "cpu"))
    return DraftBatch(rows, SamplingBatch.stack(states, vocab, "cpu"))


def propose_one(drafter, tokens, k, params=None, vocab: int = VOCAB, threshold: float = 0.0):
    """One row's proposal (slot 0) from `drafter`; a stateful drafter must have been begun on slot 0."""
    return drafter.propose(draft_batch([tokens], [k], [params] if params else None, vocab,
                                       [threshold]))[0]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): a tiny model's matmuls
    only wait on each other with several threads on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
