"""The bench's baselines and the relay's drain share rounds (outbox_embedded/bench.py
``_baselines``): the order rotates from round to round and each ratio is taken inside its
round, so a machine that speeds up or slows down between rounds moves a ratio less."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from outbox_embedded import baselines, bench


class FakeBench:
    """Stands in for the processes and databases; the machine gets faster at every step."""

    def __init__(self) -> None:
        self.args = argparse.Namespace(rows=10, keys=2, payload_bytes=8, batch_size=5)
        self.topic = "t"
        self.bootstrap = "broker:9092"
        self.order: list[str] = []
        self.speed = 1.0

    def _step(self, what: str, base: float) -> dict[str, float]:
        self.order.append(what)
        rate = base * self.speed
        self.speed *= 2  # a drift far larger than any real one: it shows in the ratios
        return {"events_per_s": rate, "cpu_us_per_row": 10.0}

    @contextlib.contextmanager
    def fresh_db(self) -> Iterator[str]:
        yield "dsn"

    def relay_drain(self, *, idle_s: float = 0.0) -> dict[str, float]:
        figures = self._step("relay", 300.0)
        figures["idle_s"] = idle_s
        return figures


def test_each_round_runs_all_three_in_a_rotating_order_and_ratios_stay_inside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeBench()

    def plain_loop(dsn: str, *, bootstrap: str | None, **_: Any) -> dict[str, float]:
        return fake._step("naive" if bootstrap else "floor", 200.0 if bootstrap else 600.0)

    monkeypatch.setattr(baselines, "plain_loop", plain_loop)
    figures, drains = bench._baselines(fake, 3, idle_s=7.0)  # type: ignore[arg-type]

    assert fake.order == ["floor", "naive", "relay", "naive", "relay", "floor", "relay", "floor", "naive"]
    assert [d["idle_s"] for d in drains] == [7.0, 0.0, 0.0]  # only the first drain idles first
    # Each ratio from its own round, at that round's speeds: round 1 floor 600 x 1, naive
    # 200 x 2, relay 300 x 4 -> 3.0 x naive, 2.0 x the floor; round 2 naive 200 x 8, relay
    # 300 x 16, floor 600 x 32 -> 3.0, 0.25; round 3 relay 300 x 64, floor 600 x 128,
    # naive 200 x 256 -> 0.375, 0.25.
    assert figures["ratio_to_naive_runs"] == [3.0, 3.0, 0.375]
    assert figures["ratio_to_floor_runs"] == [2.0, 0.25, 0.25]
    assert figures["ratio_to_naive"] == 3.0 and figures["ratio_to_floor"] == 0.25
    assert figures["naive_relay_events_per_s"] == 1600.0  # the runs' own medians, shown too


class FakeScaleBench:
    """``scale_out`` with a rate per replica count, the machine twice as fast at every drain."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.speed = 1.0

    def scale_out(self, replicas: int, *, settled: bool = True) -> float:
        assert settled is False or settled is True
        self.order.append(replicas)
        rate = {1: 100.0, 2: 150.0, 4: 120.0}[replicas] * self.speed
        self.speed *= 2
        return rate


def test_scale_out_runs_every_count_each_round_in_a_rotating_order_and_ratios_stay_inside_it() -> None:
    fake = FakeScaleBench()
    figures = bench._scale_out(fake, [1, 2, 4], 3, settled=True)  # type: ignore[arg-type]

    assert fake.order == [1, 2, 4, 2, 4, 1, 4, 1, 2]
    # Round 1: 1 at 100 x 1, 2 at 150 x 2, 4 at 120 x 4 -> 3.0 and 4.8; round 2: 2 at 150 x 8,
    # 4 at 120 x 16, 1 at 100 x 32 -> 0.375 and 0.6; round 3: 4 at 120 x 64, 1 at 100 x 128,
    # 2 at 150 x 256 -> 3.0 and 0.6.
    assert figures["ratio_runs"] == {"1": [1.0, 1.0, 1.0], "2": [3.0, 0.375, 3.0], "4": [4.8, 0.6, 0.6]}
    assert figures["ratio"] == {"1": 1.0, "2": 3.0, "4": 0.6}
    assert figures["events_per_s_runs"]["1"] == [100.0, 3200.0, 12800.0]
    assert figures["events_per_s"] == {"1": 3200.0, "2": 1200.0, "4": 1920.0}  # each count's median


@pytest.mark.parametrize(("given", "error"), [
    ("x", "'x' is not a whole number of replicas"),
    ("1,0", "0: a drain needs at least 1 replica"),
    ("1,-2", "-2: a drain needs at least 1 replica"),
    ("1,2,1", "1 is given twice"),
])
def test_bad_replica_counts_are_refused_when_the_options_are_read(
        given: str, error: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="outbox-relay bench")
    bench.add_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--replicas", given])
    assert exited.value.code == 2
    assert f"argument --replicas: {error}" in capsys.readouterr().err


def test_replica_counts_default_and_empty() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).replicas == [1, 2, 4]
    assert parser.parse_args(["--replicas", ""]).replicas == []  # '' skips the scale-out
    assert parser.parse_args(["--replicas", " 4, 1 "]).replicas == [4, 1]


class FakeDrainBench:
    """``relay_drain`` at the same rate with or without published rows, the machine twice as
    fast at every drain."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.speed = 1.0

    def relay_drain(self, *, published_rows: int = 0) -> dict[str, float]:
        self.order.append(published_rows)
        rate = 500.0 * self.speed
        self.speed *= 2
        return {"events_per_s": rate}


def test_the_published_rows_drain_is_compared_with_an_empty_table_s_drain_of_its_own_round() -> None:
    fake = FakeDrainBench()
    figures = bench._published_rows(fake, 3, 1_000_000)  # type: ignore[arg-type]

    assert fake.order == [0, 1_000_000, 1_000_000, 0, 0, 1_000_000]
    # Published rows cost nothing here: each round's ratio is only the drift between its two
    # drains (x2 after the empty one, x0.5 before it), never that of the whole run.
    assert figures["published_rows_slowdown_runs"] == [2.0, 0.5, 2.0]
    assert figures["published_rows_slowdown"] == 2.0
    assert figures["relay_events_per_s_with_published_rows"] == 2000.0  # 1000 / 2000 / 16000
    assert figures["relay_events_per_s_beside_published_rows"] == 4000.0  # 500 / 4000 / 8000
