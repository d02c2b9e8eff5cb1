"""The one back-off formula: capped exponential growth with jitter (pure, randomness injected).

After failure number ``attempt`` (1-based) the ceiling is
``initial_s * multiplier ** (attempt - 1)``, capped at ``max_s``; the delay is drawn
uniformly from ``[ceiling * (1 - jitter), ceiling]``, so that callers that failed
together do not come back together.  ``jitter=0`` gives the ceiling itself.

Callers and their settings:

* the relay's publish retries (``relay/failures.py``): ``--backoff-initial-s`` /
  ``--backoff-max-s``, multiplier 2, jitter 0.5;
* the relay's database reconnects (``relay/reconnect.py``): 0.5 s to 2 s (never above
  ``--backoff-max-s``), multiplier 2, jitter 0.5;
* the jobs worker's retries (``consumer_sdk/jobs/retry.py``: :class:`Backoff`);
* the inbox consumer's database reconnects (``consumer_sdk/inbox_upkeep.py``): jitter 0;
* the relay's LISTEN connection for shard notices (``relay/wakeup.py``): the ceiling,
  1 s to 30 s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

__all__ = ["backoff_s", "ceiling_s"]


def ceiling_s(attempt: int, *, initial_s: float, max_s: float, multiplier: float = 2.0) -> float:
    """The longest wait after failure number ``attempt`` (attempts below 1 count as 1)."""
    if initial_s < 0 or max_s < 0 or multiplier < 1:
        raise ValueError("need initial_s >= 0, max_s >= 0 and multiplier >= 1")
    exponent = max(attempt - 1, 0)
    if initial_s == 0 or multiplier == 1 or max_s <= initial_s:
        return float(min(max_s, initial_s))
    # Past this exponent the cap is reached: never compute a huge (overflowing) power.
    if exponent >= math.log(max_s / initial_s, multiplier) + 1:
        return float(max_s)
    try:
        return float(min(max_s, initial_s * multiplier**exponent))
    except OverflowError:
        return float(max_s)


def backoff_s(attempt: int, *, initial_s: float, max_s: float, multiplier: float = 2.0,
              jitter: float = 0.5, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait after failure number ``attempt``: uniform in
    ``[ceiling * (1 - jitter), ceiling]`` (``rand()`` in ``[0, 1)``; 0 gives the ceiling)."""
    if not 0 <= jitter <= 1:
        raise ValueError("jitter must be within [0, 1]")
    ceiling = ceiling_s(attempt, initial_s=initial_s, max_s=max_s, multiplier=multiplier)
    if jitter == 0:
        return ceiling
    return ceiling * (1.0 - jitter * rand())
