"""Where a replay's wall goes (manifest.replay: timings_s inside the per-call loop, outside_s
the rest), and ``cbtrace profile`` replaying the model its capture ran instead of a rebuild."""
import pytest
from helpers.settings import FAST_REPLAY

import cbtrace
from cbtrace.capture.from_spec import capture_model
from cbtrace.rundir.read import read_manifest
from cbtrace.state import same_state, state_digest

OUTSIDE = {"load_run", "verify_inputs", "calibrate", "state_copy", "compile_ahead", "setup",
           "finalize", "write", "other"}

BN_MODEL = '''
import torch
from torch import nn

def build():
    return (nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)),
            (torch.randn(16, 4),))
'''


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    return capture_model("dlrm:tiny", tmp_path_factory.mktemp("p") / "run", device="cpu")


def test_the_phases_add_up_to_the_replay_wall(cap):
    cbtrace.replay(cap.out, **FAST_REPLAY)  # rebuilt from the spec
    r = read_manifest(cap.out).replay
    assert OUTSIDE | {"rebuild", "verify_state"} == set(r.outside_s)
    assert {"load", "state_guard", "loop_other"} <= set(r.timings_s)
    total = sum(r.timings_s.values()) + sum(r.outside_s.values())
    assert total == pytest.approx(r.wall_s, abs=2e-3)  # each phase rounded to 0.1 ms
    assert min(r.outside_s.values()) >= -1e-3 and r.outside_s["rebuild"] > 0
    assert min(r.timings_s.values()) >= 0
    # "other" is the remainder: the named phases must leave little of the wall to it
    assert r.outside_s["other"] <= 0.2 * r.wall_s + 0.05, r.outside_s


def test_a_live_model_is_not_rebuilt(cap):
    cbtrace.replay(cap.out, model=cap.model, **FAST_REPLAY)
    r = read_manifest(cap.out).replay
    assert set(r.outside_s) == OUTSIDE


def test_capture_leaves_the_model_as_the_runs_digest_names_it(tmp_path):
    (tmp_path / "bn.py").write_text(BN_MODEL)
    cap = capture_model(f"{tmp_path / 'bn.py'}:build", tmp_path / "run", device="cpu",
                        step="train")  # a train step updates BatchNorm's buffers and .grad
    digest = read_manifest(cap.out).state_sha256
    assert same_state(cap.model, digest)
    assert cap.model[1].num_batches_tracked.item() == 0
    assert all(p.grad is None for p in cap.model.parameters())


def test_profile_replays_the_captured_model(tmp_path, monkeypatch):
    from cbtrace.replay.run_io import rebuild
    from cbtrace.workflows.profile_model import profile

    def refuse(*args, **kwargs):
        raise AssertionError("profile rebuilt the model it had just captured")

    monkeypatch.setattr(rebuild, "rebuild_model", refuse)
    df = profile("nanogpt:tiny", tmp_path / "run", device="cpu", replay_options=FAST_REPLAY)
    assert (df["status"] == "ok").all() and df["insitu_ms"].notna().any()
    m = read_manifest(tmp_path / "run")
    assert "rebuild" not in m.replay.outside_s
    model = resolve_model(m)
    assert state_digest(model) == m.state_sha256  # the spec still rebuilds the same weights


def resolve_model(manifest):
    from cbtrace.model.spec import resolve

    return resolve(manifest.model.spec, seed=manifest.model.seed,
                   options=manifest.model.options).model_and_batch("cpu")[0]
