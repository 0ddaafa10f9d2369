"""One writer at a time: the run lock against a second replay, a killed capture, a full disk."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import cbtrace
from cbtrace.capture.from_spec import capture_model
from cbtrace.errors import RunDirError
from cbtrace.rundir.lock import LOCK, RunLock, check_new_run, read_holder
from cbtrace.rundir.read import read_modules


# A model that, when CBTRACE_TEST_GATE names a file, waits in its forward while that file is
# absent (replay) or while the run's lock file exists (capture): the test decides when it ends.
MODEL = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    import torch

    class Gate(torch.nn.Module):
        def forward(self, x):
            gate, lock = os.environ.get("CBTRACE_TEST_GATE"), os.environ.get("CBTRACE_TEST_LOCK")
            deadline = time.time() + 300
            while gate and not Path(gate).exists() and time.time() < deadline:
                time.sleep(0.02)
            while lock and Path(lock).exists() and time.time() < deadline:
                time.sleep(0.02)
            return x * 2

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), Gate(), torch.nn.ReLU())
        return model, (torch.randn(4, 8),)

    class FailsInReplay(torch.nn.Module):
        def forward(self, x):
            f = sys._getframe()
            while f is not None:
                if f.f_code.co_filename.endswith(os.path.join("replay", "engine.py")):
                    raise RuntimeError("fails in replay")
                f = f.f_back
            return x + 1

    def failing():
        return torch.nn.Sequential(FailsInReplay(), FailsInReplay()), (torch.randn(4, 8),)
''')


def cli(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "cbtrace", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, **kw)


def wait_for(cond, what, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.fixture
def gated(tmp_path):
    spec = tmp_path / "gated.py"
    spec.write_text(MODEL)
    return f"{spec}:build"


def test_second_replay_is_refused_naming_the_holder(tmp_path, gated):
    run = capture_model(gated, tmp_path / "r", device="cpu").out
    n = len(read_modules(run))
    gate = tmp_path / "gate"
    first = cli("replay", run, "--trust", "--budget-s", "0.01",
                env={"CBTRACE_TEST_GATE": str(gate)})
    wait_for(lambda: (read_holder(run) or {}).get("pid") == first.pid, "the first replay's lock")
    second = cli("replay", run, "--trust", "--budget-s", "0.01")
    out, err = second.communicate(timeout=300)
    gate.touch()  # the first replay goes on only now
    out1, err1 = first.communicate(timeout=300)
    assert second.returncode == 1
    lines = errors(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"Error: {run}: in use by replay (pid {first.pid} on ")
    assert first.returncode == 0, err1
    df = read_modules(run)
    assert len(df) == n and sorted(df["call_id"]) == list(range(n))
    assert (df["status"] == "ok").all()
    rows = [json.loads(x) for x in (run / "replay.progress.jsonl").read_text().splitlines()]
    ids = [r["call_id"] for r in rows if "timed twice" not in (r.get("timer_notes") or "")]
    assert sorted(ids) == list(range(n))  # one row per call (a busy CPU may re-time a few)
    assert not (run / LOCK).exists()  # released: a replay that ended well leaves no lock file


def test_killed_capture_is_named_dead_by_capture_and_replay(tmp_path, gated):
    run = tmp_path / "r"
    proc = cli("capture", "--model", gated, "--device", "cpu", "--out", run,
               env={"CBTRACE_TEST_LOCK": str(run / LOCK)})
    wait_for(lambda: (read_holder(run) or {}).get("pid") == proc.pid or proc.poll() is not None,
             "the capture's lock")
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / LOCK).exists() and not (run / "manifest.json").exists()
    again = cli("capture", "--model", gated, "--device", "cpu", "--out", run)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 1 and len(errors(err)) == 1, err
    assert f"a dead capture: capture (pid {proc.pid} on " in err
    assert "gone without a word (killed or crashed)" in err and f"rm -r {run}" in err
    rep = cli("replay", run, "--trust")
    _, err = rep.communicate(timeout=300)
    assert rep.returncode == 1 and len(errors(err)) == 1, err
    assert f"a dead capture: capture (pid {proc.pid} on " in err
    assert (run / LOCK).exists() and not (run / "manifest.json").exists()  # left as it was


def no_space(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_in_capture_is_one_line_and_marks_the_run(tmp_path, monkeypatch):
    from cbtrace.rundir import writer

    monkeypatch.setattr(writer, "write_records", no_space)
    with pytest.raises(RunDirError) as e:
        capture_model("nanogpt:tiny", tmp_path / "r", device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and "disk full (No space left on device)" in msg
    assert "marked incomplete" in msg and "rm -r" in msg
    info = read_holder(tmp_path / "r")
    assert info["state"] == "failed" and "disk full" in info["error"]
    assert any((tmp_path / "r").glob("*.pt.trace.json.gz"))  # what was written is kept
    with pytest.raises(RunDirError, match="a failed capture: capture .* stopped .*disk full"):
        check_new_run(tmp_path / "r")


def test_full_disk_in_replay_keeps_rows_and_resumes(tmp_path, monkeypatch, fast_replay):
    from cbtrace.replay.run_io import progress

    run = capture_model("dlrm:tiny", tmp_path / "r", device="cpu").out
    n = len(read_modules(run))
    real = progress.ProgressLog.append
    written = []

    def append(self, row):
        if len(written) == 3:
            no_space()
        written.append(row["call_id"])
        real(self, row)

    monkeypatch.setattr(progress.ProgressLog, "append", append)
    with pytest.raises(RunDirError) as e:
        cbtrace.replay(run, **fast_replay)
    msg = str(e.value)
    assert "\n" not in msg and "disk full" in msg and "replay it again with resume=True" in msg
    assert e.value.retry == "resume"  # the CLI names --resume in its place (test_cli)
    assert read_holder(run)["state"] == "failed"
    monkeypatch.setattr(progress.ProgressLog, "append", real)
    df = cbtrace.replay(run, resume=True, **fast_replay)
    assert len(df) == n and (df["status"] == "ok").all()
    assert not (run / LOCK).exists()


def test_lock_is_reentrant_in_one_process_and_exclusive_across(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    with RunLock(run, "capture"):
        with RunLock(run, "capture"):  # capture_model around capture
            pass
        assert (run / LOCK).exists()
        code = ("import sys; from cbtrace.rundir.lock import RunLock\n"
                "try:\n    RunLock(sys.argv[1], 'replay').acquire()\n"
                "except Exception as e:\n    print(e)")
        env = {k: v for k, v in os.environ.items() if k != "CBTRACE_RUN_LOCK"}
        out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True,
                             text=True, env=env)
        assert f"in use by capture (pid {os.getpid()} on " in out.stdout, out
    assert not (run / LOCK).exists()


def test_replay_and_profile_exit_1_when_no_call_succeeds(tmp_path, gated):
    failing = gated.replace(":build", ":failing")
    run = capture_model(failing, tmp_path / "r", device="cpu").out
    for cmd in (["replay", run, "--trust", "--budget-s", "0.01"],
                ["profile", "--model", failing, "--device", "cpu", "--out", tmp_path / "p"]):
        proc = cli(*cmd)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, (cmd[0], out, err)
        assert "Traceback" not in err, err
        assert errors(err)[-1] == "Error: no call replayed successfully (3 calls, none ok: see " \
                                  "the reasons above)", err
        assert "calls: ok 0, error 3" in out  # the counts and reasons are printed first
    proc = cli("replay", run, "--trust", "--budget-s", "0.01", "--strict")
    assert proc.wait(timeout=300) == 1


def test_annotate_takes_the_lock_and_leaves_a_dead_runs_mark(tmp_path):
    from cbtrace.annotate.write import annotate

    run = capture_model("nanogpt:tiny", tmp_path / "r", device="cpu").out
    with RunLock(run, "replay"):
        env = {k: v for k, v in os.environ.items() if k != "CBTRACE_RUN_LOCK"}
        proc = subprocess.run([sys.executable, "-m", "cbtrace", "annotate", str(run),
                               "--no-pftrace"], capture_output=True, text=True, env=env)
        assert proc.returncode == 1 and len(errors(proc.stderr)) == 1, proc.stderr
        assert f"in use by replay (pid {os.getpid()} on " in proc.stderr
    assert not (run / LOCK).exists()
    stale = {"pid": 1, "host": "elsewhere", "command": "replay", "state": "failed",
             "error": "KeyboardInterrupt"}
    (run / LOCK).write_text(json.dumps(stale))
    annotate(run, pftrace=False)
    assert read_holder(run) == stale  # a replay's mark stays until a replay clears it
    with pytest.raises(RunDirError) as e:  # a new capture into it is told what it is
        check_new_run(run)
    assert str(e.value) == (f"{run}: a failed replay: replay (pid 1 on elsewhere) stopped "
                            f"(KeyboardInterrupt); replay it again with resume=True (or remove "
                            f"{run})")
    (run / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "command": "replay"}))
    with pytest.raises(RunDirError, match=r"a dead replay: replay \(pid 1 on elsewhere\) gone "
                                          r"without a word \(killed or crashed\); replay it again"):
        check_new_run(run)


def test_a_folder_is_named_an_unfinished_capture_only_when_it_holds_inputs(tmp_path):
    from cbtrace.rundir.layout import prepare_new_run

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="already exists and is not empty; choose another run "
                                          "directory"):
        prepare_new_run(tmp_path)
    (tmp_path / "inputs").mkdir()
    with pytest.raises(RunDirError, match=r"holds inputs/ but no manifest.json: a capture that "
                                          r"did not finish; remove it \(rm -r "):
        prepare_new_run(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_capture_killed_before_its_first_write_is_named_dead(tmp_path, gated):
    """Killed between taking the lock and making inputs/ (a busy CI machine's timing): the
    folder holds the lock file alone, and the next capture says whose it was, not "not
    empty", nor captures over it."""
    run = tmp_path / "r"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / LOCK).write_text(json.dumps({"pid": dead.pid, "host": "h", "command": "capture",
                                        "started": time.time(), "state": "running"}))
    again = cli("capture", "--model", gated, "--device", "cpu", "--out", run)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 1 and len(errors(err)) == 1, err
    assert f"a dead capture: capture (pid {dead.pid} on h" in err and f"rm -r {run}" in err
    assert os.listdir(run) == [LOCK]  # left as it was


def test_attribute_into_a_run_waits_for_no_one_and_is_refused_while_replay_writes(tmp_path):
    from cbtrace.attribution.join import join_insitu

    run = capture_model("dlrm:tiny", tmp_path / "r", device="cpu").out
    code = ("import sys\nfrom cbtrace.attribution.join import join_insitu\n"
            "try:\n    join_insitu(sys.argv[1])\nexcept Exception as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k != "CBTRACE_RUN_LOCK"}
    with RunLock(run, "replay"):
        out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True,
                             text=True, env=env)
        assert f"in use by replay (pid {os.getpid()} on " in out.stdout, out
    df = join_insitu(run)  # free again: it writes the in-situ columns
    assert df["insitu_ms"].notna().any() and not (run / LOCK).exists()
