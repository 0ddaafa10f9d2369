"""Layers point one way: the import-linter contracts in pyproject.toml hold on the package as
installed (replay/ and plugins/ install under cbtrace/, where import-linter can see them), and
a planted import that breaks them is caught."""
import shutil
import subprocess
import sys

import pytest

from helpers.paths import REPO

LINT = shutil.which("lint-imports", path=str(REPO / ".venv" / "bin")) or shutil.which("lint-imports")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    if LINT is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(REPO)],
                   check=True, capture_output=True, cwd=build)
    shutil.rmtree(REPO / "build", ignore_errors=True)  # setuptools' scratch copy
    return target


def lint(site, cwd):
    # cwd outside the checkout: the installed copy is the one import-linter reads
    return subprocess.run([LINT, str(REPO / "pyproject.toml"), "--no-cache"], cwd=cwd,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)


def test_every_package_is_installed(installed):
    found = {p.relative_to(REPO).parent for p in REPO.glob("cbtrace/**/__init__.py")}
    found |= {p.relative_to(REPO).parent for p in REPO.glob("replay/**/__init__.py")}
    found |= {p.relative_to(REPO).parent for p in REPO.glob("plugins/**/__init__.py")}
    for pkg in found:
        dest = pkg if pkg.parts[0] == "cbtrace" else "cbtrace" / pkg
        assert (installed / dest / "__init__.py").is_file(), f"{pkg} is missing from pyproject"


def test_import_contracts_hold(installed, tmp_path):
    out = lint(installed, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "3 kept, 0 broken" in out.stdout


def test_a_planted_upward_import_breaks_them(installed, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    mod = site / "cbtrace" / "schema" / "modules.py"
    mod.write_text(mod.read_text() + "\n\ndef _planted():\n    import cbtrace.replay.engine\n")
    out = lint(site, tmp_path)
    assert out.returncode != 0 and "BROKEN" in out.stdout
    assert "cbtrace.schema.modules -> cbtrace.replay.engine" in out.stdout


@pytest.mark.parametrize("module, planted", [
    ("plugins/backends/sampling.py", "cbtrace.replay.measure.prepare"),  # a timer calling back up
    ("replay/timer/stats.py", "cbtrace.replay.engine"),  # the timers' statistics reaching up
    ("replay/timer/graph_capture.py", "cbtrace.replay.engine"),  # the contract reaching up
])
def test_the_timer_contract_is_the_layer_timers_build_on(installed, tmp_path, module, planted):
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    mod = site / "cbtrace" / module
    mod.write_text(mod.read_text() + f"\n\ndef _planted():\n    import {planted}\n")
    out = lint(site, tmp_path)
    assert out.returncode != 0 and "timer contract" in out.stdout and "BROKEN" in out.stdout
    source = "cbtrace." + module.removesuffix(".py").replace("/", ".")
    assert f"{source} -> {planted}" in out.stdout
