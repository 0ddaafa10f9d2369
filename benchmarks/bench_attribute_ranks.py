"""Attribution of a directory of rank traces: 1 worker vs the default (one per core), and the
peak RSS of a worker as the number of ranks grows.

The ranks are copies of one real trace (TRACE) with ``distributedInfo.rank`` (and
``world_size``) rewritten, written once each as .json.gz into a temp directory; the 4- and
8-rank directories hard-link the first files of the 16. Each measurement runs
``cbtrace.attribute(dir, workers=W)`` in a fresh subprocess (imports done first, untimed; the
files already in the page cache) and reads the peak RSS (VmHWM) of the process itself and of
each worker (polled every 10 ms through psutil until it exits; VmHWM only grows, so the last
reading is the worker's peak). getrusage's ru_maxrss is not used: on Linux a process started
by fork + exec keeps its parent's high-water mark. With 1 worker the process is its own
worker. ``cpu s`` is the CPU time of the process and its workers together: the work done,
which a busy neighbour on the VM does not change (the wall time it does). Runs are interleaved
(the 2-core VM is shared and its speed drifts) and the best wall time of REPEAT kept, with the
peak RSS and CPU time of that run.

    .venv/bin/python benchmarks/bench_attribute_ranks.py [TRACE]
"""
import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "hta/tests/data/mtia_trace_single_rank/mtia_rank_0.json.gz"
RANKS = (4, 8, 16)     # directory sizes measured
WORKERS = (1, None)    # None: cbtrace's default, one worker per usable core
REPEAT = 3             # fresh-process runs per (ranks, workers); the best wall time is kept
GZIP_LEVEL = 1         # the copies' compression (reading them is what is timed)

CHILD = r"""
import json, sys, threading, time
from cbtrace.attribution.attribute import attribute  # imports first: not timed


def hwm_mb(pid="self"):  # peak RSS of one address space (not inherited on exec)
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024


def watch(peaks, stop):  # each worker's peak, read until it exits (VmHWM only grows)
    import psutil
    me = psutil.Process()
    while not stop.is_set():
        for c in me.children(recursive=True):
            try:  # the pool's workers, not multiprocessing's resource tracker
                if "spawn_main" in " ".join(c.cmdline()):
                    peaks[c.pid] = hwm_mb(c.pid)
            except (OSError, StopIteration, psutil.Error):
                pass
        time.sleep(0.01)


path, w = sys.argv[1], None if sys.argv[2] == "None" else int(sys.argv[2])
peaks, stop = {}, threading.Event()
th = threading.Thread(target=watch, args=(peaks, stop), daemon=True)
th.start()
t = time.perf_counter()
df = attribute(path, workers=w)
wall = time.perf_counter() - t
stop.set()
th.join()
me = hwm_mb()
import resource
cpu = sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                    resource.RUSAGE_CHILDREN)))
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "parent_mb": me, "worker_mb": max(peaks.values(), default=me),
                  "n_workers": len(peaks) or 1, "rows": len(df),
                  "ranks": sorted(set(df["rank"].tolist()))}))
"""


def write_ranks(trace: Path, out: Path, n: int) -> list[Path]:
    """``rank<R>.json.gz`` for R < n: the trace with distributedInfo.rank = R."""
    text = gzip.decompress(trace.read_bytes()).decode()
    key = text.find('"distributedInfo"')
    if key < 0:
        raise SystemExit(f"{trace}: no distributedInfo to rewrite")
    start = text.index(":", key) + 1
    while text[start].isspace():
        start += 1
    info, end = json.JSONDecoder().raw_decode(text, start)
    paths = []
    for r in range(n):
        info.update(rank=r, world_size=n)
        p = out / f"rank{r}.json.gz"
        with gzip.open(p, "wt", compresslevel=GZIP_LEVEL) as f:
            f.write(text[:start])
            f.write(json.dumps(info))
            f.write(text[end:])
        paths.append(p)
    return paths


def run(path: Path, workers) -> dict:
    """One measurement in a fresh process (``-c``: spawned workers do not re-run it)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(workers)], cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else TRACE
    res = {(n, w): [] for n in RANKS for w in WORKERS}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "all").mkdir()
        files = write_ranks(trace, tmp / "all", max(RANKS))
        dirs = {n: tmp / f"ranks{n}" for n in RANKS}
        for n, d in dirs.items():
            d.mkdir()
            for p in files[:n]:
                os.link(p, d / p.name)
        for p in files:  # warm the page cache
            p.read_bytes()
        for _ in range(REPEAT):
            for n in RANKS:
                for w in WORKERS:
                    r = run(dirs[n], w)
                    assert r["ranks"] == list(range(n)), r["ranks"]
                    res[(n, w)].append(r)
    print(f"trace: {trace.name} ({trace.stat().st_size / 1e6:.1f} MB gz) x ranks; "
          f"{os.cpu_count()} cores; best of {REPEAT}; load average before / after: "
          f"{load0:.2f} / {os.getloadavg()[0]:.2f} (other work on the VM slows the workers)")
    head = (f"{'ranks':>5} | {'workers':>7} | {'wall s':>7} | {'speedup':>7} | {'cpu s':>6} | "
            f"{'peak RSS/worker MB':>18} | {'parent RSS MB':>13} | {'rows':>5}")
    print(head)
    print("-" * len(head))
    for n in RANKS:
        best = {w: min(res[(n, w)], key=lambda r: r["wall_s"]) for w in WORKERS}
        for w in WORKERS:
            r = best[w]
            print(f"{n:>5} | {r['n_workers']:>7} | {r['wall_s']:>7.2f} | "
                  f"{best[1]['wall_s'] / r['wall_s']:>6.2f}x | {r['cpu_s']:>6.2f} | "
                  f"{r['worker_mb']:>18.0f} | "
                  f"{r['parent_mb']:>13.0f} | {r['rows']:>5}")


if __name__ == "__main__":
    main()
