"""Throughput of the streaming annotator (cbtrace.annotate.write) on the largest shared nn.Module trace.

Prints MB/s of trace JSON (decompressed bytes) and output/input size ratios, for:
- the rewrite pass alone (in-situ table computed beforehand), .json.gz -> .json.gz and -> .json;
- the end-to-end call (attribution + rewrite + .pftrace).
Writes the figures to benchmarks/results_annotate.md.
"""
from __future__ import annotations

import gzip
import sys
import tempfile
import time
from pathlib import Path

# --- settings ---
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "generated"
TRACE = SHARED / "torch2.13cpu_transformer48" / "cpuworker.1795949599838988485.pt.trace.json.gz"
REPEATS = 3
RESULTS = Path(__file__).with_name("results_annotate.md")


def timed(fn, repeats=REPEATS) -> float:
    fn()  # warm-up (page cache, imports)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    from cbtrace.annotate.write import annotate
    from cbtrace.attribution.attribute import attribute

    if not TRACE.is_file():
        sys.exit(f"{TRACE}: missing (needs ../shared/traces)")
    raw_mb = len(gzip.decompress(TRACE.read_bytes())) / 1e6
    t = time.perf_counter()
    insitu = attribute(TRACE, aggregate=False)
    attr_s = time.perf_counter() - t
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, kw in (("rewrite .json.gz -> .json.gz", dict(out=Path(d) / "a.pt.trace.json.gz")),
                         ("rewrite .json.gz -> .json", dict(out=Path(d) / "a.pt.trace.json"))):
            s = timed(lambda: annotate(trace=TRACE, insitu=insitu, pftrace=False, force=True, **kw))
            out = kw["out"]
            out_mb = (len(gzip.decompress(out.read_bytes())) if out.suffix == ".gz"
                      else out.stat().st_size) / 1e6
            rows.append((name, s, raw_mb / s, out_mb / raw_mb,
                         out.stat().st_size / TRACE.stat().st_size))
        out = Path(d) / "e2e.pt.trace.json.gz"
        s = timed(lambda: annotate(trace=TRACE, out=out, force=True), repeats=1)
        rows.append(("end to end (attribution + rewrite + .pftrace)", s, raw_mb / s,
                     len(gzip.decompress(out.read_bytes())) / 1e6 / raw_mb,
                     out.stat().st_size / TRACE.stat().st_size))
        n_mod = sum(1 for _ in insitu.itertuples())
    lines = ["# annotate benchmark\n",
             f"Trace: `{TRACE.name}` ({raw_mb:.1f} MB JSON, "
             f"{TRACE.stat().st_size / 1e6:.1f} MB gz, "
             f"{n_mod} attribution rows); best of {REPEATS} after a warm-up; attribution alone "
             f"{attr_s:.2f} s.\n",
             "| case | s | MB/s of JSON | out/in JSON bytes | out/in file bytes |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {n} | {s:.2f} | {mbs:.0f} | {rj:.3f} | {rf:.3f} |" for n, s, mbs, rj, rf in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
