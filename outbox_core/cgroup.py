"""How much CPU this process may use: the CPU limit of its control group (a container's
``resources.limits.cpu``, a systemd unit's ``CPUQuota=``), in cores.

Linux enforces a limit as a quota of CPU time per period (CFS bandwidth control): a
process whose threads spend the quota before the period ends is stopped until the next one.
A cgroup's limit applies to everything below it, so the process's limit is the smallest
over its cgroup and their ancestors.  Both layouts are read:

* cgroup v2: ``cpu.max`` holds ``"<quota> <period>"`` (µs) or ``"max <period>"``;
* cgroup v1: the ``cpu`` controller's ``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us``.

Anything that cannot be read counts as no limit: the caller's behaviour without a limit is
the one it had before it asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path, PurePosixPath

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_limit_cores(*, proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The smallest CPU limit over this process's cgroups and their ancestors, in cores
    (0.5: half of one core's time); None when there is none or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            limits += _walk(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            for mount in _v1_mounts(root, controllers):
                limits += _walk(mount, path, _v1_limit)
    return min(limits) if limits else None


def _walk(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The limits found in ``path``'s cgroup under ``mount`` and in each of its ancestors.
    (A process in a cgroup namespace sees its own cgroup as "/": the mount's top.)"""
    found = []
    relative = PurePosixPath(path if path.startswith("/") else "/" + path)
    for level in (relative, *relative.parents):
        directory = mount / str(level).lstrip("/")
        limit = read(directory)
        if limit is not None:
            found.append(limit)
    return found


def _v1_mounts(root: Path, controllers: str) -> list[Path]:
    """Where a v1 hierarchy carrying ``cpu`` is mounted: named after its controllers
    (``cpu,cpuacct``), often with a ``cpu`` link to it."""
    seen: list[Path] = []
    for name in (controllers, "cpu", "cpu,cpuacct"):
        mount = root / name
        if mount.is_dir() and not any(mount.resolve() == other.resolve() for other in seen):
            seen.append(mount)
    return seen


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        return None
    return None if quota == "max" else _cores(quota, period or "100000")


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _cores(quota, period)


def _cores(quota: str, period: str) -> float | None:
    try:
        cores = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return cores if cores > 0 and math.isfinite(cores) else None  # -1: no limit
