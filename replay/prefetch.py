"""Read-ahead of the next call's captured inputs while the current call is timed.

Loading a call's inputs is mostly Parquet reads and CRCs (``store.load.read_call_chunks``),
which release the GIL: on a GPU, where the timing loop waits on the device, one worker thread
reads the next calls' shards while call N is measured, into pinned host memory, so that only an
asynchronous host-to-device copy is left on the replay thread. It keeps several calls ahead (up
to ``MAX_CALLS`` and ``MAX_BYTES``): GPT-2's Dropouts and LayerNorms are timed in ~10 ms, less
than a 12 MB read takes, and one call ahead left the replay thread waiting 0.36 s of its 5 s on
the H200; the copies from pageable memory took 0.5 s more. On CPU the reads would take cores
from the timed call: no read-ahead there. A failed read-ahead is dropped; the call then loads as
usual and reports the error itself.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


MAX_CALLS = 8          # calls read ahead at most
MAX_BYTES = 512 << 20  # and at most this many of their bytes (pinned host memory; torch's
#                        host allocator rounds each block up to a power of two and keeps it)


class ReadAhead:
    """``take(cid)`` -> (inputs chunks, grads chunks) read ahead for call ``cid``, or Nones.
    Calls are read in ``order``; ``pin``: into pinned memory (for a CUDA device)."""

    def __init__(self, run: Path, order: list[int], by_id: dict, grads: bool, enabled: bool,
                 pin: bool = False):
        self.run, self.by_id, self.grads, self.pin = Path(run), by_id, grads, pin
        self._order = list(order)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cbtrace-read") if enabled else None
        self._pending: dict[int, tuple[Future, int]] = {}  # cid -> (read, its input bytes)
        self._next = 0  # index in order of the next call to queue
        if self._pool is not None:
            self._fill()

    def _fill(self) -> None:
        """Queue calls in order while at most MAX_CALLS and MAX_BYTES are pending (one call
        at least, however large)."""
        while self._next < len(self._order) and len(self._pending) < MAX_CALLS:
            rec = self.by_id[self._order[self._next]]
            nbytes = self._bytes(rec)
            pending = sum(b for _, b in self._pending.values())
            if self._pending and pending + nbytes > MAX_BYTES:
                break
            self._pending[rec.call_id] = (self._pool.submit(self._read, rec), nbytes)
            self._next += 1

    def _bytes(self, rec) -> int:
        """What a call's read-ahead holds: its inputs, and its output gradients when read."""
        from cbtrace.cost.dtypes import meta_bytes

        grads = meta_bytes(rec.output_meta) if self.grads and rec.grads_ref else 0
        return int(rec.input_bytes or 0) + grads

    def _read(self, rec):
        from cbtrace.store.load import read_call_chunks

        inputs = (read_call_chunks(self.run, rec.inputs_ref, pin=self.pin)
                  if rec.inputs_ref else None)
        grads = (read_call_chunks(self.run, rec.grads_ref, pin=self.pin)
                 if self.grads and rec.grads_ref else None)
        return inputs, grads

    def take(self, cid: int) -> tuple:
        """The read-ahead for ``cid`` (waiting for it), calls being taken in ``order``; calls
        after it are queued behind. A call not queued (yet) loads on its own."""
        if self._pool is None:
            return None, None
        fut, _ = self._pending.pop(cid, (None, 0))
        self._fill()
        if fut is None:
            return None, None
        try:
            return fut.result()
        except Exception:  # noqa: BLE001 - the call's own load reports it, with its context
            return None, None

    def close(self) -> None:
        if self._pool is not None:
            for f, _ in self._pending.values():
                f.cancel()
            self._pool.shutdown(wait=True)
            self._pending.clear()
