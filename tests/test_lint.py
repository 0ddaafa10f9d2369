"""Pyflakes' checks (ruff's F rules) over the tree, on a CPU: a name that is not defined in a
branch only a GPU takes fails here, not on the device. (Compile mode's host figure once read a
`cold` its method was never given: every compiled call on a GPU errored, and CPU tests, which
never take that branch, passed.) A planted undefined name is caught."""
import subprocess
import sys

import pytest

from helpers.paths import REPO

TREES = ("cbtrace", "replay", "plugins", "benchmarks", "tests")


def ruff(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache",
                           "--output-format", "concise", *args], cwd=cwd,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def have_ruff():
    if subprocess.run([sys.executable, "-m", "ruff", "--version"],
                      capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: pip install -e '.[dev]' (it is a dev requirement)")


def test_the_tree_has_no_undefined_or_unused_names(have_ruff):
    got = ruff(*TREES)
    assert got.returncode == 0, got.stdout + got.stderr


def test_a_planted_undefined_name_in_a_gpu_branch_is_caught(have_ruff, tmp_path):
    src = tmp_path / "planted.py"
    src.write_text("import torch\n\n\ndef host_ms(c):\n"
                   "    return cold if c.device.type == 'cuda' else None\n")
    got = ruff(str(src), cwd=tmp_path)
    assert got.returncode == 1 and "F821" in got.stdout and "`cold`" in got.stdout, got.stdout
