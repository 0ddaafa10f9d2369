"""Sharded replay's single-rank case against in-process replay (issue 16): the same capture
replayed twice in process (the run-to-run noise) and once under torchrun (`--nproc 1`),
per-call isolated times compared pairwise in one run.

    python benchmarks/bench_nproc.py OUT_DIR [SPEC] [DEVICE] [DTYPE]   # default nanogpt cuda bf16

Per pair: calls compared, the median and 90th percentile of |B/A - 1|, the share within +-5 %,
the root's B/A - 1, and each side's replay wall.
"""
import shutil
import subprocess
import sys
import time
from pathlib import Path


def replay_in_process(run: Path, spec: str) -> float:
    from cbtrace.replay.engine import replay

    t0 = time.perf_counter()
    replay(run, model_spec=spec, progress=False)
    return time.perf_counter() - t0


def replay_torchrun(run: Path, spec: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run), "--model", spec,
                    "--nproc", "1", "--top", "0"], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def compare(a, b) -> dict:
    """|B/A - 1| over calls timed ok in both (pandas frames of modules.parquet)."""
    m = a.merge(b, on="call_id", suffixes=("_a", "_b"))
    m = m[(m["status_a"] == "ok") & (m["status_b"] == "ok")]
    rel = m["isolated_ms_b"] / m["isolated_ms_a"] - 1
    root = m[m["parent_call_id_a"] == -1]
    return {"calls": len(m), "median|d|%": 100 * rel.abs().median(),
            "p90|d|%": 100 * rel.abs().quantile(0.9), "within5%": (rel.abs() <= 0.05).mean(),
            "root d%": 100 * float((root["isolated_ms_b"] / root["isolated_ms_a"] - 1).iloc[0])}


def main(out_dir, spec="nanogpt", device="cuda", dtype="bf16"):
    import pandas as pd

    from cbtrace.capture.from_spec import capture_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = {"batch_size": 8} if spec == "nanogpt" else {}
    cap = capture_model(spec, out / "capture", device=device, dtype=dtype or None, options=options)
    runs, walls = {}, {}
    for name, how in (("in-process", replay_in_process), ("in-process again", replay_in_process),
                      ("torchrun --nproc 1", replay_torchrun)):
        run = out / name.replace(" ", "_")
        shutil.copytree(cap.out, run)
        walls[name] = how(run, spec)
        runs[name] = pd.read_parquet(run / "modules.parquet")
    base = runs["in-process"]
    rows = []
    for name in ("in-process again", "torchrun --nproc 1"):
        rows.append({"B (A = in-process)": name, **compare(base, runs[name]),
                     "wall A s": walls["in-process"], "wall B s": walls[name],
                     "ranks": sorted(runs[name]["rank"].dropna().unique().tolist())
                     if "rank" in runs[name] else None})
    print(f"{spec} on {device} ({dtype or 'fp32'}): isolated_ms per call, B against A")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:])
