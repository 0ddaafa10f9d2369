"""CPU timing under load: the demo's models profiled on an idle machine and beside a CPU-bound
neighbour process, side by side in one run.

Per model and condition: calls, calls slower than their parent (impossible: the parent runs
them), the worst child/parent ratio, calls flagged noisy, the range of the error table's class
medians and the largest |error| of a call. Usage:

    python benchmarks/bench_cpu_load.py OUT_DIR [nanogpt:tiny dlrm:tiny]
"""
import subprocess
import sys
import time
from pathlib import Path

NEIGHBOUR = "while True: pass"  # one busy core of the two


def measure(spec: str, run: Path) -> dict:
    try:
        from cbtrace.attribution.join import error_table
        from cbtrace.workflows.profile_model import profile
    except ImportError:  # cbtrace before the restructure (86704d3), for the "before" figures
        from cbtrace.profile import error_table, profile

    t0 = time.perf_counter()
    df = profile(spec, run, device="cpu", replay_options=dict(timer="cpu", budget_s=0.1))
    wall = time.perf_counter() - t0
    iso = dict(zip(df["call_id"], df["isolated_ms"]))
    ratio = [(r.isolated_ms / iso[r.parent_call_id], r.fqn) for r in df.itertuples()
             if r.parent_call_id in iso and iso[r.parent_call_id]]
    table = error_table(df)
    worst = df.loc[df["error_pct"].abs().idxmax()]
    return {"calls": len(df), "above_parent": sum(x > 1 for x, _ in ratio),
            "worst_child/parent": max(ratio)[0] if ratio else float("nan"),
            "noisy": int(df["noisy"].sum()) if "noisy" in df else None,
            "class_median_min%": table["median"].min(), "class_median_max%": table["median"].max(),
            "worst_call_err%": worst["error_pct"], "worst_call": worst["fqn"] or "(root)",
            "wall_s": wall}


def main(out_dir, specs):
    import pandas as pd

    out = Path(out_dir)
    rows = []
    for condition in ("idle", "busy neighbour"):
        neighbour = (subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
                     if condition != "idle" else None)
        try:
            for spec in specs:
                run = out / f"{spec.replace(':', '-')}-{condition.split()[0]}"
                rows.append({"model": spec, "machine": condition, **measure(spec, run)})
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:] or ["nanogpt:tiny", "dlrm:tiny"])
