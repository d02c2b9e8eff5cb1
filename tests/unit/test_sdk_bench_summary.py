"""The SDK bench's report: every ratio between the medians, in each round, and the median of the rounds'."""

from __future__ import annotations

import argparse

from outbox_embedded.sdk_bench import RATIOS, summarize


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
