"""The storage tier's worker threads: one per kind of job (``"write"``, ``"prefetch"``), started on
the first job of its kind, each running its queue in order; or, without ``background``, every job on
the caller's thread at once. ``stop`` lets each worker finish what was queued, then joins it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable


class StorageWorkers:
    """The storage tier's job queues and their threads (see the module).

    Parameters
    ----------
    background : run jobs on worker threads (False: on the caller's thread).
    """

    def __init__(self, background: bool) -> None:
        self.background = background
        self._workers: dict[str, tuple[queue.Queue, threading.Thread]] = {}

    def submit(self, kind: str, job: Callable[[], None]) -> None:
        """Run ``job`` on ``kind``'s worker (started if none runs), after the jobs queued before it."""
        if not self.background:
            job()
            return
        worker = self._workers.get(kind)
        if worker is None:
            q: queue.Queue = queue.Queue()
            thread = threading.Thread(target=_serve, args=(q,), name=f"kvpool-storage-{kind}", daemon=True)
            thread.start()
            worker = self._workers[kind] = (q, thread)
        worker[0].put(job)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until the workers have run every job queued so far; False if ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        for q, _ in self._workers.values():
            done = threading.Event()
            q.put(done.set)
            if not done.wait(_left(deadline)):
                return False
        return True

    def threads(self) -> list[threading.Thread]:
        """The worker threads started and not stopped yet."""
        return [t for _, t in self._workers.values()]

    def stop(self, timeout_s: float) -> list[str]:
        """Let every worker run what was queued, then end and join it within ``timeout_s`` seconds in
        all; returns the names of those still running then (their jobs did not return). Jobs
        submitted afterwards run on the caller's thread."""
        deadline = time.monotonic() + timeout_s
        workers = self._workers
        self.background = False
        for q, _ in workers.values():
            q.put(None)
        for _, thread in workers.values():
            thread.join(_left(deadline))
        self._workers = {kind: w for kind, w in workers.items() if w[1].is_alive()}  # a later stop joins them again
        return [t.name for _, t in self._workers.values()]


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()`` time; inf: none), as a wait takes them."""
    return min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)


def _serve(q: queue.Queue) -> None:
    while True:
        job = q.get()
        if job is None:
            return
        job()
