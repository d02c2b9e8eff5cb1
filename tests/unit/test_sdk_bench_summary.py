"""The SDK bench's report: every ratio between the medians, in each round, and the median of the rounds'."""

from __future__ import annotations

import argparse

import pytest

from outbox_embedded.sdk_bench import RATIOS, parse_args, summarize


def _round(rate: float) -> dict[str, float]:
    return {"rate": rate, "cpu_us": 1.0, "jobs_per_round": 5.0}


def test_each_round_has_its_own_ratio_and_a_drifting_machine_shows_in_them() -> None:
    # The machine doubles its speed after the first round: every figure of a round moves together.
    results = {
        "naive_workers": [_round(1000), _round(2000), _round(2000)],
        "worker_pool": [_round(1400), _round(3400), _round(3200)],
        "naive_new": [_round(100), _round(200), _round(210)],
        "inbox_batch_bh_new": [_round(90), _round(150), _round(170)],
    }
    report = summarize(argparse.Namespace(runs=3), results)

    assert report["ratios_per_round"]["worker_pool_vs_naive"] == [1.4, 1.7, 1.6]
    assert report["ratios_round_median"]["worker_pool_vs_naive"] == 1.6
    assert report["ratios"]["worker_pool_vs_naive"] == 1.6  # 3200 / 2000: medians of different rounds
    assert report["worker_pool_vs_naive_per_run"] == [1.4, 1.7, 1.6]  # the earlier name, kept
    assert report["ratios_per_round"]["inbox_batch_bh_new_vs_naive"] == [0.9, 0.75, 0.81]
    assert report["ratios_round_median"]["inbox_batch_bh_new_vs_naive"] == 0.81
    assert report["ratios"]["inbox_batch_bh_new_vs_naive"] == 0.75  # 150 / 200
    # A ratio whose figures were not run is None between the medians and absent per round.
    assert report["ratios"]["inbox_single_new_vs_naive_single"] is None
    assert "inbox_single_new_vs_naive_single" not in report["ratios_per_round"]
    assert set(report["ratios"]) == set(RATIOS)
    assert report["jobs_per_claim_round"] == 5.0


def test_each_figure_is_also_given_in_its_own_rounds_round_trips() -> None:
    # The second round's machine is twice as slow: its round trip and its figures alike.
    results = {
        "naive_single_new": [_round(2000), _round(1000)],
        "inbox_single_new": [_round(2500), _round(1250)],
        "worker_pool": [_round(2000), _round(1000)],
    }
    trips = [{"wall_us": 100.0, "cpu_us": 50.0}, {"wall_us": 200.0, "cpu_us": 110.0}]
    report = summarize(argparse.Namespace(runs=2), results, trips)

    assert report["round_trip"]["wall_us"] == 150.0 and report["round_trip"]["cpu_us"] == 80.0
    assert report["round_trip"]["per_round"] == trips
    # 1e6 / 2500 = 400 us a message over 100 us a trip; the slow round says the same.
    assert report["in_round_trips"]["inbox_single_new"] == 4.0
    assert report["in_round_trips"]["naive_single_new"] == 5.0
    assert report["in_round_trips"]["worker_pool"] == 5.0


def test_without_round_trips_the_report_has_no_figures_in_them() -> None:
    report = summarize(argparse.Namespace(runs=1), {"naive_new": [_round(100)]})
    assert "round_trip" not in report and "in_round_trips" not in report


def test_a_negative_round_trip_count_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--round-trips", "-1"])
    assert parse_args(["--round-trips", "0"]).round_trips == 0


def test_db_spin_us_reaches_the_sdk_s_configs_only_when_given() -> None:
    from consumer_sdk import InboxConfig
    from consumer_sdk.jobs import WorkerConfig
    from outbox_embedded.sdk_bench import _spun

    assert parse_args([]).db_spin_us is None
    assert parse_args(["--db-spin-us", "0"]).db_spin_us == 0.0
    inbox = InboxConfig(name="b", bootstrap_servers="localhost:9092", topics=["t"])
    pool = WorkerConfig(dsn="postgresql://localhost/b")
    assert _spun(inbox, None) is inbox and _spun(pool, None) is pool  # the SDK's defaults stand
    assert _spun(inbox, 0.0).db_spin_us == 0.0
    assert _spun(pool, 250.0).db_spin_us == 250.0
    assert _spun(inbox, 250.0).name == "b"  # the rest of the config kept
