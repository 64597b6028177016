"""The C heap of a long-running server (glibc).

Large requests (a 4 MB body, a /tokenize answer of millions of tokens, 100,000 bad words)
briefly take hundreds of MB in whichever thread handles them. glibc gives each thread an
arena of its own (up to 8 per core) and keeps what a freed arena held, so a server's resident
memory crept up with every large request (388 MB -> 1.3 GB in three rounds of the soak's
hostile requests on a tiny model). The server uses two arenas, and hands free memory back to
the system whenever the engine goes idle: a plateau near 0.9 GB for the same rounds. Elsewhere
than glibc these do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("braid.server")
_M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def limit_arenas(count: int = 2) -> None:
    """At most `count` malloc arenas for the process (call before threads start)."""
    if _LIBC is not None and not _LIBC.mallopt(_M_ARENA_MAX, count):
        logger.debug("mallopt(M_ARENA_MAX) was refused")


def trim() -> None:
    """Give the heap's free memory back to the system (a few ms)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
