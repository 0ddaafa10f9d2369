"""What a fresh ``cbtrace replay`` process pays before its first figures, and what it prints.

Each test runs its own Python process: the costs and the warning below happen once per process,
so a pytest process that paid them in an earlier test would prove nothing.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new Python process in the repository root."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_counting_and_profiling_a_call_do_not_import_dynamo():
    """torch._dynamo (about as long to import as torch) is not needed to count or profile."""
    p = _python("""
        import sys, torch
        from cbtrace.cost.opcount import OpCounter
        from cbtrace.replay.measure.profiler_pass import profile_call
        model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
        with OpCounter() as oc:
            model(x)
        stats = profile_call(lambda: model(x), "cpu", runs=1)
        print(oc.cost().flops, stats.op_count > 0, "torch._dynamo" in sys.modules,
              "torch._inductor" in sys.modules)
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["128.0", "True", "False", "False"]


MODEL = ("torch.manual_seed(0); model = torch.nn.Sequential(torch.nn.Linear(8, 8), "
         "torch.nn.ReLU(), torch.nn.Linear(8, 2))")


def test_replay_of_a_run_does_not_import_dynamo(tmp_path):
    """A whole replay (count, profile, time, outputs) of a captured run, in a fresh process."""
    import torch

    import cbtrace

    run = tmp_path / "run"
    scope = {"torch": torch}
    exec(MODEL, scope)
    with cbtrace.capture(scope["model"], run):
        scope["model"](torch.randn(4, 8))
    p = _python(f"""
        import sys, torch, cbtrace
        {MODEL}
        df = cbtrace.replay({str(run)!r}, model=model, budget_s=0.001, progress=False)
        print(len(df), sorted(set(df["status"])), "torch._dynamo" in sys.modules)
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["4", "['ok']", "False"]


def test_cpu_memory_profiling_warning_stays_off_stderr():
    """The profiled pass on CPU frees blocks allocated before it started (here one per run);
    the allocator's C++ warning about them is not shown, and the call is still profiled."""
    p = _python("""
        import sys, torch
        from cbtrace.replay.measure.profiler_pass import profile_call
        old = [torch.randn(1000) for _ in range(6)]
        stats = profile_call(lambda: old.pop(), "cpu", runs=2)
        print("profiled", stats.runs)
        print("control", file=sys.stderr, flush=True)
        # the same frees under a bare memory profiler print it (every 1,000th)
        old = [torch.randn(10) for _ in range(1000)]
        with torch.autograd.profiler.profile(profile_memory=True):
            old.clear()
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["profiled", "2"]
    ours, control = p.stderr.split("control\n")
    if "Memory block of unknown size" not in control:
        pytest.skip("this torch does not print the allocator's warning")
    assert "CPUAllocator" not in ours
