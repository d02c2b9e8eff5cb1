"""The SDK's secret masking: :mod:`outbox_core.secrets` (one copy of the rules, shared with
the relay), with :func:`validate_dsn` raising the SDK's :class:`~consumer_sdk.errors.ConfigError`."""

from __future__ import annotations

from consumer_sdk.errors import ConfigError
from outbox_core import secrets as _core
from outbox_core.secrets import (
    MASK,
    SECRET_MARKERS,
    is_secret,
    mask_dsn,
    mask_text,
    masked_properties,
    safe_repr,
    scrub,
)

__all__ = ["MASK", "SECRET_MARKERS", "is_secret", "mask_dsn", "mask_text", "masked_properties",
           "safe_repr", "scrub", "validate_dsn"]


def validate_dsn(dsn: str, *, option: str = "dsn") -> None:
    """Reject a DSN libpq cannot parse, with :class:`ConfigError` showing no piece of its password."""
    try:
        _core.validate_dsn(dsn, option=option)
    except _core.InvalidDsn as exc:
        raise ConfigError(str(exc)) from None
