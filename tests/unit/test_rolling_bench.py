"""The rolling-restart bench's arithmetic (outbox_embedded/rolling_bench.py figures): which
events count before and during the restarts, the worst at each hand-over, and the events
missing from or duplicated in the topic."""

from __future__ import annotations

from outbox_embedded.rolling_bench import figures


def test_figures_split_the_events_around_the_restarts_and_count_copies() -> None:
    committed = {"a": 10.0, "b": 10.5, "c": 11.2, "d": 12.0, "e": 13.5, "f": 20.0}
    marked = {"a": 10.05, "b": 10.6, "c": 12.2, "d": 12.1, "e": 13.52}  # f never marked
    copies = {"a": 1, "b": 2, "c": 1, "d": 3, "e": 1, "other": 5}  # f never sent
    f = figures(committed, marked, copies, stops=[11.0, 13.0], gap_s=2.0)
    assert f["events"] == 6
    assert f["missing"] == 1  # f
    assert f["duplicates"] == 3  # b once, d twice; another topic's event is not counted
    assert f["ack_ms_before"]["max"] == 100.0  # a 50 ms, b 100 ms
    assert f["ack_ms_during"]["max"] == 1000.0  # c, d and e, committed in [11, 15)
    assert f["ack_ms_during"]["p50"] == 100.0
    # c (1,000 ms) and d (100 ms) follow the first stop; e (20 ms) the second.
    assert [round(w) for w in f["worst_ack_ms_per_hand_over"]] == [1000, 20]
