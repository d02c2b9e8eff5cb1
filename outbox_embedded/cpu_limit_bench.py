"""``python -m outbox_embedded.cpu_limit_bench``: the SDK's consumer and the relay under CPU
limits, in one run.

A container's CPU limit is a quota of CPU time per period (cgroup CFS bandwidth): a process
whose threads spent the quota waits for the next period, whatever it was doing.  Each of
``--limits`` (cores; 0: no limit) is set on a new cgroup in turn, ``--rounds`` times:

* ``consumer``: this process (the consumer and its Kafka client; not PostgreSQL nor the
  broker, started before) joins the cgroup and consumes ``--messages`` messages one at a
  time with ``db_spin_us=--spin-us`` and with 0, the two alternating.  Per limit, the median
  of the rounds' ratios of messages a second, polling / sleeping.  It is how the SDK's
  default was set: polling off below one core (outbox_core/spin.py, ``MIN_LIMIT_CORES``);
* ``relay``: a relay process (``outbox-relay bench``'s latency pass, ``--rate`` events a
  second for ``--latency-s``) is put in the cgroup as it starts: its CPU, claims a second and
  commit -> ack p50 / p99, as a sidecar with that CPU limit would see them.

Every run also prints the periods the cgroup was throttled in and the time it was stopped.
Needs root and cgroup v1's cpu controller at /sys/fs/cgroup/cpu (or v2 with the cpu
controller enabled below the root).  Embedded PostgreSQL and tansu (durable, as
``outbox-relay bench`` runs them).  Benchmarks are not tests: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from outbox_embedded.broker import create_topic
from outbox_embedded.calibration import rotated
from outbox_embedded.sdk_bench import produce, sdk_consumer, services

CGROUP = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class Limited:
    """A new cgroup holding this process, whose CPU limit :meth:`set` changes."""

    def __init__(self) -> None:
        name = f"outbox-cpu-limit-bench-{uuid.uuid4().hex[:6]}"
        self.v1 = (CGROUP / "cpu" / "cpu.cfs_quota_us").exists()
        self.parent = CGROUP / "cpu" if self.v1 else CGROUP
        self.path = self.parent / name
        self.path.mkdir()
        self.entered = False
        if self.v1:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))

    def enter(self) -> None:
        """Move this process into the cgroup (:meth:`close` moves it back out)."""
        self.admit(os.getpid())
        self.entered = True

    def admit(self, pid: int) -> None:
        """Move process ``pid`` (every thread of it) into this cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def set(self, cores: float) -> None:
        quota = round(cores * PERIOD_US) if cores > 0 else None
        if self.v1:
            (self.path / "cpu.cfs_quota_us").write_text(str(quota or -1))
        else:
            (self.path / "cpu.max").write_text(f"{quota or 'max'} {PERIOD_US}")

    def throttled(self) -> tuple[int, float]:
        """(periods throttled, seconds stopped) so far."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        if self.v1:
            return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e9
        return int(stat["nr_throttled"]), int(stat["throttled_usec"]) / 1e6

    def close(self) -> None:
        """Remove the cgroup (every process in it must have ended or left)."""
        if self.entered:
            (self.parent / "cgroup.procs").write_text(str(os.getpid()))
        self.path.rmdir()


@contextlib.contextmanager
def limited() -> Iterator[Limited]:
    group = Limited()
    try:
        yield group
    finally:
        group.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m outbox_embedded.cpu_limit_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="consumer,relay", help="consumer, relay or both, comma-separated")
    p.add_argument("--messages", type=int, default=4000, help="messages per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--limits", default="0,1,0.5,0.25", help="CPU limits in cores, comma-separated (0: none)")
    p.add_argument("--spin-us", type=float, default=100.0, help="the polling budget set against 0")
    p.add_argument("--rate", type=float, default=1000.0, help="events a second written in the relay's runs")
    p.add_argument("--latency-s", type=float, default=10.0, help="how long the relay's runs write")
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--payload-bytes", type=int, default=500)
    args = p.parse_args(argv)
    try:
        args.limits = [float(v) for v in args.limits.split(",")]
    except ValueError:
        p.error(f"--limits: numbers of cores, comma-separated, not {args.limits!r}")
    if any(v < 0 for v in args.limits) or args.messages < 1 or args.rounds < 1:
        p.error("--limits must be 0 or more; --messages and --rounds at least 1")
    args.what = set(args.what.split(","))
    if not args.what or args.what - {"consumer", "relay"}:
        p.error("--what: consumer, relay or both")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("cpu_limit_bench: making a cgroup needs root", file=sys.stderr)
        return 2
    try:
        with limited() as group:
            group.set(0.5)  # can this machine's cgroups take a limit at all?
    except OSError as exc:
        print(f"cpu_limit_bench: cannot make a CPU-limited cgroup under {CGROUP}: {exc} (cgroup v1's cpu "
              f"controller, or v2 with +cpu in {CGROUP / 'cgroup.subtree_control'})", file=sys.stderr)
        return 2
    if "consumer" in args.what:
        consumer_runs(args)
    if "relay" in args.what:
        relay_runs(args)
    return 0


def consumer_runs(args: argparse.Namespace) -> None:
    ratios: dict[float, list[float]] = {limit: [] for limit in args.limits}
    with services(argparse.Namespace(dsn=None, bootstrap_servers=None)) as (dsn, bootstrap):
        plan = [(r, limit) for r in range(args.rounds) for limit in args.limits]
        topics = []
        for _ in range(len(plan) * 2):  # produced before the limit: only consuming is limited
            topic = f"cpu-limit-{uuid.uuid4().hex[:8]}"
            create_topic(bootstrap, topic, partitions=args.partitions)
            produce(bootstrap, topic, args.messages, args.payload_bytes)
            topics.append(topic)
        with limited() as group:
            group.enter()
            for r, limit in plan:
                rates: dict[float, float] = {}
                for spin_us in rotated([args.spin_us, 0.0], r):
                    group.set(limit)
                    before = group.throttled()
                    inbox = f"cpu-limit-{uuid.uuid4().hex[:8]}"
                    figures = sdk_consumer(dsn, bootstrap, topics.pop(), inbox=inbox, group=inbox, batch_size=1,
                                           count=args.messages, spin_us=spin_us)
                    throttled = _since(before, group.throttled())
                    group.set(0)
                    rates[spin_us] = figures["rate"]
                    print(f"consumer round {r + 1} limit {limit or 'none':>4} db_spin_us {spin_us:5.0f}: "
                          f"{figures['rate']:7.0f} msg/s {figures['cpu_us']:6.1f} µs CPU/msg, {throttled}", flush=True)
                ratios[limit].append(rates[args.spin_us] / rates[0.0])
    for limit, values in ratios.items():
        print(f"consumer limit {limit or 'none':>4}: polling / sleeping {statistics.median(values):.2f} x "
              f"(rounds {' / '.join(f'{v:.2f}' for v in values)})", flush=True)


def relay_runs(args: argparse.Namespace) -> None:
    from outbox_embedded import bench
    from outbox_embedded.demo import services as bench_services

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    bench_args = parser.parse_args(["--rate", str(args.rate), "--latency-s", str(args.latency_s)])
    with bench_services(bench_args, durable=True) as (dsn, bootstrap), limited() as group:
        runner = bench.Bench(bench_args, bench._admin_dsn(dsn), bootstrap)
        runner.relay_hook = group.admit
        for r in range(args.rounds):
            for limit in rotated(args.limits, r):
                group.set(limit)
                before = group.throttled()
                figures = runner.latency(consumer=False, rate=args.rate)
                ack = figures["latency_ack_ms"]
                print(f"relay round {r + 1} limit {limit or 'none':>4}: {figures['relay_cpu_percent']:5.1f} % of a core, "
                      f"{figures['claims_per_s']:5.1f} claims/s, commit -> ack p50 {ack['p50']:.2f} ms "
                      f"p99 {ack['p99']:.2f} ms, {_since(before, group.throttled())}", flush=True)


def _since(before: tuple[int, float], after: tuple[int, float]) -> str:
    return f"throttled in {after[0] - before[0]} periods, stopped {after[1] - before[1]:.2f} s"


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sys.exit(main())
