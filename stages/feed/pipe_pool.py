"""A process pool fed through one pipe per child: nothing named, so nothing to leak or to track.

Why not `concurrent.futures.ProcessPoolExecutor`: outside the fork start method its queues hold five
named POSIX semaphores (/dev/shm/sem.mp-*), which `multiprocessing`'s resource tracker process must
be told of at creation and at release. In a Ray worker that bookkeeping breaks:
- Ray ends a worker's child processes when the worker exits, the tracker among them, before the
  interpreter runs the finalizers that release the semaphores. The release then starts a new
  tracker, which has never heard of them and prints a `KeyError` traceback for each: the tracebacks
  at the end of a Tune search (a stopped trial's actor exits while its loop is still closing).
- A SIGKILLed worker runs no finalizers at all and its tracker is killed with it: the names stay in
  /dev/shm (1,297 of them on the 2-core dev box after a day of tests, 2026-11-26).
Here each child gets a `Pipe` (a socketpair) and the parent waits on the pipes and on the
children's sentinels with `multiprocessing.connection.wait`: no semaphore is ever named.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing.connection
import os
import threading
import traceback
from concurrent import futures
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

__all__ = ["PipePool", "RemoteTraceback"]

log = logging.getLogger(__name__)

START_S = 60.0  # a child's start and initializer (a cold fork server imports torch and Ray first)


class RemoteTraceback(Exception):
    """The child's own traceback, chained as the `__cause__` of the error it sent (as
    ProcessPoolExecutor does): a decode error names the line in the child that raised it."""

    def __str__(self) -> str:
        return self.args[0]


def _serve(conn, initializer: Callable[..., None], initargs: tuple) -> None:
    """A child: run the initializer, say ready, then answer each (fn, args) with (ok, value, trace)
    until told to stop (None) or until the parent's end of the pipe goes away."""
    try:
        initializer(*initargs)
    except BaseException:
        conn.send((False, None, traceback.format_exc()))
        return
    conn.send((True, os.getpid(), ""))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone (a SIGKILLed parent resets the socket)
            return
        if task is None:
            return
        try:
            conn.send_bytes(_answer(*task))
        except OSError:
            return


def _answer(fn: Callable, args: tuple) -> bytes:
    """The pickled (ok, value, trace) of one task; an error that does not pickle goes as text."""
    try:
        return ForkingPickler.dumps((True, fn(*args), ""))
    except BaseException as e:  # the caller's future raises it; the pool goes on
        trace = traceback.format_exc()
        try:
            return ForkingPickler.dumps((False, e, trace))
        except Exception:
            return ForkingPickler.dumps((False, RuntimeError(f"{type(e).__name__}: {e}"), trace))


class PipePool:
    """`processes` children of `context`, each running `initializer(*initargs)` once; `submit`
    returns a Future. A child that dies breaks the pool: every pending future fails with
    `BrokenProcessPool`, as ProcessPoolExecutor's would."""

    def __init__(self, processes: int, context, initializer: Callable[..., None], initargs: tuple):
        self._children: list[tuple[Any, Any]] = []
        self._collector: threading.Thread | None = None
        try:
            for _ in range(processes):
                mine, theirs = context.Pipe(duplex=True)
                child = context.Process(target=_serve, args=(theirs, initializer, initargs), daemon=True)
                self._children.append((child, mine))
                child.start()
                theirs.close()
            for child, conn in self._children:  # every child has started and run its initializer
                _wait_ready(child, conn)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._idle = collections.deque(range(processes))
        self._queued: collections.deque = collections.deque()
        self._running: dict[int, Future] = {}
        self._broken: str | None = None
        self._wake_r, self._wake_w = context.Pipe(duplex=False)
        self._collector = threading.Thread(target=self._collect, name="pipe-pool", daemon=True)
        self._collector.start()

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Pickled here, in the caller's thread and outside the lock: the collector thread, which
        dispatches queued tasks, then only sends bytes. A task that does not pickle fails alone,
        as with ProcessPoolExecutor."""
        future: Future = Future()
        try:
            task = ForkingPickler.dumps((fn, args))
        except Exception as e:
            future.set_exception(e)
            return future
        with self._lock:
            if self._broken:
                raise BrokenProcessPool(self._broken)
            self._queued.append((future, task))
            if self._idle:
                self._dispatch(self._idle.popleft())
        return future

    def _dispatch(self, i: int) -> None:
        """Under the lock: give idle child i the next queued task that was not cancelled."""
        while self._queued:
            future, task = self._queued.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            self._running[i] = future
            try:
                self._children[i][1].send_bytes(task)
            except OSError:  # it died a moment ago: its sentinel breaks the pool
                future.set_exception(BrokenProcessPool(f"decode process {self._children[i][0].pid} ended"))
                self._running.pop(i)
            return
        self._idle.append(i)

    def _collect(self) -> None:
        """The collector thread: nothing may end it quietly, or every pending future would wait
        for ever; whatever goes wrong here breaks the pool instead."""
        try:
            self._collect_answers()
        except Exception:
            self._break(f"the pool's collector failed: {traceback.format_exc(limit=3)}")

    def _collect_answers(self) -> None:
        """Complete each future as its child answers, and give that child the next queued task."""
        conns = {conn: i for i, (_, conn) in enumerate(self._children)}
        sentinels = {child.sentinel: i for i, (child, _) in enumerate(self._children)}
        while True:
            ready = multiprocessing.connection.wait([*conns, *sentinels, self._wake_r])
            if self._wake_r in ready:
                return
            for conn in (c for c in ready if c in conns):
                try:
                    answer = conn.recv_bytes()
                except (EOFError, OSError):  # its sentinel says why; stop waiting on its pipe
                    del conns[conn]
                    continue
                self._done(conns[conn], answer)
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                child = self._children[dead[0]][0]
                self._break(f"decode process {child.pid} ended (exit code {child.exitcode})")
                return

    def _done(self, i: int, answer: bytes) -> None:
        with self._lock:
            future = self._running.pop(i)
            self._dispatch(i)
        try:
            ok, value, trace = ForkingPickler.loads(answer)
        except Exception as e:  # an answer that does not unpickle here fails its own future
            future.set_exception(RuntimeError(f"the decode process's answer did not unpickle: {e!r}"))
            return
        if ok:
            future.set_result(value)
        else:
            value.__cause__ = RemoteTraceback(trace)
            future.set_exception(value)

    def _break(self, why: str) -> None:
        log.warning("decode pool broken: %s", why)
        with self._lock:
            self._broken = why
            failed = [*self._running.values(), *(f for f, _ in self._queued)]
            self._running.clear()
            self._queued.clear()
        for future in failed:
            if not future.done():  # a queued one may have been cancelled
                future.set_exception(BrokenProcessPool(why))

    def close(self) -> None:
        """Let the tasks at hand finish (as `shutdown(wait=True)` does), cancel the queued ones, and
        stop the children."""
        if self._collector is not None:
            with self._lock:
                self._broken = self._broken or "the pool is closed"
                queued = [f for f, _ in self._queued]
                self._queued.clear()
                running = list(self._running.values())
            for future in queued:
                future.cancel()
            if futures.wait(running, timeout=START_S).not_done:
                log.warning("decode pool: a task outlasted %.0f s at close; its process is stopped", START_S)
            self._wake_w.send(None)
            self._collector.join()
            self._collector = None
            self._wake_r.close()
            self._wake_w.close()
            for future in running:  # what outlasted the wait: failed, not left running for ever
                if not future.done():
                    future.set_exception(BrokenProcessPool("the pool was closed while this task ran"))
        self._stop_children()

    def _stop_children(self) -> None:
        for _, conn in self._children:
            try:
                conn.send(None)
            except OSError:
                pass  # it has gone already
        for child, conn in self._children:
            if child.pid is not None:  # started
                child.join(5)
                if child.is_alive():
                    child.terminate()
                    child.join()
            child.close()  # its sentinel fd now, not at garbage collection
            conn.close()
        self._children = []


def _wait_ready(child, conn) -> None:
    """Raise BrokenProcessPool unless `child` said ready within START_S; with its traceback if its
    initializer raised."""
    try:
        ok, _, trace = conn.recv() if conn.poll(START_S) else (False, None, f"no word within {START_S:.0f} s")
    except (EOFError, OSError):
        ok, trace = False, f"it ended (exit code {child.exitcode})"
    if not ok:
        raise BrokenProcessPool(f"a pool process (pid {child.pid}) did not start: {trace}")
