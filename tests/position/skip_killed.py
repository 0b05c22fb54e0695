"""``python -m resumable_data skip ...`` that SIGKILLs itself at its N-th durable operation (a kill point).

    python tests/position/skip_killed.py N skip CHECKPOINT --batches K

Like ``tests/system/killpoints.py`` for the trainer: the moments that matter in a checkpoint write are
its ``os.fsync`` and ``os.rename`` calls (payload synced, manifest synced, folder synced, published),
so the process counts them and kills itself, with nothing flushed and no handler run, at call N —
before the call is made. N = 0 never fires (a run to completion).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from resumable_data.__main__ import main


def arm(n: int) -> None:
    calls = 0

    def armed(call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return call(*args, **kwargs)

        return wrapper

    os.fsync = armed(os.fsync)
    os.rename = armed(os.rename)


if __name__ == "__main__":
    arm(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
