"""Issue 3/4 GPU benchmark: profile NanoGPT GPT-2-small bf16 b8 and DLRM bf16 b8192 on one GPU.

Per model: capture, replay (timer auto), attribution of the capture trace (in-situ), then
a replay in cold mode (one call per graph after an L2 flush, do_bench's convention), then per
module the references: triton.testing.do_bench median (twice, for its own repeatability),
do_bench over a one-call CUDA graph (no host launch latency) and do_bench_cudagraph.
Prints: replay wall time and duty cycle, agreement distributions (modules >= 20 us), the
isolation error table by module class, and the top modules; writes OUT_DIR/<model>_modules.csv. Usage:
    python benchmarks/bench_replay_gpu.py OUT_DIR [nanogpt dlrm]
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

MODELS = {"nanogpt": dict(spec="nanogpt", dtype="bf16", options={"batch_size": 8}),
          "dlrm": dict(spec="dlrm", dtype="bf16", options={"batch_size": 8192})}
MIN_MS = 0.020       # agreement goal applies to modules at least this long
REF_WARMUP_MS, REF_REP_MS = 25, 100


def one_call_graph(fn):
    """A CUDA graph of one fn() call (the graph timer's warm-up and capture), or None."""
    from cbtrace.replay.timer.contract import TimerUnavailable
    from cbtrace.plugins.backends.graph import capture, side_stream_warmup

    try:
        side_stream_warmup(lambda i: fn(), 1, 3)
        return capture(lambda i: fn(), 1, 1)
    except TimerUnavailable:  # no graph reference for this call
        return None


def do_bench_refs(run, df, model):
    """Per ok call of >= MIN_MS / 2: do_bench median twice, do_bench over a one-call CUDA graph
    (the same convention without host launch latency) and do_bench_cudagraph, in ms."""
    import triton.testing as tt

    from cbtrace.store.load import load_call_inputs
    from cbtrace.schema.modules import frame_to_records
    from cbtrace.replay.measure.prepare import call_context

    def bench(f, **kw):
        try:
            return tt.do_bench(f, warmup=REF_WARMUP_MS, rep=REF_REP_MS, return_mode="median", **kw)
        except Exception as e:  # noqa: BLE001 - a reference that fails is reported, not fatal
            print(f"  do_bench failed: {type(e).__name__}: {str(e)[:120]}")
            return float("nan")

    refs = {}
    for rec in frame_to_records(df):
        if rec.status != "ok" or not rec.isolated_ms or rec.isolated_ms < MIN_MS / 2:
            continue
        module = model.get_submodule(rec.fqn) if rec.fqn else model
        module.train(bool(rec.training))
        args, kwargs = load_call_inputs(Path(run), rec.inputs_ref, device="cuda")
        with call_context(rec):  # entered once, as a user of do_bench would
            fn = lambda: module(*args, **kwargs)  # noqa: E731
            db, db2 = bench(fn), bench(fn)
            g = one_call_graph(fn)
            dbg = bench(g.replay) if g is not None else float("nan")
            dbg2 = bench(g.replay) if g is not None else float("nan")
            del g
            try:
                with torch.cuda.stream(torch.cuda.Stream()):
                    cg = tt.do_bench_cudagraph(fn, rep=REF_REP_MS, return_mode="median")
            except Exception:  # noqa: BLE001
                torch.cuda.synchronize()
                cg = float("nan")
        refs[rec.call_id] = dict(do_bench_ms=db, do_bench_again_ms=db2, do_bench_graph_ms=dbg,
                                 do_bench_graph_again_ms=dbg2, do_bench_cudagraph_ms=cg)
    return refs


def dist(errs):
    errs = [e for e in errs if e == e]
    if not errs:
        return "n=0"
    q = statistics.quantiles(errs, n=10) if len(errs) > 1 else [errs[0]] * 9
    within = sum(abs(e) <= 3.0 for e in errs) / len(errs)
    return (f"n={len(errs):3d} median {statistics.median(errs):+5.1f}% p10 {q[0]:+5.1f}% "
            f"p90 {q[-1]:+5.1f}% max|err| {max(abs(e) for e in errs):5.1f}% "
            f"within±3%: {within:4.0%}")


def agreement(t):
    """Distributions of the errors (%), modules whose launch-free do_bench is >= MIN_MS."""
    t = t[t["do_bench_graph_ms"] >= MIN_MS]
    # do_bench puts host launch latency in its events where issuing the call takes the host
    # longer than the device needs (cbtrace's host_ms vs the launch-free reference)
    free = t[t["host_ms"] < t["do_bench_graph_ms"]]
    e = lambda a, b: list(100 * (a / b - 1))  # noqa: E731
    print("  cold vs do_bench, all                    ", dist(e(t.cold_ms, t.do_bench_ms)))
    print("  cold vs do_bench, not launch-bound       ", dist(e(free.cold_ms, free.do_bench_ms)))
    print("  cold vs do_bench over a one-call graph   ", dist(e(t.cold_ms, t.do_bench_graph_ms)))
    print("  do_bench vs do_bench again (self)        ",
          dist(e(t.do_bench_again_ms, t.do_bench_ms)))
    print("  do_bench over graph vs itself again      ",
          dist(e(t.do_bench_graph_again_ms, t.do_bench_graph_ms)))
    print("  default (K/graph) vs do_bench            ", dist(e(t.isolated_ms, t.do_bench_ms)))
    print("  default (K/graph) vs do_bench_cudagraph  ",
          dist(e(t.isolated_ms, t.do_bench_cudagraph_ms)))
    print("  default (K/graph) vs in situ             ", dist(e(t.isolated_ms, t.insitu_ms)))
    print("  cold vs in situ                          ", dist(e(t.cold_ms, t.insitu_ms)))
    cols = ["fqn", "module_type", "kernel_count", "host_ms", "cold_ms", "do_bench_ms",
            "do_bench_again_ms", "do_bench_graph_ms", "do_bench_graph_again_ms", "err"]
    for ref in ("do_bench_ms", "do_bench_graph_ms"):
        worst = t.assign(err=e(t.cold_ms, t[ref])).dropna(subset=["err"])
        print(f"  largest |cold / {ref} - 1|:")
        print(worst.sort_values("err", key=abs).tail(6)[cols].to_string(
            index=False, float_format=lambda x: f"{x:.4g}"))


def bench(name, out_dir):
    import pandas as pd

    import cbtrace
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.attribution.join import error_table, join_insitu
    from cbtrace.replay.run_io.rebuild import rebuild_model
    from cbtrace import rundir

    m = MODELS[name]
    run = Path(out_dir) / name
    t0 = time.perf_counter()
    cap = capture_model(m["spec"], run, device="cuda", dtype=m["dtype"], options=m["options"])
    t_cap = time.perf_counter() - t0
    t0 = time.perf_counter()  # cold first: the run dir keeps the default replay
    cold = cbtrace.replay(run, cold=True).set_index("call_id")
    wall_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    df = cbtrace.replay(run)
    wall = time.perf_counter() - t0
    timed_s = float((df["isolated_ms"].fillna(0) * df["runs"].fillna(0)).sum()) / 1e3
    try:
        df = join_insitu(run)
        table = error_table(df)
    except Exception as e:  # noqa: BLE001
        table = f"attribution failed: {type(e).__name__}: {e}"
    df["cold_ms"] = df["call_id"].map(cold["isolated_ms"])
    df["cold_notes"] = df["call_id"].map(cold["timer_notes"])
    manifest = rundir.read_manifest(run)
    model = rebuild_model(manifest, torch.device("cuda"), verify=False)
    refs = do_bench_refs(run, df, model)
    ref = pd.DataFrame.from_dict(refs, orient="index").rename_axis("call_id").reset_index()
    if ref.empty:
        ref = pd.DataFrame(columns=["call_id", "do_bench_ms", "do_bench_again_ms",
                                    "do_bench_graph_ms", "do_bench_graph_again_ms",
                                    "do_bench_cudagraph_ms"])
    ref["call_id"] = ref["call_id"].astype(df["call_id"].dtype)
    t = df.merge(ref, on="call_id", how="left")
    t.to_csv(Path(out_dir) / f"{name}_modules.csv", index=False)
    (run / "do_bench.json").write_text(json.dumps(ref.to_dict("records")))
    print(f"\n=== {name}: {len(df)} calls; capture {t_cap:.1f} s ({len(cap.records)} calls); "
          f"replay wall {wall:.1f} s (cold {wall_cold:.1f} s); timed device time {timed_s:.1f} s;"
          f" duty cycle {timed_s / wall:.0%}")
    print("timers:", df["timer"].value_counts().to_dict(), "notes:",
          df["timer_notes"].value_counts().head(4).to_dict())
    fb = df["timer_fallback"].dropna().unique()[:5]
    if len(fb):
        print("fallbacks:", list(fb))
    print(f"agreement (error = a / b - 1; modules whose launch-free do_bench >= {MIN_MS} ms):")
    agreement(t)
    print("error table (isolated / in-situ - 1, %):")
    print(table if isinstance(table, str) else table.to_string(float_format=lambda x: f"{x:.2f}"))
    cols = ["fqn", "module_type", "timer", "isolated_ms", "cold_ms", "insitu_ms", "error_pct",
            "flops", "mfu", "mbu", "bound", "kernel_count"]
    top = t.sort_values("isolated_ms", ascending=False)[[c for c in cols if c in t]].head(12)
    print(top.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return t


def main():
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(MODELS)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in names:
        bench(name, out)


if __name__ == "__main__":
    main()
