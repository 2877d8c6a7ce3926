"""A bounded queue in front of a fixed number of generation worker threads.

At most ``workers + max_queue`` jobs are admitted at once; :meth:`WorkerPool.submit` refuses the next
one with :class:`QueueFull` (the server answers 429 with ``Retry-After``) instead of letting requests
pile up. Workers are plain threads: generation never runs on the event loop. A job talks back to its
request handler through an asyncio queue fed with ``loop.call_soon_threadsafe``; the handler cancels
it (client gone) by setting ``job.cancelled``, which the work function checks between pieces. A job
cancelled while still queued is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

log = logging.getLogger("speculate.server")


class QueueFull(Exception):
    """Every worker is busy and the queue is full."""


class Closed(Exception):
    """The server is shutting down: no job is admitted any more."""


class Job:
    """One generation request. ``work(job)`` runs on a worker thread and reports through :meth:`emit`."""

    def __init__(self, work: Callable[["Job"], None], loop: asyncio.AbstractEventLoop):
        self.work = work
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False  # set by the handler once it has read the final event
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None
        self.ended_by = None  # the error it was ended with (a shutdown), reported instead of 'cancelled'

    def emit(self, kind: str, value=None) -> None:
        """From the worker thread: hand an event ('piece', 'done', 'error', 'cancelled') to the handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def end(self, error) -> None:
        """Stop the job as a cancel does, but report ``error`` (an 'error' event) to its handler."""
        self.ended_by = error
        self.cancelled.set()

    def stopped(self) -> None:
        """From the worker: the job stopped early — 'error' with what ended it, else 'cancelled'."""
        if self.ended_by is not None:
            self.emit("error", self.ended_by)
        else:
            self.emit("cancelled")


class _Call:
    """:meth:`WorkerPool.call`'s work item: a function whose result (or exception) goes to a future."""

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.future = fn, Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as e:
            self.future.set_exception(e)


class WorkerPool:
    def __init__(self, workers: int, max_queue: int, on_change: Callable[[int, int], None] | None = None):
        if workers < 1 or max_queue < 0:
            raise ValueError("need workers >= 1 and max_queue >= 0")
        self.workers, self.max_queue = workers, max_queue
        self.on_change = on_change or (lambda running, queued: None)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.admitted = 0  # queued + running
        self.running = 0
        self._threads: list[threading.Thread] = []
        self._jobs: set[Job] = set()  # admitted, not finished
        self.closed = False

    @property
    def capacity(self) -> int:
        return self.workers + self.max_queue

    @property
    def started(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def start(self) -> None:
        if self._threads:  # (started early by call())
            return
        for i in range(self.workers):
            t = threading.Thread(target=self._loop, name=f"speculate-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def call(self, fn: Callable[[], object]):
        """Run ``fn()`` on a worker thread (starting the workers) and return its result, or raise its exception.

        The server loads its models this way (server/main.py, build_app), so that only the workers, which
        generate, keep OpenMP teams (models/loader.py, check_thread: extra teams slow every forward)."""
        if threading.current_thread() in self._threads:  # it would wait for itself
            raise RuntimeError("WorkerPool.call from one of its own workers")
        self.start()
        call = _Call(fn)
        self._queue.put(call)
        return call.future.result()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.closed:
                raise Closed()
            if self.admitted >= self.capacity:
                raise QueueFull()
            self.admitted += 1
            self._jobs.add(job)
            self._changed()
        self._queue.put(job)

    def close(self, error) -> None:
        """Admit nothing more, and end every job still waiting for a worker with ``error``."""
        with self._lock:
            self.closed = True
            waiting = [job for job in self._jobs if job.started_at is None]
        for job in waiting:
            job.end(error)

    def end_running(self, error) -> None:
        """End every job that is running with ``error`` (the shutdown's grace period is over)."""
        with self._lock:
            running = list(self._jobs)
        for job in running:
            job.end(error)

    def _changed(self) -> None:  # under the lock
        self.on_change(self.running, self.admitted - self.running)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Call):  # not a request: no admission, no load accounting
                job.run()
                continue
            with self._lock:
                self.running += 1
                self._changed()
            try:
                if job.cancelled.is_set():
                    job.stopped()
                else:
                    job.started_at = time.perf_counter()
                    job.work(job)
            except BaseException as e:  # the work function reports its own errors; this is a last resort
                log.exception("generation worker error")
                job.emit("error", e)
            finally:
                with self._lock:
                    self.running -= 1
                    self.admitted -= 1
                    self._jobs.discard(job)
                    self._changed()
