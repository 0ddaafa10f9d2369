"""Bad input (issue 13): one line on stderr naming the file or module, a non-zero exit, and every
file that existed before byte-identical afterwards (nothing half-written, nothing overwritten)."""
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers.module_traces import module_trace
from helpers.paths import REPO

from cbtrace.capture.from_spec import capture_model
from cbtrace.errors import CaptureError, ProviderError
from cbtrace.model.spec import resolve
from cbtrace.rundir.read import find_trace

KINETO = ("USDT", "STAGE")  # Kineto's own log lines (being removed elsewhere)


def cbtrace(*args, prefix=(), code=None):
    """(returncode, stdout, stderr lines that are not Kineto's) of ``cbtrace ARGS``."""
    head = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "cbtrace",
                                                             *args]
    out = subprocess.run([*prefix, *head], capture_output=True, text=True, cwd=REPO,
                         timeout=600)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith(KINETO)]
    return out.returncode, out.stdout, lines


def digests(folder: Path) -> dict:
    """relative path -> sha256 of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dlrm_run(tmp_path_factory):
    """``cbtrace capture --model dlrm:tiny --device cpu --max-depth 1``, once."""
    return capture_model("dlrm:tiny", tmp_path_factory.mktemp("cap") / "run", device="cpu",
                         max_depth=1).out


@pytest.fixture
def run(tmp_path, dlrm_run):
    return Path(shutil.copytree(dlrm_run, tmp_path / "run"))


@pytest.fixture
def read_only(run):
    """``run`` made read-only, and the prefix that runs a command unable to write it (root
    writes anywhere: setpriv drops the capabilities that let it)."""
    prefix = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: a read-only folder stays writable")
        prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search", "--")
    paths = [run, *run.rglob("*")]
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    yield prefix
    for p in paths:
        p.chmod(0o755 if p.is_dir() else 0o644)


# ---------------------------------------------------------------- 1. provider options

def test_unknown_provider_option_lists_the_options(tmp_path):
    rc, _, err = cbtrace("capture", "--model", "nanogpt:tiny", "-o", "n_layer=6", "--device",
                         "cpu", "--out", str(tmp_path / "r"))
    assert rc == 1 and err == ["Error: nanogpt: unknown option 'n_layer' (options: batch_size, "
                               "preset, seq_len, targets)"]
    assert not (tmp_path / "r").exists()
    rc, _, err = cbtrace("capture", "--model", "benchmarks/zoo.py:cnn", "-o", "width=3",
                         "--device", "cpu", "--out", str(tmp_path / "r"))
    assert rc == 1 and len(err) == 1 and err[0].endswith(
        "zoo.py:cnn: unknown option 'width' (options: size, train)"), err
    assert not (tmp_path / "r").exists()


def test_declared_options_presets_and_callables_still_resolve(tmp_path):
    for spec, options in (("nanogpt:tiny", {"batch_size": 1, "seq_len": 8, "targets": True}),
                          ("dlrm:tiny", {"batch_size": 2, "num_embeddings": 50}),
                          ("torchrec:tiny", {"arch": "dlrm", "batch_size": 2}),
                          (f"{REPO}/benchmarks/zoo.py:cnn", {"size": "tiny", "train": True})):
        resolve(spec, options=options)
    model, (idx, _) = resolve("nanogpt:tiny", options={"batch_size": 1, "seq_len": 8,
                                                        "targets": True}).model_and_batch()
    assert idx.shape == (1, 8) and len(model.transformer.h) == 2
    for name in ("torchrec", "dlrm"):
        with pytest.raises(ProviderError, match=f"^{name}: unknown option 'n_layer'"):
            resolve(f"{name}:tiny", options={"n_layer": 6})
    user = tmp_path / "user.py"
    user.write_text("import torch\n"
                    "def anything(**kw):\n    return torch.nn.Linear(2, 2), (torch.ones(1, 2),)\n"
                    "def nothing():\n    return torch.nn.Linear(2, 2), (torch.ones(1, 2),)\n")
    resolve(f"{user}:anything", options={"whatever": 1}).model_and_batch()
    with pytest.raises(ProviderError, match=r"nothing: unknown option 'x' \(options: none\)"):
        resolve(f"{user}:nothing", options={"x": 1})


# ---------------------------------------------------------------- 2. attribute --capture-run


def test_capture_run_of_another_model_is_refused(tmp_path):
    gpt = capture_model("nanogpt:tiny", tmp_path / "gpt", device="cpu").out
    dlrm = capture_model("dlrm:tiny", tmp_path / "dlrm", device="cpu").out
    trace = module_trace("dlrm:tiny", tmp_path / "dlrm.pt.trace.json")
    before = digests(tmp_path)
    rc, out, err = cbtrace("attribute", str(trace), "--capture-run", str(gpt))
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith(f"Error: {gpt}: its modules do not match the nn.Module events of "
                             f"{trace} (the run calls GPT_0 (<root>) where the trace calls ")
    # every row printed: which rows make the default top 15 depends on their timing
    rc, out, err = cbtrace("attribute", str(trace), "--capture-run", str(dlrm), "--top", "100")
    assert rc == 0 and not err, err
    assert "inter_arch.deep_fm" in out and "Linear_" not in out  # real paths, not Class_N
    assert digests(tmp_path) == before


# ---------------------------------------------------------------- 3. nothing half-written

def test_annotate_read_only_run(run, read_only):
    before = digests(run)
    rc, _, err = cbtrace("annotate", str(run), prefix=read_only)
    dst = run / f"annotated_{find_trace(run).name}"
    assert rc == 1 and err == [f"Error: {dst}: cannot write ({run} is not writable)"]
    assert digests(run) == before


def test_replay_read_only_run(run, read_only):
    before = digests(run)
    rc, _, err = cbtrace("replay", str(run), prefix=read_only)
    assert rc == 1 and len(err) == 1, err  # refused before the model is rebuilt
    assert err[0] == f"Error: {run}: cannot create files here (Permission denied)"
    assert digests(run) == before


def test_attribute_out_into_a_missing_folder(run, tmp_path):
    before = digests(tmp_path)
    out = tmp_path / "nodir" / "t.parquet"
    rc, _, err = cbtrace("attribute", str(find_trace(run)), "--out", str(out))
    assert rc == 1 and err == [f"Error: {out}: cannot write (no folder {out.parent})"]
    assert digests(tmp_path) == before and not out.parent.exists()


def test_negative_max_depth_is_refused_before_anything_is_made(tmp_path):
    rc, _, err = cbtrace("capture", "--model", "dlrm:tiny", "--device", "cpu", "--max-depth",
                         "-1", "--out", str(tmp_path / "r"))
    assert rc == 2 and err == ["Error: Invalid value for '--max-depth': -1 is not in the range "
                               "x>=0. (see cbtrace capture --help)"]
    with pytest.raises(CaptureError, match="max_depth -1: expected 0"):
        capture_model("dlrm:tiny", tmp_path / "r", device="cpu", max_depth=-1)
    assert not list(tmp_path.iterdir())


def test_torn_progress_line_loses_only_itself(tmp_path):
    from cbtrace.replay.run_io.progress import PROGRESS, ProgressLog, read_done

    log = ProgressLog(tmp_path, resume=False)
    log.append({"call_id": 0, "isolated_ms": 1.0})
    log.append({"call_id": 1, "isolated_ms": 2.0})
    log.close()
    with open(tmp_path / PROGRESS, "a") as f:
        f.write('{"call_id": 2, "isol')  # the process died mid-write
    assert set(read_done(tmp_path)) == {0, 1}
    log = ProgressLog(tmp_path, resume=True)  # --resume: call 2 is done again, then call 3
    log.append({"call_id": 2, "isolated_ms": 3.0})
    log.append({"call_id": 3, "isolated_ms": 4.0})
    log.close()
    assert {c: r["isolated_ms"] for c, r in read_done(tmp_path).items()} == \
        {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}


def test_failed_annotate_leaves_nothing_and_needs_no_force(run, monkeypatch):
    from cbtrace.annotate import pftrace
    from cbtrace.annotate.write import annotate, pftrace_path

    if pftrace.unavailable_reason():
        pytest.skip(pftrace.unavailable_reason())
    before = digests(run)

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pftrace, "build", broken)  # fails after the JSON trace was written
    with pytest.raises(RuntimeError, match="disk full"):
        annotate(run)
    assert digests(run) == before  # no annotated JSON, no .pftrace, no temp file
    monkeypatch.undo()
    out = annotate(run)  # no --force needed
    assert out.is_file() and pftrace_path(out).is_file()


# ---------------------------------------------------------------- 4. perfetto is optional

NO_PERFETTO = ("import sys; sys.modules['perfetto'] = None  # import perfetto fails\n"
               "from cbtrace.cli.main import main; main(sys.argv[1:])")


def test_annotate_without_perfetto(run, monkeypatch):
    from cbtrace.annotate.write import annotate, pftrace_path

    before = digests(run)
    rc, out, err = cbtrace("annotate", str(run), code=NO_PERFETTO)
    dst = run / f"annotated_{find_trace(run).name}"
    assert rc == 0 and not err, err
    assert "perfetto trace:  skipped (the perfetto package is not installed: pip install " \
           "'cbtrace[perfetto]')" in out
    assert json.loads(gzip.decompress(dst.read_bytes()))["cbtrace"]
    assert not pftrace_path(dst).exists()
    assert {k: v for k, v in digests(run).items() if k != dst.name} == before
    # the Python API writes the trace and warns
    for name in ["perfetto", *(m for m in sys.modules if m.startswith("perfetto."))]:
        monkeypatch.setitem(sys.modules, name, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        annotate(run, force=True)
    assert any("skipped" in str(w.message) and "cbtrace[perfetto]" in str(w.message)
               for w in seen)
    assert not pftrace_path(dst).exists()
