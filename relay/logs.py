"""The only place that configures structlog.

JSON lines when stdout is not a terminal (or ``--log-format json``), readable
console lines otherwise.  Event names are stable snake_case (``batch_published``,
``lease_lost``); values that might hold secrets are masked by a processor.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from relay.config import is_secret, mask_text

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _mask_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for name, value in list(event.items()):
        if is_secret(name):
            event[name] = "***"
        elif isinstance(value, str) and ("://" in value or "password" in value.lower()):
            event[name] = mask_text(value)
    return event


def configure(*, log_format: str = "auto", level: str = "info", stream: Any = None) -> None:
    stream = stream if stream is not None else sys.stdout
    as_json = log_format == "json" or (log_format == "auto" and not stream.isatty())
    renderer: Any = (structlog.processors.JSONRenderer() if as_json
                     else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _mask_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get(**context: Any) -> Any:
    return structlog.get_logger("outbox_relay").bind(**context)
