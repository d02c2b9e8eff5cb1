"""What the :class:`~tests.soak.run.Soak` mixins share: the attributes ``Soak`` sets up,
declared once for the type checker (no behaviour here)."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

from tests.fixtures.pg import EmbeddedPgServer
from tests.fixtures.proxy import TcpProxy
from tests.soak.config import SoakConfig, SoakReport
from tests.soak.members import Member, Writers


class SoakState:
    cfg: SoakConfig
    t0: float
    dsn: str
    bootstrap: str
    workdir: Path
    pg: EmbeddedPgServer | None
    proxy: TcpProxy | None
    members: dict[str, Member]
    writers: Writers | None
    jobs_enabled: bool
    jobs_note: str
    report: SoakReport
    faults: Counter[str]
    bad_inputs: Counter[str]
    fault_log: list[str]
    poison_ids: list[str]
    bad_messages: dict[str, str]
    peak_backlog: int
    _applied: set[str]
    _abort: threading.Event
    _lock: threading.Lock

    def say(self, text: str) -> None:
        raise NotImplementedError  # Soak.say
