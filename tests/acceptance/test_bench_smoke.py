"""A tiny `outbox-relay bench`, so the benchmark cannot rot.  Its figures are not asserted
against targets here: benchmarks are not tests."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.outbox import relay_cmd

KEYS = ["relay_events_per_s", "db_floor_events_per_s", "producer_floor_events_per_s",
        "ratio_to_floor", "latency_ack_ms", "latency_consumer_ms", "peak_rss_mb",
        "idle_queries_per_s", "idle_cpu_percent", "published_rows_slowdown", "bloat",
        "notify_writer_cost", "stalled_writer", "exactly_once_ratio", "physical_floor_events_per_s",
        "naive_relay_events_per_s", "ratio_to_naive", "relay_cpu_us_per_row",
        "keep_published_false", "steady", "scale_out_events_per_s", "scale_out_startup_events_per_s",
        "scale_out_ratio", "scale_out_ratio_runs", "scale_out_startup_ratio", "scale_out_startup_ratio_runs",
        "cpu_split_us_per_row", "scale_out_cpu_split_us_per_row"]


def test_bench_runs_end_to_end_and_writes_every_figure(pg_server, broker, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        relay_cmd("bench", "--dsn", pg_server.admin_dsn, "--bootstrap-servers", broker.bootstrap,
                  "--rows", "2000", "--runs", "1", "--rate", "200", "--latency-s", "2",
                  "--idle-s", "1", "--published-rows", "5000", "--bloat-rows", "4000",
                  "--notify-clients", "2", "--notify-s", "1", "--low-rate", "50",
                  "--replicas", "1,2", "--json", str(out)),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(KEYS) <= set(figures)
    for name in ("relay_events_per_s", "db_floor_events_per_s", "producer_floor_events_per_s",
                 "peak_rss_mb", "published_rows_slowdown", "physical_floor_events_per_s",
                 "naive_relay_events_per_s", "ratio_to_naive"):
        assert figures[name] > 0, name
    for figure in (figures["latency_ack_ms"], figures["latency_consumer_ms"],
                   figures["stalled_writer"]["latency_ack_ms"]):
        assert set(figure) == {"p50", "p95", "p99"}
        assert 0 < figure["p50"] <= figure["p99"]
    assert figures["stalled_writer"]["p99_ratio"] > 0
    # One round: its own ratios are the figures (the relay over that round's baselines).
    assert figures["ratio_to_naive_runs"] == [figures["ratio_to_naive"]]
    assert figures["ratio_to_floor_runs"] == [figures["ratio_to_floor"]]
    assert figures["keep_published_false"]["relay_events_per_s"] > 0
    # NOTIFY's cost: 2 x --runs + 1 pairs, the figure their median; the relay asleep at the
    # start of a run with the trigger on was woken by a writer's notification.
    costs = sorted(figures["notify_writer_cost_runs"])
    assert len(costs) == 3 and abs(figures["notify_writer_cost"] - costs[1]) < 1e-3
    assert figures["notify_wakeups"] >= 1
    assert [s["events_per_s"] for s in figures["steady"]] == [200, 50]
    for steady in figures["steady"]:
        assert steady["relay_cpu_percent"] > 0 and steady["claims_per_s"] > 0
        assert steady["relay_cpu_percent_runs"] == [steady["relay_cpu_percent"]]  # --runs 1
        # The machine's price of a round trip, timed just before the pass.
        assert steady["round_trip_us"] > 0 and steady["round_trip_us_runs"] == [steady["round_trip_us"]]
    for scale_out in ("scale_out", "scale_out_startup"):
        rates, ratios = figures[f"{scale_out}_events_per_s"], figures[f"{scale_out}_ratio"]
        assert set(rates) == {"1", "2"} and set(ratios) == {"1", "2"}
        assert all(rate > 0 for rate in rates.values())
        # One round: its rates are the medians, and 2 over 1 is taken inside it.
        assert figures[f"{scale_out}_events_per_s_runs"] == {n: [rate] for n, rate in rates.items()}
        assert figures[f"{scale_out}_ratio_runs"] == {n: [ratio] for n, ratio in ratios.items()}
        assert ratios["1"] == 1.0
        assert abs(ratios["2"] - rates["2"] / rates["1"]) < 0.01
    assert "2 replicas" in result.stdout and "; rounds " in result.stdout
    assert "relay drain" in result.stdout and "x min(floors)" in result.stdout
    assert "a round trip" in result.stdout
    # Where each drain's CPU went, by process: the servers here are local, so all are found.
    split = figures["cpu_split_us_per_row"]
    assert set(split["relay_drain"]) == {"relay", "postgres", "broker"}
    assert set(split["naive_relay"]) == {"client", "postgres", "broker"}
    assert set(split["physical_floor"]) == {"client", "postgres", "broker"}
    # (2,000 rows are a few clock ticks of each server's CPU: values, not their size.)
    assert all(us >= 0 for figures_ in split.values() for us in figures_.values())
    assert "CPU per row, relay drain" in result.stdout
    assert set(figures["scale_out_cpu_split_us_per_row"]) == {"1", "2"}
    for scale_split in figures["scale_out_cpu_split_us_per_row"].values():
        assert set(scale_split) == {"relays", "postgres", "broker"}


REPO = Path(__file__).resolve().parents[2]


def _bench_module(module: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``python -m outbox_embedded.<module> ... --json out`` from the checkout: its process
    (which must have exited 0) and the figures it wrote."""
    result = subprocess.run([sys.executable, "-m", f"outbox_embedded.{module}", *args, "--json", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, _failure(result)
    return result, json.loads(out.read_text())


def _failure(result: subprocess.CompletedProcess[str]) -> str:
    """What a failed bench said: its output, the lines of its error stream that are not the
    relays' JSON log lines (a traceback, the bench's own error), then the last log lines.  The
    tail alone was the relays' logs: a rolling bench that failed in CI showed no reason."""
    lines = result.stderr.splitlines()
    said = [line for line in lines if not line.startswith("{")]
    logs = [line for line in lines if line.startswith("{")]
    return "\n".join([f"exit {result.returncode}", "stdout:", result.stdout[-2000:], "stderr, not log lines:",
                      *said[-60:], "the last log lines:", *logs[-15:]])


def _topics(bootstrap: str) -> set[str]:
    from confluent_kafka.admin import AdminClient

    return set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics)


def test_every_drain_of_the_baselines_writes_a_topic_of_its_own(pg_server, broker):
    """tansu's produce slows as a topic fills, and the naive relay flushes and waits for each
    batch: when its rounds shared one topic, every round after the first ran against a fuller
    broker (issue 18's twenty-eighth pass; before 87fbb88 this found one naive topic)."""
    from outbox_embedded import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    runner = bench.Bench(parser.parse_args(["--rows", "300", "--batch-size", "100"]),
                         pg_server.admin_dsn, broker.bootstrap)
    before = _topics(broker.bootstrap)
    figures, drains = bench._baselines(runner, 2, idle_s=0.0)
    new = _topics(broker.bootstrap) - before
    naive = {t for t in new if t.startswith("bench.") and t.endswith(".naive")}
    relay = {t for t in new if t.startswith("bench.") and t.count(".") == 1}
    assert len(naive) == 2, new  # one per round
    assert len(relay) == 2 and not naive & relay, new  # the relay's drains too
    assert len(drains) == 2 and figures["naive_relay_events_per_s"] > 0


def test_bench_ab_runs_both_trees_in_turn_and_writes_every_run(pg_server, broker, tmp_path):
    """The A/B harness behind the README's before/after tables, on this checkout against
    itself: one round runs the steady figure on each tree and reports both."""
    result, figures = _bench_module(
        "bench_ab", tmp_path / "ab.json", "--old", str(REPO), "--new", str(REPO), "--dsn", pg_server.admin_dsn,
        "--bootstrap-servers", broker.bootstrap, "--rounds", "1", "--what", "steady", "--rate", "200",
        "--latency-s", "2")
    assert set(figures) == {"200/s relay CPU %", "200/s commit->ack p50 ms", "200/s commit->ack p99 ms",
                            "200/s claims/s"}
    for figure in figures.values():
        assert len(figure["old"]) == len(figure["new"]) == 1
        assert figure["old_median"] > 0 and figure["new_median"] > 0
    assert "round 1 old" in result.stdout and "round 1 new" in result.stdout


def test_bench_ab_times_rows_that_come_alone(pg_server, broker, tmp_path):
    """The "lone" figure behind the README's table of rows that come alone: each tree's relay
    sleeps between rows written 0.3-2.5 s apart, and a commit's notification wakes it well
    before its 1 s poll."""
    _, figures = _bench_module(
        "bench_ab", tmp_path / "lone.json", "--old", str(REPO), "--new", str(REPO), "--dsn", pg_server.admin_dsn,
        "--bootstrap-servers", broker.bootstrap, "--rounds", "1", "--what", "lone", "--lone-rows", "3")
    assert set(figures) == {"lone rows commit->mark p50 ms", "lone rows commit->mark p95 ms",
                            "lone rows commit->mark max ms"}
    for figure in figures.values():
        assert len(figure["old"]) == len(figure["new"]) == 1
        # A commit's time is when COMMIT returned to the writer: on a loaded machine that can
        # come after the relay, woken at the commit, marked the row (CI read -1.09 ms once).
        assert -50 < figure["old_median"] < 1000 and -50 < figure["new_median"] < 1000


def test_bench_ab_refuses_a_tree_that_is_not_a_checkout(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "outbox_embedded.bench_ab", "--old", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert "not a checkout of this project" in result.stderr and "Traceback" not in result.stderr


def test_mark_bench_prices_each_schema_variant(pg_server, tmp_path):
    """The schema-variant bench behind the README's mark table: every variant claims and
    marks the whole backlog (it raises otherwise), and the HOT variant's marks are HOT."""
    result, figures = _bench_module("mark_bench", tmp_path / "marks.json", "--dsn", pg_server.admin_dsn,
                                    "--rows", "3000", "--rounds", "1")
    assert set(figures) == {"migrated", "no_published_index", "hot_ff50", "hot_ff70", "delete", "bytea_payload",
                            "event_id_pending", "pk_only", "unique_ff90", "heap_ff50", "xid_id_index"}
    for variant in figures.values():
        assert variant["claim_rows_per_s"] > 0 and variant["mark_rows_per_s"] > 0
        assert variant["indexes_loaded_mb"] > 0 and variant["indexes_mb"] > 0
        assert "claim_postgres_cpu_us" in variant  # the test server is local: its CPU is read
    assert figures["migrated"]["hot_share"] == 0  # published_at is in the pending index's predicate
    assert figures["heap_ff50"]["hot_share"] == 0  # room on the page does not make it HOT
    assert figures["bytea_payload"]["bytes_payload_share"] == 1 and figures["migrated"]["bytes_payload_share"] == 0
    if int(pg_server.server_version().split(".")[0]) >= 16:  # a BRIN index allows HOT since 16
        assert figures["hot_ff50"]["hot_share"] == 1
    assert "medians of 1 rounds" in result.stdout


def _claim_bench(pg_server: Any, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Any] | None:
    """claim_bench's run and figures; None on a server before PostgreSQL 17, which it refuses
    in one line (it compares the claim's two indexes, and migrate builds the one with the
    shard column from 17 on): checked here."""
    if int(pg_server.server_version().split(".")[0]) >= 17:
        return _bench_module("claim_bench", out, "--dsn", pg_server.admin_dsn, *args)
    result = subprocess.run([sys.executable, "-m", "outbox_embedded.claim_bench", "--dsn", pg_server.admin_dsn,
                             *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 1 and "PostgreSQL 17 and later only" in result.stderr, _failure(result)
    return None


def test_claim_bench_times_each_claim_variant_over_the_same_rows(pg_server, tmp_path):
    """The claim's executor-time bench: every variant returns every row of the backlog (it
    exits otherwise), and each is timed."""
    ran = _claim_bench(pg_server, tmp_path / "claims.json", "--rows", "3000", "--rounds", "1")
    if ran is None:
        return
    result, figures = ran
    assert set(figures) == {"relay", "no_budget", "plain", "xid_id_index"}
    assert all(us > 0 for us in figures.values())
    assert "medians of 1 rounds" in result.stdout


@pytest.mark.parametrize(("extra", "variants"), [
    ((), {"relay", "no_budget", "xid_id_index"}),
    (("--adopted",), {"relay", "no_budget", "xid_seq_index"}),
], ids=["outbox", "adopted"])
def test_claim_bench_prices_a_replica_of_a_quarter_of_the_shards(pg_server, tmp_path, extra, variants):
    """With 4 of 16 shards held, the relay's claim on either index returns the same rows (the
    bench exits otherwise); the plain scan, which takes every shard's rows, is left out.
    --adopted: the backlog in an adopted Debezium table, claimed through its view on its
    claim index with the shard and on the one adopt built before."""
    ran = _claim_bench(pg_server, tmp_path / "claims.json", "--rows", "3000", "--rounds", "1", "--held", "4",
                       *extra)
    if ran is None:
        return
    result, figures = ran
    assert set(figures) == variants
    assert all(us > 0 for us in figures.values())
    assert "4 of 16 shards held" in result.stdout


def test_mark_bench_refuses_an_unknown_variant(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "outbox_embedded.mark_bench", "--dsn", "postgresql://nobody@127.0.0.1:1/x",
         "--variants", "migrated,bogus"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode != 0
    assert "unknown variant(s) bogus" in result.stderr and "Traceback" not in result.stderr


def test_mark_bench_drains_each_variant_with_a_real_relay(pg_server, broker, tmp_path):
    result, figures = _bench_module(
        "mark_bench", tmp_path / "drains.json", "--dsn", pg_server.admin_dsn, "--bootstrap-servers",
        broker.bootstrap, "--rows", "2000", "--rounds", "1", "--variants", "migrated,hot_ff50,bytea_payload",
        "--drain")
    assert set(figures) == {"migrated", "hot_ff50", "bytea_payload"}  # each drained all its rows (else it raises)
    for variant in figures.values():
        assert variant["drain_events_per_s"] > 0 and variant["drain_ratio_to_floor"] > 0
        assert {"drain_relay_cpu_us", "drain_postgres_cpu_us", "drain_broker_cpu_us"} <= set(variant)
    assert "round 1 physical floor" in result.stdout


def test_rolling_bench_restarts_every_replica_and_counts_every_event(pg_server, broker, tmp_path):
    """The rolling-restart bench behind the README's hand-over figures: each replica stopped
    and replaced once while a writer writes, every event's copies counted from the topic."""
    result, figures = _bench_module(
        "rolling_bench", tmp_path / "rolling.json", "--dsn", pg_server.admin_dsn, "--bootstrap-servers",
        broker.bootstrap, "--replicas", "2", "--rate", "200", "--gap-s", "1.5")
    (run,) = figures["runs"]
    assert run["events"] > 500  # 200 a second for 4.5 s
    assert len(run["worst_ack_ms_per_hand_over"]) == 2
    for window in ("ack_ms_before", "ack_ms_during"):
        assert 0 < run[window]["p50"] <= run[window]["p99"] <= run[window]["max"]
    assert run["missing"] == 0  # at least once: nothing lost (copies are allowed)
    assert isinstance(run["duplicates"], int)
    assert "run 1: " in result.stdout and " missing, " in result.stdout


def test_rolling_bench_in_exactly_once_mode_reads_every_event_once(pg_server, kafka_broker, tmp_path):
    """--exactly-once: the relays hand their shards' transactional producers over at each
    restart, and a read_committed read of the topic finds every event exactly once."""
    _, figures = _bench_module(
        "rolling_bench", tmp_path / "rolling-eo.json", "--dsn", pg_server.admin_dsn, "--bootstrap-servers",
        kafka_broker.bootstrap, "--exactly-once", "--replicas", "2", "--rate", "200", "--gap-s", "1.5")
    (run,) = figures["runs"]
    assert run["events"] > 500
    assert (run["missing"], run["duplicates"]) == (0, 0)
    assert len(run["worst_ack_ms_per_hand_over"]) == 2


def test_rolling_bench_refuses_a_bad_option(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "outbox_embedded.rolling_bench", "--replicas", "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert "--replicas and --runs must be at least 1" in result.stderr and "Traceback" not in result.stderr
