"""The CLI: every command has --help, --help imports no heavy dependency, README documents all."""
import subprocess
import sys
from pathlib import Path

import pytest

from cbtrace.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]


def test_help_imports_neither_torch_nor_pyarrow():
    code = ("import sys; from cbtrace.cli import main\n"
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
