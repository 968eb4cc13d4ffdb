"""`BenchSettings`: what one `verispec bench` run measures (the K sweep or the batch-size sweep), shared by the
timed loop (suite.py), the batch sweep (batching.py) and the report."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import StructuredOutput

BATCH_FAMILIES = ("target", "adaptive")  # the methods of the batch-size sweep: the target alone and adaptive K


@dataclass
class BenchSettings:
    max_new_tokens: int = 128
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    families: list[str] = field(default_factory=lambda: ["target", "verispec", "adaptive", "hf-assisted", "hf-target"])
    seed: int = 0
    warmup_tokens: int = 32  # one warm-up generation per method, on the first prompt, not timed
    probe_repeats: int = 5  # timed repeats per width in the cost probe (0: no prediction)
    progress: bool = True
    batch_sizes: list[int] | None = None  # the batch-size sweep (batching.py) instead of the K sweep; None: K sweep
    structured: StructuredOutput | None = None  # an output constraint for our methods (HF's are skipped)
    tree_nodes: int = 16  # the node budget of the 'tree' and 'adaptive-tree' methods
    also_drafters: list[str] = field(default_factory=list)  # more drafters, each an adaptive method 'adaptive[NAME]'
    busy: int = 0  # > 0: every run again beside this many busy processes (bench/busy.py), busy / quiet reported

    def busy_conditions(self) -> list[int]:
        """Busy processes of each run, in order: quiet, then (with `busy`) beside them."""
        return [0, self.busy] if self.busy else [0]

    def batch_methods(self) -> list[str]:
        """The batch sweep's methods: those of BATCH_FAMILIES that --methods names, the target alone always (the
        baseline of scaling and of greedy equality)."""
        return [f for f in BATCH_FAMILIES if f == "target" or f in self.families]

    def to_dict(self) -> dict:
        if self.batch_sizes:
            mode = {"mode": "batch sizes", "batch_sizes": self.batch_sizes, "methods": self.batch_methods()}
        else:
            mode = {"mode": "K sweep", "ks": self.ks, "methods": self.families, "probe_repeats": self.probe_repeats}
            if self.also_drafters:
                mode["also_drafters"] = self.also_drafters
            if any(f in ("tree", "adaptive-tree") for f in self.families):
                mode["tree_nodes"] = self.tree_nodes
        count = ("generated tokens, prompt excluded; EOS masked so every method generates exactly max_new_tokens"
                 if self.structured is None else "generated tokens, prompt excluded; each output ends where its "
                 "constraint completes (identical for our methods, which all decode greedily)")
        if self.busy:
            mode["busy"] = self.busy
        out = {**mode, "max_new_tokens": self.max_new_tokens, "seed": self.seed, "warmup_tokens": self.warmup_tokens,
               "token_count": count, "decoding": "greedy"}
        if self.structured is not None:
            out["structured_output"] = self.structured.kind
        return out
