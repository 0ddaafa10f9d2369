"""Serializers: take() -> Parquet -> load_call_inputs() is bitwise equal, for every input kind."""
import collections
import dataclasses
import enum
import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbtrace import registry
from cbtrace.errors import PluginError, SerializationError
from helpers.equality import first_difference
from helpers.snapshots import take
from cbtrace.store.load import load_call_inputs
from cbtrace.store.snapshot import Snapshotter, tensor_meta

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    scale: float = 1.0
    tag: str = dataclasses.field(default="b", init=False)


class Color(enum.IntEnum):
    RED = 1


def _dtypes():
    seen, out = set(), []
    for name in sorted(dir(torch)):
        dt = getattr(torch, name)
        quantized = name.startswith(("qint", "quint"))
        if isinstance(dt, torch.dtype) and dt not in seen and not quantized:
            seen.add(dt)
            out.append(dt)
    return out


DTYPES = _dtypes()


def roundtrip(tmp_path, args, kwargs=None, **snap_kw):
    snap = Snapshotter(tmp_path / "inputs", **snap_kw)
    ref = take(snap, tuple(args), dict(kwargs or {}))
    snap.flush()
    return load_call_inputs(tmp_path, ref), ref


def assert_same(a, b):
    diff = first_difference(a, b)
    assert diff is None, diff


def random_view(draw, dtype):
    """A tensor over random bytes with random shape, strides (0 = expanded) and offset."""
    ndim = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    stride = draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim))
    offset = draw(st.integers(0, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    isz = dtype.itemsize
    n_el = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n_el * isz,), dtype=torch.uint8, generator=g)
    t = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), offset, shape, stride)
    if dtype.is_complex and draw(st.booleans()):
        t = t.conj()
    grad_ok = (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize >= 2
    if grad_ok and draw(st.booleans()):
        t.requires_grad_(True)
    return t


@st.composite
def tensors(draw):
    return random_view(draw, draw(st.sampled_from(DTYPES)))


def _leaves():
    return st.one_of(
        tensors(), st.none(), st.booleans(), st.integers(-(2**80), 2**80),
        st.floats(allow_nan=True, allow_infinity=True), st.complex_numbers(allow_nan=True),
        st.text(max_size=8), st.binary(max_size=8), st.sampled_from(DTYPES),
        st.sampled_from([torch.device("cpu"), torch.device("cuda:1"), torch.device("meta")]),
        st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
        st.builds(slice, st.integers(-3, 3), st.none() | st.integers(0, 9), st.just(2)),
        st.just(Ellipsis), st.just(Color.RED))


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3) | st.integers(0, 5), children, max_size=3),
        st.builds(Point, children, children), st.builds(Batch, children, children))


STRUCTS = st.recursive(_leaves(), _containers, max_leaves=8)
SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@SETTINGS
@given(args=st.lists(STRUCTS, max_size=3), kwargs=st.dictionaries(st.text(max_size=4), STRUCTS,
                                                                   max_size=2))
def test_roundtrip_is_bitwise_equal(tmp_path_factory, args, kwargs):
    tmp = tmp_path_factory.mktemp("rt")
    (a2, k2), _ = roundtrip(tmp, args, kwargs)
    assert_same(tuple(args), a2)
    assert_same(kwargs, k2)


@st.composite
def views_of_one_storage(draw):
    """Several views, of random dtypes, over one 512-byte storage."""
    raw = torch.randint(0, 256, (512,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    views = []
    for _ in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        isz = dtype.itemsize
        shape = draw(st.lists(st.integers(1, 4), max_size=3))
        stride = draw(st.lists(st.integers(0, 5), min_size=len(shape), max_size=len(shape)))
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        if span > 512 // isz:  # wide strides of a wide dtype overrun the storage: one element
            shape, stride, span = [1], [1], 1
        offset = draw(st.integers(0, 512 // isz - span))
        views.append(torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), offset, shape, stride))
    return views


def _end(t):
    return t.data_ptr() + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.itemsize


def _overlap(a, b):
    return a.data_ptr() < _end(b) and b.data_ptr() < _end(a)


@SETTINGS
@given(views=views_of_one_storage())
def test_views_keep_their_aliasing(tmp_path_factory, views):
    (got, _), _ = roundtrip(tmp_path_factory.mktemp("alias"), views)
    assert_same(tuple(views), got)
    for i, a in enumerate(views):
        for j, b in enumerate(views[:i]):
            shared = got[i].untyped_storage().data_ptr() == got[j].untyped_storage().data_ptr()
            if _overlap(a, b):
                assert shared, f"views {j} and {i} overlap: they must share a storage"
            if shared:
                assert got[i].data_ptr() - got[j].data_ptr() == a.data_ptr() - b.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_with_views(tmp_path, dtype):
    raw = torch.arange(4 * 6 * 16, dtype=torch.int64).to(torch.uint8)
    isz = dtype.itemsize
    base = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, (4, 6), (6, 1))
    assert base.untyped_storage().nbytes() >= 24 * isz
    views = [base, base.t(), base[:, ::2], base[1:, 3:], base[0, 0], base[:0],
             base[:1, :3].expand(5, 1, 3), base.as_strided((2, 2), (1, 5), 3)]
    (got, _), _ = roundtrip(tmp_path, views)
    assert_same(tuple(views), got)
    storages = {v.untyped_storage().data_ptr() for v in got if v.numel()}
    assert len(storages) == 1, "views of one tensor must come back as views of one storage"


def test_python_scalars_bit_exact(tmp_path):
    nan_payload = struct.unpack(">d", bytes.fromhex("7ff8000000000abc"))[0]
    values = [0.1, -0.0, math.inf, -math.inf, math.nan, nan_payload, 2**200, -(2**64) - 1, True,
              complex(-0.0, math.nan), "\ud800 lone surrogate", b"\x00\xff", bytearray(b"ab")]
    (got, _), _ = roundtrip(tmp_path, values)
    assert_same(tuple(values), got)
    assert struct.pack(">d", got[5]).hex() == "7ff8000000000abc"


def test_records_and_fallbacks(tmp_path):
    local = collections.namedtuple("Local", "a b")  # defined in a function: cannot be imported
    od = collections.OrderedDict([(2, "b"), (1, "a")])
    args = (Point(1, torch.ones(2)), local(3, 4), Batch(torch.arange(3)), od, {(1, 2): None})
    (got, _), _ = roundtrip(tmp_path, args)
    assert type(got[0]) is Point and type(got[2]) is Batch and got[2].tag == "b"
    assert type(got[1]) is not local and got[1]._fields == ("a", "b") and tuple(got[1]) == (3, 4)
    assert_same(args[0], got[0])
    assert_same(args[2:], got[2:])
    assert type(got[3]) is collections.OrderedDict


def test_local_dataclass_is_a_clear_error(tmp_path):
    @dataclasses.dataclass
    class Local:
        x: int

    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (Local(1),), {})
    snap.flush()
    with pytest.raises(SerializationError, match="dataclass .*Local cannot be imported"):
        load_call_inputs(tmp_path, ref)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unsupported_object_is_recorded_and_fails_on_load(tmp_path):
    snap = Snapshotter(tmp_path / "inputs")
    ref = take(snap, (torch.ones(2), object()), {"q": torch.quantize_per_tensor(
        torch.ones(2), 0.1, 0, torch.qint8)})
    snap.flush()
    assert '"unsupported"' in ref
    with pytest.raises(SerializationError, match="builtins.object"):
        load_call_inputs(tmp_path, ref)


def test_tensor_meta():
    t = torch.zeros(4, 6, dtype=torch.float16)[:, 1::2]
    assert tensor_meta(t) == {"shape": [4, 3], "dtype": "float16", "stride": [6, 2],
                              "storage_offset": 1, "device": "cpu", "requires_grad": False}


def test_load_to_other_device_and_missing_device_falls_back(tmp_path):
    (got, _), ref = roundtrip(tmp_path, [torch.ones(3)])
    assert got[0].device.type == "cpu"
    faked = ref.replace('"dev":"cpu"', '"dev":"cuda:7"')
    args, _ = load_call_inputs(tmp_path, faked)
    assert args[0].device.type == ("cuda" if torch.cuda.device_count() > 7 else "cpu")
    args, _ = load_call_inputs(tmp_path, ref, device="meta")
    assert args[0].device.type == "meta" and args[0].shape == (3,)


def test_torchrec_kjt_roundtrip(tmp_path):
    jt = pytest.importorskip("torchrec.sparse.jagged_tensor")
    kjt = jt.KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5]),
                               lengths=torch.tensor([1, 1, 0, 3], dtype=torch.int32),
                               weights=torch.rand(5))
    kjt.length_per_key()  # fills a cache: it must come back as the module saw it
    kt = jt.KeyedTensor(keys=["x", "y"], length_per_key=[2, 3], values=torch.randn(4, 5))
    jagged = jt.JaggedTensor(torch.ones(3), lengths=torch.tensor([3]))
    (got, kw), _ = roundtrip(tmp_path, [kjt, jagged], {"kt": kt})
    assert type(got[0]) is jt.KeyedJaggedTensor
    assert_same(vars(kjt), vars(got[0]))
    assert got[0]["b"].values().tolist() == [3, 4, 5]
    assert_same(vars(kt), vars(kw["kt"]))
    assert kw["kt"]["y"].shape == (4, 3)


class _Frac:
    name = "test_fraction"

    def handles(self, obj):
        import fractions
        return isinstance(obj, fractions.Fraction)

    def encode(self, obj, ctx):
        return {"num": ctx.encode(obj.numerator), "den": ctx.encode(obj.denominator)}

    def decode(self, node, ctx):
        import fractions
        return fractions.Fraction(ctx.decode(node["num"]), ctx.decode(node["den"]))


class _Plugin:
    def __init__(self, serializer):
        self.serializer = serializer

    @registry.hookspecs.hookimpl
    def register_serializers(self, register):
        register(self.serializer)


@pytest.fixture
def plugin():
    registered = []

    def add(serializer):
        p = _Plugin(serializer)
        registry.load()
        registry.pm.register(p, name=f"test-{serializer.name}-{len(registered)}")
        registered.append(p)

    yield add
    for p in registered:
        registry.pm.unregister(p)


def test_builtins_register_through_the_hook():
    names = [s.name for s in registry.serializers()]
    assert {"tensor", "dict", "namedtuple", "dataclass", "torchrec"} <= set(names)


def test_third_party_serializer_is_asked_first(tmp_path, plugin):
    import fractions

    plugin(_Frac())
    assert registry.serializers()[0].name == "test_fraction"
    (got, _), ref = roundtrip(tmp_path, [fractions.Fraction(3, 7)])
    assert got == (fractions.Fraction(3, 7),) and '"test_fraction"' in ref


def test_duplicate_serializer_name_is_a_plugin_error(tmp_path, plugin):
    dup = _Frac()
    dup.name = "tensor"
    plugin(dup)
    with pytest.raises(PluginError, match="'tensor' is registered twice"):
        Snapshotter(tmp_path / "inputs")


POST_INIT_RAN = []


@dataclasses.dataclass
class Audited:
    ids: torch.Tensor
    scale: float = 1.0

    def __post_init__(self):
        POST_INIT_RAN.append(self.scale)


def test_a_dataclass_input_is_rebuilt_without_running_its_code(tmp_path):
    """Loading a run builds a dataclass as data: its __init__/__post_init__ (code a crafted run
    could name, with arguments it chooses) never runs."""
    got = roundtrip(tmp_path, (Audited(torch.arange(3), 2.5),))[0][0][0]
    assert type(got) is Audited and got.scale == 2.5 and torch.equal(got.ids, torch.arange(3))
    assert POST_INIT_RAN == [2.5]  # the capture's own construction only
