"""The one error of the embedded services that a person fixes: they cannot start here."""

from __future__ import annotations


class EmbeddedUnavailable(RuntimeError):
    """An embedded service cannot start on this machine (a missing extra, running as root);
    the message is one line saying what to do."""
