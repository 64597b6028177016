"""A child process's lifetime tied to its parent's (the engine process to the server's, a
pipeline stage to the engine's)."""

from __future__ import annotations

import os
import threading
import time

PARENT_CHECK_S = 0.5


def follow_parent() -> None:
    """End when the parent process dies, however it dies. (Linux's PR_SET_PDEATHSIG would
    follow the parent's thread that started this process, not the process: a replica started
    from a passing thread would die with it.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="braid-follow-parent", daemon=True).start()
