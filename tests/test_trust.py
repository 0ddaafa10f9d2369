"""A run directory is data (issue 13): loading or replaying one never runs code it names.

Each crafted run gives a one-line error and a non-zero exit, and the sentinel file the named
code would write never appears: model specs (only registered providers are rebuilt unless the
run is signed by this user, the user names the model or passes --trust), class paths in stored
inputs (never imported from the run directory or the working directory), and paths in the
manifest (inside the run only). A run captured here is signed (issue 29): it replays plainly,
and any edit of its manifest brings the refusal back.
"""
import collections
import dataclasses
import enum
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import manifest as make_manifest
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace.annotate.write import annotate
from cbtrace.errors import CbtraceError, ReplayError, RunDirError, SerializationError
from cbtrace.replay.config import ReplayConfig
from cbtrace.replay.run_io.rebuild import rebuild_model
from cbtrace.rundir import writer
from cbtrace.rundir import signature
from cbtrace.rundir.read import find_trace, read_manifest, read_records
from cbtrace.schema.manifest import ModelSource
from cbtrace.store.serializer import lookup_class, qualname_of

# replay/config.py and engine.py pass these to rebuild_model (the lead's half of issue 13)
CONFIG_READY = {"trust", "model_spec"} <= set(ReplayConfig.__dataclass_fields__)
needs_config = pytest.mark.skipif(not CONFIG_READY, reason="ReplayConfig has no trust/model_spec "
                                  "fields yet (engine.py must pass them to rebuild_model)")

MODEL_PY = '''
from pathlib import Path

def build():
    import torch
    with open({sentinel!r}, "a") as f:
        f.write("built\\n")
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), (torch.randn(2, 4),)
'''


def cli(*args, cwd=None):
    """(returncode, non-empty stderr lines) of ``cbtrace ARGS``."""
    out = subprocess.run([sys.executable, "-m", "cbtrace", *map(str, args)], capture_output=True,
                         text=True, cwd=cwd)
    return out.returncode, [ln for ln in out.stderr.splitlines() if ln.strip() and "USDT" not in ln]


def one_line_error(*args, cwd=None) -> str:
    rc, lines = cli(*args, cwd=cwd)
    assert rc != 0 and len(lines) == 1, lines
    return lines[0]


def edit_manifest(run: Path, change) -> None:
    path = run / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))


def model_file(d: Path, sentinel: Path) -> str:
    """A harmless file.py:fn spec whose call appends to ``sentinel``."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(MODEL_PY.format(sentinel=str(sentinel)))
    return f"{d / 'model.py'}:build"


@pytest.fixture(scope="module", autouse=True)
def config_dir(tmp_path_factory):
    """This module's own signing key (CBTRACE_CONFIG_DIR), seen by the CLI's subprocesses too."""
    d = tmp_path_factory.mktemp("config")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(signature.KEY_ENV, str(d))
        yield d


@pytest.fixture(scope="module")
def file_run(tmp_path_factory, config_dir):
    """A real capture of a file.py:fn model (signed with this module's key); its sentinel
    removed afterwards."""
    from cbtrace.capture.from_spec import capture_model

    base = tmp_path_factory.mktemp("trust")
    sentinel = base / "built.txt"
    spec = model_file(base / "src", sentinel)
    run = capture_model(spec, base / "run", device="cpu", warmup=0, trace=False).out
    sentinel.unlink()
    return run, spec, sentinel


@pytest.fixture
def run_copy(file_run, tmp_path):
    run, spec, sentinel = file_run
    dst = shutil.copytree(run, tmp_path / "run")
    yield dst, spec, sentinel
    sentinel.unlink(missing_ok=True)


# -- model specs ----------------------------------------------------------------------------

def test_a_spec_naming_a_command_is_refused_and_runs_nothing(run_copy, tmp_path):
    run, _, _ = run_copy
    touched = tmp_path / "SENTINEL"

    def craft(doc):
        doc["model"]["spec"] = "subprocess:getoutput"
        doc["model"]["options"] = {"cmd": f"touch {touched}"}

    edit_manifest(run, craft)
    line = one_line_error("replay", run, cwd=tmp_path)
    assert "'subprocess:getoutput' is not a registered provider" in line
    assert "--model SPEC" in line and "--trust" in line
    assert not touched.exists()
    with pytest.raises(ReplayError, match="not a registered provider"):
        cbtrace.replay(run, **FAST_REPLAY)
    assert not touched.exists()


def test_a_file_spec_is_refused_without_trust(run_copy, tmp_path):
    run, spec, sentinel = run_copy
    assert read_manifest(run).model.spec == spec
    signature.unsign(run)  # a run from elsewhere: no signature of this user's
    line = one_line_error("replay", run, cwd=tmp_path)
    assert spec in line and "--trust" in line and "cbtrace trust RUN" in line
    assert not sentinel.exists()


def test_trust_rebuilds_from_the_runs_spec(run_copy):
    run, _, sentinel = run_copy
    signature.unsign(run)
    model = rebuild_model(read_manifest(run), torch.device("cpu"), verify=True, trust=True)
    assert isinstance(model, nn.Sequential) and sentinel.exists()


@needs_config
def test_trust_flag_rebuilds_from_the_runs_spec(run_copy, tmp_path):
    run, _, sentinel = run_copy
    signature.unsign(run)
    rc, lines = cli("replay", run, "--trust", "--budget-s", "0.01", cwd=tmp_path)
    assert rc == 0, lines
    assert sentinel.exists()


# -- signed runs (issue 29) -----------------------------------------------------------------

def test_a_run_captured_here_is_signed_with_a_private_key(file_run, config_dir):
    run, _, _ = file_run
    key = config_dir / "key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert (run / signature.SIGNATURE).read_text().startswith(signature.PREFIX)
    assert signature.signed_manifest(run) == read_manifest(run)
    assert signature.SIGNATURE not in read_manifest(run).files  # not among its own checksums


@needs_config
def test_a_run_captured_here_replays_plainly_and_stays_signed(run_copy, tmp_path):
    run, _, sentinel = run_copy
    rc, lines = cli("replay", run, "--budget-s", "0.01", cwd=tmp_path)
    assert rc == 0, lines
    assert sentinel.exists()  # its own model, rebuilt from its spec
    after = read_manifest(run)
    assert after.replay is not None and signature.signed_manifest(run) == after


def _edit_spec(run: Path, spec: str, how: str) -> None:
    """The manifest's spec changed: by hand, or through cbtrace's writer (checksums
    refreshed)."""
    if how == "by hand":
        edit_manifest(run, lambda doc: doc["model"].__setitem__("spec", spec))
        return
    m = read_manifest(run)
    m.model.spec = spec
    writer.write_manifest(run, m, rewritten=["modules.parquet"])


@pytest.mark.parametrize("how", ["by hand", "checksums refreshed"])
def test_an_edited_manifest_is_refused_in_one_line(run_copy, tmp_path, how):
    run, _, sentinel = run_copy
    planted = tmp_path / "PLANTED"
    evil = model_file(tmp_path / "evil", planted)
    _edit_spec(run, evil, how)
    assert signature.signed_manifest(run) is None
    line = one_line_error("replay", run, cwd=tmp_path)
    assert "is not a registered provider" in line and evil in line and "--trust" in line
    assert not planted.exists() and not sentinel.exists()
    with pytest.raises(ReplayError, match="not signed by you"):
        cbtrace.replay(run, **FAST_REPLAY)
    assert not planted.exists()


def test_another_users_signature_is_not_trusted(run_copy, tmp_path, monkeypatch):
    run, _, sentinel = run_copy
    monkeypatch.setenv(signature.KEY_ENV, str(tmp_path / "other-user"))
    assert signature.signed_manifest(run) is None
    assert not (tmp_path / "other-user").exists()  # checking makes no key
    with pytest.raises(ReplayError, match="not a registered provider"):
        cbtrace.replay(run, **FAST_REPLAY)
    assert not sentinel.exists()


def test_a_planted_signature_is_not_trusted(run_copy, file_run, tmp_path):
    """A signature copied from another signed run, or made up, signs nothing."""
    run, _, sentinel = run_copy
    other = shutil.copytree(file_run[0], tmp_path / "other")
    edit_manifest(other, lambda doc: doc.__setitem__("created", "2001-01-01T00:00:00+0000"))
    shutil.copy(run / signature.SIGNATURE, other / signature.SIGNATURE)
    (run / signature.SIGNATURE).write_text(signature.PREFIX + "0" * 64 + "\n")
    for r in (run, other):
        assert signature.signed_manifest(r) is None
        with pytest.raises(ReplayError, match="not signed by you"):
            cbtrace.replay(r, **FAST_REPLAY)
    assert not sentinel.exists()


def test_a_key_others_can_read_signs_and_trusts_nothing(run_copy, config_dir):
    run, _, _ = run_copy
    key = config_dir / "key"
    key.chmod(0o644)
    try:
        assert signature.signed_manifest(run) is None
        with pytest.raises(signature.TrustError, match="readable by other users"):
            signature.sign(run)
    finally:
        key.chmod(0o600)
    assert signature.signed_manifest(run) is not None


@needs_config
def test_replay_with_a_named_model_does_not_sign_an_edited_run(run_copy, tmp_path):
    run, spec, _ = run_copy
    planted = tmp_path / "PLANTED"
    _edit_spec(run, model_file(tmp_path / "evil", planted), "by hand")
    mine = tmp_path / "mine.txt"
    rc, lines = cli("replay", run, "--model", model_file(tmp_path / "own", mine),
                    "--budget-s", "0.01", cwd=tmp_path)
    assert rc == 0, lines
    assert read_manifest(run).replay is not None  # replay wrote its table and checksums
    assert signature.signed_manifest(run) is None and not (run / signature.SIGNATURE).exists()
    assert not planted.exists()


def test_a_capture_over_an_older_run_is_signed(run_copy):
    """capture(overwrite=True) of another model into a signed run: the new run is the
    user's own, signed too (the older signature named another model)."""
    run, _, _ = run_copy
    model = nn.Sequential(nn.Linear(2, 2))
    with cbtrace.capture(model, run, trace=False, overwrite=True):
        model(torch.ones(1, 2))
    m = read_manifest(run)
    assert m.model.spec is None and signature.signed_manifest(run) == m


def test_cbtrace_trust_shows_the_code_then_signs(run_copy, tmp_path):
    run, spec, sentinel = run_copy
    signature.unsign(run)
    path = spec.rpartition(":")[0]
    out = subprocess.run([sys.executable, "-m", "cbtrace", "trust", str(run)], input="n\n",
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 1 and f"executes the file {path} and calls build()" in out.stdout
    assert "not signed" in out.stderr and signature.signed_manifest(run) is None
    out = subprocess.run([sys.executable, "-m", "cbtrace", "trust", str(run)], input="y\n",
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"signed {run}" in out.stdout
    assert signature.signed_manifest(run) == read_manifest(run)
    model = rebuild_model(read_manifest(run), torch.device("cpu"), verify=True, run=run)
    assert isinstance(model, nn.Sequential) and sentinel.exists()


def test_cbtrace_trust_refuses_a_run_whose_files_differ(run_copy, tmp_path):
    run, _, _ = run_copy
    signature.unsign(run)
    with open(run / "modules.parquet", "ab") as f:
        f.write(b"x")
    line = one_line_error("trust", run, "--yes", cwd=tmp_path)
    assert "modules.parquet" in line and "sha256 differs" in line
    assert not (run / signature.SIGNATURE).exists()


def test_model_spec_names_the_model(run_copy, tmp_path):
    run, _, sentinel = run_copy
    mine = tmp_path / "mine.txt"
    spec = model_file(tmp_path / "elsewhere", mine)  # the same model, named by the user
    model = rebuild_model(read_manifest(run), torch.device("cpu"), verify=True, spec=spec)
    assert isinstance(model, nn.Sequential) and mine.exists() and not sentinel.exists()


@needs_config
def test_model_flag_names_the_model(run_copy, tmp_path):
    run, _, sentinel = run_copy
    mine = tmp_path / "mine.txt"
    spec = model_file(tmp_path / "elsewhere", mine)
    rc, lines = cli("replay", run, "--model", spec, "--budget-s", "0.01", cwd=tmp_path)
    assert rc == 0, lines
    assert mine.exists() and not sentinel.exists()


def test_registered_provider_options_are_values_never_evaluated(tmp_path):
    touched = tmp_path / "SENTINEL"
    code = f"__import__('os').system('touch {touched}')"
    m = make_manifest(model=ModelSource(model_class="x", spec="dlrm:tiny", seed=0,
                                        options={"num_embeddings": code}))
    with pytest.raises(ReplayError, match="cannot rebuild the run's model 'dlrm:tiny'"):
        rebuild_model(m, torch.device("cpu"), verify=False)
    assert not touched.exists()
    m.model.options = {"batch_size": 2}
    assert isinstance(rebuild_model(m, torch.device("cpu"), verify=False), nn.Module)


# -- classes named in stored inputs ---------------------------------------------------------

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Box:
    x: torch.Tensor


class Mode(enum.Enum):
    A = 1


class Takes(nn.Module):
    def forward(self, value, *rest):
        return value


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair, self.box, self.mode = Takes(), Takes(), Takes()

    def forward(self, x):
        self.pair(Pair(x, x + 1))
        self.box(Box(x))
        return self.mode(x, Mode.A)


EVIL_PY = '''
import collections, dataclasses, enum
open({sentinel!r}, "w").write("imported")
Pair = collections.namedtuple("Pair", "x y")
@dataclasses.dataclass
class Box:
    x: object
class Mode(enum.Enum):
    A = 1
'''

LOAD = '''
import json, sys
sys.path.insert(0, "")  # a notebook's default: the working directory, here the run
import cbtrace
from cbtrace.errors import SerializationError
out = {}
for fqn in ("pair", "box", "mode"):
    try:
        (v, *_), _ = cbtrace.load_inputs(".", fqn)
        out[fqn] = [type(v).__module__, type(v).__name__, list(getattr(v, "_fields", []))]
    except SerializationError as e:
        out[fqn] = str(e)
print(json.dumps(out))
'''


def _rename_classes(node, module: str, to: str):
    if isinstance(node, dict):
        if isinstance(node.get("cls"), str) and node["cls"].startswith(module + ":"):
            node["cls"] = to + node["cls"][len(module):]
        for v in node.values():
            _rename_classes(v, module, to)
    elif isinstance(node, list):
        for v in node:
            _rename_classes(v, module, to)


@pytest.fixture
def class_run(tmp_path):
    """A real capture whose stored class paths are rewritten to name ``evil``, a module file
    placed inside the run directory that writes a sentinel when imported."""
    run, model = tmp_path / "run", Parent()
    with cbtrace.capture(model, run, trace=False):
        model(torch.ones(2))
    records = read_records(run)
    for rec in records:
        doc = json.loads(rec.inputs_ref)
        _rename_classes(doc, Pair.__module__, "evil")
        rec.inputs_ref = json.dumps(doc)
    assert any("evil:Pair" in r.inputs_ref for r in records)
    writer.write_records(run, records)
    sentinel = tmp_path / "IMPORTED"
    (run / "evil.py").write_text(EVIL_PY.format(sentinel=str(sentinel)))
    return run, sentinel


def test_class_paths_never_import_a_module_from_the_run(class_run):
    run, sentinel = class_run
    out = subprocess.run([sys.executable, "-c", LOAD], cwd=run, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert not sentinel.exists()
    module, name, fields = got["pair"]  # a look-alike namedtuple with the same fields
    assert module != "evil" and name == "Pair" and fields == ["x", "y"]
    assert "dataclass evil:Box is not rebuilt" in got["box"] and "import evil" in got["box"]
    assert "enum evil:Mode.A cannot be rebuilt" in got["mode"] and "import evil" in got["mode"]
    assert all("\n" not in v for v in (got["box"], got["mode"]))


@pytest.mark.parametrize("where", ["cwd", "sys.path"])
def test_an_allowed_package_is_not_imported_from_a_run(tmp_path, where):
    """A ``transformers/`` shipped inside the run must not shadow the installed one, whether
    the run is the working directory or a directory on sys.path."""
    sentinel = tmp_path / "IMPORTED"
    run = tmp_path / "run"
    (run / "transformers").mkdir(parents=True)
    (run / "transformers" / "__init__.py").write_text(
        f"open({str(sentinel)!r}, 'w').write('imported')\n")
    (run / "manifest.json").write_text("{}")
    entry = "" if where == "cwd" else str(run)
    code = (f"import sys; sys.path.insert(0, {entry!r})\n"
            "from cbtrace.store.serializer import lookup_class\n"
            "from cbtrace.errors import SerializationError\n"
            "try:\n    lookup_class('transformers.cache_utils:DynamicCache')\n"
            "except SerializationError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=run if where == "cwd" else tmp_path,
                         capture_output=True, text=True)
    assert "refused:" in out.stdout and "a run directory" in out.stdout, out.stderr[-2000:]
    assert not sentinel.exists()


def test_lookup_class_rule(monkeypatch):
    assert lookup_class(qualname_of(Pair)) is Pair  # its module is imported
    assert lookup_class("torch.return_types:max") is torch.return_types.max  # allowlisted
    notebook = collections.namedtuple("Row", "a", module="__main__")  # a notebook's own class
    monkeypatch.setattr(sys.modules["__main__"], "Row", notebook, raising=False)
    assert lookup_class("__main__:Row") is notebook
    for spec, why in [("no_such_module_xyz:C", "its module no_such_module_xyz is not imported"),
                      ("collections:OrderedDict.__class__", "not a module:Class name"),
                      ("torch.utils.bottleneck.__main__:X", "is not imported"),
                      ("subprocess:Popen.__init__", "not a module:Class name"),
                      ("os:path", "does not name a class"),  # a module
                      ("os:sep", "does not name a class"),
                      ("json:JSONDecodeError", "does not name a class"),  # json.decoder's
                      (f"{Pair.__module__}:Box.x", "has no Box.x")]:
        with pytest.raises(SerializationError, match=why):
            lookup_class(spec)


def test_a_registered_serializers_modules_are_allowed(tmp_path, monkeypatch):
    from cbtrace import registry
    from cbtrace.hookspecs import hookimpl
    from cbtrace.store.serializer import Serializer

    pkg = tmp_path / "site" / "cbtrace_fake_ext"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(SerializationError, match="is not imported"):
        lookup_class("cbtrace_fake_ext:Thing")

    class Declares(Serializer):
        name, modules = "fake_ext", ("cbtrace_fake_ext",)

    class Plugin:
        @hookimpl
        def register_serializers(self, register):
            register(Declares())

    registry.pm.register(Plugin(), name="fake_ext")
    try:
        assert lookup_class("cbtrace_fake_ext:Thing").__name__ == "Thing"
    finally:
        registry.pm.unregister(name="fake_ext")
        sys.modules.pop("cbtrace_fake_ext", None)


# -- paths named in the manifest ------------------------------------------------------------

@pytest.fixture
def traced_run(tmp_path):
    """A real capture with its trace, and a copy of the trace outside the run."""
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    run = tmp_path / "run"
    with cbtrace.capture(model, run):
        model(torch.randn(2, 4))
    trace = find_trace(run)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(trace, outside / trace.name)
    return run, outside / trace.name, model


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_a_trace_outside_the_run_is_refused(traced_run, how, tmp_path):
    from cbtrace.attribution.join import join_insitu

    run, outside, _ = traced_run
    named = f"../elsewhere/{outside.name}" if how == "relative" else str(outside)
    edit_manifest(run, lambda doc: doc.__setitem__("trace", named))
    line = one_line_error("annotate", run, cwd=tmp_path)
    assert "trace names" in line and named in line and "outside the run directory" in line
    assert [p.name for p in outside.parent.iterdir()] == [outside.name]  # nothing written there
    with pytest.raises(RunDirError, match="trace names .* outside the run directory"):
        join_insitu(run)
    with pytest.raises(RunDirError, match="outside the run directory"):
        find_trace(run)


def test_input_files_and_files_outside_the_run_are_refused(traced_run, tmp_path):
    run, outside, model = traced_run
    edit_manifest(run, lambda doc: doc.__setitem__("input_files", ["../elsewhere/x.parquet"]))
    with pytest.raises(RunDirError, match="input_files names '../elsewhere/x.parquet'"):
        cbtrace.replay(run, model=model, **FAST_REPLAY)
    edit_manifest(run, lambda doc: (doc.__setitem__("input_files", []),
                                    doc["files"].__setitem__("/etc/passwd", "0" * 64)))
    assert "files names '/etc/passwd'" in one_line_error("replay", run, cwd=tmp_path)


def test_a_link_leading_out_of_the_run_is_never_the_trace(traced_run):
    run, outside, _ = traced_run
    own = find_trace(run)
    edit_manifest(run, lambda doc: doc.__setitem__("trace", None))
    own.unlink()
    (run / "planted.pt.trace.json.gz").symlink_to(outside)
    assert find_trace(run) is None
    with pytest.raises(CbtraceError, match="no capture trace"):
        annotate(run)


def test_trust_refuses_a_manifest_changed_since_it_was_shown(tmp_path):
    from cbtrace.errors import RunDirError
    from cbtrace.rundir.signature import trust

    run = tmp_path / "r"
    run.mkdir()
    (run / "manifest.json").write_bytes(b'{"shown": 1}')
    with pytest.raises(RunDirError, match="changed since it was shown; not signed"):
        trust(run, shown=b'{"shown": 0}')


def test_a_signature_with_non_ascii_text_is_no_signature(tmp_path, monkeypatch):
    from cbtrace.rundir.signature import SIGNATURE, load_key, signed_bytes

    assert load_key(create=True) is not None  # a key here: the signature itself is compared
    run = tmp_path / "r"
    run.mkdir()
    (run / "manifest.json").write_bytes(b"{}")
    (run / SIGNATURE).write_text("hmac-sha256:\u00e9", encoding="utf-8")
    assert signed_bytes(run) is None
