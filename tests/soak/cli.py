"""The command line of the soak: ``python -m tests.soak --help``."""

from __future__ import annotations

import argparse
import json
import random
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.soak.config import SoakConfig
from tests.soak.run import run_soak


def main(argv: Sequence[str] | None = None) -> int:
    from tests import soak  # the package: its docstring's first paragraph describes the command

    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=(soak.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0, help="time faults and writes run (default 300)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the fault plan and the writers (default random)")
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="job workers (0: no jobs)")
    parser.add_argument("--rate", type=float, default=300.0, help="events/s written (default 300)")
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--mean-fault-gap-s", type=float, default=5.0)
    parser.add_argument("--drain-timeout-s", type=float, default=240.0)
    parser.add_argument("--workdir", type=Path, default=None, help="where process logs go (default a temp dir, kept)")
    parser.add_argument("--broker", choices=("kafka", "tansu"), default="kafka",
                        help="kafka: Apache Kafka (tansu when Java or its jars are missing, outside CI); "
                             "tansu: the light broker (default kafka)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    config = SoakConfig(duration_s=args.duration_s, seed=seed, relays=args.relays, consumers=args.consumers,
                        workers=args.workers, rate=args.rate, keys=args.keys, partitions=args.partitions,
                        mean_fault_gap_s=args.mean_fault_gap_s, drain_timeout_s=args.drain_timeout_s,
                        workdir=args.workdir, jobs=None if args.workers > 0 else False, broker=args.broker)

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)

    def say(text: str) -> None:
        print(text, flush=True)

    say(f"chaos soak: seed {seed}, {args.duration_s:g} s, {args.relays} relays, {args.consumers} consumers, "
        f"{args.workers} workers, {args.rate:g} events/s")
    try:
        report = run_soak(config, log=say)
    except KeyboardInterrupt:
        say(f"interrupted; everything was stopped (seed {seed})")
        return 130
    say(report.render())
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1
