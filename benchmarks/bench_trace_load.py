"""Trace load (+ attribution) time and peak RSS: cbtrace vs HTA TraceAnalysis vs json.load.

Each measurement runs in a fresh subprocess and reads its peak RSS from /proc/self/status
(VmHWM). Prints a table and writes benchmarks/results_trace_load.md.

    .venv/bin/python benchmarks/bench_trace_load.py [TRACE ...]

Without arguments: the three largest traces (by decompressed size) in ../shared/traces.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "traces"
OUT = REPO / "benchmarks" / "results_trace_load.md"
REPEAT = 1  # runs per (tool, trace); each is a fresh process

CHILD = r"""
import json, sys, time, gzip, shutil, tempfile, logging, os
kind, path = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if kind == "json.load":
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rb") as f:
        json.load(f)
elif kind == "cbtrace load":
    from cbtrace.attribution.loader import load
    load(path)
elif kind == "cbtrace attribute":
    from cbtrace.attribution.attribute import attribute
    attribute(path, aggregate=True)
elif kind == "HTA TraceAnalysis":
    logging.disable(logging.WARNING)
    import warnings; warnings.simplefilter("ignore")
    from hta.trace_analysis import TraceAnalysis
    d = tempfile.mkdtemp()
    os.symlink(path, os.path.join(d, os.path.basename(path)))
    TraceAnalysis(trace_dir=d)
wall = time.perf_counter() - t
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"wall_s": wall, "peak_rss_mb": hwm / 1024}))
"""
TOOLS = ["json.load", "HTA TraceAnalysis", "cbtrace load", "cbtrace attribute"]


def decompressed_size(p: Path) -> int:
    if not p.name.endswith(".gz"):
        return p.stat().st_size
    import gzip
    with gzip.open(p, "rb") as f:
        return sum(len(c) for c in iter(lambda: f.read(1 << 20), b""))


def measure(kind: str, path: Path) -> dict:
    best = None
    for _ in range(REPEAT):
        r = subprocess.run([sys.executable, "-c", CHILD, kind, str(path)], capture_output=True,
                           text=True, cwd=REPO)
        if r.returncode != 0:
            return {"wall_s": float("nan"), "peak_rss_mb": float("nan"),
                    "error": r.stderr.strip().splitlines()[-1:]}
        m = json.loads(r.stdout.strip().splitlines()[-1])
        best = m if best is None or m["wall_s"] < best["wall_s"] else best
    return best


def main(paths):
    if not paths:
        cands = [p for p in SHARED.rglob("*") if p.name.endswith((".json", ".json.gz"))]
        paths = sorted(cands, key=decompressed_size, reverse=True)[:3]
    rows = []
    for p in map(Path, paths):
        mb = decompressed_size(p) / 1e6
        res = {k: measure(k, p) for k in TOOLS}
        hta = res["HTA TraceAnalysis"]
        for k in TOOLS:
            r = res[k]
            rows.append((p.name, mb, k, r["wall_s"], r["peak_rss_mb"],
                         hta["wall_s"] / r["wall_s"], r["peak_rss_mb"] / hta["peak_rss_mb"]))
            print(f"{p.name[:40]:40s} {mb:7.1f} MB  {k:18s} {r['wall_s']:7.2f} s "
                  f"{r['peak_rss_mb']:7.0f} MB  x{rows[-1][5]:.1f} faster  {rows[-1][6]:.2f}x RSS",
                  flush=True)
    lines = ["# Trace loading: cbtrace vs HTA vs json.load", "",
             f"Machine: {open('/proc/cpuinfo').read().count('processor')} CPUs; each figure is "
             f"a fresh process (best of {REPEAT}); peak RSS = VmHWM.", "",
             "| trace | MB (json) | tool | wall s | peak RSS MB | speed vs HTA | RSS vs HTA |",
             "|---|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {n} | {mb:.1f} | {k} | {w:.2f} | {r:.0f} | {s:.1f}x | {q:.2f} |"
              for n, mb, k, w, r, s, q in rows]
    OUT.write_text("\n".join(lines) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    t0 = time.time()
    main(sys.argv[1:])
    print(f"total {time.time() - t0:.0f} s")
