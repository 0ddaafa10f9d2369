"""`cbtrace report RUN [--out DIR] [--svg] [-r NAME]`: files written, summary printed, errors."""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from helpers.cli import run_cli
from helpers.sample_runs import write_sample_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_sample_run(tmp_path_factory.mktemp("r") / "dlrm", "dlrm")


def test_report_writes_icicle_svg_and_summary(run, capsys):
    code, out, err = run_cli(["report", str(run), "--svg", "--top", "3"], capsys)
    assert code == 0, err
    for name in ("icicle.html", "icicle.svg", "summary.txt"):
        assert (run / name).stat().st_size > 500
        assert f"wrote {run / name}" in out
    assert "Top 3 of 24 modules by self time" in out
    assert (run / "summary.txt").read_text().startswith("Top 15 of 24")
    ET.parse(run / "icicle.svg")
    page = (run / "icicle.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="cbtrace-data"' in page


def test_report_out_dir_and_capture_only_run(tmp_path, capsys):
    bare = write_sample_run(tmp_path / "bare", "transformer", timings=False)
    code, out, err = run_cli(["report", str(bare), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "icicle.html").is_file()
    assert not (bare / "icicle.html").exists()
    assert "no timings yet" in out
    assert "captured but not replayed" in (tmp_path / "out" / "icicle.html").read_text()


def test_report_errors_are_one_line(tmp_path, run, capsys):
    code, _, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err.strip() == f"Error: {tmp_path}: not a cbtrace run directory (no manifest.json)"
    code, _, err = run_cli(["report", str(run), "-r", "nope"], capsys)
    assert code == 1 and "unknown reporter(s) nope; registered: icicle, summary, svg" in err
    (tmp_path / "manifest.json").write_text("{}")
    code, _, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "manifest.json: invalid manifest: Object missing required field" in err
    from helpers.runs import manifest
    from cbtrace.schema.manifest import encode

    (tmp_path / "manifest.json").write_bytes(encode(manifest()))
    (tmp_path / "modules.parquet").write_bytes(b"not parquet")
    code, _, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 1 and "corrupt Parquet file" in err and len(err.strip().splitlines()) == 1


def test_report_command_is_lazy_and_runs_as_a_process(run):
    # `cbtrace report --help` imports neither torch nor pyarrow
    code = ("import sys; from cbtrace.cli.main import main\n"
            "try: main(['report', '--help'])\nexcept SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'pyarrow', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("[]"), out.stderr
    assert "Usage: cbtrace report [OPTIONS] RUN" in out.stdout
    out = subprocess.run([sys.executable, "-m", "cbtrace", "report", str(run)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"wrote {run / 'icicle.html'}"


def test_report_writes_svg_only_with_svg_as_its_help_says(tmp_path, capsys):
    run = write_sample_run(tmp_path / "t", "transformer")
    code, out, err = run_cli(["report", str(run), "--top", "2"], capsys)
    assert code == 0, err
    assert (run / "icicle.html").is_file() and (run / "summary.txt").is_file()
    assert not (run / "icicle.svg").exists() and "icicle.svg" not in out
    code, out, _ = run_cli(["report", "-h"], capsys)
    assert "icicle.svg with --svg" in " ".join(out.split())
