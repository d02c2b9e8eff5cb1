"""The relay's modules stay small: every relay/*.py is at most 400 lines.

A module that could not be split at once would be capped at its size then, so that it
can only shrink (:data:`STILL_LARGE`, empty since every module was split); no module joins it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import relay

PACKAGE = Path(relay.__file__).parent
MAX_LINES = 400

#: Not split under 400 lines yet: the most lines each may have (none left).
STILL_LARGE: dict[str, int] = {}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda path: path.name)
def test_relay_module_is_small(path: Path) -> None:
    cap = STILL_LARGE.get(path.name) or MAX_LINES
    assert _lines(path) <= cap, f"relay/{path.name}: {_lines(path)} lines, at most {cap}"


def test_the_caps_name_modules_that_exist() -> None:
    """A module split or renamed leaves the lists (its cap would otherwise linger, unused)."""
    names = {path.name for path in PACKAGE.glob("*.py")}
    assert set(STILL_LARGE) <= names
    assert [name for name in STILL_LARGE if _lines(PACKAGE / name) <= MAX_LINES] == []
