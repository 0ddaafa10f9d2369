"""The CLI: every command has --help, --help imports no heavy dependency, README documents all."""
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli

from cbtrace.cli.main import COMMANDS

REPO = Path(__file__).resolve().parents[1]


def test_help_imports_neither_torch_nor_pyarrow():
    code = ("import sys; from cbtrace.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('torch', 'pyarrow', 'pandas', 'tensorboard') if m in sys.modules]\n"
            "print('HEAVY', bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout
    for name in COMMANDS:
        assert name in out.stdout


HEAVY = {"torch", "pyarrow", "pandas", "tensorboard"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_light_help(name):
    """``cbtrace <cmd> --help`` prints its usage without importing torch, pyarrow or pandas."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "cbtrace", name, "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Usage: cbtrace" in out.stdout and len(out.stdout.splitlines()) > 4
    imported = {ln.rsplit("|", 1)[1].strip() for ln in out.stderr.splitlines()
                if ln.startswith("import time:")}
    assert "cbtrace.cli.main" in imported  # importtime did report (import_module's are not)
    assert not imported & HEAVY, sorted(imported & HEAVY)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_readme_documents_every_command(name):
    readme = (REPO / "README.md").read_text()
    assert f"cbtrace {name}" in readme


def test_user_error_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(tmp_path) in lines[0] and "manifest" in lines[0]


def test_unknown_model_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cbtrace", "capture", "--model", "nosuch",
                          "--out", str(tmp_path / "r"), "--device", "cpu"],
                         capture_output=True, text=True)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "nosuch" in lines[0]


def test_with_stack_flag_reaches_the_trace_and_the_manifest(tmp_path):
    """cbtrace capture --with-stack: Python frames in the trace, the setting in the manifest."""
    import gzip
    import json

    from cbtrace.rundir.read import find_trace, read_manifest

    run = tmp_path / "r"
    subprocess.run([sys.executable, "-m", "cbtrace", "capture", "--model", "nanogpt:tiny",
                    "--device", "cpu", "--with-stack", "--out", str(run)], check=True,
                   capture_output=True)
    with gzip.open(find_trace(run)) as f:
        cats = {e.get("cat") for e in json.load(f)["traceEvents"]}
    assert "python_function" in cats and read_manifest(run).capture.with_stack is True


def _one_line_error(args, cwd=None):
    out = subprocess.run([sys.executable, "-m", "cbtrace", *args], capture_output=True, text=True,
                         cwd=cwd)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "USDT" not in ln]
    assert out.returncode != 0 and len(lines) == 1, out.stderr[-2000:]
    return lines[0]


def test_bad_inputs_give_one_line_errors_and_lose_nothing(tmp_path):
    import json

    from cbtrace.rundir.read import find_trace
    from cbtrace.rundir.files import sha256_file
    from cbtrace.capture.from_spec import capture_model

    run = capture_model("dlrm:tiny", tmp_path / "run", device="cpu").out
    modules = sha256_file(run / "modules.parquet")
    trace = find_trace(run)
    # attribute --out never overwrites silently
    line = _one_line_error(["attribute", str(trace), "--out", str(run / "modules.parquet")])
    assert "already exists" in line
    assert sha256_file(run / "modules.parquet") == modules
    # an unknown device, a run that exists, options that do not parse
    assert "tpu" in _one_line_error(["capture", "--model", "dlrm:tiny", "--device", "tpu",
                                     "--out", str(tmp_path / "x")])
    assert "already exists" in _one_line_error(["capture", "--model", "dlrm:tiny", "--device",
                                                "cpu", "--out", str(run)])
    assert "dlrm:tiny" in _one_line_error(["capture", "--model", "dlrm:tiny", "--device", "cpu",
                                           "-o", "batch_size=abc", "--out", str(tmp_path / "y")])
    # a manifest that is JSON but not an object
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text(json.dumps([1, 2]))
    assert "manifest" in _one_line_error(["replay", str(bad)])


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_dash_h_is_help_on_every_command(name, capsys):
    code, out, err = run_cli([name, "-h"], capsys)
    assert code == 0, err
    assert out.startswith(f"Usage: cbtrace {name}") and "-h, --help" in out


def test_ctrl_c_exits_130_with_one_line():
    # a real SIGINT delivered inside a command, as Ctrl-C in a terminal would; raised in the main
    # thread (os.kill may hand it to another thread, and the command can end before Python sees it).
    # Python's own SIGINT handler first: a shell without job control starts background commands
    # (a CI runner's) with SIGINT ignored, and Python then leaves it ignored
    code = ("import signal, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from cbtrace.cli.commands import models\n"
            "def interrupted():\n"
            "    signal.raise_signal(signal.SIGINT)\n"
            "    time.sleep(60)\n"
            "models.command.callback = interrupted\n"
            "from cbtrace.cli.main import main\n"
            "main(['models'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 130
    assert out.stderr == "Interrupted.\n" and out.stdout == ""


def test_shell_completion_works_as_documented():
    import os

    docs = (REPO / "docs" / "cli.md").read_text()
    assert "_CBTRACE_COMPLETE=bash_source cbtrace" in docs
    out = subprocess.run([sys.executable, "-m", "cbtrace"], capture_output=True, text=True,
                         env={**os.environ, "_CBTRACE_COMPLETE": "bash_source"})
    assert out.returncode == 0 and "complete " in out.stdout and "_CBTRACE_COMPLETE" in out.stdout


H200_RUN = REPO / "tests" / "data" / "h200_nanogpt_run"


@pytest.fixture
def annotated_run(tmp_path):
    """A copy of the H200 run with an annotated_ copy of its trace beside the original."""
    import shutil

    run = tmp_path / "gpt"
    shutil.copytree(H200_RUN, run)
    trace = next(run.glob("*.pt.trace.json.gz"))
    shutil.copy(trace, run / f"annotated_{trace.name}")
    return run


def test_attribute_takes_a_run_dir_and_skips_annotated_copies(annotated_run, capsys):
    import pandas as pd

    out = annotated_run.parent / "t.csv"
    code, text, err = run_cli(["attribute", str(annotated_run), "--workers", "1", "--top", "3",
                               "--out", str(out)], capsys)
    assert code == 0, err
    assert err == "" and "ranks [0]," in text
    assert set(pd.read_csv(out)["trace"]) == {str(next(annotated_run.glob("vm_*")))}
    # the shell's glob gives the original and its annotated copy: one rank, one warning line
    files = sorted(str(p) for p in annotated_run.glob("*.pt.trace.json.gz"))
    assert len(files) == 2
    res = subprocess.run([sys.executable, "-m", "cbtrace", "attribute", *files, "--workers", "1",
                          "--top", "3"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ranks [0]," in res.stdout and "across 2 ranks" not in res.stdout
    warned = [ln for ln in res.stderr.splitlines() if ln.strip() and "USDT" not in ln]
    assert len(warned) == 1 and warned[0].startswith("Warning: skipped 1 annotated_* trace")


def test_attribute_out_must_name_parquet_or_csv(annotated_run, capsys):
    out = annotated_run.parent / "table.txt"
    code, text, err = run_cli(["attribute", str(annotated_run), "--out", str(out)], capsys)
    assert code == 2 and not out.exists()
    assert err.count("\n") == 1 and "table.txt" in err and ".parquet or .csv" in err


def test_tb_logdir_places_a_view_and_leaves_the_run(annotated_run, tmp_path):
    from cbtrace.errors import RunDirError
    from cbtrace.plugins.reporters.logdir import annotated_traces, find_runs
    from cbtrace.workflows.tb_logdir import logdir_target, place_in_logdir

    logdir = tmp_path / "tb"
    view = place_in_logdir(annotated_run, logdir)
    assert view == logdir / "gpt" and find_runs(logdir) == ["gpt"]
    assert annotated_traces(view) == [p.name for p in annotated_run.glob("annotated_*")]
    assert not (view / "inputs").exists() and (annotated_run / "manifest.json").is_file()
    with pytest.raises(RunDirError, match="already exists"):
        logdir_target(annotated_run, logdir)  # before any work, not after
    assert place_in_logdir(annotated_run, tmp_path) == annotated_run  # already under it


def test_timer_warning_names_the_fallback_once():
    import pandas as pd

    from cbtrace.cli.options import timer_warning

    why = "graph: graph timer needs a CUDA device, got cpu"
    df = pd.DataFrame({"timer": ["cpu", "cpu", None], "timer_fallback": [why, why, None]})
    assert timer_warning(df, "graph") == f"Warning: --timer graph: 2 of 2 calls timed with cpu instead ({why})"
    assert timer_warning(df, "cpu") is None and timer_warning(df, "auto") is None


def test_profile_tb_logdir_keeps_the_run_at_out(tmp_path):
    """(and --timer graph on a CPU says, on stderr, that the CPU timer was used)"""
    from cbtrace.plugins.reporters.logdir import annotated_traces, find_runs

    out, tb = tmp_path / "runs" / "d", tmp_path / "tb"
    res = subprocess.run([sys.executable, "-m", "cbtrace", "profile", "--model", "dlrm:tiny",
                          "--device", "cpu", "--max-depth", "1", "--out", str(out),
                          "--tb-logdir", str(tb), "--timer", "graph"], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    warned = [ln for ln in res.stderr.splitlines() if ln.startswith("Warning: --timer graph")]
    assert len(warned) == 1 and "timed with cpu instead" in warned[0] and "CUDA" in warned[0]
    assert (out / "inputs").is_dir() and annotated_traces(out)  # the run where --out said
    assert find_runs(tb) == ["d"] and annotated_traces(tb / "d") == annotated_traces(out)
    assert f"TensorBoard: {tb / 'd'}" in res.stdout
    # a second profile into the same view is refused before it captures anything
    again = tmp_path / "runs2" / "d"
    line = _one_line_error(["profile", "--model", "dlrm:tiny", "--device", "cpu", "--out",
                            str(again), "--tb-logdir", str(tb)])
    assert "already exists" in line and str(tb / "d") in line and not again.exists()
    assert line.endswith("choose another --tb-logdir or --out name")  # the CLI names its flags


def test_library_advice_names_the_cli_flag(tmp_path):
    """The library advises ``resume=True`` (its own terms); the CLI says ``--resume``, also
    from a command that lacks the flag (a capture into a failed replay's run)."""
    (tmp_path / "manifest.json").write_text('{"complete": true}')
    (tmp_path / ".cbtrace.lock").write_text('{"pid": 1, "host": "elsewhere", "command": '
                                            '"replay", "state": "failed", "error": "Killed"}')
    line = _one_line_error(["capture", "--model", "nanogpt:tiny", "--device", "cpu", "--out",
                            str(tmp_path)])
    assert line == (f"Error: {tmp_path}: a failed replay: replay (pid 1 on elsewhere) stopped "
                    f"(Killed); replay it again with --resume (or remove {tmp_path})")
    assert "resume=True" not in line


def test_readme_is_a_short_page_whose_links_exist():
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = set(re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme))
    assert {"docs/trust.md", "docs/timers.md", "benchmarks/RESULTS.md"} <= links
    for link in links:
        if not link.startswith("http"):
            assert (REPO / link).exists(), link
    for doc in (REPO / "docs").glob("*.md"):  # the docs' own relative links too
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / link).exists(), f"{doc.name}: {link}"
