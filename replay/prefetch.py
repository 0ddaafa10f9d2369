"""Read-ahead of the next call's captured inputs while the current call is timed.

Loading a call's inputs is mostly Parquet reads and CRCs (``store.load.read_call_chunks``),
which release the GIL: on a GPU, where the timing loop waits on the device, one worker thread
reads call N+1's shards while call N is measured, and only the host-to-device copy is left on
the replay thread. On CPU the reads would take cores from the timed call: no read-ahead there.
A failed read-ahead is dropped; the call then loads as usual and reports the error itself.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


class ReadAhead:
    """``take(cid)`` -> (inputs chunks, grads chunks) read ahead for call ``cid``, or Nones."""

    def __init__(self, run: Path, order: list[int], by_id: dict, grads: bool, enabled: bool):
        self.run, self.by_id, self.grads = Path(run), by_id, grads
        self._next = {a: b for a, b in zip(order, order[1:])}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cbtrace-read") if enabled else None
        self._pending: dict[int, Future] = {}
        if self._pool is not None and order:
            self._submit(order[0])

    def _submit(self, cid: int | None) -> None:
        if cid is not None and cid not in self._pending:
            self._pending[cid] = self._pool.submit(self._read, self.by_id[cid])

    def _read(self, rec):
        from cbtrace.store.load import read_call_chunks

        inputs = read_call_chunks(self.run, rec.inputs_ref) if rec.inputs_ref else None
        grads = (read_call_chunks(self.run, rec.grads_ref)
                 if self.grads and rec.grads_ref else None)
        return inputs, grads

    def take(self, cid: int) -> tuple:
        """The read-ahead for ``cid`` (waiting for it); the next call's is queued behind it."""
        if self._pool is None:
            return None, None
        fut = self._pending.pop(cid, None)
        self._submit(self._next.get(cid))
        if fut is None:
            return None, None
        try:
            return fut.result()
        except Exception:  # noqa: BLE001 - the call's own load reports it, with its context
            return None, None

    def close(self) -> None:
        if self._pool is not None:
            for f in self._pending.values():
                f.cancel()
            self._pool.shutdown(wait=True)
            self._pending.clear()
