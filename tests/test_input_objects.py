"""Inputs of plain-attribute classes (issue 28): stored as data, rebuilt without running code.

A class of a test-local module, allowlisted through CBTRACE_INPUT_CLASSES, round-trips (its
``__dict__`` and ``__slots__``, with no ``__init__`` run); not allowlisted, it is refused in one
line; loading a run never imports a module the run names unless the user allowlisted it, and
never from the run directory even then.
"""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import cbtrace
from cbtrace.errors import SerializationError
from cbtrace.plugins.inputs.objects import ENV, PlainObjectSerializer, allowed_packages
from cbtrace.rundir import writer
from cbtrace.rundir.read import read_records

MODULE = "cbtrace_test_records"
RECORDS_PY = '''
import os

if os.environ.get("RECORDS_SENTINEL"):
    with open(os.environ["RECORDS_SENTINEL"], "a") as f:
        f.write("imported\\n")

INITS = []


class ImageList:
    """torchvision's ImageList, as it is: tensors and their sizes in plain attributes."""

    def __init__(self, tensors, image_sizes):
        INITS.append(1)
        self.tensors = tensors
        self.image_sizes = image_sizes
        self.meta = {"scale": 0.5, "names": ("a", "b")}


class Slotted:
    __slots__ = ("weight", "__private", "unset")

    def __init__(self, weight, private):
        INITS.append(1)
        self.weight = weight
        self.__private = private
'''

LOAD = '''
import json, sys
sys.path.insert(0, {where!r})
import cbtrace
from cbtrace.errors import SerializationError
try:
    (v, *_), _ = cbtrace.load_inputs({run!r}, "head")
    print(json.dumps(["ok", type(v).__module__, type(v).__name__]))
except SerializationError as e:
    print(json.dumps(["refused", str(e)]))
'''


class Head(nn.Module):
    def forward(self, images, slotted):
        return images.tensors.sum() + slotted.weight.sum()


class Net(nn.Module):
    def __init__(self, records):
        super().__init__()
        self.records, self.head = records, Head()

    def forward(self, x):
        images = self.records.ImageList(x, [(2, 3)])
        return self.head(images, self.records.Slotted(x[0] * 2, 7))


@pytest.fixture
def records(tmp_path, monkeypatch):
    """The test-local module, imported from a folder on sys.path."""
    src = tmp_path / "site"
    src.mkdir()
    (src / f"{MODULE}.py").write_text(RECORDS_PY)
    monkeypatch.syspath_prepend(str(src))
    import importlib

    mod = importlib.import_module(MODULE)
    yield mod
    sys.modules.pop(MODULE, None)


def capture(records, run, allow: bool, monkeypatch):
    if allow:
        monkeypatch.setenv(ENV, f"other_pkg, {MODULE}")
    else:
        monkeypatch.delenv(ENV, raising=False)
    model, x = Net(records), torch.arange(6.0).reshape(2, 3)
    with cbtrace.capture(model, run, trace=False):
        model(x)
    return x


def test_the_allowlist_is_the_defaults_and_the_users(monkeypatch):
    monkeypatch.setenv(ENV, " a.b ,c,")
    assert allowed_packages() == ("torchvision", "torchaudio", "torch_geometric", "a.b", "c")
    s = PlainObjectSerializer()
    assert not s.handles(nn.Linear(1, 1)) and not s.handles(torch.ones(1))


def test_an_allowlisted_class_round_trips_without_its_init(records, tmp_path, monkeypatch):
    x = capture(records, tmp_path / "run", True, monkeypatch)
    assert len(records.INITS) == 2  # the step's own
    (images, slotted), kwargs = cbtrace.load_inputs(tmp_path / "run", "head")
    assert kwargs == {} and len(records.INITS) == 2  # rebuilt without __init__
    assert type(images) is records.ImageList and type(slotted) is records.Slotted
    assert torch.equal(images.tensors, x) and images.image_sizes == [(2, 3)]
    assert images.meta == {"scale": 0.5, "names": ("a", "b")}
    assert torch.equal(slotted.weight, x[0] * 2) and slotted._Slotted__private == 7
    assert not hasattr(slotted, "unset")
    ref = json.loads(next(r for r in read_records(tmp_path / "run") if r.fqn == "head").inputs_ref)
    node = ref["args"][0]
    assert node["t"] == "object" and node["cls"] == f"{MODULE}:ImageList"


def test_not_allowlisted_at_capture_is_an_unsupported_input(records, tmp_path, monkeypatch):
    capture(records, tmp_path / "run", False, monkeypatch)
    with pytest.raises(SerializationError, match=f"{MODULE}.ImageList was not captured"):
        cbtrace.load_inputs(tmp_path / "run", "head")


def test_not_allowlisted_at_load_is_refused_in_one_line(records, tmp_path, monkeypatch):
    capture(records, tmp_path / "run", True, monkeypatch)
    monkeypatch.delenv(ENV)
    with pytest.raises(SerializationError) as e:
        cbtrace.load_inputs(tmp_path / "run", "head")
    msg = str(e.value)
    assert f"{MODULE}:ImageList is not rebuilt" in msg and f"{ENV}={MODULE}" in msg
    assert "\n" not in msg


@pytest.fixture
def records_run(records, tmp_path, monkeypatch):
    """A run holding the test-local classes, and the module's folder (not imported in a
    fresh process)."""
    capture(records, tmp_path / "run", True, monkeypatch)
    monkeypatch.delenv(ENV)
    return tmp_path / "run", tmp_path / "site"


def _load(run, where, cwd, env_allow: str | None, sentinel):
    env = {k: v for k, v in __import__("os").environ.items() if k != ENV}
    env["RECORDS_SENTINEL"] = str(sentinel)
    if env_allow:
        env[ENV] = env_allow
    out = subprocess.run([sys.executable, "-c", LOAD.format(where=str(where), run=str(run))],
                         cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_loading_imports_a_named_module_only_when_allowlisted(records_run, tmp_path):
    run, site = records_run
    sentinel = tmp_path / "IMPORTED"
    got = _load(run, site, tmp_path, None, sentinel)
    assert got[0] == "refused" and "not on the input-class allowlist" in got[1]
    assert not sentinel.exists()  # importable from sys.path, yet never imported
    got = _load(run, site, tmp_path, MODULE, sentinel)
    assert got == ["ok", MODULE, "ImageList"] and sentinel.exists()


def test_a_module_shipped_in_the_run_is_never_imported(records_run, tmp_path):
    """A run naming its own module (placed inside it) is refused, allowlisted or not."""
    run, _ = records_run
    recs = read_records(run)
    for rec in recs:
        rec.inputs_ref = rec.inputs_ref.replace(f"{MODULE}:", "evil_records:")
    writer.write_records(run, recs)
    (run / "evil_records.py").write_text(RECORDS_PY)
    sentinel = tmp_path / "IMPORTED"
    for allow, why in ((None, "not on the input-class allowlist"),
                       ("evil_records", "the working directory or a run directory")):
        got = _load(run, "", run, allow, sentinel)  # "": the working directory, here the run
        assert got[0] == "refused" and "evil_records:ImageList" in got[1] and why in got[1], got
    assert not sentinel.exists()
