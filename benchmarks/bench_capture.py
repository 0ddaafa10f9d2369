"""Capture overhead: a captured step vs a plain profiled step, against disk write bandwidth.

Goal (issues 2 and 15): capture <= 1.5 x (plain profiled step + captured bytes / disk bandwidth).
All sides export a gzipped Kineto trace; the capture side also copies, serializes and writes
the inputs, modules.parquet and the manifest. A third side, the *floor*, is the plain step with
the two hooks per module a capture needs, doing nothing but open and close its ranges: what any
hook-based capture costs before it copies, records or writes anything (``floor/b``). ``writes``
re-writes the capture's files atomically with no fsync, hashing or input encoding, a lower bound
of writing any run; ``(f+w)/b`` = (floor + writes) / bound.

The bound's disk bandwidth is one 512 MB fsynced write at the start of the run (``ratio``). A
shared disk drifts over a run of minutes, so ``adj`` also gives the median over repeats of each
repeat's capture / (its plain step + bytes / the bandwidth of an fsynced write of the same
bytes made right after that capture, in the same directory).

One-time costs are paid by neither side: before the timed repeats one profiled step and one
capture run untimed (the process's first profiler start initialises Kineto, and CUPTI on a GPU;
the first capture imports pyarrow and the plugins and makes the writer threads' pinned staging
buffers). The first capture's wall is printed beside the breakdown, for what a one-off capture
in a fresh process pays on top. Each side then pays its own profiler start, stop and gzipped
export in every repeat.

The breakdown is the median capture's ``timings_s`` (cbtrace.capture): the parts that follow
one another (recorder.TIMINGS_IN_SEQUENCE), ``other`` = wall - their sum (the bench's own
calls inside the ``with``, constructing the capture object), then the parts of
inputs_and_trace (which overlap) and the input writer threads' summed seconds; and the plain
profiled step's own phases beside it.

Every side profiles as the capture does by default, without ``with_stack``; a case named with
``+stack`` (``dlrm-large+stack``) runs all three sides and the capture with it.

Run: python benchmarks/bench_capture.py [CASE ...]   (default: nanogpt-tiny-cpu, and on a GPU
nanogpt dlrm dlrm-large and the zoo's GPU models; CASES lists the names; the -cpu DLRM cases are
the GPU cases' shapes scaled down to a 2-core CPU)
"""
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

ZOO = str(Path(__file__).resolve().parent / "zoo.py")
REAL = {"size": "real"}
CASES = {  # name: (spec, device, dtype, provider options)
    "nanogpt-tiny-cpu": ("nanogpt:tiny", "cpu", None, {}),
    "dlrm-cpu": ("dlrm", "cpu", None, {"batch_size": 2048, "num_embeddings": 100_000}),
    "dlrm-large-cpu": ("dlrm:large", "cpu", None, {"batch_size": 32}),
    "nanogpt": ("nanogpt", "cuda", "bf16", {}),
    "dlrm": ("dlrm", "cuda", "bf16", {}),
    "dlrm-large": ("dlrm:large", "cuda", "bf16", {}),
    "llama-0.5b": (f"{ZOO}:hf_llama", "cuda", "bf16", REAL),
    "bert-base": (f"{ZOO}:hf_bert", "cuda", "bf16", REAL),
    "vit-b16": (f"{ZOO}:timm_vit_b16", "cuda", "bf16", REAL),
    "resnet50": (f"{ZOO}:tv_resnet50", "cuda", "bf16", REAL),
    "gpt2-compiled": (f"{ZOO}:compiled_nanogpt", "cuda", "bf16", REAL),
}
GPU_DEFAULT = ["nanogpt", "dlrm", "dlrm-large", "llama-0.5b", "bert-base", "vit-b16", "resnet50",
               "gpt2-compiled"]
REPEATS = int(os.environ.get("CBTRACE_BENCH_REPEATS", 5))  # the median of this many of each
DISK_PROBE_MB = 512  # bytes written (with fsync) to measure disk bandwidth
STACK = "+stack"  # a case name's suffix: every side profiled with with_stack=True


def case(name: str) -> tuple:
    """(spec, device, dtype, provider options, with_stack) of a case name."""
    base = name.removesuffix(STACK)
    return (*CASES[base], name != base)


def disk_bandwidth(dirname, nbytes: int = DISK_PROBE_MB << 20) -> float:
    """bytes/s of a sequential write of ``nbytes`` with fsync, in the directory the runs go
    to."""
    data = os.urandom(1 << 20)
    path = Path(dirname) / "probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for lo in range(0, nbytes, len(data)):
            f.write(data[:nbytes - lo])
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return nbytes / dt


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_profiled_step(provider, model, batch, device, out_dir, hooks=False, with_stack=False):
    """A profiled step and its gzipped trace export: (seconds, their phases); ``hooks``: every
    module also gets the pre/post hooks a capture needs, doing nothing but open and close its
    two ranges (the floor of what any capture adds to the step, before copying or writing
    anything)."""
    from cbtrace.capture.recorder import RANGE_ENTER, RANGE_EXIT, profiler_activities
    from cbtrace.trace_io import gzip_trace

    stack, handles = [], []

    def pre(mod, args, kwargs):  # capture's two ranges: the (empty) copy range, then the call
        RANGE_EXIT(RANGE_ENTER("cbtrace.copy::", None))
        stack.append(RANGE_ENTER("cbtrace::", None))

    def post(mod, args, kwargs, out):
        RANGE_EXIT(stack.pop())

    sync(device)
    t0 = time.perf_counter()
    laps = [(None, t0)]
    for mod in model.modules() if hooks else ():
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
    with torch.profiler.profile(activities=profiler_activities(), record_shapes=True,
                                with_stack=with_stack) as p:
        laps.append(("start", time.perf_counter()))  # hooks (floor) and profiler start
        provider.run(model, batch)
        sync(device)
        laps.append(("step", time.perf_counter()))
    for h in handles:
        h.remove()
    laps.append(("stop", time.perf_counter()))  # profiler stop, hooks removed
    raw = Path(out_dir) / "plain.json"
    p.export_chrome_trace(str(raw))
    gzip_trace(raw, str(raw) + ".gz")
    laps.append(("trace_write", time.perf_counter()))
    phases = {name: t - laps[i][1] for i, (name, t) in enumerate(laps[1:])}  # seconds
    return laps[-1][1] - t0, phases


def captured_step(provider, model, batch, device, out_dir, with_stack=False
                  ) -> tuple[float, int, dict]:
    """(wall, stored input bytes, the capture's timings_s with ``other`` = wall - the parts
    that follow one another); timings_s as the capture object holds it, so it also has what
    the manifest cannot (checksums_and_manifest, total)."""
    import cbtrace
    from cbtrace.capture.recorder import TIMINGS_IN_SEQUENCE

    run = Path(out_dir) / "run"
    sync(device)
    t0 = time.perf_counter()
    with cbtrace.capture(model, run, with_stack=with_stack) as cap:
        provider.run(model, batch)
        sync(device)
    dt = time.perf_counter() - t0
    stored = sum(p.stat().st_size for p in (run / "inputs").glob("*.parquet"))
    timings = dict(cap.timings_s)
    timings["other"] = dt - sum(timings.get(k, 0.0) for k in TIMINGS_IN_SEQUENCE)
    return dt, stored, timings


def minimal_writes(run: Path, out_dir) -> float:
    """Seconds to write a capture's three kinds of files again, atomically (temp file, rename)
    but with no fsync, hashing or encoding of the inputs: the modules table from its Arrow
    table, the input shards' bytes as they are, the manifest's text. A lower bound of what
    writing any such run costs on this disk."""
    import pyarrow.parquet as pq

    table = pq.read_table(run / "modules.parquet")
    blobs = [p.read_bytes() for p in sorted((run / "inputs").glob("*.parquet"))]
    blobs.append((run / "manifest.json").read_bytes())
    out = Path(tempfile.mkdtemp(dir=out_dir))
    t0 = time.perf_counter()
    pq.write_table(table, out / "m.tmp")
    os.replace(out / "m.tmp", out / "modules.parquet")
    for i, blob in enumerate(blobs):
        (out / f"{i}.tmp").write_bytes(blob)
        os.replace(out / f"{i}.tmp", out / f"{i}.bin")
    return time.perf_counter() - t0


def bench(spec, device, dtype, options, work, with_stack=False):
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.model.spec import resolve

    provider = resolve(spec, options=options)
    model, batch = provider.model_and_batch(device, torch_dtype(dtype) if dtype else None)
    model.eval()
    with torch.no_grad():
        for _ in range(2):  # lazy init, autotuning (eval, no grad: the state stays as it is)
            provider.run(model, batch)
        sync(device)
        d = Path(tempfile.mkdtemp(dir=work))  # one-time costs, paid by neither side's repeats
        plain_profiled_step(provider, model, batch, device, d, with_stack=with_stack)
        first = captured_step(provider, model, batch, device, d, with_stack)[0]
        shutil.rmtree(d)
        plain, floor, writes, cap, stored, adjacent = [], [], [], [], 0, []
        for i in range(REPEATS):
            d = Path(tempfile.mkdtemp(dir=work))
            plain.append(plain_profiled_step(provider, model, batch, device, d,
                                             with_stack=with_stack))
            floor.append(plain_profiled_step(provider, model, batch, device, d, hooks=True,
                                             with_stack=with_stack))
            t, stored, timings = captured_step(provider, model, batch, device, d, with_stack)
            cap.append((t, timings))
            writes.append(minimal_writes(d / "run", d))
            shutil.rmtree(d / "run")
            adjacent.append(t / (plain[-1][0] + stored / disk_bandwidth(d, stored)))
            shutil.rmtree(d)
    mid = REPEATS // 2
    plain, floor, cap = (sorted(x, key=lambda r: r[0])[mid] for x in (plain, floor, cap))
    return plain, floor, sorted(writes)[mid], cap, stored, first, sorted(adjacent)[mid]


def main(names):
    work = Path(os.environ.get("CBTRACE_BENCH_DIR", tempfile.gettempdir()))
    bw = disk_bandwidth(work)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {name}; disk write bandwidth {bw / 1e6:.0f} MB/s (fsync, {DISK_PROBE_MB} MB)")
    print(f"{'model':<23}{'dev':<6}{'plain s':>9}{'floor s':>9}{'writes s':>9}{'capture s':>11}"
          f"{'stored MB':>11}{'MB/s':>8}{'bound s':>9}{'floor/b':>8}{'(f+w)/b':>8}{'ratio':>7}"
          f"{'adj':>6}  goal<=1.5")
    breakdown = []
    names = names or ["nanogpt-tiny-cpu"] + (GPU_DEFAULT if torch.cuda.is_available() else [])
    for name in names:
        spec, device, dtype, options, with_stack = case(name)
        try:
            (plain, plain_phases), (floor, floor_phases), writes, (cap, timings), stored, first, \
                adjacent = bench(spec, device, dtype, options, work, with_stack)
        except Exception as e:  # noqa: BLE001 - one model failing must not hide the others
            print(f"{name:<23}FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        bound = plain + stored / bw
        print(f"{name:<23}{device:<6}{plain:>9.3f}{floor:>9.3f}{writes:>9.3f}{cap:>11.3f}"
              f"{stored / 1e6:>11.1f}{stored / 1e6 / cap:>8.0f}{bound:>9.3f}{floor / bound:>8.2f}"
              f"{(floor + writes) / bound:>8.2f}{cap / bound:>7.2f}{adjacent:>6.2f}")
        breakdown.append((name, cap, timings, plain_phases, floor_phases, first))
    for name, cap, timings, plain_phases, floor_phases, first in breakdown:
        print(breakdown_lines(name, cap, timings, plain_phases, floor_phases, first))


def breakdown_lines(name, wall, timings, plain_phases, floor_phases, first) -> str:
    """Where the median capture's wall went (s), the parts in order summing to it, and the
    plain and floor steps' phases beside it."""
    from cbtrace.capture.recorder import TIMINGS_IN_SEQUENCE

    seq = [k for k in (*TIMINGS_IN_SEQUENCE, "other") if k in timings]
    threads = {k[len("inputs_"):-len("_thread_s")]: v for k, v in timings.items()
               if k.endswith("_thread_s")}
    rest = {k: v for k, v in timings.items()
            if k not in seq and k != "total" and not k.endswith("_thread_s")}

    def fmt(d):
        return ", ".join(f"{k} {v:.3f}" for k, v in d.items())

    return (f"  {name}: capture {wall:.3f} = " + " + ".join(f"{k} {timings[k]:.3f}" for k in seq)
            + f"\n    within inputs_and_trace: {fmt(rest)}; writer threads' s: {fmt(threads)}"
            + f"\n    plain: {fmt(plain_phases)}; floor: {fmt(floor_phases)}; first capture "
            f"{first:.3f}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
