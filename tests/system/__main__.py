"""``python tests/system verify-resume|chaos|gpu-smoke`` from the checkout's root; see :mod:`system.cli`."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: import the checkout's trainer and this package, not its modules loose
    TESTS = Path(__file__).resolve().parents[1]
    sys.path[0:1] = [str(TESTS.parent), str(TESTS)]

from system.cli import main

sys.exit(main())
