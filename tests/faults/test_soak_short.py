"""The chaos soak (tests/soak/), short: about a minute of writes under every kind of fault.

Three relay replicas, two dedup consumers and two job workers (when consumer_sdk.jobs is
there) on an embedded PostgreSQL and an Apache Kafka node behind a fault proxy (tansu when
Java is missing, outside CI: tests/soak/__init__.py says why not tansu); a fixed seed whose
plan puts every fault kind and every bad input in the first three quarters of the run.
The long run is `make soak SOAK_ARGS="--duration-s 1200 --seed 7"`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak import BAD_INPUTS, PROCESS_FAULTS, SERVICE_FAULTS, SoakConfig, plan_faults, run_soak

SEED = 3
DURATION_S = 60.0
CONFIG = dict(duration_s=DURATION_S, seed=SEED, relays=3, consumers=2, workers=2, rate=150.0,
              mean_fault_gap_s=4.0, drain_timeout_s=120.0)


def test_the_short_plan_has_every_kind_of_fault_and_bad_input():
    plan = plan_faults(seed=SEED, duration_s=DURATION_S, relays=3, consumers=2, workers=2, mean_gap_s=4.0)
    assert {f.kind for f in plan} == {*PROCESS_FAULTS, *SERVICE_FAULTS, *BAD_INPUTS}
    assert all(f.at_s + f.hold_s < DURATION_S for f in plan)
    assert plan == plan_faults(seed=SEED, duration_s=DURATION_S, relays=3, consumers=2, workers=2,
                               mean_gap_s=4.0)  # the seed replays it


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_chaos_soak_loses_nothing_and_applies_everything_once(tmp_path: Path):
    report = run_soak(SoakConfig(**CONFIG, workdir=tmp_path))  # type: ignore[arg-type]
    print(report.render())

    assert report.failures() == [], report.render()
    assert report.written > 3000
    assert report.lost == 0
    assert report.effects_applied == report.written and report.effect_duplicates == 0
    assert report.order_violations == 0 and report.effect_order_violations == 0
    kinds = [k for k in (*PROCESS_FAULTS, *SERVICE_FAULTS) if report.jobs_enabled or not k.startswith("worker")]
    assert all(report.faults_by_kind.get(k, 0) >= 1 for k in kinds), report.faults_by_kind
    tried = {name.split(":")[0] for name in report.bad_inputs_by_kind}
    assert tried == set(BAD_INPUTS), report.bad_inputs_by_kind
    if report.jobs_enabled:
        assert report.jobs_expected > 0 and report.jobs_completed_once == report.jobs_expected
