"""`round_origins`: how each committed token of a round was decided (the server's `speculative.annotate`)."""

from verispec.engine.sequence import TokenOrigin, round_origins


def test_round_origins():
    assert [o.origin for o in round_origins("ngram", 3, 4, 2, False, 3)] == ["accepted", "accepted", "recovered"]
    assert [o.origin for o in round_origins("model", 1, 2, 2, True, 3)] == ["accepted", "accepted", "bonus"]
    assert round_origins("model", 1, 4, 0, False, 1) == [TokenOrigin("recovered", "model", 1, 4)]
    assert round_origins(None, 5, 0, 0, True, 1) == [TokenOrigin("target", None, 5, 0)]
    assert len(round_origins("model", 1, 4, 4, True, 2)) == 2  # a stop keeps the tokens before it
