"""Worker processes that die with the process that started them.

A process pool's workers outlive their owner when the owner is killed (``kill -9``, the out-of-
memory killer): ``ProcessPoolExecutor`` workers wait on a queue whose write end they hold
themselves, and a ``forkserver`` worker's parent is the fork server, not the owner. Four parse
workers (~250 MB each) were found alive 41 minutes after their ``flowopt ingest`` was killed.
:func:`die_with_parent` is the initializer of every process pool flowopt starts
(:func:`flow_assets.logs.chunks.ordered_map`). Standard library only: every worker imports it.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(owner_pid: int) -> None:
    """Process-pool initializer: make this worker die (SIGKILL) as soon as ``owner_pid``, the
    process that created the pool, dies, however it dies (``kill -9`` included).

    Two mechanisms, neither of which polls: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` kills the worker
    when its parent dies (a fork server exits when its owner dies), and a daemon thread waits on
    a pidfd of ``owner_pid`` (Linux >= 5.3) and kills the worker when the owner exits, whoever
    the parent is. A worker whose owner is already gone when it starts ends at once. On systems
    other than Linux this does nothing.

    Use: ``ProcessPoolExecutor(n, initializer=die_with_parent, initargs=(os.getpid(),))``.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a libc without prctl: the pidfd watch below still applies
    try:
        pidfd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)  # the owner died before this worker started
        return
    except (OSError, AttributeError):
        return  # a kernel without pidfd_open: PR_SET_PDEATHSIG alone

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the owner has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="flowopt-die-with-owner", daemon=True).start()
