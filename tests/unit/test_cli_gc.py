"""`outbox-relay run` quiets CPython's cyclic garbage collector (issue 18's thirteenth pass:
it was 10 % of the relay's CPU in a drain): one collection, everything alive frozen out of
later ones, a youngest generation of GC_YOUNG_THRESHOLD objects.  Only the process's own
command does; importing the relay (tests, embedding) leaves the collector alone."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from relay import cli


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_the_collector_is_frozen_and_collects_less_often(restored_gc: None) -> None:
    _young, older, oldest = gc.get_threshold()
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    cli.quiet_garbage_collector()
    assert gc.get_freeze_count() > 1000  # the modules, classes and functions alive now
    assert gc.get_threshold() == (cli.GC_YOUNG_THRESHOLD, older, oldest)
    assert cli.GC_YOUNG_THRESHOLD > 700  # CPython's default

    class Cycle:
        other: Any = None

    a, b = Cycle(), Cycle()
    a.other, b.other = b, a  # a cycle the relay might make: still collected
    del a, b
    assert gc.collect() >= 2


def test_only_the_run_command_quiets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class FakeRelay:
        def __init__(self, settings: Any) -> None:
            calls.append("built")

        def run(self) -> int:
            calls.append("ran")
            return 0

    import relay.app

    monkeypatch.setattr(relay.app, "Relay", FakeRelay)
    monkeypatch.setattr(relay.app, "install_signal_handlers", lambda relay: None)
    monkeypatch.setattr(cli, "quiet_garbage_collector", lambda: calls.append("quieted"))
    monkeypatch.setattr(cli, "_configure_logs", lambda *args: None)  # the process's logs stay as they are
    env = {"OUTBOX_RELAY_DSN": "postgresql://relay@db.invalid/app",
           "OUTBOX_RELAY_BOOTSTRAP_SERVERS": "kafka.invalid:9092"}
    assert cli.main(["run"], env) == 0
    assert calls == ["built", "quieted", "ran"]
    calls.clear()
    assert cli.main(["migrate", "--print"], env) == 0
    assert calls == []
