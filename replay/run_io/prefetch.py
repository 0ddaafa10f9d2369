"""Read-ahead of the next call's captured inputs while the current call is timed.

Loading a call's inputs is mostly Parquet reads and CRCs (``store.load.read_call_chunks``),
which release the GIL: on a GPU, where the timing loop waits on the device, one worker thread
reads the next calls' shards while call N is measured, into pinned host memory, so that only an
asynchronous host-to-device copy is left on the replay thread. It keeps several calls ahead (up
to ``MAX_CALLS`` and ``MAX_BYTES``): a small call is timed faster than its inputs are read, so
one call ahead leaves the replay thread waiting (benchmarks/RESULTS.md). On CPU the reads would
take cores from the timed call: no read-ahead there. A failed read-ahead is dropped; the call
then loads as usual and reports the error itself.

The worker makes no CUDA call: one from another thread invalidates a CUDA graph that a model
captures in torch's default ("global") mode during replay, and a pinned allocation through
torch's caching host allocator makes several (cudaHostAlloc, cudaEventQuery). So the pinned
memory is one ring, allocated on the replay thread, which the worker fills with numpy copies.
Bytes of it are reused only once the replay thread has seen that an event recorded after the
copies out of them (``issued``, or the next ``take``) has completed; the worker only waits, on a
threading.Condition, for ring bytes to be freed. A call larger than the ring is read ahead into
pageable memory instead (no CUDA call either; its copy to the GPU then waits).
"""
from __future__ import annotations

import collections
import contextlib
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from cbtrace.cost.dtypes import meta_bytes
from cbtrace.replay.timer.contract import pause_while_host_paced
from cbtrace.store import load


MAX_CALLS = 8          # calls read ahead at most
MAX_BYTES = 512 << 20  # and at most this many of their bytes; the pinned ring is no larger
RING_ROUND = 1 << 20   # the ring's size is rounded up to this


@dataclass
class _Lease:
    """One call's read-ahead, and the ring bytes it holds until the copies out of them are done."""
    cid: int
    nbytes: int                     # its bytes for MAX_BYTES (ReadAhead._bytes)
    need: tuple | None              # ring bytes of its (inputs, grads); None: read outside it
    read: Future | None = None
    block: list | None = None       # [start, end, freed] in the ring; set by the worker
    done: object = None             # an event recorded after its copies were queued


class _Ring:
    """Byte ranges of one buffer, handed out in order and reused in that order once freed.
    ``claim`` waits on a threading.Condition for room; nothing here touches the buffer."""

    def __init__(self, size: int):
        self.size = size
        self._live: collections.deque = collections.deque()  # [start, end, freed], oldest first
        self._cv = threading.Condition()
        self._closed = False

    def claim(self, n: int) -> list | None:
        """A block of ``n`` bytes (0 < n <= size), waiting for the room; None once closed."""
        assert 0 < n <= self.size, (n, self.size)
        with self._cv:
            while not self._closed:
                start = self._fit(n)
                if start is not None:
                    self._live.append([start, start + n, False])
                    return self._live[-1]
                self._cv.wait()
        return None

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        head, tail = self._live[-1][1], self._live[0][0]
        if self._live[-1][0] >= tail:  # not wrapped: room after the head, then before the tail
            return head if self.size - head >= n else (0 if tail >= n else None)
        return head if tail - head >= n else None

    def free(self, block: list) -> None:
        with self._cv:
            block[2] = True
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class _NothingCopied:
    """The event of a read-ahead that nothing was copied out of."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_NOTHING_COPIED = _NothingCopied()


def _pinned(nbytes: int):

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _cuda_event(device):
    """A CUDA event recorded on ``device``'s current stream, where the input copies went."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


class ReadAhead:
    """``take(cid)`` -> (inputs chunks, grads chunks) read ahead for call ``cid``, or Nones.
    Calls are read in ``order``; ``pin``: into a pinned ring (for the CUDA ``device``), whose
    bytes a call holds until the copies queued by ``issued(cid)`` or the next ``take`` are done.
    ``alloc(nbytes)`` (a uint8 CPU tensor) and ``mark()`` (an event with ``query()`` and
    ``synchronize()``, recorded after the copies queued so far) stand in for the pinned ring and
    the CUDA events, with a ring even without ``pin`` (tests); both are called on the replay
    thread only."""

    def __init__(self, run: Path, order: list[int], by_id: dict, grads: bool, enabled: bool,
                 pin: bool = False, *, device=None, alloc=None, mark=None):
        self.run, self.by_id, self.grads, self.pin = Path(run), by_id, grads, pin
        self._order = list(order)
        self._index = {c: i for i, c in enumerate(self._order)}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cbtrace-read") if enabled else None
        self._pending: dict[int, _Lease] = {}  # queued calls, in order
        self._taken: list[_Lease] = []  # taken calls still holding ring bytes, oldest first
        self._next = 0  # index in order of the next call to queue
        self._ring = self._buf = self._view = None
        self._needs: dict[int, tuple | None] = {}
        self._mark = mark or (lambda: _cuda_event(device))
        # paused while the replay thread measures the host's pace (``paused``): no read starts,
        # and one under way is waited for
        self._hold = threading.Condition()
        self._pauses = self._reading = 0
        self._closing = False  # close(): a paused worker goes on, to be shut down
        self._unregister = pause_while_host_paced(self) if self._pool is not None else None
        if self._pool is not None and (pin or alloc is not None):
            self._open_ring(alloc or _pinned)
        if self._pool is not None:
            self._fill()

    def _open_ring(self, alloc) -> None:
        """Size the ring for MAX_CALLS + 1 calls in a row (the one being timed and those queued)
        and the largest call once more (room lost at the wrap), MAX_BYTES at most."""
        needs = [self._need(self.by_id[c]) for c in self._order]
        self._needs = dict(zip(self._order, needs))
        sizes = [sum(n) if n else 0 for n in needs]
        k = MAX_CALLS + 1
        window = max((sum(sizes[i:i + k]) for i in range(len(sizes))), default=0)
        if not window:
            return
        size = min(MAX_BYTES, -(-(window + max(sizes)) // RING_ROUND) * RING_ROUND)
        try:
            self._buf = alloc(size)
        except RuntimeError:  # no pinned memory to be had: read ahead into pageable memory
            return
        self._ring, self._view = _Ring(size), self._buf.numpy()  # the worker writes via _view

    def _need(self, rec) -> tuple | None:
        """Ring bytes of a call's (inputs, grads); None for a reference that does not parse
        (its read then fails, and the call reports it)."""
        try:
            ins = load.host_bytes(self.run, rec.inputs_ref) if rec.inputs_ref else 0
            grads = load.host_bytes(self.run, rec.grads_ref) if self.grads and rec.grads_ref else 0
        except Exception:  # noqa: BLE001 - the call's own load reports it
            return None
        return ins, grads

    def _fill(self) -> None:
        """Queue calls in order while at most MAX_CALLS and MAX_BYTES are pending (one call
        at least, however large)."""
        while self._next < len(self._order) and len(self._pending) < MAX_CALLS:
            rec = self.by_id[self._order[self._next]]
            lease = _Lease(rec.call_id, self._bytes(rec), self._needs.get(rec.call_id))
            pending = sum(p.nbytes for p in self._pending.values())
            if self._pending and pending + lease.nbytes > MAX_BYTES:
                break
            lease.read = self._pool.submit(self._read, rec, lease)
            self._pending[rec.call_id] = lease
            self._next += 1

    def _bytes(self, rec) -> int:
        """What a call's read-ahead holds: its inputs, and its output gradients when read."""
        grads = meta_bytes(rec.output_meta) if self.grads and rec.grads_ref else 0
        return int(rec.input_bytes or 0) + grads

    def _read(self, rec, lease: _Lease):
        """On the worker, so: no CUDA call, and no pinned allocation through torch."""
        into = (None, None)
        need = lease.need
        if self._ring is not None and need is not None and 0 < sum(need) <= self._ring.size:
            lease.block = self._ring.claim(sum(need))
            if lease.block is None:
                raise RuntimeError("the read-ahead was closed")
            start, end, _ = lease.block
            into = self._view[start:start + need[0]], self._view[start + need[0]:end]
        pin = self.pin and lease.block is not None  # else pageable memory: no CUDA call
        with self._hold:
            while self._pauses and not self._closing:
                self._hold.wait()
            if self._closing:
                raise RuntimeError("the read-ahead was closed")
            self._reading += 1
        try:
            inputs = (load.read_call_chunks(self.run, rec.inputs_ref, pin=pin, into=into[0])
                      if rec.inputs_ref else None)
            grads = (load.read_call_chunks(self.run, rec.grads_ref, pin=pin, into=into[1])
                     if self.grads and rec.grads_ref else None)
        finally:
            with self._hold:
                self._reading -= 1
                self._hold.notify_all()
        return inputs, grads

    @contextlib.contextmanager
    def paused(self):
        """No read runs while this is open (one under way is waited for first): the replay
        thread is measuring the host's pace (``timer.contract.host_paced``)."""
        with self._hold:
            self._pauses += 1
        try:  # a signal (--timeout-s, Ctrl-C) may end the wait: the pause is undone all the same
            with self._hold:
                while self._reading:
                    self._hold.wait()
            yield
        finally:
            with self._hold:
                self._pauses -= 1
                self._hold.notify_all()

    def take(self, cid: int) -> tuple:
        """The read-ahead for ``cid`` (waiting for it), calls being taken in ``order``; calls
        after it are queued behind, calls queued before it are dropped. A call not queued yet
        loads on its own, and reading goes on after it. The copies out of the calls taken before
        are queued by now."""
        if self._pool is None:
            return None, None
        for held in self._taken:
            if held.done is None:
                held.done = self._mark()
        pos = self._index.get(cid)
        beyond = cid not in self._pending and pos is not None and pos >= self._next
        while self._pending and (beyond or (cid in self._pending
                                            and next(iter(self._pending)) != cid)):
            self._drop(next(iter(self._pending)))
        if beyond:  # taken past the queued window: read on from the call after it
            self._next = pos + 1
        self._retire(wait=False)
        lease = self._pending.pop(cid, None)
        self._fill()
        if lease is None:
            return None, None
        if not lease.read.done():
            self._retire(wait=True)  # the worker may be waiting for the ring bytes they hold
        try:
            got = lease.read.result()
        except Exception:  # noqa: BLE001 - the call's own load reports it, with its context
            got = None
        if lease.block is not None and got is None:  # nothing will be copied out of it
            self._ring.free(lease.block)
        elif lease.block is not None:
            self._taken.append(lease)
        return got or (None, None)

    def _drop(self, cid: int) -> None:
        """Drop a queued call taken past: its ring bytes are free once its read ends."""
        skipped = self._pending.pop(cid)
        skipped.read.cancel()
        skipped.done = _NOTHING_COPIED
        self._taken.append(skipped)

    def issued(self, cid: int) -> None:
        """Call ``cid``'s copies out of its read-ahead are queued (on the current stream): its
        ring bytes are reused once they are done."""
        for held in self._taken:
            if held.cid == cid and held.done is None:
                held.done = self._mark()

    def _retire(self, wait: bool) -> None:
        """Free the ring bytes of taken calls whose copies are done (waiting for the marked
        ones when ``wait``)."""
        still = []
        for held in self._taken:
            if held.done is not None and wait:
                held.done.synchronize()
                futures.wait([held.read])
            if held.done is not None and held.read.done() and held.done.query():
                if held.block is not None:
                    self._ring.free(held.block)
            else:
                still.append(held)
        self._taken = still

    def close(self) -> None:
        """Stop the worker, wait for the copies out of the ring, and drop it, on this thread
        (freeing pinned memory makes CUDA calls too)."""
        if self._pool is None:
            return
        if self._unregister is not None:
            self._unregister()
        with self._hold:
            self._closing = True
            self._hold.notify_all()
        for lease in self._pending.values():
            lease.read.cancel()
        if self._ring is not None:
            self._ring.close()  # a read waiting for ring bytes gives up
        self._pool.shutdown(wait=True)
        with contextlib.suppress(RuntimeError):  # a CUDA error raised already: nothing to wait
            for held in self._taken:
                (held.done or self._mark()).synchronize()
        self._pending.clear()
        self._taken.clear()
        self._ring = self._buf = self._view = None
