"""Snapshotter: copy at entry, dedup, aliasing, synthesis, sharding, and corrupt files."""
import json
import math

import pyarrow.parquet as pq
import pytest
import torch

from cbtrace.errors import SerializationError
from cbtrace.store import shards
from helpers.equality import first_difference
from helpers.snapshots import take
from cbtrace.store.load import load_call_inputs
from cbtrace.store.snapshot import Snapshotter


def rows_and_bytes(files):
    tables = [pq.read_table(f) for f in files]
    rows = sum(t.num_rows for t in tables)
    data = sum(len(v) for t in tables for v in t.column("data").to_pylist())
    return rows, data


def test_model_mutating_its_input_in_place(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(8, 2))
    snap, refs = Snapshotter(tmp_path / "inputs"), {}
    seen = {}

    def pre_hook(name):
        def hook(mod, args, kwargs):
            refs[name] = take(snap, args, kwargs)
            seen[name] = args[0].clone()
        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n), with_kwargs=True)
               for n, m in model.named_children()]
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    snap.flush()
    (relu_in,), _ = load_call_inputs(tmp_path, refs["1"])
    assert (seen["1"] < 0).any(), "the ReLU input had negatives before it ran"
    assert torch.equal(relu_in, seen["1"])


def test_value_is_the_one_at_take(tmp_path):
    x = torch.randn(3, 5)
    before = x.clone()
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (x[:, 1:],), {"full": x})
    x.mul_(2).add_(1)
    snap.flush()
    (view,), kw = load_call_inputs(tmp_path, ref)
    assert torch.equal(view, before[:, 1:]) and torch.equal(kw["full"], before)


def test_one_tensor_passed_twice_is_stored_once(tmp_path):
    x = torch.randn(256, 64)  # 64 KiB
    snap = Snapshotter(tmp_path / "inputs")
    refs = [take(snap, (x, x), {}), take(snap, (x,), {"again": x}), take(snap, (x[3:7],), {})]
    assert snap.last_input_bytes == 4 * 64 * 4
    before = x.clone()
    x.add_(1)  # a new version: stored again
    refs.append(take(snap, (x,), {}))
    files = snap.flush()
    assert rows_and_bytes(files) == (2, 2 * x.nbytes)
    for ref in refs[:2]:
        args, kw = load_call_inputs(tmp_path, ref)
        assert all(torch.equal(t, before) for t in [*args, *kw.values()])
    assert torch.equal(load_call_inputs(tmp_path, refs[3])[0][0], x)


def test_freed_storage_is_never_mistaken_for_a_new_one(tmp_path):
    snap = Snapshotter(tmp_path / "inputs")
    refs, expected = [], []
    for i in range(20):  # the allocator hands out the same address again and again
        t = torch.full((1024,), float(i))
        refs.append(take(snap, (t,), {}))
        expected.append(t.clone())
        del t
    snap.flush()
    for ref, want in zip(refs, expected):
        assert torch.equal(load_call_inputs(tmp_path, ref)[0][0], want)


def test_aliasing_between_arguments_survives(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (base, base[1:, ::2], base.t()), {"row": base[2]})
    assert snap.last_input_bytes == base.nbytes
    snap.flush()
    (a, b, c), kw = load_call_inputs(tmp_path, ref)
    assert b.storage_offset() == 6 and c.stride() == (1, 6)
    a[1, 0] = -1.0
    assert b[0, 0] == -1.0 and c[0, 1] == -1.0
    a[2, 3] = -2.0
    assert kw["row"][3] == -2.0


def test_far_offset_keeps_alignment_not_the_prefix(tmp_path):
    big = torch.randn(3 << 18)  # 3 MiB
    tail = big[(2 << 18) + 3:]  # starts 8 MiB + 12 B in: the prefix is not copied back
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (tail, big[:5]), {})
    snap.flush()
    (got, head), _ = load_call_inputs(tmp_path, ref)
    assert torch.equal(got, tail) and torch.equal(head, big[:5])
    assert got.untyped_storage().nbytes() < 2 << 20
    base = got.untyped_storage().data_ptr()  # allocators align bases to 64 B (CPU) / 512 B (CUDA)
    assert (got.data_ptr() - base) % 4096 == (tail.data_ptr() - big.data_ptr()) % 4096
    assert head.storage_offset() == 0


def test_inference_tensors_and_gradients(tmp_path):
    with torch.inference_mode():
        inf = torch.randn(5)
    w = torch.randn(3, requires_grad=True)
    y = w * 2  # non-leaf with a grad_fn
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (inf, w, y, torch.nn.Parameter(torch.ones(2))), {})
    snap.flush()
    got, _ = load_call_inputs(tmp_path, ref)
    assert torch.equal(got[0], inf) and got[1].requires_grad and got[2].requires_grad
    assert type(got[3]) is torch.nn.Parameter and got[3].requires_grad
    assert first_difference((inf, w, y), got[:3]) is None


def test_synthesis_keeps_ranges_and_moments(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 900, (64, 40), generator=g)
    dense = (torch.randn(80, 90, generator=g) * 3 + 7)[:, ::2]  # a strided view
    mask = torch.rand(100, 50, generator=g) < 0.3
    small = torch.randn(4)
    snap = Snapshotter(tmp_path / "inputs", synthesize_above_bytes=4096)
    ref = take(snap, (ids, dense, mask), {"small": small, "half": dense.half()})
    assert snap.last_synthesized
    files = snap.flush()
    assert rows_and_bytes(files)[1] < 4096 + 16 * 4 * 4  # only small (+ stats) stored
    (ids2, dense2, mask2), kw = load_call_inputs(tmp_path, ref)
    assert ids2.dtype == torch.int64 and ids2.shape == ids.shape
    assert ids.min() <= ids2.min() and ids2.max() <= ids.max()
    assert dense2.shape == dense.shape and dense2.stride() == dense.stride()
    assert dense2.storage_offset() == dense.storage_offset()
    assert math.isclose(dense2.mean().item(), 7, abs_tol=0.3)
    assert math.isclose(dense2.std().item(), dense.std().item(), rel_tol=0.1)
    assert math.isclose(kw["half"].float().mean().item(), 7, abs_tol=0.3)
    assert mask2.dtype == torch.bool and abs(mask2.float().mean().item() - 0.3) < 0.05
    assert torch.equal(kw["small"], small)
    again, _ = load_call_inputs(tmp_path, ref)
    assert torch.equal(again[0], ids2) and torch.equal(again[1], dense2), "deterministic"


def test_early_writes_and_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "PART_BYTES", 1000)  # chunks split into several rows
    monkeypatch.setattr(shards, "GROUP_BYTES", 2500)  # row groups that cut through chunks
    snap = Snapshotter(tmp_path / "inputs", max_pending_bytes=10_000, shard_bytes=6000)
    tensors = [torch.randn(700) for _ in range(8)]  # 2800 B each
    refs = []
    for t in tensors:
        refs.append(take(snap, (t,), {}))
    written_early = sorted((tmp_path / "inputs").glob("*.parquet"))
    assert written_early, "max_pending_bytes must write shards before flush()"
    files = snap.flush()
    assert len(files) >= 4 and set(written_early) <= set(files)
    assert not list((tmp_path / "inputs").glob(".*")), "temp files are renamed or removed"
    assert rows_and_bytes(files) == (8 * 3, 8 * 2800)
    for ref, t in zip(refs, tensors):
        assert torch.equal(load_call_inputs(tmp_path, ref)[0][0], t)


@pytest.fixture
def one_shard(tmp_path):
    payload = torch.arange(4096, dtype=torch.int32)
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (payload,), {})
    (path,) = snap.flush()
    return path, ref, payload


def _load_error(tmp_path, ref) -> str:
    with pytest.raises(SerializationError) as err:
        load_call_inputs(tmp_path, ref)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_truncated_shard(tmp_path, one_shard):
    path, ref, _ = one_shard
    path.write_bytes(path.read_bytes()[:-100])
    msg = _load_error(tmp_path, ref)
    assert str(path) in msg and "corrupt or truncated" in msg


def test_flipped_byte_is_a_checksum_mismatch(tmp_path, one_shard):
    path, ref, payload = one_shard
    data = bytearray(path.read_bytes())
    at = data.find(payload[1000:1004].numpy().tobytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    msg = _load_error(tmp_path, ref)
    assert str(path) in msg and "checksum mismatch" in msg


def test_missing_shard_and_bad_refs(tmp_path, one_shard):
    path, ref, _ = one_shard
    doc = json.loads(ref)
    doc["chunks"]["0"][1] = 5  # a row the shard does not have
    assert str(path) in _load_error(tmp_path, json.dumps(doc))
    assert "not a cbtrace inputs reference" in _load_error(tmp_path, "{not json")
    path.unlink()
    msg = _load_error(tmp_path, ref)
    assert str(path) in msg and "missing" in msg


@pytest.mark.gpu
def test_cuda_roundtrip_and_synthesis(tmp_path):
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (4096,), device="cuda")
    snap = Snapshotter(tmp_path / "inputs", synthesize_above_bytes=16 << 10)
    ref = take(snap, (x, x[:, ::2].t(), ids), {"cpu": torch.ones(3)})
    x.zero_()  # after take: must not reach the stored copy
    snap.flush()
    (a, b, ids2), kw = load_call_inputs(tmp_path, ref)
    assert a.is_cuda and b.is_cuda and ids2.is_cuda and kw["cpu"].device.type == "cpu"
    assert b.stride() == (2, 32)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert a.abs().sum() > 0 and ids2.min() >= ids.min() and ids2.max() <= ids.max()
    (a_cpu, _, _), _ = load_call_inputs(tmp_path, ref, device="cpu")
    assert a_cpu.device.type == "cpu" and torch.equal(a_cpu, a.cpu())
