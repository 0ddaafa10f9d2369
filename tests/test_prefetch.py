"""Read-ahead of captured inputs (replay/prefetch.py): what a call loads from chunks read on the
worker thread is what it loads from the shards itself, aliasing included; a read-ahead that
fails leaves the call to load (and report) on its own."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import cbtrace
from cbtrace.calltree import bfs_order
from cbtrace.errors import SerializationError
from cbtrace.replay.prefetch import ReadAhead
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


def test_read_ahead_loads_what_the_shards_hold(tmp_path):
    model = Pair()
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randint(0, 50, (4, 8)), torch.randn(4, 8, 32))
    _, df = load_run(tmp_path / "r")
    recs = {r.call_id: r for r in frame_to_records(df)}
    order = bfs_order({c: r.parent_call_id for c, r in recs.items()})
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
    _, df = load_run(tmp_path / "r")
    recs = {r.call_id: r for r in frame_to_records(df)}
    return recs, bfs_order({c: r.parent_call_id for c, r in recs.items()})


def test_read_ahead_keeps_several_calls_queued(tmp_path, monkeypatch):
    from cbtrace.replay import prefetch

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
    from cbtrace.replay import prefetch

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
