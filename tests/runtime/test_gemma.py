"""Gemma 3 on the native runner (runtime/model/gemma.py) against Hugging Face's Gemma3ForCausalLM: logits of prefill,
decode steps past the sliding window, ragged rows and a token tree within 1e-4 (fp32: the same math in another
order), with a negative control (the window ignored) that must fail; a Gemma 3 GGUF file (Q8_0 / Q5_0 blocks, the
norms stored + 1 as llama.cpp writes them) built natively equals Hugging Face on its dequantized values; a row's
logits are bitwise the same alone and in a batch; greedy speculation equals the target alone; sampled speculation
follows the target's distribution (the statistical check of test_sampling_exactness.py on a Gemma target)."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf.quants import dequantize
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from conftest import VOCAB, _common
from test_sampling_exactness import NEW_TOKENS, _sample, exact_joint, tvd_bound
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.model import ModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.gemma import GemmaModel
from verispec.runtime.runners.native import NativeRunner

ATOL = 1e-4
WINDOW = 6  # sliding layers see 6 entries: prompts of 12 and decode steps to 20 run well past it


def tiny_gemma(seed: int, hidden: int = 64, layers: int = 4, vocab: int = VOCAB, window: int = WINDOW,
               scalar: int = 24, softcap: float | None = 30.0, **extra) -> Gemma3ForCausalLM:
    """Sliding and global layers alternating, bases 100 / 10000, a query scalar (24) other than the head dim (16),
    a final soft-cap, random norms (fresh ones are zeros: 1 + w would hide a misplaced norm)."""
    torch.manual_seed(seed)
    fields = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, query_pre_attn_scalar=scalar,
                  sliding_window=window, max_position_embeddings=256, final_logit_softcapping=softcap,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                  **_common(vocab))
    fields.update(extra)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:  # [n, vocab]: every position of one full forward
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_logits_match_hf_in_prefill_decode_past_the_window_ragged_rows_and_a_tree():
    model = tiny_gemma(3)
    native = NativeRunner.from_hf(model, 64, 3)
    assert isinstance(native.model, GemmaModel)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (12, 3, 9)]
    for slot, seq in enumerate(seqs):  # ragged prefill, one slot each
        out = native.forward(torch.tensor([seq]), start_slot=slot).logits[0]
        torch.testing.assert_close(out, hf_logits(model, seq), atol=ATOL, rtol=0)
    for _ in range(8):  # decode steps of all three rows together, each past its window
        nxt = torch.randint(0, VOCAB, (3, 1), generator=g)
        out = native.forward(nxt).logits[:, 0]
        for row, seq in enumerate(seqs):
            seq.append(nxt[row, 0].item())
            torch.testing.assert_close(out[row], hf_logits(model, seq)[-1], atol=ATOL, rtol=0)
    # a verify pass as a tree after rollback: 0 -> 1, 0 -> 2 -> 3, at positions length + depth
    for slot, keep in enumerate((17, 6, 15)):
        native.truncate(keep, slot)
        seqs[slot] = seqs[slot][:keep]
    tokens = torch.randint(0, VOCAB, (3, 4), generator=g)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    lengths = torch.tensor(native.lengths[:3]).view(3, 1)
    out = native.forward(tokens, tree_mask=tree.expand(3, 4, 4), positions=lengths + torch.tensor([0, 1, 1, 2]),
                         logits_at=torch.tensor([[1, 3]] * 3)).logits  # [3, 2, vocab]
    for row, seq in enumerate(seqs):
        t = tokens[row].tolist()
        torch.testing.assert_close(out[row, 0], hf_logits(model, seq + [t[0], t[1]])[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out[row, 1], hf_logits(model, seq + [t[0], t[2], t[3]])[-1], atol=ATOL, rtol=0)


def test_the_check_fails_when_the_window_is_ignored():
    """Negative control: the same weights with the sliding window past every sequence must differ from Hugging Face's
    windowed model once a sequence is longer than the window (so the test above checks the window)."""
    model = tiny_gemma(3)
    unwindowed = tiny_gemma(3, window=1000)
    unwindowed.load_state_dict(model.state_dict())
    seq = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    out = NativeRunner.from_hf(unwindowed, 64, 1).forward(torch.tensor([seq])).logits[0]
    assert (out[WINDOW:] - hf_logits(model, seq)[WINDOW:]).abs().max() > 100 * ATOL
    torch.testing.assert_close(out[:WINDOW], hf_logits(model, seq)[:WINDOW], atol=ATOL, rtol=0)


def test_a_row_is_bitwise_the_same_alone_and_in_a_batch():
    model = tiny_gemma(4)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (11, 4, 8)]
    drafts = torch.randint(0, VOCAB, (3, 5), generator=g)  # a verify-like pass of 5 tokens a row
    batch = NativeRunner.from_hf(model, 64, 3, batch_invariant=True)
    for slot, prompt in enumerate(prompts):
        batch.forward(prompt.view(1, -1), start_slot=slot)
    together = batch.forward(drafts).logits
    for row, prompt in enumerate(prompts):
        alone = NativeRunner.from_hf(model, 64, 1, batch_invariant=True)
        alone.forward(prompt.view(1, -1))
        steps = torch.cat([alone.forward(drafts[row, t].view(1, 1)).logits for t in range(5)], dim=1)
        assert torch.equal(together[row], steps[0]), row


@pytest.mark.parametrize("drafter_kind", ["identical", "other-model", "ngram", "twin", "twin-reduced-head"])
def test_greedy_speculation_equals_the_target_alone(drafter_kind, tokenizer):
    """Drafts all accepted (the target drafting for itself), mostly rejected (another model), n-gram, and the
    target's quantized twin (whole head, and reduced to 40 token ids)."""
    from verispec.generator import SpeculativeGenerator

    target = tiny_gemma(5)
    draft = {"identical": target, "other-model": tiny_gemma(6, hidden=32, layers=2), "ngram": "ngram",
             "twin": "self:int8", "twin-reduced-head": "self:int8:v40"}[drafter_kind]
    gen = SpeculativeGenerator(target, draft, tokenizer, K=4, max_len=128)
    assert gen.engine.target.backend == "native"
    for text in ("the cat sat on the mat, the cat sat on", "one two three"):
        prompt = tokenizer(text)["input_ids"]
        spec = gen.generate(prompt, max_new_tokens=30, ignore_eos=True, return_dict=True)
        alone = gen.generate(prompt, max_new_tokens=30, ignore_eos=True, speculative=False)
        assert spec.token_ids == alone
        if drafter_kind == "identical":
            assert spec.stats.rounds <= 30 // 5 + 1  # every draft accepted
        with torch.no_grad():  # and the target alone is Hugging Face's greedy output
            ids = torch.tensor([prompt])
            for _ in range(30):
                ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
        assert alone == ids[0, len(prompt):].tolist()


SAMPLES = 3000


def test_speculative_sampling_on_a_gemma_target_follows_its_distribution():
    """A 4-token Gemma target, a Gemma draft model that disagrees with it (logits soft-capped at 2: no token is
    certain), the sliding window (2) shorter than prompt + output: the first three tokens' empirical joint
    distribution within the sampling bound."""
    class Chars:
        eos_token_id = None

        def decode(self, ids, **kwargs):
            return "".join("abcd"[i] for i in ids)

    def peaky(seed):
        return tiny_gemma(seed, hidden=32, layers=2, vocab=4, window=2, softcap=2.0, initializer_range=0.2,
                          eos_token_id=None, bos_token_id=None, pad_token_id=None)

    target = peaky(0)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=3, top_p=0.95)
    engine = SpeculativeEngine(target, Chars(), None, SpeculativeConfig(num_draft_tokens=2), 64, max_batch_size=64)
    assert engine.target.backend == "native"
    counts, stats = _sample(engine, {"gemma": params}, {"gemma": ModelDrafter(peaky(1), 128)}, SAMPLES)
    joint = exact_joint(target, params)
    tvd = 0.5 * sum(abs(counts["gemma"].get(s, 0) / SAMPLES - p) for s, p in joint.items())
    bound = tvd_bound(4 ** NEW_TOKENS, SAMPLES)
    assert 0.05 < stats["gemma"].acceptance_rate < 0.9, "both the draft path and the residual path must run"
    assert tvd < bound, f"TVD {tvd:.4f} exceeds the sampling bound {bound:.4f}"


# -- a Gemma 3 GGUF file ------------------------------------------------------------------------------------------

GGUF_LAYER = {"self_attn.q_proj": ("attn_q", "Q5_0"), "self_attn.k_proj": ("attn_k", "Q5_0"),
              "self_attn.v_proj": ("attn_v", "Q8_0"), "self_attn.o_proj": ("attn_output", "Q8_0"),
              "mlp.gate_proj": ("ffn_gate", "Q5_0"), "mlp.up_proj": ("ffn_up", "Q5_0"),
              "mlp.down_proj": ("ffn_down", "Q8_0"), "input_layernorm": ("attn_norm", None),
              "post_attention_layernorm": ("post_attention_norm", None),
              "pre_feedforward_layernorm": ("ffn_norm", None), "post_feedforward_layernorm": ("post_ffw_norm", None),
              "self_attn.q_norm": ("attn_q_norm", None), "self_attn.k_norm": ("attn_k_norm", None)}


def write_gemma_gguf(model, path) -> dict[str, torch.Tensor]:
    """model as a Gemma 3 GGUF file as llama.cpp writes one (norms + 1, quantized linears, no q/k permutation)
    -> {HF name: the values transformers' conversion reads back}."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("block_count", cfg.num_hidden_layers), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim), ("attention.sliding_window", cfg.sliding_window)):
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32("gemma3.rope.freq_base", cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    values = {}
    for name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        if name == "lm_head.weight":
            continue
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            short, qtype = GGUF_LAYER[".".join(rest[:-1])]
            gguf_name = f"blk.{i}.{short}.weight"
        else:
            gguf_name, qtype = {"model.embed_tokens.weight": ("token_embd.weight", "Q8_0"),
                                "model.norm.weight": ("output_norm.weight", None)}[name]
        if qtype is None:  # a norm: llama.cpp stores 1 + w; the conversion subtracts 1 again
            writer.add_tensor(gguf_name, w + 1)
            values[name] = torch.from_numpy(w + 1) - 1
            continue
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
        values[name] = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[qtype]))
        writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


@pytest.mark.kernel("quant")
def test_a_gemma3_gguf_file_runs_natively_on_its_blocks_as_hf_on_their_values(tmp_path):
    """Six layers: llama.cpp's pattern (every sixth global), its attention scale (head_dim^-1/2) and the sliding
    layers' base 10000, which the file does not store; the logits within 1e-4 of Hugging Face on the file's values."""
    from verispec.runtime.kernels.quant import QuantWeight
    from verispec.runtime.model.native_lm import from_gguf

    model = tiny_gemma(7, layers=6, scalar=16, softcap=None, layer_types=None,
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    assert model.config.layer_types[5] == "full_attention" and model.config.layer_types[4] == "sliding_attention"
    values = write_gemma_gguf(model, tmp_path / "tiny-gemma3.gguf")
    model.load_state_dict(values, strict=False)
    native = from_gguf(tmp_path / "tiny-gemma3.gguf", activations="fp32")
    runner = NativeRunner.from_hf(native, 64, 1)
    assert isinstance(runner.model.layers[0].qkv.weight, QuantWeight)
    assert runner.model.spec.sliding == (True,) * 5 + (False,)
    seq = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    out = runner.forward(torch.tensor([seq[:10]])).logits[0]
    torch.testing.assert_close(out, hf_logits(model, seq[:10]), atol=ATOL, rtol=0)
    for t in range(10, 14):
        out = runner.forward(torch.tensor([[seq[t]]])).logits[0, -1]
        torch.testing.assert_close(out, hf_logits(model, seq[: t + 1])[-1], atol=ATOL, rtol=0)
