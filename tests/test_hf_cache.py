"""transformers Cache inputs (issue 12): stored bitwise, refused from untrusted nodes, put back
before every replayed run, and GPT-2, Llama and T5 replayed at their default settings."""
import collections.abc
import inspect
import json
import sys
import weakref

import pytest
import torch

pytest.importorskip("transformers.cache_utils")

import cbtrace  # noqa: E402
from cbtrace.errors import SerializationError  # noqa: E402
from cbtrace.plugins.backends.cpu import CpuTimer  # noqa: E402
from cbtrace.replay.measure.prepare import InputState, prepare  # noqa: E402
from cbtrace.replay.config import ReplayConfig  # noqa: E402
from cbtrace.replay.timer.contract import TimingConfig  # noqa: E402
from cbtrace.state import state_fingerprint  # noqa: E402
from cbtrace.store.load import load_call_inputs  # noqa: E402
from cbtrace.store.snapshot import Snapshotter  # noqa: E402
from helpers.equality import first_difference  # noqa: E402
from helpers.settings import FAST_REPLAY  # noqa: E402
from helpers.snapshots import take  # noqa: E402
from transformers import cache_utils as cu  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

B, H, D = 2, 2, 8  # (batch, kv heads, head dim) of the hand-made caches


def kv(n: int, seed: int = 0):
    """Key and value states (B, H, n, D) of n tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def llama_config(**kw):
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **kw)


def roundtrip(tmp_path, *args, **kwargs):
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, args, kwargs)
    snap.flush()
    return load_call_inputs(tmp_path, ref), ref


def assert_same(a, b):
    diff = first_difference(a, b)
    assert diff is None, diff


def _dynamic(filled: bool):
    c = cu.DynamicCache(config=llama_config())
    if filled:
        c.update(*kv(5), layer_idx=0)  # layer 0 holds 5 tokens, layer 1 is empty
    return c


def _lazy(filled: bool):
    c = cu.DynamicCache()  # no config: layers appear on update, from layer_class_to_replicate
    if filled:
        c.update(*kv(3), layer_idx=0)
    return c


def _sliding(filled: bool):
    c = cu.DynamicCache(config=llama_config(layer_types=["sliding_attention", "full_attention"],
                                            sliding_window=4))
    if filled:
        c.update(*kv(6), layer_idx=0)  # more than the window: the layer keeps the last 3
    return c


def _static(filled: bool):
    c = cu.StaticCache(config=llama_config(), max_cache_len=12)
    if filled:
        c.update(*kv(5), layer_idx=0)
    return c


def _static_sliding(filled: bool):
    cfg = llama_config(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    c = cu.StaticCache(config=cfg, max_cache_len=12)
    if filled:
        c.update(*kv(2), layer_idx=0)
        c.update(*kv(3, 1), layer_idx=1)
    return c


def _hybrid(filled: bool):
    """Linear-attention, hybrid and dummy layers, as hybrid models (Qwen3-Next style) hold."""
    c = cu.DynamicCache()
    c.layers = [cu.LinearAttentionAndFullAttentionLayer(), cu.LinearAttentionLayer(),
                cu.DynamicSlidingWindowLayer(sliding_window=4)]
    if hasattr(cu, "DummyLayer"):  # transformers >= 5.2x
        c.layers.append(cu.DummyLayer())
    c.layer_class_to_replicate = None
    if filled:
        c.layers[0].update_conv_state(torch.randn(B, 6, 4))
        c.layers[0].update_recurrent_state(torch.randn(B, H, D, D))
        c.layers[0].update(*kv(3))
        c.layers[1].update_conv_state(torch.randn(B, 6, 4))
        c.layers[2].update(*kv(2))
    return c


def _encoder_decoder(filled: bool):
    c = cu.EncoderDecoderCache(cu.DynamicCache(config=llama_config()),
                               cu.DynamicCache(config=llama_config()))
    if filled:
        c.self_attention_cache.update(*kv(2), layer_idx=0)
        c.cross_attention_cache.update(*kv(7, 1), layer_idx=0)
        c.is_updated[0] = True
    return c


CACHES = {"dynamic": _dynamic, "dynamic_lazy": _lazy, "dynamic_sliding": _sliding,
          "static": _static, "static_sliding": _static_sliding, "hybrid_linear": _hybrid,
          "encoder_decoder": _encoder_decoder}


@pytest.mark.parametrize("filled", [False, True], ids=["empty", "partly_filled"])
@pytest.mark.parametrize("kind", sorted(CACHES))
def test_cache_round_trip_is_bitwise(tmp_path, kind, filled):
    cache = CACHES[kind](filled)
    (args, kwargs), ref = roundtrip(tmp_path, torch.ones(2), cache=cache)
    assert '"unsupported"' not in ref
    got = kwargs["cache"]
    assert type(got) is type(cache) and got is not cache
    assert_same(vars(cache), vars(got))
    assert got.get_seq_length(0) == cache.get_seq_length(0)


def test_rebuilt_cache_keeps_working(tmp_path):
    """A decoded cache is the live object: it grows (dynamic) and writes in place (static)."""
    (_, kw), _ = roundtrip(tmp_path, dyn=_dynamic(True), lazy=_lazy(False), st=_static(True))
    k, v = kv(4, 2)
    kw["dyn"].update(k, v, layer_idx=0)
    kw["lazy"].update(k, v, layer_idx=0)  # replicates a fresh DynamicLayer: the class came back
    kw["st"].update(k, v, layer_idx=0)
    assert kw["dyn"].get_seq_length(0) == 9 and kw["lazy"].get_seq_length(0) == 4
    assert type(kw["lazy"].layers[0]) is cu.DynamicLayer
    assert int(kw["st"].layers[0].cumulative_length) == 9


def test_class_reference_is_not_cached_by_metaclass(tmp_path):
    """A cache_utils class and another ABC share a metaclass: only the first is ours."""
    (args, _), ref = roundtrip(tmp_path, [cu.DynamicLayer, cu.StaticCache])
    assert args[0] == [cu.DynamicLayer, cu.StaticCache]
    snap = Snapshotter(tmp_path / "other")
    ref = take(snap, (cu.DynamicLayer, collections.abc.Sized), {})
    nodes = json.loads(ref)["args"]
    assert [n["t"] for n in nodes] == ["hf_cache_class", "unsupported"]


def test_encoding_does_not_import_transformers(tmp_path, monkeypatch):
    cache = _dynamic(True)
    for name in ("transformers", "transformers.cache_utils"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of it now fails
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (cache,), {})
    snap.flush()
    assert '"unsupported"' not in ref
    with pytest.raises(SerializationError, match="DynamicCache cannot be imported"):
        load_call_inputs(tmp_path, ref)
    monkeypatch.undo()
    (args, _) = load_call_inputs(tmp_path, ref)
    assert_same(vars(cache), vars(args[0]))


@pytest.mark.parametrize("spec", [
    "xml.dom.minidom:Node",                     # another module: never imported
    "transformers.cache_utils:torch",           # a name cache_utils imports, not a class of it
    "transformers.cache_utils:PreTrainedConfig",  # a class imported into cache_utils
    "transformers.cache_utils:torch.nn.Module",  # no walking through attributes
    "transformers.cache_utils:NoSuchCache",
])
@pytest.mark.parametrize("kind", ["hf_cache", "hf_cache_class"])
def test_untrusted_class_names_are_refused(tmp_path, spec, kind):
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (_dynamic(False) if kind == "hf_cache" else cu.DynamicLayer,), {})
    snap.flush()
    doc = json.loads(ref)
    assert doc["args"][0]["t"] == kind
    doc["args"][0]["cls"] = spec
    had_minidom = "xml.dom.minidom" in sys.modules
    with pytest.raises(SerializationError, match="refusing|does not name a class|cannot be imported"):
        load_call_inputs(tmp_path, json.dumps(doc))
    assert ("xml.dom.minidom" in sys.modules) == had_minidom


class Holder:
    """An object holding a tensor that no serializer knows."""

    def __init__(self):
        self.t = torch.ones(3)


def test_unsupported_input_names_its_type_and_the_hook(tmp_path):
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (Holder(),), {})
    snap.flush()
    with pytest.raises(SerializationError) as e:
        load_call_inputs(tmp_path, ref)
    msg = str(e.value)
    assert f"input of type {__name__}.Holder was not captured: no serializer handles it" in msg
    assert "register_serializers" in msg and "docs/ARCHITECTURE.md" in msg


# ---- replay: mutated inputs are put back before every run ------------------------------------

def test_input_state_puts_attributes_lists_dicts_and_counters_back():
    cache = _static(True)
    enc = _encoder_decoder(True)
    st = InputState(((torch.ones(1),), {"cache": cache, "enc": enc}))
    assert st and not InputState(((torch.ones(1), (torch.ones(2),)), {"x": 1}))
    levels, names = [torch.ones(2)], {"y": 1}  # a list or dict the call may change
    plain = InputState(((torch.ones(1), levels), {"x": names}))
    levels.append(torch.ones(3))
    names["z"] = 2
    plain.restore()
    assert plain and len(levels) == 1 and names == {"y": 1}
    layer, keys, updated = cache.layers[0], cache.layers[0].keys, dict(enc.is_updated)
    cache.update(*kv(4, 3), layer_idx=0)  # cumulative_length.add_ in place, keys written
    enc.self_attention_cache.update(*kv(1), layer_idx=0)  # self.keys = torch.cat(...)
    enc.is_updated[1] = not enc.is_updated[1]
    cache.layers.append(cu.StaticLayer(4))
    layer.extra = 1
    st.restore()
    assert int(layer.cumulative_length) == 5 and layer.keys is keys
    assert enc.self_attention_cache.get_seq_length(0) == 2 and enc.is_updated == updated
    assert len(cache.layers) == 2 and not hasattr(layer, "extra")


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A tiny Llama captured at its defaults (a DynamicCache flows between its layers)."""
    torch.manual_seed(0)
    model = _llama()
    run = tmp_path_factory.mktemp("llama") / "r"
    with cbtrace.capture(model, run, trace=False):
        model(input_ids=torch.randint(0, 128, (2, 16)))
    return model, run


def _llama():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config()).eval()


def cache_of(kwargs):
    """The Cache among a call's kwargs (named ``cache`` in transformers 5.24, earlier
    ``past_key_values``)."""
    return next(v for v in kwargs.values() if isinstance(v, cu.Cache))


def cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _entry_lengths(module, layer_idx: int) -> list:
    """Key length of cache layer ``layer_idx`` each time ``module`` is entered."""
    seen = []

    def hook(mod, args, kwargs):
        layer = cache_of(kwargs).layers[layer_idx]
        seen.append(None if layer.keys is None else layer.keys.shape[-2])

    return seen, module.register_forward_pre_hook(hook, with_kwargs=True)


def test_replayed_decoder_layer_sees_the_captured_cache_every_run(llama_run):
    model, run = llama_run
    layer = model.model.layers[1]
    args, kwargs = cbtrace.load_inputs(run, "model.layers.1")
    cache = cache_of(kwargs)
    assert isinstance(cache, cu.DynamicCache)
    assert cache.get_seq_length(0) == 16 and not cache.layers[1].is_initialized  # partly filled
    call = prepare(layer, _record(run, "model.layers.1"), args, kwargs, torch.device("cpu"),
                   ReplayConfig(max_copies=3))
    first = call.run(0)
    seen, handle = _entry_lengths(layer.self_attn, 1)
    try:
        for i in range(30):
            out = call.run(i)
            assert out.shape == first.shape and torch.equal(out, first)
            assert cache.get_seq_length(0) == 16 and cache.layers[1].keys.shape[-2] == 16
    finally:
        handle.remove()
    assert seen == [None] * 30  # layer 1 empty at every entry, as captured


def _record(run, fqn: str, call_index: int = 0):
    """The captured call's ModuleRecord."""
    from cbtrace.rundir.read import read_records

    return next(r for r in read_records(run) if r.fqn == fqn and r.call_index == call_index)


def test_cpu_timer_over_50_calls_sees_no_growth(llama_run):
    model, run = llama_run
    attn = model.model.layers[1].self_attn
    args, kwargs = cbtrace.load_inputs(run, "model.layers.1.self_attn")
    cache = cache_of(kwargs)
    call = prepare(attn, _record(run, "model.layers.1.self_attn"), args, kwargs,
                   torch.device("cpu"), ReplayConfig(max_copies=2))
    lengths = []

    def hook(mod, a, kw, out):  # after the call: the layer holds its own 16 tokens, no more
        lengths.append(cache_of(kw).layers[1].keys.shape[-2])

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    cfg = TimingConfig(budget_s=0.0, min_runs=50, max_runs=50, warmup_runs=3, warmup_min_s=0.0)
    try:
        t = CpuTimer().measure(call.run, call.n_copies, torch.device("cpu"), cfg)
    finally:
        handle.remove()
    assert t.runs == 50 and len(lengths) >= 53
    assert set(lengths) == {16}, sorted(set(lengths))
    assert cache.get_seq_length(0) == 16


def _static_llama_layer(run, device: str, early: bool = False):
    """Decoder layer 1 of a tiny Llama run with a StaticCache (max_cache_len=32) on ``device``,
    prepared for replay, and the loaded cache. ``early``: its layers allocated before the step
    (a lazily allocated layer copies its counter to the device: no CUDA graph can hold that)."""
    from transformers.cache_utils import StaticCache

    torch.manual_seed(0)
    model = _llama().to(device)
    ids = torch.randint(0, 128, (2, 16), device=device)
    cache = StaticCache(config=model.config, max_cache_len=32)
    if early:
        fake = torch.zeros(2, 2, 0, 16, device=device)  # (B, kv heads, 0 tokens, head dim)
        for layer in cache.layers:
            layer.lazy_initialization(fake, fake)
    with cbtrace.capture(model, run, trace=False, include=("model.layers.*",), max_depth=3):
        model(input_ids=ids, **{cache_kwarg(model): cache})
    args, kwargs = cbtrace.load_inputs(run, "model.layers.1")
    cache = cache_of(kwargs)
    assert type(cache.layers[1]) is cu.StaticLayer and int(cache.layers[0].cumulative_length) == 16
    call = prepare(model.model.layers[1], _record(run, "model.layers.1"), args, kwargs,
                   torch.device(device), ReplayConfig(max_copies=2))
    return call, cache


@pytest.mark.parametrize("early", [False, True], ids=["lazy", "early"])
def test_static_cache_counter_is_put_back(tmp_path, early):
    """StaticLayer bumps cumulative_length in place: without putting it back the third run of
    16 tokens would write past max_cache_len=32."""
    call, cache = _static_llama_layer(tmp_path / "r", "cpu", early)
    first = call.run(0)
    for i in range(10):
        assert torch.equal(call.run(i), first)
    assert int(cache.layers[1].cumulative_length) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_graph_timer_replays_the_captured_cache(tmp_path, static):
    """K calls in one CUDA graph, replayed many times: the counter's copy-back is in the graph.
    A static cache's layer is captured too (cbtrace's own putting back of the counter asks the C
    capture check, which the graph timer does not watch); were the layer itself to ask whether
    it is being captured, the graph timer would refuse it for that alone and the events timer
    time it, state put back either way."""
    from cbtrace.plugins.backends.events import EventsTimer
    from cbtrace.plugins.backends.graph import GraphTimer
    from cbtrace.replay.timer.contract import TimerUnavailable

    if static:
        call, cache = _static_llama_layer(tmp_path / "r", "cuda", early=True)
    else:
        torch.manual_seed(0)
        model = _llama().cuda()
        with cbtrace.capture(model, tmp_path / "r", trace=False):
            model(input_ids=torch.randint(0, 128, (2, 16), device="cuda"))
        args, kwargs = cbtrace.load_inputs(tmp_path / "r", "model.layers.1")
        cache = cache_of(kwargs)
        call = prepare(model.model.layers[1], _record(tmp_path / "r", "model.layers.1"), args,
                       kwargs, torch.device("cuda"), ReplayConfig(max_copies=2))
    first = call.run(0)
    cfg = TimingConfig(budget_s=0.02, min_runs=20, warmup_runs=3, graph_k=4)
    timer = GraphTimer()
    try:
        t = timer.measure(call.run, call.n_copies, torch.device("cuda"), cfg)
    except TimerUnavailable as e:  # only the layer's own question may refuse it
        assert static and "is_current_stream_capturing" in str(e), e
        timer = EventsTimer()
        t = timer.measure(call.run, call.n_copies, torch.device("cuda"), cfg)
    torch.cuda.synchronize()
    assert t.timer == timer.name and t.runs >= 20, t
    if static:
        assert int(cache.layers[1].cumulative_length) == 16
    out = call.run(1)
    assert out.shape == first.shape and torch.allclose(out, first)
    assert cache.get_seq_length(0) == 16 and cache.layers[1].keys.shape[-2] in (16, 32)


# ---- end to end: capture + replay at the models' default settings ----------------------------

def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval(), {"input_ids": torch.randint(0, 128, (2, 8))}


def _llama_batch():
    return _llama(), {"input_ids": torch.randint(0, 128, (2, 8))}


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg).eval(), {
        "input_ids": torch.randint(0, 128, (2, 8)),
        "decoder_input_ids": torch.randint(0, 128, (2, 4))}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("build, layer, cache_type", [
    (_gpt2, "transformer.h.1", cu.DynamicCache),
    (_llama_batch, "model.layers.1", cu.DynamicCache),
    (_t5, "decoder.block.1", cu.EncoderDecoderCache),
], ids=["gpt2", "llama", "t5"])
def test_transformers_models_replay_ok(tmp_path, build, layer, cache_type, device):
    torch.manual_seed(0)
    model, batch = build()
    model, batch = model.to(device), {k: v.to(device) for k, v in batch.items()}
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(**batch)
    args, kwargs = cbtrace.load_inputs(tmp_path / "r", layer)
    assert any(isinstance(v, cache_type) for v in (*args, *kwargs.values())), (args, kwargs)
    before = state_fingerprint(model)
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    bad = df[df["status"] != "ok"][["fqn", "status", "status_reason"]]
    assert bad.empty, "\n" + bad.to_string()
    assert state_fingerprint(model) == before
    if device == "cuda":  # graphs, but for the calls that ask whether they are captured
        asks = df["timer_fallback"].fillna("").str.contains("is_current_stream_capturing")
        assert set(df.loc[~asks, "timer"]) == {"graph"}, df.groupby("timer")["fqn"].apply(list)
        assert set(df.loc[asks, "timer"]) <= {"stream"} and asks.sum() < len(df) / 2


def test_a_staged_backward_lets_go_of_what_earlier_forwards_left_in_the_caches(llama_run):
    """Each forward with grad appends keys and values, with their autograd graph, to its copy's
    Cache, and they stay until that copy runs again. The graph holds the projections'
    AccumulateGrad nodes and the stream each was made on; a backward staged and captured on a
    side stream while one made on the default stream is alive fails the capture (the attention
    backwards of transformers models). Unstaging puts every copy's objects back first."""
    from cbtrace.replay.modes.backward import (_backward_runner, _Backward, _gradients,
                                               _grad_outputs)

    class Saved:  # what a graph node saved for its backward, alive as long as the node
        def __init__(self, t):
            self.t = t.detach()  # no reference to the graph itself

    alive = weakref.WeakSet()

    def pack(t):
        alive.add(s := Saved(t))
        return s

    model, run = llama_run
    attn = model.model.layers[1].self_attn
    args, kwargs = cbtrace.load_inputs(run, "model.layers.1.self_attn")
    call = prepare(attn, _record(run, "model.layers.1.self_attn"), args, kwargs,
                   torch.device("cpu"), ReplayConfig(max_copies=3))
    caches = [cache_of(k) for _, k in call.run.copies]
    assert not caches[0].layers[1].is_initialized  # as captured: layer 1 not yet written
    with torch.enable_grad():
        outs = _grad_outputs(call.run(0))
        grads, _ = _gradients(call, outs)
        del outs
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.t):
            for i in range(call.n_copies):
                call.run(i)  # outputs dropped at once
    assert all(c.layers[1].keys.grad_fn is not None for c in caches) and len(alive) > 0
    runner = _backward_runner(call, _Backward(call, grads))
    runner.unstage()
    assert not any(c.layers[1].is_initialized for c in caches)
    assert len(alive) == 0  # every graph those forwards made is gone


def test_no_autograd_node_made_before_a_backward_is_timed_survives_into_its_staging(llama_run,
                                                                                  monkeypatch):
    """On a GPU every run outside a timer is on the default stream, and a parameter's
    AccumulateGrad node keeps the stream it was made on: one still alive when the graph timer
    stages and captures a backward on its side stream fails the capture ("operation would make
    the legacy stream depend on a capturing blocking stream"; transformers attentions and their
    layers). The backward step as the replay runs it, after forward runs that left
    keys in the copies' Cache, with a timer that does what the graph timer does before its
    capture (warm-up runs, unstage, stage): every parameter node alive when the timer began
    (tagged then) is gone by the staging."""
    from cbtrace.plugins.backends.cpu import CpuTimer
    from cbtrace.replay.modes.backward import BackwardStep

    model, run = llama_run
    attn = model.model.layers[1].self_attn
    args, kwargs = cbtrace.load_inputs(run, "model.layers.1.self_attn")
    cfg = ReplayConfig(max_copies=3, backward=True, timer="cpu", **FAST_REPLAY)
    call = prepare(attn, _record(run, "model.layers.1.self_attn"), args, kwargs,
                   torch.device("cpu"), cfg)
    params = list(attn.parameters())

    def node(p):  # its AccumulateGrad: the live one, else a new one that dies at once
        return p.view_as(p).grad_fn.next_functions[0][0]

    staged, measure = [], CpuTimer.measure

    def like_the_graph_timer(self, runner, n_copies, device, tcfg):
        if runner.stage is not None:
            for p in params:
                node(p).metadata["before the timer"] = True
            for i in range(2):  # its warm-up, on the capture stream on a GPU
                runner.run(i)
            runner.unstage()
            for j in range(3):
                runner.stage(j)
            staged.append(sum("before the timer" in node(p).metadata for p in params))
            runner.unstage()
        return measure(self, runner, n_copies, device, tcfg)

    monkeypatch.setattr(CpuTimer, "measure", like_the_graph_timer)
    with torch.enable_grad():
        for i in range(call.n_copies):  # the forward steps' runs: keys left in each copy
            call.run(i)
    assert all(cache_of(k).layers[1].keys.grad_fn is not None for _, k in call.run.copies)
    row = BackwardStep(cfg, ["cpu"], {"cpu": CpuTimer()}).run(call)
    assert row["bwd_status"] == "ok" and staged == [0]
