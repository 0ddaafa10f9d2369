"""benchmarks/fidelity_zoo.py, run as a script: its figures from a modules table worked out by
hand, and a CPU run on nanogpt:tiny that prints the table and writes the summaries."""
import csv
import json
import subprocess
import sys

import pandas as pd
import pytest
from helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "fidelity_zoo.py"
COLUMNS = ["model", "phase", "calls", "errors", "skipped", "n>=10us", "fell_back", "by_kernels",
           "within5%",
           "EmbBag_med%",
           "root_err%", "<10us_|err|_med%", "<10us_|kern|_med%", "misses_named",
           "hooked_within5%", "step/timed_MHz", "clock_free_within5%"]
# the script's own functions, called in a process of its own: the tests import nothing from
# benchmarks/ (argv: the script, then a modules table or the script's arguments)
FIGURES = """import json, runpy, sys
import pandas as pd
fidelity = runpy.run_path(sys.argv[1])["fidelity"]
df = pd.read_parquet(sys.argv[2])
print(json.dumps({p: fidelity(df, p) for p in ("fwd", "bwd")}, default=lambda o: o.item()))
"""
# paired(a, b): the second table is the first with other errors and isolated times
PAIRED = """import json, runpy, sys
import pandas as pd
paired = runpy.run_path(sys.argv[1])["paired"]
a = pd.read_parquet(sys.argv[2])
b = a.copy()
b["error_pct"] = [2.0, 1.0, 3.0, -9.0, 0.0, 0.0, None, None]
b["isolated_ms"] = a["isolated_ms"] * [1.02, 1.05, 0.97, 0.92, 1.0, 1.0, 1.0, 1.0]
print(json.dumps(paired(a, b, "fwd"), default=lambda o: o.item()))
"""
# main() with one more model, whose library is missing
MISSING_LIBRARY = """import runpy, sys
script = runpy.run_path(sys.argv[1])
script["MODELS"]["needs-x"] = ("nanogpt:tiny", {}, "nanogpt", {}, "no_such_module_for_cbtrace")
sys.exit(script["main"](sys.argv[2:]))
"""


# main() with a replay that fails whenever min_runs is 2 (a variant's replay failing)
FAILING_VARIANT = """import runpy, sys
from cbtrace.replay import engine
real = engine.replay
def replay(run, **kw):
    if kw.get("min_runs") == 2:
        raise RuntimeError("this variant cannot replay")
    return real(run, **kw)
engine.replay = replay
sys.exit(runpy.run_path(sys.argv[1])["main"](sys.argv[2:]))
"""


def python(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def table(rows):
    cols = ("call_id", "parent_call_id", "module_type", "status", "insitu_ms", "error_pct",
            "bwd_status", "bwd_insitu_ms", "bwd_error_pct")
    df = pd.DataFrame([dict(zip(cols, r)) for r in rows])
    df["isolated_ms"] = df["insitu_ms"] * (1 + df["error_pct"] / 100)
    df["timer_notes"] = ["graph", "context 2 calls", "context 2 calls", None,
                         "K=20; context: 1 call before (bn); its kernels in context, 10 profiled "
                         "runs (graph less context: 0.0061 ms, 3 runs)", None, None, None]
    # calls timed by a fallback timer: forward 1 and 4 (4 under 10 us), backward 1, 2 and 4
    df["timer_fallback"] = [None, "graph: capture failed", None, None, "graph: capture failed",
                            None, None, None]
    df["bwd_timer_fallback"] = [None, "graph: capture failed", "graph: capture failed", None,
                                "graph: x", None, None, None]
    return df


DF = table([
    (0, -1, "Net", "ok", 1.0, 2.0, "ok", 2.0, -8.0),
    (1, 0, "EmbeddingBag", "ok", 0.020, -4.0, "ok", 0.050, 1.0),
    (2, 0, "EmbeddingBag", "ok", 0.030, 6.0, "ok", 0.060, 3.0),
    (3, 0, "EmbeddingBag", "ok", 0.040, -1.0, None, None, None),
    (4, 0, "ReLU", "ok", 0.005, 30.0, "ok", 0.004, -2.0),
    (5, 0, "ReLU", "ok", 0.004, -10.0, "ok", 0.003, 4.0),
    (6, 0, "ReLU", "error", None, None, "error", None, None),
    (7, 0, "Linear", "skipped", 0.5, None, "skipped", None, None),
])


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """fidelity(DF, phase) for both phases, as the script computes them."""
    table_path = tmp_path_factory.mktemp("fidelity") / "modules.parquet"
    DF.to_parquet(table_path)
    out = python("-c", FIGURES, SCRIPT, table_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_forward_figures_by_hand(figures):
    row, classes = figures["fwd"]
    assert (row["calls"], row["errors"], row["skipped"], row["n>=10us"]) == (8, 1, 1, 4)
    assert row["fell_back"] == 1  # of the calls >= 10 us
    assert row["by_kernels"] == 1  # the ReLU of 5 us: its kernels in its context
    assert row["within5%"] == pytest.approx(75.0)  # 2, -4, -1 within; 6 not
    assert row["EmbBag_med%"] == pytest.approx(-1.0)
    assert row["root_err%"] == pytest.approx(2.0)
    assert row["<10us_|err|_med%"] == pytest.approx(20.0)  # |30|, |-10|
    by = {c["module_type"]: c for c in classes}
    assert set(by) == {"Net", "EmbeddingBag"}  # calls >= 10 us only
    assert by["EmbeddingBag"]["count"] == 3 and by["EmbeddingBag"]["median_err%"] == -1.0
    assert by["EmbeddingBag"]["timer_notes"] == "context 2 calls"  # the class's most common
    assert [c["module_type"] for c in classes] == ["Net", "EmbeddingBag"]  # by in-situ time


def test_backward_figures_read_the_backward_columns(figures):
    row, classes = figures["bwd"]
    assert (row["calls"], row["errors"], row["n>=10us"], row["fell_back"]) == (7, 1, 3, 2)
    assert row["within5%"] == pytest.approx(100 * 2 / 3)  # -8 misses
    assert row["root_err%"] == -8.0 and row["EmbBag_med%"] == pytest.approx(2.0)
    assert row["<10us_|err|_med%"] == pytest.approx(3.0)
    assert {c["phase"] for c in classes} == {"bwd"}


def test_a_variant_is_compared_call_by_call_with_the_base(tmp_path):
    table_path = tmp_path / "modules.parquet"
    DF.to_parquet(table_path)
    out = python("-c", PAIRED, SCRIPT, table_path)
    assert out.returncode == 0, out.stderr[-3000:]
    p = json.loads(out.stdout)
    # calls >= 10 us ok in both: 0..3; base errors 2, -4, 6, -1; the variant's 2, 1, 3, -9
    assert (p["calls"], p["within_base"], p["within_variant"]) == (4, 3, 3)
    assert (p["in"], p["out"]) == (1, 1)  # call 2 moved in, call 3 out
    assert p["median_change%"] == pytest.approx(-0.5)  # of -8, -3, +2, +5
    assert p["median_|err|_base%"] == pytest.approx(3.0)  # 1, 2, 4, 6
    assert p["median_|err|_variant%"] == pytest.approx(2.5)  # 1, 2, 3, 9


@pytest.mark.parametrize("variant, says", [
    ("few", "expected NAME:KEY=VALUE"),
    ("few:nosuch=1", "'nosuch' is not a ReplayConfig field"),
    ("few:min_runs", "'min_runs' is not KEY=VALUE"),
    ("odd:context_rewrite=twice", "context_rewrite: 'twice' is not one of off, self, sum"),
])
def test_a_malformed_variant_is_one_line_error(variant, says):
    out = python(SCRIPT, "--out", "unused", "--models", "nanogpt", "--variant", variant)
    error = out.stderr.splitlines()[-1]  # argparse's usage, then the one-line error
    assert out.returncode == 2 and error.startswith("fidelity_zoo.py: error: --variant: ")
    assert says in error


def test_a_failing_variant_leaves_the_base_and_the_other_variants(tmp_path):
    proc = python("-c", FAILING_VARIANT, SCRIPT, "--out", tmp_path, "--models", "nanogpt",
                  "--device", "cpu", "--budget-s", "0.002", "--variant", "bad:min_runs=2",
                  "--variant", "few:min_runs=3", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "nanogpt@bad: FAILED RuntimeError: this variant cannot replay" in out
    with open(tmp_path / "fidelity.csv") as f:
        assert [r["model"] for r in csv.DictReader(f)] == ["nanogpt", "nanogpt@few"]


def test_unknown_model_is_one_line_error():
    out = python(SCRIPT, "--out", "unused", "--models", "nanogpt,nosuch")
    assert out.returncode == 2 and "unknown nosuch" in out.stderr


@pytest.mark.slow
def test_a_cpu_run_on_nanogpt_tiny(tmp_path):
    # a model whose library is missing is skipped with a note, the others still run
    proc = python("-c", MISSING_LIBRARY, SCRIPT, "--out", tmp_path, "--models", "needs-x,nanogpt",
                  "--device", "cpu", "--budget-s", "0.002", "--variant", "few:min_runs=3",
                  timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs-x: skipped (no_such_module_for_cbtrace is not installed)" in out
    final = out[out.index("== fidelity (cpu"):].splitlines()
    assert final[1].split() == COLUMNS
    cells = final[2].split()
    assert cells[:2] == ["nanogpt", "fwd"] and int(cells[2]) >= 20 and cells[3] == "0"
    assert "nanogpt fwd class medians" in out and "Linear" in out
    summary = json.loads((tmp_path / "nanogpt.json").read_text())
    assert summary["spec"] == "nanogpt:tiny" and summary["rows"][0]["errors"] == 0
    with open(tmp_path / "fidelity.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == ["nanogpt", "nanogpt@few"] and list(rows[0]) == COLUMNS
    assert (tmp_path / "nanogpt_classes.csv").is_file()
    # the variant: the same capture replayed again with min_runs=3, compared call by call
    assert "nanogpt@few: replayed again in" in out and "; @few: min_runs=3)" in out
    paired = next(ln for ln in out.splitlines() if "against the base, paired" in ln)
    assert paired.startswith("  nanogpt@few fwd against the base, paired (")
    few = json.loads((tmp_path / "nanogpt.few.json").read_text())
    assert few["variant"] == {"min_runs": 3} and few["rows"][0]["calls"] == cells_calls(cells)
    again = pd.read_csv(tmp_path / "nanogpt.few_rows.csv.gz")
    base = pd.read_csv(tmp_path / "nanogpt_rows.csv.gz")
    assert list(again["call_id"]) == list(base["call_id"])
    assert list(again["insitu_ms"]) == list(base["insitu_ms"])  # one step, both replays
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fidelity.csv", "nanogpt.few.json", "nanogpt.few_classes.csv", "nanogpt.few_rows.csv.gz",
        "nanogpt.json", "nanogpt_classes.csv", "nanogpt_rows.csv.gz"]  # no run


def cells_calls(cells) -> int:
    return int(cells[2])
