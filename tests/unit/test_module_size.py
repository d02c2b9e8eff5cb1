"""The product's modules stay small: every module of relay, consumer_sdk (its subpackages
included) and outbox_core is under 400 lines.  (relay/ and consumer_sdk/ each had a
module over 600 lines until issue 18's thirty-sixth session split them.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import consumer_sdk
import outbox_core
import relay

MAX_LINES = 400
ROOT = Path(relay.__file__).parent.parent
MODULES = sorted(path for package in (relay, consumer_sdk, outbox_core)
                 for path in Path(package.__file__).parent.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(ROOT)))
def test_module_is_small(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines, fewer than {MAX_LINES} wanted"


def test_every_package_is_looked_at() -> None:
    """The list is not empty by mistake (a package moved): each package gives modules."""
    for package in ("relay", "consumer_sdk", "outbox_core"):
        assert any(path.relative_to(ROOT).parts[0] == package for path in MODULES), package
