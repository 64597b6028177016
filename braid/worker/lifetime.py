"""A child process's lifetime tied to its parent's (the engine process to the server's, a
pipeline stage to the engine's), and the error that ends an engine whose executor can run
no more steps."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

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


def exit_on_failure(what: str, fn: Callable[..., None], *args: Any) -> None:
    """`fn(*args)`; where it raises, this process ends (logged), as a process running it
    as its main would: for a Ray actor's loop (an engine, a pipeline stage), whose owner
    then sees a dead actor and its connections closed, instead of an actor that answers
    nothing and keeps them open."""
    try:
        fn(*args)
    except BaseException:
        logging.getLogger("braid").exception("%s failed; its process ends", what)
        os._exit(1)


class ExecutorBroken(RuntimeError):
    """The executor cannot run any step again (a pipeline stage is gone): the engine ends, so
    whatever runs it (the server's replicas) sees a dead engine and starts a new one,
    instead of failing every later step's requests one by one."""
