"""A tiny run of `python -m outbox_embedded.sdk_bench`, so the SDK benchmark cannot rot.  Its figures are not
asserted against the issue's targets here: benchmarks are not tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
VARIANTS = ["naive_new", "naive_redelivered", "inbox_batch_new", "inbox_batch_redelivered",
            "inbox_batch_bh_new", "inbox_batch_bh_redelivered", "naive_single_new", "naive_single_redelivered",
            "inbox_single_new", "inbox_single_redelivered", "naive_workers", "worker_pool",
            "worker_pool_execute", "inbox_single_statements_new", "inbox_single_statements_redelivered",
            "inbox_batch_statements_new", "inbox_batch_statements_redelivered"]


def test_sdk_bench_runs_every_variant_and_reports_ratios(pg_server, broker, tmp_path):
    out = tmp_path / "sdk-bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "outbox_embedded.sdk_bench", "--dsn", pg_server.admin_dsn,
         "--bootstrap-servers", broker.bootstrap, "--messages", "300", "--single-messages", "60",
         "--batch-size", "100", "--partitions", "2", "--jobs", "60", "--threads", "2", "--runs", "1",
         "--round-trips", "200", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["figures"]) == set(VARIANTS)
    for name in VARIANTS:
        assert report["figures"][name]["rate"] > 0 and report["figures"][name]["cpu_us"] > 0, name
    assert all(value > 0 for value in report["ratios"].values()), report["ratios"]
    assert set(report["ratios_per_round"]) == set(report["ratios"])
    for name, rounds in report["ratios_per_round"].items():
        # One round: its ratio is the medians', but from unrounded rates (the medians' are
        # rounded to 0.1, a few tenths of a percent of this tiny run's slowest rates).
        assert len(rounds) == 1 and abs(rounds[0] - report["ratios"][name]) <= 0.01 * rounds[0] + 0.001, name
        assert report["ratios_round_median"][name] == rounds[0], name
    assert len(report["worker_pool_vs_naive_per_run"]) == 1 and report["jobs_per_claim_round"] > 0
    assert len(report["worker_pool_execute_vs_naive_per_run"]) == 1
    assert "worker_pool_vs_naive" in result.stdout and "worker_pool_execute_vs_naive" in result.stdout
    # The round trip's price, timed in the round, and every figure in round trips.
    trip = report["round_trip"]
    assert trip["wall_us"] > 0 and trip["cpu_us"] > 0 and len(trip["per_round"]) == 1
    assert set(report["in_round_trips"]) == set(VARIANTS)
    for name in VARIANTS:
        expected = 1e6 / report["figures"][name]["rate"] / trip["wall_us"]
        assert abs(report["in_round_trips"][name] - expected) <= 0.01 * expected + 0.01, name


def test_sdk_bench_runs_only_the_variants_and_phases_asked(pg_server, broker, tmp_path):
    out = tmp_path / "sdk-bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "outbox_embedded.sdk_bench", "--dsn", pg_server.admin_dsn,
         "--bootstrap-servers", broker.bootstrap, "--single-messages", "40", "--partitions", "2",
         "--runs", "1", "--only", "consumer", "--variants", "naive_single,inbox_single", "--phases", "new",
         "--profile-dir", str(tmp_path / "prof"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["figures"]) == {"naive_single_new", "inbox_single_new"}
    assert report["ratios"]["inbox_single_new_vs_naive_single"] > 0
    assert (tmp_path / "prof" / "inbox_single_new_1.prof").exists()
