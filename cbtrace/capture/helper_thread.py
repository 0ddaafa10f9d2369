"""Run capture's hook bookkeeping on a thread the profiler does not trace (``with_stack``
captures only: without it no Python call is traced, and the bookkeeping runs inline).

Under ``with_stack`` every Python call made on a profiled thread becomes a trace event: the
bookkeeping in capture's hooks (walking and planning the inputs, building the record) made 90 %
of the events of a captured tiny model's trace (6,414 of 6,852), and stopping the profiler and
exporting that trace cost more than the step itself. torch.profiler instruments the threads that
exist when it starts; a thread started afterwards is neither traced nor op-recorded. The hook
hands its work to such a thread and waits. The hand-off itself (a queue put, then a get on the
caller's own reply queue) goes through ``untraced`` callables: no event at all.

What it saves is trace events, and with them profiler-stop and export time, more than step
time: under Python 3.12 a profile function on one thread instruments the interpreter's code for
every thread, so Python on the helper runs slower while the step's thread is profiled, and a
call handed over may cost as much as one run inline (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import functools
import queue
import threading

_WAKE_S = 1.0  # how often a waiting caller checks that the helper is still alive


def untraced(fn, *args, **kwargs):
    """``fn`` (a built-in) behind a functools.partial, which the profiler's Python tracer does
    not see: CPython reports a C call to a profile hook only when Python code calls a built-in
    function or method directly (``trace_call_function``; 3.12's legacy shim checks the same),
    and a partial calls it from C. Each such call in a hook is one trace event fewer, which
    costs time in the step, when the profiler stops and in the exported trace."""
    return functools.partial(fn, *args, **kwargs)


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
        self._put = untraced(self._jobs.put)
        self._closed = False
        self._submit_error: BaseException | None = None
        # per thread: an untraced get on its own reply queue; None on the helper (runs inline)
        self._local = threading.local()
        self._thread = threading.Thread(target=self._loop, name="cbtrace-capture", daemon=True)
        self._thread.start()

    def call(self, fn, *args):
        try:
            replies, wait = self._local.replies
        except AttributeError:  # this thread's first call
            replies = queue.SimpleQueue()
            replies, wait = self._local.replies = (replies, untraced(replies.get, timeout=_WAKE_S))
        if replies is None or self._closed:  # called from fn on the helper, or closed
            return fn(*args)
        box = [fn, args, None]  # this call's own slot: [fn, args, error] then [result, ...]
        self._put((box, replies))
        while True:
            try:
                done = wait()
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("cbtrace's capture helper thread died") from None
                continue
            if done is box:  # not a reply left behind by an interrupted earlier call
                break
        if box[2] is not None:
            raise box[2]
        return box[0]

    def submit(self, fn, *args) -> None:
        """Run ``fn(*args)`` there later, in order with the other jobs, without waiting; the
        first error of such a job is raised by ``close()``."""
        try:
            inline = self._closed or self._local.replies[0] is None  # closed, or on the helper
        except AttributeError:  # this thread has made no call yet
            inline = False
        if inline:
            fn(*args)
            return
        self._put(([fn, args, None], None))

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
        self._local.replies = (None, None)  # calls made from a job run inline
        while True:
            job = self._jobs.get()
            if job is None:
                return
            box, replies = job
            try:
                box[0] = box[0](*box[1])
            except BaseException as e:  # noqa: BLE001 - handed back, or raised by close()
                if replies is None:
                    self._submit_error = self._submit_error or e
                box[2] = e
            if replies is not None:
                replies.put(box)
