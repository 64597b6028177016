"""Cores shared with the server's process.

The engine's steps run torch's intra-op threads, one per core by default. On a small machine
the server's process needs a core of its own at times: tokenizing a multi-megabyte /tokenize
body, tokenizing 100,000 bad words, writing a response of every prompt token's logprobs.
Meanwhile a step whose work is split over every core waits, at each parallel op, for the
thread that shares its core with the server (measured on 2 cores: an innocent stream's pace
5.8x slower beside a 3.5 MB /tokenize with 2 engine threads, 2.4x with 1). vLLM's CPU backend
reserves cores for its front end (VLLM_CPU_NUM_OF_RESERVED_CPU), for good; `CoreShare` steps
aside only while the server works: it reads the server process's CPU time (Linux's
/proc/<pid>/stat), and while that is above `BUSY` of a core it runs one thread fewer,
back to all of them once it falls below `CALM`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("braid")

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
WINDOW_S = 0.1  # how often the server's CPU time is read
BUSY = 0.6  # cores' worth of the server's CPU time from which the engine steps aside
CALM = 0.3  # and below which it takes every core again


def cpu_seconds(pid: int) -> float | None:
    """The process's CPU time so far, all its threads (None where /proc cannot tell)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


class CoreShare:
    """Sets the engine's thread count from the server's recent CPU use: `threads` while the
    server is calm, one fewer while it is busy (never under one)."""

    def __init__(self, server_pid: int, threads: int, set_threads: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic,
                 read: Callable[[int], float | None] = cpu_seconds) -> None:
        self.server_pid, self.threads, self.set_threads = server_pid, threads, set_threads
        self.clock, self.read = clock, read
        self.now = threads
        self.times = 0  # steps aside so far (the tests and the log read it)
        self._at, self._cpu = clock(), read(server_pid)

    @property
    def active(self) -> bool:
        return self.threads > 1 and self._cpu is not None

    def check(self) -> None:
        """Read the server's CPU time once a window has passed; step aside or back."""
        if not self.active:
            return
        now = self.clock()
        if now - self._at < WINDOW_S:
            return
        cpu = self.read(self.server_pid)
        if cpu is None:
            return
        busy = (cpu - self._cpu) / (now - self._at)  # type: ignore[operator]
        self._at, self._cpu = now, cpu
        want = self.now
        if busy >= BUSY:
            want = self.threads - 1
        elif busy < CALM:
            want = self.threads
        if want != self.now:
            self.set_threads(want)
            self.times += want < self.now
            logger.debug("the server's process used %.2f cores: the engine runs %d threads",
                         busy, want)
            self.now = want
