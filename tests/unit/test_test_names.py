"""Every test file's name is unique across tests/: the test directories are not packages, so
pytest imports each file under its bare name, and a second file of the same name fails to be
collected ("import file mismatch") — in CI, where every tier is collected at once, even when
each passes alone (this round's first CI run: a unit test and a fault test both named
test_jobs_unanswered.py)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_two_test_files_share_a_name() -> None:
    found: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        found[path.name].append(str(path.relative_to(TESTS)))
    assert len(found) > 100, f"only {len(found)} test files found under {TESTS}"
    shared = {name: sorted(paths) for name, paths in found.items() if len(paths) > 1}
    assert not shared, f"test files sharing a name (rename one of each): {shared}"
