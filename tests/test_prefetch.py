"""Read-ahead of captured inputs (replay/run_io/prefetch.py): what a call loads from chunks read
on the worker thread is what it loads from the shards itself, aliasing included; a read-ahead that
fails leaves the call to load (and report) on its own. Its ring's bytes are reused only once
the copies out of them are done (CPU stand-ins for the pinned ring and the CUDA events here),
and on a GPU the worker makes no CUDA call that would break a graph capture elsewhere."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent import futures

import pytest
import torch

import cbtrace
from cbtrace.calltree import bfs_order
from cbtrace.errors import SerializationError
from cbtrace.replay.run_io.prefetch import ReadAhead, _Ring
from cbtrace.rundir.read import load_run
from cbtrace.schema.modules import frame_to_records
from cbtrace.store.load import load_call_inputs


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, ids, x):
        return self.lin(self.emb(ids) + x[..., :16]) + x[..., 16:]  # x: one storage, two views


def _flat(args, kwargs):
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def _records(run):
    """The run's records by call_id, and the call ids breadth-first (replay's order)."""
    _, df = load_run(run)
    recs = {r.call_id: r for r in frame_to_records(df)}
    return recs, bfs_order({c: r.parent_call_id for c, r in recs.items()})


def _captured_pair(tmp_path):
    model = Pair()
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randint(0, 50, (4, 8)), torch.randn(4, 8, 32))
    return _records(tmp_path / "r")


def test_read_ahead_loads_what_the_shards_hold(tmp_path):
    recs, order = _captured_pair(tmp_path)
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    try:
        for cid in order:
            inputs, grads = ahead.take(cid)
            assert inputs is not None and grads is None
            got = load_call_inputs(tmp_path / "r", recs[cid].inputs_ref, chunks_read=inputs)
            want = load_call_inputs(tmp_path / "r", recs[cid].inputs_ref)
            for a, b in zip(_flat(*got), _flat(*want), strict=True):
                assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
            if recs[cid].fqn == "":  # the root's two inputs: ids, and x read from one chunk
                (ids, x), _ = got
                assert ids.dtype == torch.int64 and x.shape == (4, 8, 32)
    finally:
        ahead.close()


def test_failed_read_ahead_leaves_the_error_to_the_call(tmp_path):
    model = torch.nn.Linear(8, 8)
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(2, 8))
    _, df = load_run(tmp_path / "r")
    rec = frame_to_records(df)[0]
    bad = dataclasses.replace(rec, inputs_ref='{"v": 99, "chunks": {}}')
    ahead = ReadAhead(tmp_path / "r", [rec.call_id], {rec.call_id: bad}, grads=False,
                      enabled=True)
    assert ahead.take(rec.call_id) == (None, None)
    ahead.close()
    with pytest.raises(SerializationError, match="format v99"):
        load_call_inputs(tmp_path / "r", bad.inputs_ref)
    off = ReadAhead(tmp_path / "r", [rec.call_id], {rec.call_id: rec}, grads=False,
                    enabled=False)
    assert off.take(rec.call_id) == (None, None)
    off.close()


def _captured(tmp_path, n=12):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(2, 8))
    return _records(tmp_path / "r")


def test_read_ahead_keeps_several_calls_queued(tmp_path, monkeypatch):
    from cbtrace.replay.run_io import prefetch

    recs, order = _captured(tmp_path)
    monkeypatch.setattr(prefetch, "MAX_CALLS", 4)
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    try:
        assert list(ahead._pending) == order[:4]                   # queued at once, in order
        assert ahead.take(order[0])[0] is not None
        assert list(ahead._pending) == order[1:5]                  # one taken, one more queued
        for cid in order[1:]:
            assert ahead.take(cid)[0] is not None
        assert not ahead._pending
    finally:
        ahead.close()


def test_read_ahead_stops_queueing_at_the_byte_limit(tmp_path, monkeypatch):
    from cbtrace.replay.run_io import prefetch

    recs, order = _captured(tmp_path)
    per_call = int(recs[order[1]].input_bytes)
    monkeypatch.setattr(prefetch, "MAX_BYTES", 3 * per_call)  # three calls of 64 B fit
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    try:
        assert list(ahead._pending) == order[:3]
    finally:
        ahead.close()
    monkeypatch.setattr(prefetch, "MAX_BYTES", per_call // 2)  # none fits: one at a time
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    try:
        assert list(ahead._pending) == order[:1]
        assert ahead.take(order[0])[0] is not None and list(ahead._pending) == order[1:2]
    finally:
        ahead.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_read_ahead_loads_the_same_tensors_on_the_gpu(tmp_path):
    recs, order = _captured(tmp_path)
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True, pin=True)
    try:
        for cid in order:
            inputs, _ = ahead.take(cid)
            assert all(c.pinned and c.data.is_pinned() for c in inputs.values())
            got = load_call_inputs(tmp_path / "r", recs[cid].inputs_ref, device="cuda",
                                   chunks_read=inputs)
            want = load_call_inputs(tmp_path / "r", recs[cid].inputs_ref)
            for a, b in zip(_flat(*got), _flat(*want), strict=True):
                assert a.is_cuda and torch.equal(a.cpu(), b)
    finally:
        ahead.close()


class _Event:
    """A CPU stand-in for a CUDA event: done when the test says so, or once waited for."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _hooks(done: bool = True):
    """``alloc`` and ``mark`` for a ReadAhead with a pageable ring, and what they made."""
    made = {"rings": [], "events": []}

    def alloc(nbytes):
        made["rings"].append(torch.zeros(nbytes, dtype=torch.uint8))
        return made["rings"][-1]

    def mark():
        made["events"].append(_Event(done))
        return made["events"][-1]

    return alloc, mark, made


def _offset(ring, chunk) -> int | None:
    """Where a HostChunk's bytes start in the ring, or None when they are elsewhere."""
    at = chunk.data.data_ptr() - ring.data_ptr()
    return at if 0 <= at < ring.numel() else None


def _same(run, ref, chunks):
    got = load_call_inputs(run, ref, chunks_read=chunks)
    want = load_call_inputs(run, ref)
    for a, b in zip(_flat(*got), _flat(*want), strict=True):
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
        assert a.storage_offset() == b.storage_offset()


def test_ring_is_reused_in_order_once_freed():
    ring = _Ring(100)
    a, b = ring.claim(40), ring.claim(40)
    assert (a[0], b[0]) == (0, 40) and ring._fit(40) is None  # 20 left at the end
    ring.free(b)                      # freed out of order: reused only once a is
    assert ring._fit(40) is None
    ring.free(a)
    c, d = ring.claim(60), ring.claim(30)
    ring.free(c)
    e = ring.claim(50)                # wraps to the start, before d
    assert (c[0], d[0], e[0]) == (0, 60, 0)
    assert ring._fit(20) is None and ring._fit(10) == 50  # only between e and d
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.claim(40)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # waits for room, holding no lock
    ring.free(d)
    waiter.join(10)
    assert got and got[0][0] == 50
    ring.close()
    assert ring.claim(100) is None


def _train_capture(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(4, 8, requires_grad=True)).pow(2).mean().backward()
    return _records(tmp_path / "r")


@pytest.mark.parametrize("grads", [False, True])
def test_ring_read_ahead_loads_what_the_shards_hold(tmp_path, grads):
    if grads:
        recs, order = _train_capture(tmp_path)
        assert all(r.grads_ref for r in recs.values())
    else:
        recs, order = _captured_pair(tmp_path)
    alloc, mark, made = _hooks()
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=grads, enabled=True, alloc=alloc,
                      mark=mark)
    try:
        (ring,) = made["rings"]
        for cid in order:
            inputs, grad_chunks = ahead.take(cid)
            assert (grad_chunks is not None) == grads
            chunks = [*inputs.values(), *(grad_chunks or {}).values()]
            assert all(_offset(ring, c) is not None and c.data.untyped_storage().nbytes()
                       == c.data.nbytes for c in chunks)  # its own storage, inside the ring
            _same(tmp_path / "r", recs[cid].inputs_ref, inputs)
            if grads:
                _same(tmp_path / "r", recs[cid].grads_ref, grad_chunks)
            ahead.issued(cid)
    finally:
        ahead.close()
    assert len(made["events"]) == len(order)


def test_ring_bytes_are_not_reused_before_the_copies_out_of_them_are_done(tmp_path,
                                                                         monkeypatch):
    from cbtrace.replay.run_io import prefetch

    recs, order = _captured(tmp_path)  # one 64 B chunk a call: 4 KiB of the ring each
    monkeypatch.setattr(prefetch, "MAX_BYTES", 2 * 4096)  # the ring holds two calls
    alloc, mark, made = _hooks(done=False)
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True, alloc=alloc,
                      mark=mark)
    c0, c1, c2 = order[:3]
    try:
        (ring,) = made["rings"]
        assert ring.numel() == 2 * 4096
        first = ahead.take(c0)[0]
        kept = {k: c.data.clone() for k, c in first.items()}
        assert [_offset(ring, c) for c in first.values()] == [0]
        ahead.issued(c0)                                  # its copies are not done
        ahead._pending[c1].read.result(timeout=10)
        assert [_offset(ring, c) for c in ahead.take(c1)[0].values()] == [4096]
        waiting = ahead._pending[c2].read
        assert not futures.wait([waiting], timeout=0.3).done  # no room for c2 ...
        assert all(torch.equal(c.data, kept[k]) for k, c in first.items())  # ... nor reuse
        made["events"][0].done = True                     # c0's copies are done
        third = ahead.take(c2)[0]
        assert [_offset(ring, c) for c in third.values()] == [0]  # c0's bytes, now free
        _same(tmp_path / "r", recs[c2].inputs_ref, third)
        ahead.issued(c2)
        for cid in order[3:]:                             # waits for each call's copies
            _same(tmp_path / "r", recs[cid].inputs_ref, ahead.take(cid)[0])
            ahead.issued(cid)
    finally:
        ahead.close()


def test_a_call_larger_than_the_ring_is_read_ahead_outside_it(tmp_path, monkeypatch):
    from cbtrace.replay.run_io import prefetch

    recs, order = _captured_pair(tmp_path)
    monkeypatch.setattr(prefetch, "MAX_BYTES", 4096)  # the root's two chunks need 8 KiB
    alloc, mark, made = _hooks()
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True, alloc=alloc,
                      mark=mark)
    try:
        (ring,) = made["rings"]
        for cid in order:
            inputs, _ = ahead.take(cid)
            where = {_offset(ring, c) for c in inputs.values()}
            assert where == ({None} if recs[cid].fqn == "" else {0}), (recs[cid].fqn, where)
            _same(tmp_path / "r", recs[cid].inputs_ref, inputs)
            ahead.issued(cid)
    finally:
        ahead.close()


def test_close_stops_a_read_waiting_for_ring_bytes(tmp_path, monkeypatch):
    from cbtrace.replay.run_io import prefetch

    recs, order = _captured(tmp_path)
    monkeypatch.setattr(prefetch, "MAX_BYTES", 4096)  # one call at a time
    alloc, mark, _ = _hooks(done=False)
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True, alloc=alloc,
                      mark=mark)
    assert ahead.take(order[0])[0] is not None  # holds the ring: order[1] waits for it
    closing = threading.Thread(target=ahead.close)
    closing.start()
    closing.join(10)
    assert not closing.is_alive()


def test_a_call_taken_past_the_queue_loads_alone_and_reading_goes_on(tmp_path, monkeypatch):
    from cbtrace.replay.run_io import prefetch

    recs, order = _captured(tmp_path)
    monkeypatch.setattr(prefetch, "MAX_CALLS", 2)  # order[0] and order[1] queued
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    try:
        assert ahead.take(order[3]) == (None, None)  # not queued: loads on its own
        for cid in order[4:]:                        # read ahead again from the next one
            inputs, _ = ahead.take(cid)
            assert inputs is not None, recs[cid].fqn
            _same(tmp_path / "r", recs[cid].inputs_ref, inputs)
    finally:
        ahead.close()


def test_host_tensors_loaded_from_the_ring_keep_their_values(tmp_path, monkeypatch):
    """A tensor loaded on the host from ring bytes is a copy: the bytes are reused once freed."""
    from cbtrace.replay.run_io import prefetch

    recs, order = _captured(tmp_path)
    monkeypatch.setattr(prefetch, "MAX_BYTES", 4096)  # one call's bytes: every call reuses them
    alloc, mark, _ = _hooks()
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True, alloc=alloc,
                      mark=mark)
    try:
        (x,), _ = load_call_inputs(tmp_path / "r", recs[order[1]].inputs_ref,
                                   chunks_read=ahead.take(order[1])[0])
        kept = x.clone()
        ahead.issued(order[1])
        for cid in order[2:5]:
            load_call_inputs(tmp_path / "r", recs[cid].inputs_ref,
                             chunks_read=ahead.take(cid)[0])
            ahead.issued(cid)
        assert torch.equal(x, kept)
    finally:
        ahead.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_ahead_leaves_a_global_graph_capture_valid(tmp_path, monkeypatch):
    """The main thread captures a CUDA graph in torch's default ("global") mode while the worker
    reads every call into pinned memory: the capture stays valid, as the worker makes no CUDA
    call. Pinned allocations on the worker (cudaHostAlloc, cudaEventQuery) invalidated such
    captures."""
    from cbtrace.replay.run_io import prefetch
    from cbtrace.store import load

    recs, order = _captured(tmp_path)
    monkeypatch.setattr(prefetch, "MAX_CALLS", len(order))  # all queued, all read meanwhile
    go, read = threading.Event(), []
    plain = load.read_call_chunks

    def gated(*args, **kwargs):  # the reads start once the capture has begun
        go.wait(30)
        out = plain(*args, **kwargs)
        read.append(out)
        return out

    monkeypatch.setattr(load, "read_call_chunks", gated)
    x = torch.randn(4096, device="cuda")
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True, pin=True,
                      device=torch.device("cuda"))
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # capture_error_mode: torch's default, "global"
            y = x * 2
            go.set()
            deadline = time.monotonic() + 30
            while len(read) < len(order) and time.monotonic() < deadline:
                time.sleep(0.005)
            y = y + 1
        assert len(read) == len(order)
        g.replay()
        torch.testing.assert_close(y, x * 2 + 1)
        for cid in order:
            inputs, _ = ahead.take(cid)
            assert all(c.pinned and c.data.is_pinned() for c in inputs.values())
            got = load_call_inputs(tmp_path / "r", recs[cid].inputs_ref, device="cuda",
                                   chunks_read=inputs)
            ahead.issued(cid)
            want = load_call_inputs(tmp_path / "r", recs[cid].inputs_ref)
            for a, b in zip(_flat(*got), _flat(*want), strict=True):
                assert a.is_cuda and torch.equal(a.cpu(), b)
    finally:
        go.set()
        ahead.close()


def test_no_read_runs_while_the_host_pace_is_measured(tmp_path, monkeypatch):
    """``host_paced()`` (HostIssue, the stream timer) holds the read-ahead: a read under way is
    waited for, none starts until it ends; then reading goes on."""
    from cbtrace.replay.run_io import prefetch
    from cbtrace.replay.timer.contract import _BACKGROUND, host_paced

    recs, order = _captured_pair(tmp_path)
    started, inside = [], threading.Event()
    first_started, release_first = threading.Event(), threading.Event()
    real = prefetch.load.read_call_chunks

    def watched(*a, **k):
        started.append(inside.is_set())
        if not first_started.is_set():  # the first read is under way when the pace is taken
            first_started.set()
            release_first.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(prefetch.load, "read_call_chunks", watched)
    entered_while_reading = []

    def measure():
        with host_paced():
            entered_while_reading.append(not release_first.is_set())
            inside.set()
            time.sleep(0.3)  # the worker would start the next reads now, were it free to
            inside.clear()

    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    try:
        assert ahead in [ref() for ref in _BACKGROUND] and first_started.wait(10)
        t = threading.Thread(target=measure)
        t.start()
        time.sleep(0.2)
        assert not inside.is_set()  # it waits for the read under way
        release_first.set()
        t.join(10)
        assert entered_while_reading == [False]
        for cid in order:  # after it, every call's read-ahead is there
            assert ahead.take(cid)[0] is not None
        assert len(started) == len(order) and not any(started)
    finally:
        release_first.set()
        ahead.close()
    assert ahead not in [ref() for ref in _BACKGROUND]  # closed: nothing left to pause


def test_a_pause_ended_by_an_error_or_nested_lets_reading_go_on(tmp_path, monkeypatch):
    """A signal (--timeout-s, Ctrl-C) raised while the pause waits for a read under way, or
    inside it, undoes the pause; nested pauses hold until the outer one ends; a dropped
    read-ahead is not kept alive by the registry."""
    import gc
    import weakref

    from cbtrace.replay.timer.contract import _BACKGROUND, host_paced

    recs, order = _captured_pair(tmp_path)
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    try:
        for cid in order:
            assert ahead.take(cid)[0] is not None  # the worker is idle from here
        with ahead._hold:
            ahead._reading = 1  # a read under way, which the pause waits for

        def interrupted(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(ahead._hold, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with ahead.paused():
                pass
        assert ahead._pauses == 0
        monkeypatch.undo()
        with ahead._hold:
            ahead._reading = 0
        with pytest.raises(KeyboardInterrupt):
            with host_paced():
                raise KeyboardInterrupt
        assert ahead._pauses == 0
        with host_paced():
            with host_paced():
                assert ahead._pauses == 2
            assert ahead._pauses == 1
        assert ahead._pauses == 0
    finally:
        ahead.close()
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    ahead._pool.shutdown(wait=True)  # left unclosed, as a setup that raised would leave it
    gone = weakref.ref(ahead)
    del ahead
    gc.collect()
    assert gone() is None and all(ref() is not None for ref in _BACKGROUND)


def test_closing_a_paused_read_ahead_does_not_hang(tmp_path, monkeypatch):
    """close() while a pause holds the worker before its read: the worker gives up, close
    returns."""
    recs, order = _captured_pair(tmp_path)
    real_fill = ReadAhead._fill
    monkeypatch.setattr(ReadAhead, "_fill", lambda self: None)  # nothing queued yet
    ahead = ReadAhead(tmp_path / "r", order, recs, grads=False, enabled=True)
    pause = ahead.paused()
    pause.__enter__()
    real_fill(ahead)  # queued now, held before their reads
    closed = threading.Thread(target=ahead.close)
    closed.start()
    closed.join(30)
    hung = closed.is_alive()
    pause.__exit__(None, None, None)
    closed.join(30)
    assert not hung


def test_host_issue_is_timed_with_background_work_paused(monkeypatch):
    """HostIssue's runs happen inside ``host_paced()`` (a CUDA call stood in for on a CPU)."""
    import types

    from cbtrace.replay.measure.steps import HostIssue
    from cbtrace.replay.timer.contract import pause_while_host_paced

    class Work:
        held = 0

        @contextlib.contextmanager
        def paused(self):
            Work.held += 1
            try:
                yield
            finally:
                Work.held -= 1

    work, during = Work(), []
    unregister = pause_while_host_paced(work)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    c = types.SimpleNamespace(device=torch.device("cuda"), n_copies=1, outputs=None,
                              run=lambda i: during.append(Work.held))
    try:
        row = HostIssue(reps=3).run(c)
    finally:
        unregister()
    assert during == [1, 1, 1] and Work.held == 0 and row["host_ms"] >= 0
