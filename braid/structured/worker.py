"""Grammar work off every other thread's stack.

llguidance's grammar compiler recurses once per level of a grammar's chain of rules (or of
`$ref`s in a JSON schema): a chain of 3,000 Lark rules overflowed the 8 MiB stack of the
thread that compiled it and the process died of SIGSEGV, with no log line. So each job runs
on a thread of its own with a stack of `STACK_BYTES`: address space reserved when the thread
starts, pages touched only as deep as the job recurses, all returned when the thread ends.
Jobs run one at a time, in the order submitted. With specs bounded by `MAX_GRAMMAR_BYTES`
(grammar.py) the deepest chain they can spell needs well under a quarter of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

STACK_BYTES = 512 * 2**20
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide
T = TypeVar("T")


class GrammarWorker:
    """A queue of jobs, each run on a fresh thread with a large stack."""

    def __init__(self) -> None:
        self._queue = ThreadPoolExecutor(1, thread_name_prefix="braid-grammar")

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._queue.submit(run_on_large_stack, fn, *args)

    def shutdown(self) -> None:
        self._queue.shutdown(wait=False, cancel_futures=True)


def run_on_large_stack(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a new thread with a `STACK_BYTES` stack; its result or its exception."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller's thread
            outcome.append((False, e))

    thread = _start(run)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _start(target: Callable[[], None]) -> threading.Thread:
    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(STACK_BYTES)
        try:
            thread = threading.Thread(target=target, name="braid-grammar-job", daemon=True)
            thread.start()
        except RuntimeError:  # no address space for the stack (strict overcommit)
            logger.warning("cannot reserve a %d MiB stack for grammar work; using the "
                           "default one", STACK_BYTES >> 20)
            threading.stack_size(previous)
            thread = threading.Thread(target=target, name="braid-grammar-job", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread
