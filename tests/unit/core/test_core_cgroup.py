"""outbox_core.cgroup reads this process's CPU limit from fake cgroup trees (both layouts),
and the consumer's default polling budget follows it (outbox_core.spin.default_budget_us)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from consumer_sdk import inbox
from consumer_sdk.config import DEFAULT_DB_SPIN_US, InboxConfig
from outbox_core.cgroup import cpu_limit_cores
from outbox_core.spin import MIN_LIMIT_CORES, default_budget_us


def tree(tmp_path: Path, proc: str, files: dict[str, str]) -> dict[str, Path]:
    (tmp_path / "proc").write_text(proc)
    for name, text in files.items():
        path = tmp_path / "cg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "cg").mkdir(exist_ok=True)
    return {"proc_cgroup": tmp_path / "proc", "root": tmp_path / "cg"}


def test_v2_a_container_limited_to_half_a_core(tmp_path: Path) -> None:
    where = tree(tmp_path, "0::/kubepods/pod1/app\n", {
        "cpu.max": "max 100000\n",
        "kubepods/pod1/app/cpu.max": "50000 100000\n",
    })
    assert cpu_limit_cores(**where) == 0.5


def test_v2_the_smallest_limit_over_the_ancestors_holds(tmp_path: Path) -> None:
    where = tree(tmp_path, "0::/kubepods/pod1/app\n", {
        "kubepods/pod1/cpu.max": "25000 100000\n",  # the pod's limit
        "kubepods/pod1/app/cpu.max": "max 100000\n",
    })
    assert cpu_limit_cores(**where) == 0.25


def test_v2_in_a_cgroup_namespace_the_process_sees_its_cgroup_as_the_top(tmp_path: Path) -> None:
    assert cpu_limit_cores(**tree(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})) == 1.5


def test_v2_no_limit(tmp_path: Path) -> None:
    assert cpu_limit_cores(**tree(tmp_path, "0::/a/b\n", {"a/b/cpu.max": "max 100000\n"})) is None
    assert cpu_limit_cores(**tree(tmp_path, "0::/a/b\n", {})) is None  # no cpu controller there


def test_v1_the_cpu_controller_mounted_with_cpuacct(tmp_path: Path) -> None:
    where = tree(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "memory/docker/abc/cpu.cfs_quota_us": "1000\n",  # not the cpu controller's: ignored
        "memory/docker/abc/cpu.cfs_period_us": "100000\n",
    })
    assert cpu_limit_cores(**where) == 0.5


def test_v1_no_quota_and_unreadable_files_are_no_limit(tmp_path: Path) -> None:
    assert cpu_limit_cores(**tree(tmp_path, "2:cpu:/\n", {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})) is None
    assert cpu_limit_cores(**tree(tmp_path, "2:cpu:/x\n", {"cpu/x/cpu.cfs_quota_us": "garbage\n"})) is None
    assert cpu_limit_cores(proc_cgroup=tmp_path / "missing", root=tmp_path) is None


def test_the_default_budget_is_off_under_one_core_and_the_asked_one_always_holds() -> None:
    assert default_budget_us(None, 100.0, lambda: None) == (100.0, None)
    assert default_budget_us(None, 100.0, lambda: MIN_LIMIT_CORES) == (100.0, None)
    assert default_budget_us(None, 100.0, lambda: 4.0) == (100.0, None)
    assert default_budget_us(None, 100.0, lambda: 0.5) == (0.0, 0.5)
    assert default_budget_us(100.0, 100.0, lambda: 0.5) == (100.0, None)  # the service's word
    assert default_budget_us(0.0, 100.0, lambda: None) == (0.0, None)


@pytest.mark.parametrize(("limit", "asked", "polls_us", "logged"), [
    (None, None, DEFAULT_DB_SPIN_US, False),
    (0.5, None, 0.0, True),
    (0.5, 250.0, 250.0, False),
    (2.0, None, DEFAULT_DB_SPIN_US, False),
])
def test_the_consumer_s_connections_poll_by_its_limit(monkeypatch: pytest.MonkeyPatch, limit: float | None,
                                                       asked: float | None, polls_us: float, logged: bool) -> None:
    made: dict[str, Any] = {}

    def factory(dsn: str, **kwargs: Any) -> Any:
        made.update(kwargs)
        return lambda: None

    monkeypatch.setattr(inbox.cgroup, "cpu_limit_cores", lambda: limit)
    monkeypatch.setattr(inbox, "connect_factory", factory)
    config = InboxConfig(name="svc", dsn="postgresql://127.0.0.1:1/app", bootstrap_servers="127.0.0.1:1",
                         topics=["t"], db_spin_us=asked)
    with capture_logs() as logs:
        inbox.InboxConsumer(config, lambda conn, message: None)
    assert made["spin_s"] == polls_us / 1e6
    off = [e for e in logs if e["event"] == "db_spin_off"]
    assert bool(off) == logged
    if logged:
        assert off[0]["cpu_limit_cores"] == limit
