"""GenerationStats' derived figures that reports and the bench read (stats.py)."""

from verispec.stats import GenerationStats


def test_rounds_by_k_counts_each_rounds_draft_length():
    stats = GenerationStats()
    for proposed, accepted in [(4, 2), (4, 4), (0, 0), (2, 1), (1, 0), (0, 0)]:
        stats.record_round(proposed, accepted, accepted + 1)
    assert stats.rounds_by_k == [2, 1, 1, 0, 2]  # K = 0, 1, 2, 3, 4
    assert sum(stats.rounds_by_k) == stats.rounds
    assert stats.to_dict()["rounds_by_k"] == [2, 1, 1, 0, 2]
    assert GenerationStats().rounds_by_k == [0]
