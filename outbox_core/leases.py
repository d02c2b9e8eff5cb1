"""The local lease clock, shared by the relay's shard leases and the jobs worker's job leases.

The database decides a lease's expiry (``lease_until``) on its own clock; a process
trusts its lease only until a local monotonic deadline that is never later than that.
"""

from __future__ import annotations

__all__ = ["local_deadline", "safety_margin_s"]


def safety_margin_s(lease_s: float) -> float:
    """How long before the database's expiry a holder stops trusting its lease.

    Covers the round trip of the renewal and a small clock-rate difference.
    """
    return min(1.0, lease_s * 0.1)


def local_deadline(sent_at: float, lease_s: float) -> float:
    """Monotonic time until which a lease renewed by a call sent at ``sent_at`` is trusted.

    The database computed ``lease_until`` from its own clock *after* the call was
    sent, so counting from ``sent_at`` errs on the safe side.
    """
    return sent_at + lease_s - safety_margin_s(lease_s)
