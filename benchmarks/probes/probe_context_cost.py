"""What context replay costs a whole-tree replay: ``cbtrace profile`` with and without it.

Per variant (``--context``, ``--no-context``): the replay wall and its phases
(``manifest.replay``), the timed work (sum of ``timed_ms``), and for the calls timed with a
context (``timer_notes`` names one) against the others: how many, their replay wall and timed
work; and the share of calls >= 10 us within +-5 % of in situ.

Usage: python benchmarks/probes/probe_context_cost.py OUT_DIR [--model nanogpt] [--device cuda]
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd


def figures(run: Path) -> dict:
    r = json.loads((run / "manifest.json").read_text())["replay"]
    df = pd.read_parquet(run / "modules.parquet")
    ctx = df["timer_notes"].fillna("").str.contains("context:")
    big = df[(df["insitu_ms"] >= 0.01) & df["error_pct"].notna()]
    out = {"replay wall_s": r["wall_s"], "timed_s": df["timed_ms"].fillna(0).sum() / 1e3,
           "calls": len(df), "context calls": int(ctx.sum()),
           "context calls wall_s": df.loc[ctx, "replay_wall_s"].sum(),
           "context calls timed_s": df.loc[ctx, "timed_ms"].fillna(0).sum() / 1e3,
           "other calls wall_s": df.loc[~ctx, "replay_wall_s"].sum(),
           "within 5 % (>= 10 us)": float((big["error_pct"].abs() <= 5).mean()) if len(big) else 0}
    out.update({f"loop.{k}": v for k, v in r["timings_s"].items()})
    out.update({f"outside.{k}": v for k, v in r["outside_s"].items()})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--model", default="nanogpt")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    rows = {}
    for flag in ("--context", "--no-context"):
        run = a.out_dir / f"{a.model.replace(':', '_')}{flag}"
        p = subprocess.run([sys.executable, "-m", "cbtrace", "profile", "--model", a.model,
                            "--device", a.device, "--out", str(run), flag],
                           capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"profile {flag} failed:\n{p.stderr[-2000:]}")
        rows[flag] = figures(run)
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    print(f"{a.model} on {a.device}: cbtrace profile, the replay with and without context")
    print(f"{'':28} {'--context':>12} {'--no-context':>12}")
    for k in keys:
        print(f"{k:28} " + " ".join(f"{rows[f].get(k, 0):12.3f}" for f in rows))


if __name__ == "__main__":
    main()
