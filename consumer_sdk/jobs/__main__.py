"""``python -m consumer_sdk.jobs``: see :mod:`consumer_sdk.jobs.cli`."""

from __future__ import annotations

import sys

from consumer_sdk.jobs.cli import main

sys.exit(main())
