"""The served model's prefill budget: measured at start (engine/budget.py) and said in the log unless both the
chunk and the step budget are configured; the probe leaves the runner's slot empty."""

from __future__ import annotations

from verispec.engine.budget import CHUNK_WIDTHS
from verispec.server import ServerConfig
from verispec.server.served import ServedModel


def test_served_model_takes_the_measured_budget_unless_configured(model_dirs, caplog):
    with caplog.at_level("INFO", logger="verispec"):
        served = ServedModel.load(ServerConfig(model=str(model_dirs["target"]), max_len=256, max_num_seqs=2))
    chosen = served.prefill_budget
    assert chosen is not None and chosen.chunk_tokens in CHUNK_WIDTHS
    config = served.engine.scheduler.config
    assert (config.prefill_chunk_tokens, config.max_batched_tokens) == (chosen.chunk_tokens, chosen.max_batched_tokens)
    assert any("prefill chunks of" in r.getMessage() for r in caplog.records)
    assert served.engine.target.lengths[0] == 0  # the probe left its slot empty
    fixed = ServedModel.load(ServerConfig(model=str(model_dirs["target"]), max_len=256, max_num_seqs=2,
                                          prefill_chunk_tokens=8, max_batched_tokens=24))
    assert fixed.prefill_budget is None
    assert (fixed.engine.scheduler.config.prefill_chunk_tokens, fixed.engine.scheduler.config.max_batched_tokens) \
        == (8, 24)
