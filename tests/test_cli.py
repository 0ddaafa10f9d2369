"""The CLI: every command has --help, --help imports no heavy dependency, README documents all."""
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name):
    out = subprocess.run([sys.executable, "-m", "cbtrace", name, "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "Usage: cbtrace" in out.stdout and len(out.stdout.splitlines()) > 4


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
