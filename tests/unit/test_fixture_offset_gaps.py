"""The replica tests' diagnostic of events missing from a topic: which offsets were not read."""

from __future__ import annotations

from tests.fixtures.broker import KafkaRecord, offset_gaps


def _records(partition: int, offsets: list[int]) -> list[KafkaRecord]:
    return [KafkaRecord(topic="t", partition=partition, offset=o, key=None, value=None, headers={},
                        timestamp_ms=None) for o in offsets]


def test_holes_in_the_offsets_read_are_reported_per_partition() -> None:
    records = _records(0, [0, 1, 2, 3]) + _records(1, [2, 3, 7, 8, 8]) + _records(2, [0])
    assert offset_gaps(records) == {
        0: {"read": 4, "max_offset": 3, "gaps": []},  # everything the broker held was read
        1: {"read": 5, "max_offset": 8, "gaps": [(0, 1), (4, 6)]},  # a duplicate read counts once
        2: {"read": 1, "max_offset": 0, "gaps": []},
    }
