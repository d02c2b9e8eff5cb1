"""Two source trees of the relay measured against each other in one run, alternating.

``python -m outbox_embedded.bench_ab --old ../checkout-of-main --what steady,low``

A change's effect on a noisy machine is smaller than the spread between two runs of the
bench, so the README's before/after figures come from this: one embedded PostgreSQL
(durable) and one tansu, and rounds in which the old tree's relay and the new tree's run
in turn (old first in even rounds, new first in odd ones), each measured by the bench's
own figures (:class:`outbox_embedded.bench.Bench`).  Only the relay processes differ:
each runs ``python -m relay run`` with ``PYTHONPATH`` naming its tree, from a working
directory outside both (``-m`` would find the working directory's ``relay`` first).

Figures (``--what``, comma-separated): ``steady`` (relay CPU and commit -> ack at
``--rate``), ``low`` (the same at ``--low-rate``), ``lone`` (commit -> mark of rows written
one at a time, 0.3-2.5 s apart: ``--lone-rows``, 40 by default), ``drain`` (a ``--rows`` backlog),
``scale`` (the settled drain with each of ``--replicas``).  Prints every run, then each
figure's medians and new / old.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from outbox_embedded import bench
from outbox_embedded.calibration import write_json

WHAT = ("steady", "low", "lone", "drain", "scale")
#: Rows of the "lone" figure when --lone-rows is 0 (the main bench's default: skipped).
LONE_ROWS = 40


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m outbox_embedded.bench_ab",
                                description="two relay source trees against each other, alternating")
    bench.add_arguments(p)
    p.add_argument("--old", required=True, help="a checkout of the tree to compare against")
    p.add_argument("--new", default=".", help="the tree under test (default: the working directory)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs both trees")
    p.add_argument("--what", default="steady", help=f"comma-separated figures among {', '.join(WHAT)}")
    args = p.parse_args(argv)
    args.what = [w.strip() for w in args.what.split(",") if w.strip()]
    unknown = [w for w in args.what if w not in WHAT]
    if unknown or not args.what:
        p.error(f"--what: unknown figure(s) {', '.join(unknown) or '(none)'}; choose among {', '.join(WHAT)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    for option in ("old", "new"):
        tree = os.path.abspath(getattr(args, option))
        if not os.path.isfile(os.path.join(tree, "relay", "__main__.py")):
            p.error(f"--{option} {tree}: not a checkout of this project (no relay/__main__.py)")
        setattr(args, option, tree)
    return args


def measure(b: bench.Bench, what: str, args: argparse.Namespace) -> dict[str, float]:
    """One run of one figure on the relay ``PYTHONPATH`` names."""
    if what in ("steady", "low"):
        rate = args.rate if what == "steady" else args.low_rate
        run = b.latency(consumer=False, rate=rate)
        return {f"{rate:g}/s relay CPU %": run["relay_cpu_percent"],
                f"{rate:g}/s commit->ack p50 ms": run["latency_ack_ms"]["p50"],
                f"{rate:g}/s commit->ack p99 ms": run["latency_ack_ms"]["p99"],
                f"{rate:g}/s claims/s": run["claims_per_s"]}
    if what == "lone":
        lone = b.lone_rows(args.lone_rows or LONE_ROWS)["latency_ack_ms"]
        return {f"lone rows commit->mark {q} ms": lone[q] for q in ("p50", "p95", "max")}
    if what == "drain":
        drain = b.relay_drain()
        return {"drain events/s": drain["events_per_s"], "drain CPU us/row": drain["cpu_us_per_row"],
                **{f"drain {name} CPU us/row": us  # the servers', when they run on this machine
                   for name, us in drain.get("cpu_split_us_per_row", {}).items() if name != "relay"}}
    counts: list[int] = args.replicas or [1]
    return {f"scale-out {n} events/s": b.scale_out(n, settled=True) for n in counts}


def run(args: argparse.Namespace, b: bench.Bench,
        say: Callable[[str], None] = print) -> dict[str, dict[str, list[float]]]:
    """Every figure of every round: {figure: {"old": [...], "new": [...]}}."""
    trees = {"old": args.old, "new": args.new}
    figures: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        for name in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
            os.environ["PYTHONPATH"] = trees[name]
            for what in args.what:
                for key, value in measure(b, what, args).items():
                    figures.setdefault(key, {"old": [], "new": []})[name].append(value)
                    say(f"  round {round_ + 1} {name}  {key:28} {value:10.2f}")
    return figures


def summary(figures: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, runs in figures.items():
        old, new = statistics.median(runs["old"]), statistics.median(runs["new"])
        out[key] = {"old": runs["old"], "new": runs["new"], "old_median": round(old, 2),
                    "new_median": round(new, 2), "new_over_old": round(new / old, 3) if old else None}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from outbox_embedded.demo import services

    os.chdir(tempfile.gettempdir())  # so that `python -m relay` finds PYTHONPATH's tree first
    with services(args, durable=True) as (dsn, bootstrap):
        b = bench.Bench(args, bench._admin_dsn(dsn), bootstrap)
        print(f"bench_ab: old {args.old}, new {args.new}, {args.rounds} round(s) of {', '.join(args.what)}",
              flush=True)
        result = summary(run(args, b, say=lambda line: print(line, flush=True)))
    print("\nmedians (old -> new):")
    for key, fig in result.items():
        print(f"  {key:28} {fig['old_median']:10.2f} -> {fig['new_median']:10.2f}  ({fig['new_over_old']} x)")
    write_json(args.json_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
