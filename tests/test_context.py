"""Context replay (replay/measure/context.py): a call's step-order predecessors run untimed
before each of its timed runs, in step order, and an input equal to one of their outputs is taken from it."""
import dataclasses
import time
import types

import pytest
import torch
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace.replay.measure.context import ContextSource, chained_positions, predecessors
from cbtrace.schema.modules import ModuleRecord
from cbtrace.state import state_fingerprint

SLEEP_S = 0.02


class Sleep(nn.Module):
    """A predecessor slow enough that a timed figure including it could not be missed."""

    def forward(self, x):
        time.sleep(SLEEP_S)
        return x * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = Sleep()
        self.t = nn.Linear(8, 8)

    def forward(self, x):
        return self.t(self.b(self.a(x)))


FAST = {**FAST_REPLAY, "context": True, "count_flops": False, "host_runs": 1}


def _capture(tmp_path, model, *inputs):
    """The run of one forward of ``model`` on ``inputs``."""
    with cbtrace.capture(model, tmp_path / "run"):
        model(*inputs)
    return tmp_path / "run"


@pytest.fixture
def run(tmp_path):
    torch.manual_seed(0)
    model = Net().eval()
    return model, _capture(tmp_path, model, torch.randn(4, 8))


def _rec(call_id, parent, nbytes=1000):
    return ModuleRecord(fqn=f"m{call_id}", call_index=0, call_id=call_id,
                        parent_call_id=parent, parent_fqn=None, depth=0, module_type="X",
                        module_class="X", param_bytes=0, buffer_bytes=0, input_bytes=nbytes,
                        input_shapes="[]", input_meta="[]", output_meta="[]", training=False,
                        grad_enabled=False, autocast_dtype=None, inputs_ref="{}")


def test_predecessors_are_earlier_leaves_in_step_order_never_descendants():
    # root 0 > (1 > 2, 3), 4 > 5
    recs = [_rec(0, -1), _rec(1, 0), _rec(2, 1), _rec(3, 1), _rec(4, 0), _rec(5, 4)]
    before = predecessors(recs, max_calls=4, max_bytes=1 << 30)
    assert before[0] == [] and before[1] == [] and before[2] == []
    assert before[3] == [2]
    assert before[4] == [2, 3]  # its own leaf 5 starts after it
    assert before[5] == [2, 3]
    assert predecessors(recs, max_calls=1, max_bytes=1 << 30)[5] == [3]
    assert predecessors(recs, max_calls=4, max_bytes=1)[5] == [3]  # one call's bytes fill it


def test_inputs_are_loaded_only_where_an_output_may_feed_the_call():
    # call 2's ids (int64) cannot be call 1's output; call 3's input has its metadata
    out = '[{"shape": [4, 8], "dtype": "float32", "stride": [8, 1]}]'
    ids = '[{"shape": [4], "dtype": "int64", "stride": [1]}]'
    big = '[{"shape": [512, 256], "dtype": "float32", "stride": [256, 1]}]'  # no output's
    recs = [_rec(0, -1), dataclasses.replace(_rec(1, 0), output_meta=out),
            dataclasses.replace(_rec(2, 0), input_meta=ids),
            dataclasses.replace(_rec(3, 0), input_meta=out),
            dataclasses.replace(_rec(4, 0), input_meta=big)]
    model = nn.Module()
    for i in (1, 2, 3, 4):
        model.add_module(f"m{i}", nn.Identity())

    def source(rewrite=False):
        loaded = []
        return loaded, ContextSource(recs, model, "cpu", rewrite=rewrite,
                                     load=lambda r: loaded.append(r.call_id)
                                     or ((torch.zeros(4, 8),), {}))

    loaded, src = source()
    assert src.calls(2) == [] and loaded == []  # nothing read for a lookup's ids
    assert [c.rec.call_id for c in src.calls(3)] == [1, 2] and loaded == [1, 2]
    assert src.calls(4) == [] and loaded == [1, 2]  # a residual's output: no producer
    # a rewrite needs the context whatever it produced, for an activation it may rewrite; an
    # embedding lookup's ids are data, never rewritten: still nothing read for them
    loaded, src = source(rewrite=True)
    assert src.calls(2) == [] and loaded == []
    assert [c.rec.call_id for c in src.calls(4)] == [1, 2, 3] and loaded == [1, 2, 3]


def test_offered_inputs_serve_a_context_and_go_when_its_calls_are_done():
    out = '[{"shape": [4, 8], "dtype": "float32", "stride": [8, 1]}]'
    recs = [_rec(0, -1), dataclasses.replace(_rec(1, 0), output_meta=out),
            dataclasses.replace(_rec(2, 0), output_meta=out, input_meta=out),
            dataclasses.replace(_rec(3, 0), input_meta=out)]
    model = nn.Module()
    for i in (1, 2, 3):
        model.add_module(f"m{i}", nn.Identity())
    loaded = []
    src = ContextSource(recs, model, "cpu", pending={1, 2, 3},
                        load=lambda r: loaded.append(r.call_id) or ((torch.zeros(4, 8),), {}))
    x = torch.ones(4, 8)
    src.offer(recs[1], ((x,), {}))  # as the replay loads call 1, before it runs
    x.add_(1)                       # call 1 writes its input: the offered copy is as loaded
    [c1] = src.calls(2)
    assert loaded == [] and torch.equal(c1.copies[0][0][0], torch.ones(4, 8))
    src.offer(recs[2], ((x,), {}))
    assert [c.rec.call_id for c in src.calls(3)] == [1, 2] and loaded == []
    src.finished(2)
    assert [c.rec.call_id for c in src.calls(3)] == [1, 2] and loaded == []  # 3 still to come
    src.finished(3)  # no call left needs them: dropped, a later context reads the run again
    src.calls(3)
    assert loaded == [1, 2]
    src.release()
    src.offer(recs[1], ((x,), {}))  # nothing wanted after a release
    src.calls(2)
    assert loaded == [1, 2, 1]


def test_chained_positions_match_equal_outputs_only():
    out = torch.arange(6.0).reshape(2, 3)
    other = torch.ones(2, 3)
    found = chained_positions([[other], [out]], ((out.clone(), 5), {"y": other.clone(),
                                                                   "z": torch.zeros(2, 3)}))
    assert found == {("a", 0): (1, 0), ("k", "y"): (0, 0)}


def test_context_runs_untimed_in_step_order_and_feeds_the_call(run):
    model, path = run
    seen = []  # (module name, input data_ptr, output data_ptr) of every forward during replay
    for name in ("a", "b", "t"):
        getattr(model, name).register_forward_hook(
            lambda m, i, o, name=name: seen.append((name, i[0].data_ptr(), o.data_ptr())))
    before = state_fingerprint(model)
    df = cbtrace.replay(path, model=model, device="cpu", **FAST).set_index("fqn")
    assert state_fingerprint(model) == before
    assert (df.status == "ok").all()
    # the call t, timed: its runs right after a and b (in that order), on b's fresh output
    fed = [i for i, s in enumerate(seen) if s[0] == "t" and i >= 2 and seen[i - 2][0] == "a"
           and seen[i - 1][0] == "b" and s[1] == seen[i - 1][2] and seen[i - 1][1] == seen[i - 2][2]]
    assert len(fed) >= FAST["min_runs"]
    # the context's 20 ms sleep is not in t's figure (a figure with it reads >= 20 ms however
    # idle the machine; a Linear(8, 8) without it stays far below on a busy one), but is in b's
    assert df.loc["t", "isolated_ms"] < SLEEP_S * 1e3
    assert df.loc["b", "isolated_ms"] >= SLEEP_S * 1e3
    assert "context: 2 calls before (a, b); 1 input from their outputs" in df.loc["t", "timer_notes"]
    assert "context: 1 call before (a); 1 input from their outputs" in df.loc["b", "timer_notes"]
    assert "context" not in str(df.loc["", "timer_notes"])


def test_context_off_times_the_call_alone(run):
    model, path = run
    df = cbtrace.replay(path, model=model, device="cpu", **{**FAST, "context": False}).set_index("fqn")
    assert not any("context" in n for n in df.timer_notes.dropna())


def test_context_is_off_by_default_on_a_cpu(run):
    model, path = run
    df = cbtrace.replay(path, model=model, device="cpu", **{**FAST, "context": None})
    assert not any("context" in n for n in df.timer_notes.dropna())


def test_cold_replay_has_no_context(run):
    model, path = run
    df = cbtrace.replay(path, model=model, device="cpu", cold=True, **FAST).set_index("fqn")
    assert not any("context" in n for n in df.timer_notes.dropna())


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.act = nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(inplace=True)
        self.t = nn.Linear(256, 64)

    def forward(self, x):
        return self.t(self.act(self.bn(self.a(x))))


def test_an_inplace_call_is_fed_by_its_producer(tmp_path):
    torch.manual_seed(0)
    model = Chain().eval()
    run = _capture(tmp_path, model, torch.randn(512, 64))
    df = cbtrace.replay(run, model=model, device="cpu", **FAST).set_index("fqn")
    assert "context: 2 calls before (a, bn); 1 input from their outputs" in (
        df.loc["act", "timer_notes"])


def test_a_predecessor_replayed_first_hands_its_inputs_to_the_contexts(tmp_path, monkeypatch):
    """Breadth-first, a, bn and act are replayed before the calls whose contexts they are (bn,
    act, t): their inputs are read from the run once each, as their own, never again for a
    context, and the contexts still feed the calls (act's in-place run left them intact)."""
    from cbtrace.replay import engine
    from cbtrace.store import load

    torch.manual_seed(0)
    model = Chain().eval()
    run = _capture(tmp_path, model, torch.randn(512, 64))
    # a loaded CPU times noisy calls once more after the loop, reading their inputs again (and
    # their contexts', whose copies went once the calls were measured): the first pass is counted
    monkeypatch.setattr(engine, "recheck", lambda done, by_id, every=False: [])
    reads = []
    real = load.load_call_inputs
    monkeypatch.setattr(load, "load_call_inputs",
                        lambda run, ref, **kw: reads.append(ref) or real(run, ref, **kw))
    df = cbtrace.replay(run, model=model, device="cpu", **FAST).set_index("fqn")
    assert (df.status == "ok").all()
    assert len(reads) == len(df) == 5  # one a call: none for a context
    assert "context: 2 calls before (a, bn); 1 input from their outputs" in (
        df.loc["act", "timer_notes"])
    assert "context: 3 calls before (a, bn, act); 1 input from their outputs" in (
        df.loc["t", "timer_notes"])


class BatchNormAct(nn.Module):
    """timm's BatchNormAct2d, in one dimension: the BatchNorm is the parent's own code, then
    ``drop`` (an Identity: its output is its input) and an in-place ``act``."""

    def __init__(self, n: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(n)
        self.drop, self.act = nn.Identity(), nn.SiLU(inplace=True)

    def forward(self, x):
        x = nn.functional.batch_norm(x, self.bn.running_mean, self.bn.running_var,
                                     self.bn.weight, self.bn.bias, False, 0.1, self.bn.eps)
        return self.act(self.drop(x))


class ConvBnAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bnact, self.t = nn.Linear(64, 256), BatchNormAct(256), nn.Linear(256, 64)

    def forward(self, x):
        return self.t(self.bnact(self.a(x)))


def test_an_identitys_output_is_not_a_fresh_input_but_an_in_place_write_is(tmp_path):
    # act's input equals drop's output, which is drop's input copy as loaded: nothing ran that
    # wrote it, so it is rewritten after the context as what the parent's code wrote; t's
    # input is act's in-place write, a fresh output
    torch.manual_seed(0)
    model = ConvBnAct().eval()
    run = _capture(tmp_path, model, torch.randn(512, 64))  # act's input: 512 KiB
    df = cbtrace.replay(run, model=model, device="cpu", **FAST).set_index("fqn")
    assert (df.status == "ok").all()
    act = str(df.loc["bnact.act", "timer_notes"])
    assert "context: 2 calls before (a, bnact.drop); its inputs rewritten after them (x + 0 * y)" \
        in act and "from their outputs" not in act
    assert "context: 3 calls before (a, bnact.drop, bnact.act); 1 input from their outputs" in (
        str(df.loc["t", "timer_notes"]))


class Square(nn.Module):
    def forward(self, x):
        return x * x


class ReadEarlier(nn.Module):
    """DLRM's inter_arch in small: an MLP reads the embeddings first, then ``fm`` reads them
    again after the MLP's calls, which are its context; with ``first=False`` only ``fm`` reads
    them, right after what the parent wrote."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.deep = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.ReLU())])
        self.fm = Square()

    def forward(self, emb, h):
        h = self.deep(emb if self.first else h)
        return h.sum() + self.fm(emb * 1 if not self.first else emb).sum()


@pytest.mark.parametrize("first", [True, False])
def test_an_input_read_before_the_context_is_not_rewritten_after_it(tmp_path, first):
    torch.manual_seed(0)
    model = ReadEarlier(first).eval()
    run = _capture(tmp_path, model, torch.randn(512, 4, 64), torch.randn(512, 4, 64))
    df = cbtrace.replay(run, model=model, device="cpu", **FAST).set_index("fqn")
    assert (df.status == "ok").all()
    fm = str(df.loc["fm", "timer_notes"])
    if first:  # written before deep.0, which lies before fm's four calls of context
        assert "no context: its inputs were read before, not written just before it" in fm
    else:  # written by the parent just before fm: rewritten as an op of two operands would
        assert "its inputs rewritten after them (x + 0 * y)" in fm


def test_inputs_read_before_counts_readers_before_the_context_not_ancestors_nor_in_it():
    from cbtrace.replay.measure.context import inputs_read_before
    from cbtrace.store import ref_format

    def ref(*rows):  # one 64 KiB float tensor per stored chunk row
        chunks = {str(i): [0, r, 1, 0, 65536, "d"] for i, r in enumerate(rows)}
        args = [{"t": "tensor", "dtype": "float32", "shape": [16384], "c": i}
                for i in range(len(rows))]
        return ref_format.build(args, {}, chunks)

    recs = [_rec(0, -1), _rec(1, 0), _rec(2, 0), _rec(3, 0), _rec(4, 0)]
    for r, refs in zip(recs, [ref(7), ref(7), ref(8), ref(9), ref(7)]):
        r.inputs_ref = refs
    # call 4 reads chunk 7, which call 1 (outside its context [2, 3]) and its parent 0 read
    assert inputs_read_before(recs, {4: [2, 3], 1: [], 3: [2]}) == {4}
    assert inputs_read_before(recs, {4: [1, 2, 3]}) == set()  # the reader is in its context
    recs[1].inputs_ref = ref(6)
    assert inputs_read_before(recs, {4: [2, 3]}) == set()  # only its parent read it before
    recs[4].inputs_ref = "not json"
    assert inputs_read_before(recs, {4: [2, 3]}) == set()  # unreadable: as unread


def test_written_outputs_leave_out_untouched_inputs_and_their_views():
    from cbtrace.replay.measure.context import ContextCall, written_outputs

    class Views(nn.Module):
        def forward(self, x, y, z):
            return x, y.view(-1), z.add_(1), x * 2

    x, y, z = torch.ones(4), torch.ones(2, 2), torch.ones(3)
    call = ContextCall(Views(), _rec(1, -1), [((x, y, z), {})], None, torch.device("cpu"))
    out = written_outputs(call)
    assert out[0] is None and out[1] is None  # the input itself, a view of one: not written
    assert out[2] is z and torch.equal(out[3], torch.full((4,), 2.0))  # in place; a new tensor

    class AddInPlace(nn.Module):
        def forward(self, x, y):
            return x.add_(y)

    # two halves of one storage, each rebuilt on it with its own version counter, as a run's
    # loaded tensors are: the one written makes the storage written
    base = torch.ones(4, 8)
    x = torch.empty(0).set_(base.untyped_storage(), 0, (4, 4), (8, 1))
    y = torch.empty(0).set_(base.untyped_storage(), 4, (4, 4), (8, 1))
    call = ContextCall(AddInPlace(), _rec(1, -1), [((x, y), {})], None, torch.device("cpu"))
    assert written_outputs(call)[0] is x


class Residual(nn.Module):
    """A ReLU whose input a residual add wrote, code of the parent and no module's output."""

    def __init__(self):
        super().__init__()
        self.a, self.act = nn.Linear(256, 256), nn.ReLU()

    def forward(self, x):
        return self.act(self.a(x) + x)


@pytest.mark.parametrize("rewrite", ["off", "self", "sum"])
def test_an_input_no_module_wrote_is_rewritten_after_the_context_when_asked(tmp_path, rewrite):
    torch.manual_seed(0)
    model = Residual().eval()
    run = _capture(tmp_path, model, torch.randn(512, 256))  # 512 KiB: above the rewrite's floor
    before, rng = state_fingerprint(model), torch.get_rng_state()
    df = cbtrace.replay(run, model=model, device="cpu",
                        **{**FAST, "context_rewrite": rewrite}).set_index("fqn")
    assert state_fingerprint(model) == before and torch.equal(torch.get_rng_state(), rng)
    assert (df.status == "ok").all()
    note = str(df.loc["act", "timer_notes"])
    if rewrite != "off":
        how = {"self": "x * 1", "sum": "x + 0 * y"}[rewrite]
        assert f"context: 1 call before (a); its inputs rewritten after them ({how})" in note
    else:
        assert "context" not in note


def test_the_sum_rewrite_is_the_default_for_a_residual_output(tmp_path):
    torch.manual_seed(0)
    model = Residual().eval()
    run = _capture(tmp_path, model, torch.randn(512, 256))
    df = cbtrace.replay(run, model=model, device="cpu", **FAST).set_index("fqn")
    assert "its inputs rewritten after them (x + 0 * y)" in str(df.loc["act", "timer_notes"])


class Lookups(nn.Module):
    """Two embedding bags over one batch of ids: the second's inputs are the batch's data, which
    no predecessor wrote (and a rewrite must not make it a context call)."""

    def __init__(self):
        super().__init__()
        self.e1 = nn.EmbeddingBag(50_000, 64, mode="sum")
        self.e2 = nn.EmbeddingBag(50_000, 64, mode="sum")

    def forward(self, ids, offsets, weights):
        return self.e1(ids, offsets) + self.e2(ids, offsets, per_sample_weights=weights)


def test_an_embedding_lookups_ids_are_never_rewritten_nor_its_context_loaded(tmp_path):
    from cbtrace.replay.measure.context import may_be_rewritten
    from cbtrace.rundir.read import read_records

    torch.manual_seed(0)
    model = Lookups().eval()
    ids = torch.randint(0, 50_000, (65_536,))  # 512 KiB of int64: above the rewrite's floor
    offsets = torch.arange(0, 65_536, 64)
    weights = torch.rand(65_536)  # floating, 256 KiB: a lookup's, never rewritten either
    run = _capture(tmp_path, model, ids, offsets, weights)
    recs = {r.fqn: r for r in read_records(run)}
    assert not may_be_rewritten(recs["e1"]) and may_be_rewritten(recs["e2"])  # its weights
    src = ContextSource(list(recs.values()), model, "cpu", load=None, rewrite=True)
    assert not src._loads(recs["e2"].call_id, src.before[recs["e2"].call_id])
    df = cbtrace.replay(run, model=model, device="cpu", **FAST).set_index("fqn")
    assert "context" not in str(df.loc["e2", "timer_notes"])


def test_a_large_floating_input_may_be_rewritten_a_small_one_not():
    from cbtrace.replay.measure.context import may_be_rewritten

    big = dataclasses.replace(_rec(1, -1),
                              input_meta='[{"shape": [512, 256], "dtype": "torch.float32"}]')
    small = dataclasses.replace(big, input_meta='[{"shape": [8, 8], "dtype": "torch.float32"}]')
    ids = dataclasses.replace(big, input_meta='[{"shape": [65536], "dtype": "torch.int64"}]')
    fp8 = dataclasses.replace(big, input_meta='[{"shape": [512, 256], "dtype": "float8_e4m3fn"}]')
    expanded = dataclasses.replace(big, input_meta='[{"shape": [512, 256], "dtype": "float32", '
                                                   '"stride": [0, 1]}]')
    assert may_be_rewritten(big) and not may_be_rewritten(small) and not may_be_rewritten(ids)
    assert not may_be_rewritten(fp8) and not may_be_rewritten(expanded)  # no multiply in place


@pytest.mark.gpu
def test_graph_timer_times_each_slot_inside_the_graph(tmp_path):
    torch.manual_seed(0)
    model = Chain().cuda().eval()
    run = _capture(tmp_path, model, torch.randn(512, 64, device="cuda"))
    before = state_fingerprint(model)
    df = cbtrace.replay(run, model=model, device="cuda", progress=False,
                        budget_s=0.01).set_index("fqn")
    assert state_fingerprint(model) == before
    assert (df.status == "ok").all(), df.status_reason.dropna().to_dict()
    assert (df.timer == "graph").all(), df.timer_fallback.dropna().to_dict()
    notes = df.loc["act", "timer_notes"]
    assert "context: 2 calls before (a, bn); 1 input from their outputs" in notes


def _meta(*shapes, dtype="torch.float32"):
    import json
    return json.dumps([{"shape": list(s), "dtype": dtype, "stride": None} for s in shapes])


@pytest.mark.parametrize("module, ins, outs, expected", [
    (nn.ReLU(inplace=True), [(8, 64, 56, 56)], [(8, 64, 56, 56)], True),
    (nn.SiLU(), [(8, 32)], [(8, 32)], True),
    (nn.GELU(approximate="tanh"), [(4, 16, 768)], [(4, 16, 768)], True),
    (nn.AdaptiveAvgPool2d(1), [(8, 64, 7, 7)], [(8, 64, 1, 1)], False),   # a shape of its own
    (nn.Linear(32, 32), [(8, 32)], [(8, 32)], False),                    # parameters
    (nn.BatchNorm1d(32), [(8, 32)], [(8, 32)], False),
    (nn.Sequential(nn.ReLU()), [(8, 32)], [(8, 32)], False),             # a parent
    (nn.Identity(), [(2, 4, 16, 8)] * 3, [(2, 4, 16, 8)], False),  # attention's q, k, v
])
def test_an_activation_is_told_by_structure(module, ins, outs, expected):
    from cbtrace.replay.measure.context import activation

    rec = dataclasses.replace(_rec(1, None), input_meta=_meta(*ins), output_meta=_meta(*outs))
    assert activation(module, rec) is expected
    # a cast is not an activation; nor is a record whose metadata does not parse
    cast = dataclasses.replace(rec, output_meta=_meta(*outs, dtype="torch.bfloat16"))
    assert not activation(module, cast)
    assert not activation(module, dataclasses.replace(rec, input_meta="{not json"))


def test_an_activation_gets_its_context_up_to_its_own_limit():
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.context import _small

    rec = dataclasses.replace(_rec(1, None), input_meta=_meta((8, 32)),
                              output_meta=_meta((8, 32)))

    def small(module, ms, **cfg):
        c = dataclasses.make_dataclass("C", ["module", "rec", "row", "device", "cfg"])(
            module, rec, {"device_ms": ms}, torch.device("cuda"), ReplayConfig(**cfg))
        return _small(c)

    assert small(nn.ReLU(), 0.05) and not small(nn.ReLU(), 0.15)
    assert small(nn.Linear(32, 32), 0.01) and not small(nn.Linear(32, 32), 0.05)
    assert not small(nn.ReLU(), 0.05, context_activation_max_ms=0.0)
    assert not small(nn.ReLU(), None)


def test_a_memory_bound_call_gets_its_context_up_to_its_own_limit_where_asked(monkeypatch):
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure import context

    monkeypatch.setattr(context, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    rec = dataclasses.replace(_rec(1, None), input_meta=_meta((64, 64, 56, 56)),
                              output_meta=_meta((64, 64, 56, 56)))
    # a BatchNorm's figures: ~10 FLOPs an element over 4 bytes moved an element; a GEMM's 4096
    norm = {"flops": 10 * 64 * 64 * 56 * 56, "bytes": 4 * 64 * 64 * 56 * 56,
            "compute_dtype": "torch.bfloat16"}
    gemm = {"flops": 2 * 4096 ** 3, "bytes": 3 * 2 * 4096 ** 2, "compute_dtype": "torch.bfloat16"}
    assert context.memory_bound(norm, "NVIDIA H100 80GB HBM3")
    assert not context.memory_bound(gemm, "NVIDIA H100 80GB HBM3")
    assert not context.memory_bound({"flops": None, "bytes": None}, "NVIDIA H100 80GB HBM3")
    assert not context.memory_bound(norm, "no such device")

    def small(row, ms, **cfg):
        c = dataclasses.make_dataclass("C", ["module", "rec", "row", "device", "cfg"])(
            nn.BatchNorm2d(64), rec, {**row, "device_ms": ms}, torch.device("cuda"),
            ReplayConfig(**cfg))
        return context._small(c)

    assert not small(norm, 0.22)  # over the default limit, 0.1 ms
    assert small(norm, 0.08)
    assert not small(norm, 0.08, context_memory_max_ms=0)  # off: context_max_ms alone
    assert small(norm, 0.22, context_memory_max_ms=0.35)
    assert not small(norm, 0.4, context_memory_max_ms=0.35)
    assert not small(gemm, 0.22, context_memory_max_ms=0.35)


def test_a_call_like_one_profiled_as_timed_after_the_same_context_takes_its_figures(monkeypatch):
    """The re-profile in the cache state a call is timed in (``profile_as_timed``) runs once per
    kind of call and kind of context: DLRM's hundreds of ReLUs after Linears are few kinds."""
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure import steps
    from cbtrace.replay.measure.prepare import CallUnderTest
    from cbtrace.replay.measure.profiler_pass import AsTimed
    from cbtrace.replay.timer.contract import CallRunner

    profiled = []

    def fake_profile(runner, device, runs):  # the GPU's part, stood in: which runner it got
        profiled.append(runner)
        return AsTimed(1, 0.01 * len(profiled), (0.01 * len(profiled),) * runs)

    monkeypatch.setattr(steps, "profile_as_timed", fake_profile)
    monkeypatch.setattr(steps, "sm_clock_mhz", lambda device: None)
    timed = steps.Timed(["graph"], {}, ReplayConfig())
    cost = dict(flops=0.0, flops_executed=0.0, bytes=4096.0, unknown_ops=0, compute_dtype=None)

    def call(fqn, key):
        rec = ModuleRecord(fqn=fqn, call_index=0, call_id=0, parent_call_id=-1, parent_fqn=None,
                           depth=0, module_type="ReLU", module_class="torch.nn.ReLU",
                           param_bytes=0, buffer_bytes=0, input_bytes=4096, input_shapes="[]",
                           input_meta='[{"shape": [1024]}]', output_meta="[]", training=False,
                           grad_enabled=False, autocast_dtype=None, inputs_ref="{}")
        c = CallUnderTest(module=nn.ReLU(), rec=rec, run=None, n_copies=4,
                          device=torch.device("cuda"), cfg=ReplayConfig(), row=dict(cost))
        c.timed, c.context_key = CallRunner(run=lambda j: None, n_copies=4), key
        return c

    after_linear = ("context", (("Linear", '[{"shape": [1024]}]'),), 1, None)
    first = timed._profile_as_timed(call("a.relu", after_linear), True)
    again = timed._profile_as_timed(call("b.relu", after_linear), True)
    assert first[3] is None and again[3] == "a.relu"  # whose runs the figures are
    other = timed._profile_as_timed(call("c.relu", ("tables", 8)), False)
    assert len(profiled) == 2  # a.relu, then c.relu after another context
    assert first[:2] == ({"kernel_count": 1, "device_ms": 0.01}, "profiled as timed")
    assert again[:2] == ({"kernel_count": 1, "device_ms": 0.01}, "profiled as timed as a.relu")
    assert other[0]["device_ms"] == 0.02 and other[1] == "profiled as timed"
    # a call in its context is profiled for its figure (context_kernel_runs), one on table
    # copies for its kernels alone (profile_runs)
    assert len(first[2].run_ms) == 10 and len(other[2].run_ms) == 3
    # off with the counts' reuse, as the profiled pass's own cache is
    alone = steps.Timed(["graph"], {}, ReplayConfig(reuse_counts=False))
    alone._profile_as_timed(call("a.relu", after_linear), True)
    alone._profile_as_timed(call("b.relu", after_linear), True)
    assert len(profiled) == 4


@pytest.mark.parametrize("kernels_max_ms", [0.1, 0.0, 0.01])
def test_a_short_call_in_its_context_takes_its_figure_from_its_kernels_so_profiled(
        monkeypatch, kernels_max_ms):
    """The graph difference (context and call, less the context alone) carries the context's
    own change between the two graphs: microseconds a short call off kernels that match the
    step. A call whose kernels so profiled take under ``context_kernels_max_ms`` has their
    busy time as its figure, their spread its p10..p90; the difference stays in the notes."""
    import types

    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure import steps
    from cbtrace.replay.measure.profiler_pass import AsTimed
    from cbtrace.replay.timer.contract import CallRunner, Timing

    class Graph:
        name = "graph"
        runs_asked: list = []

        def unavailable_reason(self, device):
            return None

        def measure(self, call, n_copies, device, cfg):
            self.runs_asked.append((cfg.min_runs, cfg.budget_s))
            return Timing(median_ms=0.0152, p10_ms=0.0150, p90_ms=0.0154, runs=40, timer="graph")

    asked = []

    def fake_profile(runner, device, runs):  # the GPU's part: the ReLU's kernel after bn
        asked.append(runs)
        each = tuple(0.0124 + 0.0001 * i for i in range(runs))
        return AsTimed(1, sum(each) / runs, each)

    monkeypatch.setattr(steps, "profile_as_timed", fake_profile)
    monkeypatch.setattr(steps, "in_step_cache_state", lambda c: None)
    clocks = iter([1700.0, 1900.0] * 8)  # after the profiled runs, after the graph's
    monkeypatch.setattr(steps, "sm_clock_mhz", lambda device: next(clocks))
    step = steps.Timed(["graph"], {"graph": Graph()},
                       ReplayConfig(context_kernels_max_ms=kernels_max_ms))

    def call(before):
        return types.SimpleNamespace(
            row={"device_ms": 0.0126, "kernel_count": 1}, n_copies=4, context_key=None,
            timed=CallRunner(run=lambda i: None, n_copies=4, before=before),
            device=torch.device("cuda"), context_note="context: 2 calls before (conv1, bn1)",
            rec=types.SimpleNamespace(fqn="layer1.0.relu"), value_free=False,
            module=nn.ReLU())

    got = step.run(call(before=lambda j: None))
    assert got["timer"] == "graph"
    if kernels_max_ms == 0:  # off: the graph difference, the kernels profiled as before
        assert Graph.runs_asked[-1] == (10, 0.03)
        assert got["device_ms"] == pytest.approx(0.0125)
        assert got["isolated_ms"] == 0.0152 and got["runs"] == 40 and asked == [3]
        assert "its kernels in context" not in got["timer_notes"]
        return
    if kernels_max_ms == 0.01:  # kernels of 12.85 us: a call too long for their figure
        assert got["isolated_ms"] == 0.0152 and got["device_ms"] == pytest.approx(0.01285)
        assert got["timed_clock_mhz"] == 1700.0  # one reading, the graph's: none after profiling
        assert "its kernels in context" not in got["timer_notes"] and asked == [10]
        return
    assert asked == [10]  # context_kernel_runs: a spread for its p10 and p90
    assert got["isolated_ms"] == pytest.approx(0.01285) and got["runs"] == 10
    assert got["timed_clock_mhz"] == 1700.0  # the clock its figure's runs left
    assert got["isolated_ms_p10"] == pytest.approx(0.01249)  # within the runs, inclusive
    assert got["isolated_ms_p90"] == pytest.approx(0.01321)
    assert ("its kernels in context, 10 profiled runs (graph less context: 0.0152 ms, 40 runs)"
            in got["timer_notes"])
    # its graph only a check then: a few runs, no budget; a call its graph gives the figure
    # of has the replay's
    assert Graph.runs_asked[-1] == (steps.CHECK_RUNS, 0.0)
    # a call on table copies, with nothing run before it, keeps its graph figure
    alone = step.run(call(before=None))
    assert alone["isolated_ms"] == 0.0152 and asked == [10, 3]
    # a call of the same work after the same kinds of context takes the first one's runs, and
    # says so: none of the row's own
    shared = steps.Timed(["graph"], {"graph": Graph()}, ReplayConfig())
    first, second = call(before=lambda j: None), call(before=lambda j: None)
    second.rec = types.SimpleNamespace(fqn="layer1.1.relu")
    for x in (first, second):
        x.context_key = ("context", (("BatchNorm2d", "[]"),), 1, None)
        x.rec.input_meta, x.rec.training, x.rec.grad_enabled = "[]", False, False
        x.rec.autocast_dtype = None
        x.row.update(flops=0.0, flops_executed=0.0, bytes=4096.0, unknown_ops=0,
                     compute_dtype=None)
    a, b = shared.run(first), shared.run(second)
    assert asked == [10, 3, 10] and a["isolated_ms"] == b["isolated_ms"]
    assert a["runs"] == 10 and b["runs"] == 0
    assert "layer1.0.relu's kernels in context, 10 profiled runs" in b["timer_notes"]


class Bags(nn.Module):
    """Two lookups into tables of a few MB: in the step each is read once, after the other."""

    def __init__(self):
        super().__init__()
        self.t0 = nn.EmbeddingBag(8192, 128, mode="sum")  # 4 MB (fp32)
        self.t1 = nn.EmbeddingBag(4096, 128, mode="sum")  # 2 MB

    def forward(self, ids, offsets):
        return self.t0(ids, offsets) + self.t1(ids % 4096, offsets)


@pytest.mark.gpu
def test_a_lookup_rotates_enough_table_copies_to_leave_the_l2(tmp_path):
    torch.manual_seed(0)
    model = Bags().cuda().eval()
    ids = torch.randint(0, 8192, (4096 * 4,), device="cuda")
    offsets = torch.arange(0, ids.numel(), 4, device="cuda")
    run = tmp_path / "r"
    with cbtrace.capture(model, run, trace=False):
        model(ids, offsets)
    df = cbtrace.replay(run, model=model, device="cuda", progress=False,
                        budget_s=0.01).set_index("fqn")
    assert (df.status == "ok").all(), df.status_reason.dropna().to_dict()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for fqn, mb in (("t0", 4), ("t1", 2)):
        n = min(64, -(-2 * l2 // (mb << 20)))
        notes = df.loc[fqn, "timer_notes"]
        assert f"{n} copies of the table, one a run" in notes, notes
        assert df.loc[fqn, "timer"] == "graph", notes


def _short_linear_call(tmp_path, fqn: str = "0", **settings):
    """A Linear's call (of two in a row, 16.6 KB of parameters each) prepared for timing, on a
    "cuda" device whose L2 is 64 KB (the copies are made where the module is, on this CPU),
    its kernels 4 us in the profiled pass; and the call before it, ready to run as its
    context."""
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.context import ContextCall
    from cbtrace.replay.measure.prepare import prepare
    from cbtrace.rundir.read import load_run
    from cbtrace.schema.modules import frame_to_records
    from cbtrace.store.load import load_call_inputs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).eval()
    run = _capture(tmp_path, model, torch.randn(4, 64))
    recs = {r.fqn: r for r in frame_to_records(load_run(run)[1])}
    args, kwargs = load_call_inputs(run, recs[fqn].inputs_ref)
    c = prepare(model[int(fqn)], recs[fqn], args, kwargs, torch.device("cpu"),
                ReplayConfig(**settings))
    c.device, c.context = torch.device("cuda"), []
    c.row["device_ms"] = 0.004
    first = ContextCall(model[0], recs["0"], [load_call_inputs(run, recs["0"].inputs_ref)],
                        None, torch.device("cpu"))
    return model[int(fqn)], args, c, first


def test_a_short_call_timed_alone_rotates_copies_of_its_parameters(tmp_path, monkeypatch):
    """In the step a Linear reads its weight once, cold; K back-to-back slots on one weight
    read it warm. Copies enough to overflow the L2 twice, one a run; the module's own
    parameters untouched."""
    from cbtrace.replay.measure.context import in_step_cache_state
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(L2_cache_size=64 << 10))
    linear, args, c, _ = _short_linear_call(tmp_path, small_call_max_ms=0.01)
    before = state_fingerprint(linear)
    seen = []
    linear.register_forward_hook(lambda m, i, o: seen.append(m.weight.data_ptr()))
    in_step_cache_state(c)
    n = -(-2 * (64 << 10) // (64 * 64 * 4 + 64 * 4))  # 8
    assert c.context_note == f"{n} copies of its parameters, one a run"
    assert c.context_key == ("parameters", n) and c.timed.n_copies == n
    assert c.timed.before is None  # no context: the timers run the call alone
    with torch.no_grad():
        outs = [c.timed(j) for j in range(2 * n)]
        want = linear(args[0])
    assert all(torch.equal(o, want) for o in outs)
    assert len(set(seen[:n])) == n and seen[:n] == seen[n:2 * n]  # each run its own copy
    assert seen[0] == linear.weight.data_ptr() == seen[-1]  # the last: the module's own
    assert state_fingerprint(linear) == before


def test_a_short_call_in_its_context_rotates_copies_of_its_parameters(tmp_path, monkeypatch):
    """Its context runs before each run, on its own copies; the call reads the context's fresh
    output and its own parameter copy j."""
    from cbtrace.replay.measure.context import in_context
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(L2_cache_size=64 << 10))
    linear, args, c, first = _short_linear_call(tmp_path, "1", small_call_max_ms=0.01)
    seen = []
    linear.register_forward_hook(lambda m, i, o: seen.append(m.weight.data_ptr()))
    in_context(c, [first])
    n = 8
    assert c.context_note == ("context: 1 call before (0); 1 input from their outputs; "
                              f"{n} copies of its parameters, one a run"), c.context_note
    assert c.timed.n_copies == n and c.context_key[-1] == n
    with torch.no_grad():
        want = linear(first.module(*first.copies[0][0]))
        seen.clear()
        for j in range(2 * n):
            c.timed.before(j)
            assert torch.equal(c.timed(j), want)
    assert len(set(seen[:n])) == n and seen[:n] == seen[n:]
    assert linear.weight.data_ptr() in seen


@pytest.mark.parametrize("settings, device_ms", [({"small_call_max_ms": 0.0}, 0.004),
                                                 ({}, 0.02), ({"cold": True}, 0.004)])
def test_a_call_not_short_or_with_the_setting_off_or_cold_runs_on_its_parameters(
        tmp_path, monkeypatch, settings, device_ms):
    from cbtrace.replay.measure.context import in_step_cache_state
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(L2_cache_size=64 << 10))
    _, _, c, _ = _short_linear_call(tmp_path, **settings)
    c.row["device_ms"] = device_ms
    in_step_cache_state(c)
    assert c.timed is None and c.context_note is None


@pytest.mark.gpu
def test_on_a_gpu_a_short_call_takes_its_kernels_busy_time_on_parameter_copies(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 16)).cuda().eval()
    run = _capture(tmp_path, model, torch.randn(8, 512, device="cuda"))
    df = cbtrace.replay(run, model=model, device="cuda", progress=False, budget_s=0.01,
                        small_call_max_ms=0.05).set_index("fqn")
    assert (df.status == "ok").all(), df.status_reason.dropna().to_dict()
    head = df.loc["0"]  # the first call: no context before it
    assert head.device_ms < 0.05 and head.timer == "graph", head.timer_notes
    assert "copies of its parameters, one a run" in head.timer_notes
    assert "its kernels' busy time (" in head.timer_notes
    assert head.isolated_ms == pytest.approx(head.device_ms)
