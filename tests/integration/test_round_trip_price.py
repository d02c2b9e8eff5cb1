"""The round trip's price, timed on a real PostgreSQL."""

from __future__ import annotations

from outbox_embedded.calibration import round_trip


def test_a_round_trip_has_a_wall_time_and_a_cpu_time(db_dsn: str) -> None:
    price = round_trip(db_dsn, 50)
    assert set(price) == {"wall_us", "cpu_us"}
    # A round trip waits on the server: it takes time, and the client's own CPU besides.
    assert price["wall_us"] > 0 and price["cpu_us"] > 0
    assert round_trip(db_dsn, 1)["wall_us"] > 0
