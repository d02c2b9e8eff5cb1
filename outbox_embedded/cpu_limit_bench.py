"""``python -m outbox_embedded.cpu_limit_bench``: the one-at-a-time InboxConsumer polling its
connection (``db_spin_us``) and sleeping at once, under CPU limits, in one run.

A container's CPU limit is a quota of CPU time per period (cgroup CFS bandwidth): the CPU a
poll spends counts against it, and a process that spent its quota waits for the next
period.  This bench puts its own process (the consumer and its Kafka client; not PostgreSQL
nor the broker, started before) in a new cgroup and, for each of ``--limits`` (cores; 0: no
limit), consumes ``--messages`` messages one at a time with ``db_spin_us=--spin-us`` and
with 0, the two alternating in ``--rounds`` rounds.  It prints each run (messages a second,
CPU a message, the periods throttled and the time stopped) and, per limit, the median of
the rounds' ratios polling / sleeping.  It is how the SDK's default was set: polling off
below one core (outbox_core/spin.py, ``MIN_LIMIT_CORES``); ``InboxConfig(db_spin_us=None)``
is what a service gets.

Needs root and cgroup v1's cpu controller at /sys/fs/cgroup/cpu (or v2 with the cpu
controller enabled below the root).  Embedded PostgreSQL and tansu, or ``--dsn`` /
``--bootstrap-servers``.  Benchmarks are not tests: nothing here is asserted.
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
        if self.v1:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

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
    p.add_argument("--dsn", default=None, help="PostgreSQL to use (default: an embedded one)")
    p.add_argument("--bootstrap-servers", default=None, help="Kafka to use (default: a local tansu)")
    p.add_argument("--messages", type=int, default=4000, help="messages per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--limits", default="0,1,0.5,0.25", help="CPU limits in cores, comma-separated (0: none)")
    p.add_argument("--spin-us", type=float, default=100.0, help="the polling budget set against 0")
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--payload-bytes", type=int, default=500)
    args = p.parse_args(argv)
    try:
        args.limits = [float(v) for v in args.limits.split(",")]
    except ValueError:
        p.error(f"--limits: numbers of cores, comma-separated, not {args.limits!r}")
    if any(v < 0 for v in args.limits) or args.messages < 1 or args.rounds < 1:
        p.error("--limits must be 0 or more; --messages and --rounds at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("cpu_limit_bench: making a cgroup needs root", file=sys.stderr)
        return 2
    ratios: dict[float, list[float]] = {limit: [] for limit in args.limits}
    with services(args) as (dsn, bootstrap):
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
                    periods0, stopped0 = group.throttled()
                    inbox = f"cpu-limit-{uuid.uuid4().hex[:8]}"
                    figures = sdk_consumer(dsn, bootstrap, topics.pop(), inbox=inbox, group=inbox, batch_size=1,
                                           count=args.messages, spin_us=spin_us)
                    periods1, stopped1 = group.throttled()
                    group.set(0)
                    rates[spin_us] = figures["rate"]
                    print(f"round {r + 1} limit {limit or 'none':>4} db_spin_us {spin_us:5.0f}: "
                          f"{figures['rate']:7.0f} msg/s {figures['cpu_us']:6.1f} µs CPU/msg, "
                          f"throttled {periods1 - periods0} periods, stopped {stopped1 - stopped0:.2f} s", flush=True)
                ratios[limit].append(rates[args.spin_us] / rates[0.0])
    for limit, values in ratios.items():
        print(f"limit {limit or 'none':>4}: polling / sleeping {statistics.median(values):.2f} x "
              f"(rounds {' / '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sys.exit(main())
