"""A process in a real cgroup with a CPU quota reads its limit (outbox_core.cgroup), and the
consumer's default polling budget turns off there (outbox_core.spin.default_budget_us).

Needs root and a writable cgroup file system (cgroup v1's cpu controller, or v2 with the
cpu controller enabled for children of the root): it skips with the reason elsewhere, and
fails under CI=true, where .ci/run runs as root."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_embedded.cpu_limit_bench import Limited
from tests.fixtures.apache_kafka import in_ci

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
sys.stdin.readline()  # moved into the cgroup by now
from outbox_core.cgroup import cpu_limit_cores
from outbox_core.spin import default_budget_us
print(cpu_limit_cores(), default_budget_us(None, 100.0, cpu_limit_cores)[0])
"""


def _unavailable(reason: str) -> None:
    if in_ci():
        pytest.fail(f"{reason} (CI=true: .ci/run runs as root with a writable cgroup file system)")
    pytest.skip(reason)


@pytest.fixture
def limited_cgroup() -> Iterator[Limited]:
    """A new cgroup limited to half a core (the bench's own, outbox_embedded/cpu_limit_bench.py)."""
    if os.geteuid() != 0:
        _unavailable("creating a cgroup needs root")
    try:
        group = Limited()
    except OSError as exc:
        _unavailable(f"cannot make a cgroup: {exc}")
    try:
        group.set(0.5)
    except OSError as exc:
        group.close()
        _unavailable(f"cannot limit a cgroup's CPU: {exc}")
    try:
        yield group
    finally:
        group.close()


def test_a_process_limited_to_half_a_core_reads_it_and_does_not_poll(limited_cgroup: Limited) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        limited_cgroup.admit(child.pid)
        out, err = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert out.split() == ["0.5", "0.0"]

