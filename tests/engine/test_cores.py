"""The engine steps aside a core while the server's process works (braid/engine/cores.py)."""

from __future__ import annotations

import os

from braid.engine.cores import WINDOW_S, CoreShare, cpu_seconds


def test_the_engine_runs_a_thread_fewer_while_the_server_is_busy() -> None:
    now, cpu, threads = [0.0], [0.0], []
    share = CoreShare(1, 2, threads.append, clock=lambda: now[0], read=lambda pid: cpu[0])

    def window(cores: float) -> None:
        now[0] += 1.5 * WINDOW_S
        cpu[0] += cores * 1.5 * WINDOW_S
        share.check()

    window(0.1)
    assert threads == [] and share.now == 2
    window(0.9)  # the server took a core: one thread fewer
    window(0.45)  # between the marks: as it was
    assert threads == [1] and share.now == 1 and share.times == 1
    window(0.1)  # calm again: every core
    assert threads == [1, 2] and share.now == 2
    now[0] += WINDOW_S / 3
    cpu[0] += 1.0
    share.check()  # within a window: nothing read
    assert threads == [1, 2]


def test_one_thread_or_no_proc_means_no_sharing() -> None:
    assert not CoreShare(1, 1, print).active
    assert not CoreShare(1, 2, print, read=lambda pid: None).active
    assert cpu_seconds(os.getpid()) is not None or not os.path.exists("/proc")
