"""``python -m tests.soak``: the chaos soak's command line (:func:`tests.soak.cli.main`)."""

import sys

from tests.soak.cli import main

if __name__ == "__main__":
    sys.exit(main())
