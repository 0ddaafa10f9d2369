"""Run capture's hook bookkeeping on a thread the profiler does not trace.

Under ``with_stack`` every Python call made on a profiled thread becomes a trace event: the
bookkeeping in capture's hooks (walking and planning the inputs, building the record) made 90 %
of the events of a captured tiny model's trace (6,414 of 6,852), and stopping the profiler and
exporting that trace cost more than the step itself. torch.profiler instruments the threads that
exist when it starts; a thread started afterwards is neither traced nor op-recorded. The hook
hands its work to such a thread and waits: a few C-level calls per hand-off (queue put, lock
acquire), each call with its own result slot.
"""
from __future__ import annotations

import _thread
import queue
import threading

_WAKE_S = 1.0  # how often a waiting caller checks that the helper is still alive


class InlineHelper:
    """Runs the work on the calling thread (no profiler, or after the step)."""

    def call(self, fn, *args):
        return fn(*args)

    def submit(self, fn, *args) -> None:
        fn(*args)

    def close(self) -> None:
        pass


class HelperThread:
    """One worker thread; ``call(fn, *args)`` runs ``fn`` there and returns (or raises) its
    result while the caller waits, so ``fn`` may read the caller's state; ``submit(fn, *args)``
    hands work over without waiting. Jobs run one at a time, in the order they were handed
    over; after ``close()`` they run inline."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._submit_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="cbtrace-capture", daemon=True)
        self._thread.start()
        self._ident = self._thread.ident

    def call(self, fn, *args):
        if self._closed or _thread.get_ident() == self._ident:  # closed, or called from fn
            return fn(*args)
        done = _thread.allocate_lock()
        done.acquire()
        box = [None, None]
        self._jobs.put((fn, args, done, box))
        while not done.acquire(timeout=_WAKE_S):
            if not self._thread.is_alive():
                raise RuntimeError("cbtrace's capture helper thread died")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def submit(self, fn, *args) -> None:
        """Run ``fn(*args)`` there later, in order with the other jobs, without waiting; the
        first error of such a job is raised by ``close()``."""
        if self._closed or _thread.get_ident() == self._ident:
            fn(*args)
            return
        self._jobs.put((fn, args, None, None))

    def close(self) -> None:
        """Finish the jobs already handed over, then stop the thread; raises the first error of
        a submitted job, if any."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._thread.join()
        if self._submit_error is not None:
            err, self._submit_error = self._submit_error, None
            raise err

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, done, box = job
            if done is None:  # submitted: nobody waits for it
                try:
                    fn(*args)
                except BaseException as e:  # noqa: BLE001 - raised by close()
                    self._submit_error = self._submit_error or e
                continue
            try:
                box[0] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box[1] = e
            finally:
                done.release()
