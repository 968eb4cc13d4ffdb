"""The draft memory check: sizes from headers and configs (nothing loaded), free memory, and the verdict."""

import math
import sys

import pytest
import torch

from conftest import tiny_gpt2, tiny_llama
from verispec.runtime.model import memory
from verispec.runtime.model.memory import check_draft_memory, free_memory_bytes, kv_cache_bytes, weights_bytes
from verispec.runtime.model.llama import LlamaSpec


def unique_param_bytes(model, bytes_per_element=4):
    return bytes_per_element * sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory-models")
    models = {"llama": tiny_llama(40), "gpt2": tiny_gpt2(41)}  # gpt2 ties its input and output embeddings
    for name, model in models.items():
        model.save_pretrained(root / name)
    return root, models


def test_kv_cache_bytes_by_hand():
    llama = tiny_llama(1).config  # 2 layers, 4 heads, 2 kv heads, hidden 32 -> head_dim 8
    assert kv_cache_bytes(llama, 100) == 2 * 2 * 2 * 8 * 100 * 4
    assert kv_cache_bytes(llama, 100, torch.bfloat16) == 2 * 2 * 2 * 8 * 100 * 2
    gpt2 = tiny_gpt2(1).config  # no kv heads: every head keeps keys and values
    assert kv_cache_bytes(gpt2, 10) == 2 * 2 * 4 * 8 * 10 * 4


def test_weights_bytes_from_safetensors_headers(saved):
    root, models = saved
    for name, model in models.items():
        assert weights_bytes(root / name) == unique_param_bytes(model)
        assert weights_bytes(root / name, torch.bfloat16) == unique_param_bytes(model, 2)
    assert weights_bytes(root / "missing") is None
    (root / "no_weights").mkdir(exist_ok=True)
    assert weights_bytes(root / "no_weights") is None


def test_free_memory_host_psutil_and_proc_meminfo(monkeypatch):
    measured = free_memory_bytes("cpu")
    assert isinstance(measured, int) and measured > 0
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` now raises ImportError
    from_proc = free_memory_bytes("cpu")
    assert isinstance(from_proc, int) and from_proc > 0


def test_free_memory_gpu_uses_mem_get_info(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    assert free_memory_bytes("cuda") == 3 * 2**30
    assert free_memory_bytes("cuda:0") == 3 * 2**30


def test_check_draft_memory_verdicts(saved, monkeypatch):
    root, models = saved
    draft, target = models["gpt2"].config, models["llama"].config
    need = unique_param_bytes(models["gpt2"]) + kv_cache_bytes(draft, 512) + kv_cache_bytes(target, 512)
    fits = check_draft_memory(root / "gpt2", draft, target, 512, free_bytes=2 * need)
    assert fits.fits and fits.needed_bytes == need
    short = check_draft_memory(root / "gpt2", draft, target, 512, free_bytes=need)  # no headroom left
    assert not short.fits and "needs" in str(short) and "host memory is free" in str(short)
    # the target not loaded yet: its weights count too
    both = check_draft_memory(root / "gpt2", draft, target, 512, free_bytes=2 * need, target_path=root / "llama")
    assert both.needed_bytes == need + unique_param_bytes(models["llama"])
    # measured free memory, mocked: a GPU with 1 KiB free
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 1024)
    gpu = check_draft_memory(root / "gpt2", draft, target, 512, device="cuda")
    assert not gpu.fits and "GPU memory" in gpu.detail


def test_unknown_sizes_do_not_block(saved):
    root, models = saved
    config = models["llama"].config
    unknown = check_draft_memory(root / "no_weights_here", config, config, 512, free_bytes=1)
    assert unknown.fits and "skipped" in unknown.detail


@pytest.mark.parametrize("name, qtype, head", [("self:int8", "int8", None), ("self:int4", "Q4_1", None),
                                               ("self:q8_0", "Q8_0", None), ("self:int8:v20", "int8", 20),
                                               ("self:q4_0:v40", "Q4_0", 40)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_twin_bytes_from_the_config_equal_the_built_twins(name, qtype, head, arch):
    """The quantized twin has no files: its size comes from the target's config, exactly what it holds once built
    (drafters/twin.py), and its KV cache is the target's per slot."""
    from conftest import tiny_qwen2
    from verispec.drafters.twin import TwinDrafter, twin_memory_bytes

    target = (tiny_llama if arch == "llama" else tiny_qwen2)(3, hidden=64)
    built = TwinDrafter(target, name, 64).weight_bytes()
    assert memory.twin_weight_bytes(LlamaSpec.from_config(target.config, 64), qtype, head) == built
    assert twin_memory_bytes(name, target.config, 100, 3, torch.bfloat16) == built + 3 * kv_cache_bytes(
        target.config, 100, torch.bfloat16)


def test_a_twin_that_does_not_fit_is_left_out_of_a_cascade_with_a_warning(tokenizer):
    from verispec.drafters.build import build_drafter
    from verispec.drafters.twin import TwinDrafter

    target = tiny_llama(3, hidden=64)
    short = build_drafter("ngram+self:int8", target, tokenizer, 64, on_error="fallback", free_bytes=1024)
    assert short.name == "ngram" and "self:int8 not used (not enough memory: the twin needs" in short.warning
    roomy = build_drafter("ngram+self:int8", target, tokenizer, 64, on_error="fallback", free_bytes=2**34)
    assert roomy.warning is None and isinstance(roomy.drafter.stages[1], TwinDrafter)


def served_model(target, **config):
    """A `ServedModel` with what its drafter guard reads (`_make_room`): config, target, slots, an empty cache, and a
    target cache that has allocated nothing yet."""
    from types import SimpleNamespace

    from verispec.server import served as runtime

    served = runtime.ServedModel.__new__(runtime.ServedModel)
    served.config = SimpleNamespace(**{"max_len": 64, "dtype": torch.float32, "device": "cpu", "draft_device": None,
                                       **config})
    served.target, served.max_num_seqs, served._cache = target, 4, {}
    served.engine = SimpleNamespace(target=SimpleNamespace(cache=SimpleNamespace(layers=[])))
    return served


def test_the_servers_guard_counts_a_twin_and_refuses_one_that_does_not_fit(monkeypatch):
    """server/served.py's guard before a request's drafter loads: the twin's weights and its KV cache for every
    slot count (it has no files to read); 503 when they do not fit, nothing checked for n-gram."""
    from verispec.server import served as runtime
    from verispec.server.errors import APIError

    target = tiny_llama(3, hidden=64)
    served = served_model(target)
    spoken_for = 4 * runtime.kv_slot_bytes(served.config, target)  # the target's slots, not allocated yet
    need = memory.twin_bytes(target.config, "int8", None, runtime.cache_len(64), 4, torch.float32)
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: int((need + spoken_for) / memory.HEADROOM) + 64)
    runtime.ServedModel._make_room(served, "twin", "ngram+self:int8")  # fits, just
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: int((need + spoken_for) / memory.HEADROOM) - 64)
    with pytest.raises(APIError) as info:
        runtime.ServedModel._make_room(served, "twin", "ngram+self:int8")
    assert info.value.status == 503 and "`twin` needs" in str(info.value.message)
    runtime.ServedModel._make_room(served, "ngram", "ngram")  # nothing to count


def test_the_servers_guard_reads_free_memory_on_the_draft_device(monkeypatch, saved):
    """A draft model on its own device (--draft-device) is checked against that device's free memory, not the
    target's; the target's slots still to come are spoken for on the target's device only."""
    from verispec.server import served as runtime
    from verispec.server.errors import APIError

    root, _ = saved
    served = served_model(tiny_llama(3, hidden=64), draft_device="cuda:1")
    draft = str(root / "llama")
    need = weights_bytes(root / "llama") + 4 * kv_cache_bytes(tiny_llama(40).config, runtime.cache_len(64))
    asked = []

    def free_on(target_free, draft_free):
        def free(device):
            asked.append(str(device))
            return {"cpu": target_free, "cuda:1": draft_free}[str(device)]
        return free

    monkeypatch.setattr(runtime, "free_memory_bytes", free_on(1024, int(need / memory.HEADROOM) + 64))
    runtime.ServedModel._make_room(served, "draft", draft)  # fits on cuda:1, however full the target's device is
    assert asked == ["cuda:1"]
    monkeypatch.setattr(runtime, "free_memory_bytes", free_on(2**40, int(need / memory.HEADROOM) - 64))
    with pytest.raises(APIError) as info:
        runtime.ServedModel._make_room(served, "draft", draft)
    assert info.value.status == 503 and "on cuda:1" in str(info.value.message)
    served.config.draft_device = None  # on the target's device: its slots still to come count against it
    spoken_for = 4 * runtime.kv_slot_bytes(served.config, served.target)
    monkeypatch.setattr(runtime, "free_memory_bytes", free_on(int((need + spoken_for) / memory.HEADROOM) - 64, 0))
    with pytest.raises(APIError):
        runtime.ServedModel._make_room(served, "draft", draft)
    monkeypatch.setattr(runtime, "free_memory_bytes", free_on(int((need + spoken_for) / memory.HEADROOM) + 64, 0))
    runtime.ServedModel._make_room(served, "draft", draft)


def test_a_gguf_files_weights_as_stored_or_converted():
    """A GGUF draft on the CPU runs its own blocks: the memory check counts the file's tensor bytes; converted, its
    elements in the dtype."""
    from verispec.runtime.model.loading import smollm2_gguf_path
    from verispec.runtime.model.memory import weights_bytes
    from verispec.runtime.weights.gguf_file import open_gguf

    path = smollm2_gguf_path()
    tensors = open_gguf(path).tensors
    assert weights_bytes(path, torch.float32, stored=True) == sum(t.nbytes for t in tensors)
    assert weights_bytes(path, torch.float32) == 4 * sum(math.prod(t.shape) for t in tensors)
    assert weights_bytes(path, torch.float32, stored=True) < path.stat().st_size < weights_bytes(path, torch.float32)
