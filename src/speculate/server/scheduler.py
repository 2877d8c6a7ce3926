"""Continuous batching: one generation thread moves every running request by one speculative round at a time,
all their rows in ONE target forward (engine.py, ``step``).

Requests join at round boundaries and leave when done; between rounds the thread takes what arrived, drops the
requests whose client left, and admits waiting ones up to ``max_batch``. A new request's prompt goes in by
chunks of ``prefill_chunk`` tokens (one chunk per round, in the same forward as the others' drafts), so a long
prompt does not stall the requests already running; its last chunk goes with its first draft, so the round that
completes the prompt gives its first token (``Run.joins``). At most ``max_batch + max_queue`` requests are admitted at
once; :meth:`Scheduler.submit` refuses the next with :class:`QueueFull` (the server answers 429 with
``Retry-After``) instead of letting requests pile up.

Why one thread: decoding on a CPU is bound by reading the weights, so one forward over the rows of 8 requests
costs little more than over one request's (docs/benchmarks.md, "Batched serving"), while several generation
threads each kept an OpenMP team and competed for the same cores (slower than one at every load). At int8 and
q4 every row's bits are independent of the other rows (models/exactness.py), so a batched greedy answer is the
answer that request gets alone.

A job talks back to its request handler through an asyncio queue fed with ``loop.call_soon_threadsafe``; the
handler cancels it (client gone) by setting ``job.cancelled``, which the thread checks between rounds.

Admission by memory (--kv-memory): a job that says what a cache position costs it (``Job.position_bytes``) joins the
batch when its prompt and a first stretch of output (``STRETCH`` positions) fit beside what the running generations
hold, and its cache is allocated for that much; once it has taken its prompt's cached blocks from the prefix store, it
reserves only what it computes (the store's blocks are held once, under the store's own budget). Before each round a generation whose next round would pass its
reservation gets another stretch; where the budget has no room for it, the youngest generation is preempted: its
cache is given up (its blocks the prefix store holds stay there) and its job goes to the front of the waiting line,
to resume later from its tokens so far (``Run.resume``: recomputed, or found in the store). A job
without ``position_bytes`` reserves its whole ``kv_bytes`` at once and is never preempted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ..engine import Run, step
from ..models.kernel import KEYS, release_openmp_threads

log = logging.getLogger("speculate.server")

STRETCH = 256  # cache positions a generation reserves at a time past its tokens (admission by memory)


def _blocks(positions: int) -> int:
    """``positions`` rounded up to whole blocks of the cache (a lean cache is allocated in blocks of KEYS)."""
    return -(-positions // KEYS) * KEYS


def _computed_beside(run: Run, chosen: list[Run]) -> bool:
    """Whether a run chosen to prefill this round completes, from the same tokens, the prompt block that ``run``
    would complete next (a block of the prefix store, models/prefix_store.py, which it then takes next round)."""
    end = (run.filled // KEYS + 1) * KEYS  # the end of the block run's next chunk completes first
    if run.store is None or run.store.block != KEYS or not run.store.budget:
        return False  # (a store that keeps nothing: the block would not be there to take)
    return any(c.filled <= run.filled and c.filled + c.prefill_rows >= end and run.could_take(end, c)
               and c.tokens[:end] == run.tokens[:end] for c in chosen)


def _held(run: Run) -> int:
    """Bytes of KV cache ``run`` alone holds now: the target's and its drafter's (a draft model's). Blocks it maps from
    the prefix store are not counted: the store's own budget (--prefix-cache-gib) holds them."""
    return run.kv.own_bytes + run.drafter.cache_bytes()


class QueueFull(Exception):
    """The batch is full and so is the queue."""


class Closed(Exception):
    """The server is shutting down: no job is admitted any more."""


@dataclass
class Outcome:
    generation: object  # engine.Generation
    first_piece_at: float | None  # perf_counter time of the first text piece


class Job:
    """One generation request. ``open()`` runs on the generation thread when the job is admitted to the batch and
    returns ``(run, release)``: the engine's :class:`~speculate.engine.Run` and the function that gives its cache
    up (it ended, or was preempted); what it raises (settings the engine refuses) goes to the handler as the job's
    error."""

    def __init__(self, open: Callable[..., tuple[Run, Callable[[], None]]], loop: asyncio.AbstractEventLoop,
                 prompt_tokens: int = 0, drafter: str = "", kv_bytes: int = 0, position_bytes: int = 0):
        self.open = open
        self.prompt_tokens = prompt_tokens  # (admission: a long prompt may wait while shorter ones pass it)
        self.drafter = drafter  # its drafter's name, for the metrics' τ by drafter
        self.kv_bytes = kv_bytes  # the KV cache its generation may fill: never more than the --kv-memory budget
        # What one cache position costs it (the target's and a draft model's): reserved a stretch at a time, and
        # open(resume=run, reserve=positions) takes a preempted run back. 0: kv_bytes at once, never preempted.
        self.position_bytes = position_bytes
        self.run: Run | None = None  # its run, while it waits to resume after a preemption...
        self.sent: tuple = ()  # ...and what had gone to its handler (_Running's first, scored, prompt_scored)
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False  # set by the handler once it has read the final event
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None
        self.ended_by = None  # the error it was ended with (a shutdown), reported instead of 'cancelled'

    def emit(self, kind: str, value=None) -> None:
        """From the generation thread: hand an event ('ready', 'piece', 'done', 'error', 'cancelled') to the
        handler."""
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
        """The job stopped early — 'error' with what ended it, else 'cancelled'."""
        if self.ended_by is not None:
            self.emit("error", self.ended_by)
        else:
            self.emit("cancelled")


class _Call:
    """:meth:`Scheduler.call`'s work item: a function whose result (or exception) goes to a future."""

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.future = fn, Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as e:
            self.future.set_exception(e)


@dataclass
class _Running:
    job: Job
    run: Run
    release: Callable[[], None]
    reserved: int = 0  # bytes of the --kv-memory budget it holds
    positions: int = 0  # cache positions those bytes are (stretch admission; 0: the job's whole kv_bytes)
    first: float | None = None  # when its first text piece went out
    scored: int = 0  # its new tokens' log-probabilities sent so far (a stream that asked for them)
    prompt_scored: bool = False  # its prompt's log-probabilities sent (echo with logprobs), once its prefill is done


class Scheduler:
    """``max_batch``: generations that share a forward; ``max_queue``: admitted requests waiting for a place.
    ``plan(runs) -> (ks, depths)``: each run's draft length and deepest draft this round (k by batch size,
    speculate/policy/batch.py, ``BatchPlanner.round``; None: each run's own policy, and as deep as it drafts), and
    ``observe(runs, seconds)`` what the round it planned took (the planner's gate, which withholds drafts where they
    measure slower). ``on_change(running, queued)``, ``on_round(generations, rows,
    seconds)`` and ``on_admit(seconds queued)`` feed the metrics."""

    def __init__(self, max_batch: int, max_queue: int, on_change: Callable[[int, int], None] | None = None,
                 plan: Callable[[list[Run]], tuple[list | None, list | None]] | None = None, prefill_chunk: int = 128,
                 prefill_budget: int | None = None, kv_budget: int = 0, stretch: int = STRETCH):
        prefill_budget = prefill_budget or 2 * prefill_chunk
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1 or prefill_budget < 1:
            raise ValueError("need max_batch >= 1, max_queue >= 0, prefill_chunk >= 1 and prefill_budget >= 1")
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        # Prompt tokens all joining requests feed in one round together, the shortest remaining prompt first; and
        # at most max_long_prefills requests whose prompt exceeds that budget prefill at once, shorter ones
        # admitted past the others. Before, 8 prompts of 3,900 tokens held every place in the batch while each fed
        # its chunk every round: a 16-token request beside them took 45 s, against 0.16 s alone (issue 42).
        self.prefill_budget = prefill_budget
        self.max_long_prefills = max(1, max_batch // 2)
        # Admission by memory (--kv-memory): a request joins the batch only while the KV its running generations may
        # fill (kv_reserved) leaves room for its own. A request that needs more than the whole budget never joins (the handler refuses it: too_large).
        self.kv_budget, self.kv_reserved = kv_budget, 0
        self.stretch = stretch
        self.on_change = on_change or (lambda running, queued: None)
        self.on_round: Callable[[int, int, float], None] = lambda generations, rows, seconds: None
        self.on_admit: Callable[[float], None] = lambda queued_seconds: None
        self.on_preempt: Callable[[], None] = lambda: None
        self.preempted = 0  # generations preempted so far
        self.plan = plan or (lambda runs: (None, None))
        self.observe: Callable[[list[Run], float], None] = lambda runs, seconds: None
        self._inbox: queue.Queue = queue.Queue()  # jobs, calls, None (stop)
        self._waiting: deque[Job] = deque()
        self._running: list[_Running] = []
        self._lock = threading.Lock()
        self.admitted = 0  # waiting + running
        self.running = 0
        self._thread: threading.Thread | None = None
        self._jobs: set[Job] = set()  # admitted, not finished
        self.closed = False

    @property
    def capacity(self) -> int:
        return self.max_batch + self.max_queue

    @property
    def started(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:  # (started early by call())
            return
        # The starting thread hands every forward to the generation thread: it gives back the OpenMP workers it
        # may hold (a torch op run before, e.g. a benchmark's machine line), or the two teams would slow every
        # forward ~2x (models/kernel.py, release_openmp_threads).
        release_openmp_threads()
        self._thread = threading.Thread(target=self._loop, name="speculate-generation", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout)
            self._thread = None

    def call(self, fn: Callable[[], object]):
        """Run ``fn()`` on the generation thread (starting it) and return its result, or raise its exception.

        The server loads its models this way (server/main.py, build_app), so that only the thread that generates
        keeps an OpenMP team (models/loader.py, check_thread: extra teams slow every forward)."""
        if threading.current_thread() is self._thread:  # it would wait for itself
            raise RuntimeError("Scheduler.call from the generation thread")
        self.start()
        call = _Call(fn)
        self._inbox.put(call)
        return call.future.result()

    def too_large(self, job: Job) -> bool:
        """Whether ``job`` needs more KV memory than the whole --kv-memory budget (it could never join the batch)."""
        return bool(self.kv_budget) and job.kv_bytes > self.kv_budget

    def submit(self, *jobs: Job) -> None:
        """Admit ``jobs`` (a request's choices) together, or none of them (QueueFull, Closed)."""
        with self._lock:
            if self.closed:
                raise Closed()
            if self.admitted + len(jobs) > self.capacity:
                raise QueueFull()
            self.admitted += len(jobs)
            self._jobs.update(jobs)
            self._changed()
        for job in jobs:
            self._inbox.put(job)

    def close(self, error) -> None:
        """Admit nothing more, and end every job still waiting for a place with ``error``."""
        with self._lock:
            self.closed = True
            waiting = [job for job in self._jobs if job.started_at is None]
        for job in waiting:
            job.end(error)

    def end_running(self, error) -> None:
        """End every job that is admitted with ``error`` (the shutdown's grace period is over)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.end(error)

    def _changed(self) -> None:  # under the lock
        self.on_change(self.running, self.admitted - self.running)

    # --- the generation thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            # Nothing to run: the generation thread gives its OpenMP workers back while it waits, so that another
            # thread's team (another server in this process, a caller's own forwards) spins alone; the next round
            # makes them again (models/kernel.py, release_openmp_threads).
            idle = not self._running and not self._waiting
            if idle:
                release_openmp_threads()
            if not self._take(block=idle):
                return
            self._drop_cancelled()
            self._admit()
            if self._running:
                try:
                    self._round()
                except BaseException as e:  # a last resort: the round's own errors are the runs'
                    log.exception("generation error")
                    for r in list(self._running):
                        self._finish(r, error=e)

    def _take(self, block: bool) -> bool:
        """Move what arrived into the waiting line (running calls at once); False when told to stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, _Call):  # not a request: no admission, no load accounting
                item.run()
            else:
                self._waiting.append(item)

    def _drop_cancelled(self) -> None:
        """Requests whose client left (or that a shutdown ended) leave the batch between rounds; their caches are
        given up."""
        for r in [r for r in self._running if r.job.cancelled.is_set()]:
            self._finish(r)
            r.job.stopped()

    def _admit(self) -> None:
        long_prefills = sum(self._long(r.job) and r.run.prefilling for r in self._running)
        i = 0
        while i < len(self._waiting) and len(self._running) < self.max_batch:
            job = self._waiting[i]
            long = self._long(job)
            if long and long_prefills >= self.max_long_prefills and not job.cancelled.is_set():
                i += 1  # it waits for a long prefill to end; a shorter request behind it may go first
                continue
            if job.cancelled.is_set():
                del self._waiting[i]
                job.stopped()
                self._forget(job)
                continue
            positions = self._first_stretch(job)
            need = job.position_bytes * positions if positions else job.kv_bytes
            if self.kv_budget and self._running and self.kv_reserved + need > self.kv_budget:
                break  # it waits for memory, and those behind it with it (first come, first served)
            del self._waiting[i]
            resumed, job.run = job.run, None
            if resumed is None:
                job.started_at = time.perf_counter()
                self.on_admit(job.started_at - job.submitted_at)
            try:
                run, release = (job.open(resume=resumed, reserve=positions) if positions else job.open())
            except Exception as e:  # noqa: BLE001 — the handler's to report (server/app.py, as_api_error)
                job.emit("error", e)
                self._forget(job)
                continue
            if job.cancelled.is_set():  # the client left while the decoder was being built: no prefill for nobody
                release()
                job.stopped()
                self._forget(job)
                continue
            if resumed is None:
                job.emit("ready")
            if positions:
                # Admitted on its whole stretch, it reserves what it computes: the positions it took from the prefix
                # store are the store's (a resumed run's cache may hold more than the stretch: what it holds counts).
                need = max(need - job.position_bytes * run.filled, _held(run))
            sent, job.sent = job.sent, ()  # (a resumed job's text and log-probabilities went out once already)
            self._running.append(_Running(job, run, release, need, positions, *sent))
            self.kv_reserved += need
            long_prefills += long
            with self._lock:
                self.running += 1
                self._changed()

    def _first_stretch(self, job: Job) -> int:
        """The cache positions ``job`` reserves as it joins: its tokens so far (a preempted run's whole sequence) and
        a stretch past them, at most all it may need; 0 where it reserves its whole kv_bytes instead."""
        if not (self.kv_budget and job.position_bytes):
            return 0
        most = job.kv_bytes // job.position_bytes if job.run is None else job.run.positions_needed
        have = job.prompt_tokens if job.run is None else len(job.run.tokens)
        return _blocks(min(most, have + self.stretch))

    def _grow(self) -> None:
        """Before a round: each generation whose round could pass its reserved positions gets another stretch,
        the oldest first; where the budget has no room, the youngest generations that may be are preempted until it
        has (the growing one itself, if it is the youngest)."""
        for r in list(self._running):
            if r not in self._running or not r.positions or r.run.positions_next <= r.positions:
                continue
            grant = _blocks(min(r.run.positions_needed, max(r.run.positions_next, r.positions + self.stretch)))
            extra = (grant - r.positions) * r.job.position_bytes
            while self.kv_reserved + extra > self.kv_budget:
                # The youngest that may be preempted (a list in the order they joined), r included.
                victim = [v for v in self._running if v.run.preemptible or v is r][-1]
                if len(self._running) == 1:  # alone: its whole need fits the budget (too_large)
                    break
                self._preempt(victim)
                if victim is r:
                    break
            if r not in self._running:
                continue
            r.run.kv.ensure(grant)  # (allocated as reserved: a cache grown by doubling would pass the budget)
            held = max(r.reserved + extra, _held(r.run))  # (a draft model's cache grows on its own)
            r.positions, self.kv_reserved, r.reserved = grant, self.kv_reserved + held - r.reserved, held

    def _preempt(self, r: _Running) -> None:
        """Take ``r`` out of the batch between rounds: its cache given up, its job to the front of the
        waiting line with its run, to :meth:`~speculate.engine.Run.resume` when memory allows."""
        self._running.remove(r)
        self.kv_reserved -= r.reserved
        r.release()
        r.job.run, r.job.sent = r.run, (r.first, r.scored, r.prompt_scored)
        self._waiting.appendleft(r.job)
        self.preempted += 1
        self.on_preempt()
        with self._lock:
            self.running -= 1
            self._changed()

    def _long(self, job: Job) -> bool:
        """Whether ``job``'s prompt takes more than one round's prefill budget."""
        return job.prompt_tokens > self.prefill_budget

    def _round(self) -> None:
        """One speculative round of every running request (engine.step), then each one's text to its handler.
        Prefilling requests share ``prefill_budget`` prompt tokens, the shortest remaining prompt first; one left
        without a share this round sits it out. So does one whose next prompt block another request computes this
        round from the same tokens: it takes that block from the prefix store next round (:meth:`Run.catch_up`),
        so requests that share a prompt prefix and start together compute it once."""
        if self.kv_budget:
            self._grow()
        for r in self._running:
            r.run.catch_up()
        running, left = [r for r in self._running if not r.run.prefilling], self.prefill_budget
        chosen = []
        for r in sorted((r for r in self._running if r.run.prefilling), key=lambda r: r.run.prompt_end - r.run.filled):
            if left <= 0:
                break
            if _computed_beside(r.run, chosen):
                continue
            r.run.prefill_chunk = min(self.prefill_chunk, left)
            left -= r.run.prefill_rows
            running.append(r)
            chosen.append(r.run)
        runs = [r.run for r in running]
        t0 = time.perf_counter()
        pieces = step(runs, *self.plan(runs))
        now = time.perf_counter()
        self.observe(runs, now - t0)
        self.on_round(len(runs), sum(r.rows_last for r in runs), now - t0)
        for r, out in zip(running, pieces):
            prompt_scored = r.run.prompt_logprobs
            if prompt_scored is not None and not (r.prompt_scored or r.run.prefilling or r.job.cancelled.is_set()):
                r.job.emit("prompt_logprobs", list(prompt_scored))  # (before the first text: the echo comes first)
                r.prompt_scored = True
            if out and not r.job.cancelled.is_set():
                r.first = r.first or now
                for piece in out:
                    r.job.emit("piece", piece)
            scored = r.run.logprobs
            if scored is not None and len(scored) > r.scored and not r.job.cancelled.is_set():
                r.job.emit("logprobs", scored[r.scored:])  # (after the round's text; a client adds them up)
                r.scored = len(scored)
            if r.run.error is not None:
                self._finish(r, error=r.run.error)
            elif r.run.done:
                self._finish(r)
                r.job.emit("done", Outcome(r.run.generation, r.first))

    def _finish(self, r: _Running, error: BaseException | None = None) -> None:
        """Take ``r`` out of the batch, its cache given up; report ``error`` where it failed."""
        self._running.remove(r)
        self.kv_reserved -= r.reserved
        r.release()
        if error is not None:  # (the handler tells the client: server/app.py, as_api_error)
            r.job.emit("error", error)
        with self._lock:
            self.running -= 1
        self._forget(r.job)

    def _forget(self, job: Job) -> None:
        with self._lock:
            self.admitted -= 1
            self._jobs.discard(job)
            self._changed()
