"""The fault plan (pure: seed in, list of faults out)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tests.soak.config import (
    BAD_INPUTS,
    PROCESS_FAULTS,
    RELAY_LEASE_S,
    SERVICE_FAULTS,
    SESSION_TIMEOUT_S,
    TERMINATE_TARGETS,
    WEIGHTS,
    WORKER_LEASE_S,
)


@dataclass(frozen=True)
class Fault:
    """One planned fault: at ``at_s`` after the start, on ``target``, lasting ``hold_s``."""

    at_s: float
    kind: str
    target: str
    hold_s: float = 0.0
    param: float = 0.0

    def describe(self) -> str:
        extra = f" param={self.param:g}" if self.param else ""
        return f"t={self.at_s:7.2f}s {self.kind:<17} {self.target:<18} hold={self.hold_s:5.2f}s{extra}"


def plan_faults(*, seed: int, duration_s: float, relays: int, consumers: int, workers: int,
                mean_gap_s: float) -> list[Fault]:
    """Every available kind once (shuffled, spread over the first three quarters), then
    random kinds at exponential gaps.  A target (a process, the proxy, the database) has
    one fault at a time; every fault ends before ``duration_s``."""
    rng = random.Random(seed)
    members = {"relay": [f"r{i}" for i in range(1, relays + 1)],
               "consumer": [f"c{i}" for i in range(1, consumers + 1)],
               "worker": [f"w{i}" for i in range(1, workers + 1)]}
    kinds = [k for k in (*PROCESS_FAULTS, *SERVICE_FAULTS, *BAD_INPUTS)
             if not k.endswith(("_sigkill", "_sigstop")) or members[k.split("_")[0]]]
    busy: dict[str, float] = {}
    end = duration_s - 1.0
    faults: list[Fault] = []

    def add(kind: str, at: float, first: bool) -> None:
        fault = _draw(rng, kind, at, first, members)
        while busy.get(fault.target, 0.0) > fault.at_s:  # the target is still faulted: later
            fault = _draw(rng, kind, busy[fault.target] + 0.5, first, members)
        if fault.at_s + fault.hold_s <= end:
            settle = 1.0 if fault.kind.endswith("_sigkill") else 0.5
            busy[fault.target] = fault.at_s + fault.hold_s + settle
            faults.append(fault)

    first_round = list(kinds)
    rng.shuffle(first_round)
    start = min(5.0, duration_s * 0.05)
    spacing = min(mean_gap_s, max(0.5, (duration_s * 0.75 - start) / len(first_round)))
    t = start
    for kind in first_round:
        add(kind, t, first=True)
        t += spacing
    weights = [WEIGHTS[k] for k in kinds]
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= end:
            break
        add(rng.choices(kinds, weights)[0], t, first=False)
    return sorted(faults, key=lambda f: f.at_s)


def _draw(rng: random.Random, kind: str, at: float, first: bool, members: dict[str, list[str]]) -> Fault:
    """One fault of ``kind`` at ``at``; in the first round, pauses outlast the lease/session."""
    u = rng.uniform
    if kind.endswith(("_sigkill", "_sigstop")):
        role = kind.split("_")[0]
        target = rng.choice(members[role])
        if kind.endswith("_sigkill"):
            return Fault(at, kind, target, u(0.5, 4.0))
        limit = SESSION_TIMEOUT_S if role == "consumer" else (RELAY_LEASE_S if role == "relay" else WORKER_LEASE_S)
        hold = u(limit + 1.0, limit * 2 + 1.0) if first or rng.random() < 0.6 else u(0.5, limit)
        return Fault(at, kind, target, hold)
    if kind == "broker_cut":
        return Fault(at, kind, "proxy", u(1.0, 6.0))
    if kind == "broker_delay":
        return Fault(at, kind, "proxy", u(2.0, 8.0), param=round(u(50, 400)))
    if kind == "broker_blackhole":
        return Fault(at, kind, "proxy", u(2.0, 8.0))
    if kind == "db_restart":
        return Fault(at, kind, "db", u(0.2, 3.0))
    if kind == "db_crash":
        return Fault(at, kind, "db", u(0.2, 2.0))
    if kind == "pg_terminate":
        return Fault(at, kind, rng.choice(TERMINATE_TARGETS))
    return Fault(at, kind, kind)  # bad inputs: instantaneous, one at a time per kind
