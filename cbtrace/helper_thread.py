"""Run capture's hook bookkeeping on a thread the profiler does not trace.

Under ``with_stack`` every Python call made on a profiled thread becomes a trace event: the
bookkeeping in capture's hooks (walking and planning the inputs, building the record) made 90 %
of the events of a captured tiny model's trace (6,414 of 6,852), and stopping the profiler and
exporting that trace cost more than the step itself. torch.profiler instruments the threads that
exist when it starts; a thread started afterwards is neither traced nor op-recorded. The hook
hands its work to such a thread and waits: one lock release and one acquire per call.
"""
from __future__ import annotations

import contextlib
import threading


class InlineHelper:
    """Runs the work on the calling thread (no profiler, or after the step)."""

    def call(self, fn, *args):
        return fn(*args)

    def close(self) -> None:
        pass


class HelperThread:
    """One worker thread; ``call(fn, *args)`` runs ``fn`` there and returns (or raises) its
    result. Calls never overlap: the caller waits, so ``fn`` may read the caller's state."""

    def __init__(self, stream=None):
        self._stream = stream  # CUDA stream of the caller: kernels fn launches are ordered on it
        self._go, self._done, self._one = threading.Lock(), threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job = self._out = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="cbtrace-capture", daemon=True)
        self._thread.start()

    def call(self, fn, *args):
        if self._stop:
            return fn(*args)
        with self._one:  # hooks may fire on several threads (e.g. nn.DataParallel replicas)
            self._job = (fn, args)
            self._go.release()
            try:
                self._done.acquire()
            except BaseException:  # e.g. Ctrl-C: let the job end, so no later call reads
                self._done.acquire()  # this one's answer
                self._out = None
                raise
            out, err = self._out
            self._out = None
        if err is not None:
            raise err
        return out

    def close(self) -> None:
        if not self._stop:
            self._stop = True
            self._go.release()
            self._thread.join()

    def _loop(self) -> None:
        ctx = contextlib.nullcontext()
        if self._stream is not None:
            import torch

            ctx = torch.cuda.stream(self._stream)
        with ctx:
            while True:
                self._go.acquire()
                if self._stop:
                    return
                fn, args = self._job
                self._job = None
                try:
                    self._out = (fn(*args), None)
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    self._out = (None, e)
                self._done.release()
