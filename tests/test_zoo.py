"""The zoo (benchmarks/zoo.py): every model people bring captures and replays with 0 errors and
leaves the model's state bit-identical, through the Python API and through the CLI."""
import importlib.util
import runpy
import subprocess
import sys

import pytest
from helpers.paths import REPO
from helpers.settings import FAST_REPLAY

import cbtrace
from cbtrace.capture.from_spec import run_step
from cbtrace.model.spec import resolve
from cbtrace.state import state_fingerprint

FAST = {**FAST_REPLAY, "budget_s": 0.002, "min_runs": 2}  # every call of every zoo model
# the zoo is a model file (--model benchmarks/zoo.py:NAME), read here by path as cbtrace reads it
ENTRIES = runpy.run_path(str(REPO / "benchmarks" / "zoo.py"))["ENTRIES"]
NEEDS = {"torchrec-deepfm": "torchrec", "torchrec-dlrm": "torchrec"}
# also captured and replayed by the CLI: a transformers model (T5: an encoder, a decoder and
# their cache) and a train step; the rest of the zoo goes through the API only (a compiled
# model's capture and replay: tests/test_compiled_step.py)
CLI = ("t5", "cnn-train")
TABLE: dict[str, tuple] = {}


def _installed(entry: str) -> bool:
    mod = NEEDS.get(entry)
    return mod is None or importlib.util.find_spec(mod) is not None


def _statuses(df) -> str:
    counts = df["status"].value_counts()
    return " / ".join(str(counts.get(s, 0)) for s in ("ok", "skipped", "error"))


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_zoo_entry_through_the_api(entry, tmp_path):
    if not _installed(entry):
        pytest.skip(f"{NEEDS[entry]} is not installed")
    spec, options, step = ENTRIES[entry]
    provider = resolve(str(REPO / spec) if ".py:" in spec else spec, options=options)
    model, batch = provider.model_and_batch("cpu")
    model.train(step == "train")
    before = state_fingerprint(model)
    with cbtrace.capture(model, tmp_path / "run", trace=False):
        run_step(provider, model, batch, step)
    captured = state_fingerprint(model)  # a training step may change BatchNorm statistics
    df = cbtrace.replay(tmp_path / "run", model=model, **FAST)
    same = state_fingerprint(model) == captured
    TABLE[entry] = (len(df), _statuses(df), same, step)
    bad = df[df["status"] != "ok"][["fqn", "module_type", "status", "status_reason"]]
    assert bad.empty, f"{entry}:\n{bad.to_string()}"
    assert same, f"{entry}: replay changed the model's state"
    assert len(df) >= 3 and (df["isolated_ms"] > 0).all()
    if step == "forward" and not any(m.training for m in model.modules()):
        assert captured == before  # an eval forward changes nothing


@pytest.mark.slow
@pytest.mark.parametrize("entry", CLI)
def test_zoo_entry_through_the_cli(entry, tmp_path):
    spec, options, step = ENTRIES[entry]
    opts = [a for k, v in options.items() for a in ("-o", f"{k}={str(v).lower()}")]
    run = tmp_path / "run"
    cap = subprocess.run([sys.executable, "-m", "cbtrace", "capture", "--model", spec, *opts,
                          "--device", "cpu", "--step", step, "--out", str(run)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert cap.returncode == 0, cap.stderr[-3000:]
    rep = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run), "--model", spec,
                          "--budget-s", "0.002"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert rep.returncode == 0, rep.stderr[-3000:]
    import pandas as pd

    df = pd.read_parquet(run / "modules.parquet")
    bad = df[df["status"] != "ok"][["fqn", "status", "status_reason"]]
    assert bad.empty, f"{entry} (CLI):\n{bad.to_string()}"


@pytest.mark.slow
def test_zoo_table(capsys):
    """Runs last in this file: the table of what the API test saw (run the whole file)."""
    if not TABLE:
        pytest.skip("run with the other zoo tests")
    lines = [f"{'model':<16} {'step':<8} {'calls':>5}  ok / skipped / error  state unchanged"]
    for name, (calls, statuses, same, step) in TABLE.items():
        lines.append(f"{name:<16} {step:<8} {calls:>5}  {statuses:<20}  {'yes' if same else 'NO'}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert all(s.endswith("/ 0") for _, s, _, _ in TABLE.values())
    assert all(same for _, _, same, _ in TABLE.values())
