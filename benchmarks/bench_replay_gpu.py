"""Issue 3/4 GPU benchmark: profile NanoGPT GPT-2-small bf16 b8 and DLRM bf16 b8192 on one GPU.

Per model: capture, replay (timer auto), attribution of the capture trace (in-situ), then
per module a do_bench reference (triton.testing.do_bench median, and do_bench_cudagraph).
Prints: replay wall time and duty cycle, agreement with do_bench (modules >= 20 us), the
isolation error table by module class, and the top modules. Usage:
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


def do_bench_refs(run, df, model):
    """Per ok call >= MIN_MS: (do_bench median, do_bench_cudagraph) in ms on the captured inputs."""
    import triton.testing as tt

    from cbtrace.plugins.inputs.load import load_call_inputs
    from cbtrace.records import frame_to_records
    from cbtrace.replay.measure import call_context

    refs = {}
    for rec in frame_to_records(df):
        if rec.status != "ok" or not rec.isolated_ms or rec.isolated_ms < MIN_MS:
            continue
        module = model.get_submodule(rec.fqn) if rec.fqn else model
        module.train(bool(rec.training))
        args, kwargs = load_call_inputs(Path(run), rec.inputs_ref, device="cuda")

        def fn():
            with call_context(rec):
                module(*args, **kwargs)

        try:
            med = tt.do_bench(fn, warmup=REF_WARMUP_MS, rep=REF_REP_MS, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a reference that fails is reported, not fatal
            med = float("nan")
            print(f"  do_bench failed for {rec.fqn}: {e}")
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                g = tt.do_bench_cudagraph(fn, rep=REF_REP_MS, return_mode="median")
        except Exception:  # noqa: BLE001
            g = float("nan")
        refs[rec.call_id] = (med, g)
    return refs


def dist(errs):
    errs = [e for e in errs if e == e]
    if not errs:
        return "n=0"
    q = statistics.quantiles(errs, n=10) if len(errs) > 1 else [errs[0]] * 9
    within = sum(abs(e) <= 3.0 for e in errs) / len(errs)
    return (f"n={len(errs)} median {statistics.median(errs):+.1f}% p10 {q[0]:+.1f}% "
            f"p90 {q[-1]:+.1f}% max|err| {max(abs(e) for e in errs):.1f}% within±3%: {within:.0%}")


def bench(name, out_dir):
    import cbtrace
    from cbtrace.pipeline import capture_model
    from cbtrace.profile import error_table, join_insitu
    from cbtrace.replay.engine import rebuild_model
    from cbtrace import rundir

    m = MODELS[name]
    run = Path(out_dir) / name
    t0 = time.perf_counter()
    cap = capture_model(m["spec"], run, device="cuda", dtype=m["dtype"], options=m["options"])
    t_cap = time.perf_counter() - t0
    t0 = time.perf_counter()
    df = cbtrace.replay(run)
    wall = time.perf_counter() - t0
    timed_s = float((df["isolated_ms"].fillna(0) * df["runs"].fillna(0)).sum()) / 1e3
    try:
        df = join_insitu(run)
        table = error_table(df)
    except Exception as e:  # noqa: BLE001
        table = f"attribution failed: {type(e).__name__}: {e}"
    manifest = rundir.read_manifest(run)
    model = rebuild_model(manifest, torch.device("cuda"), verify=False)
    refs = do_bench_refs(run, df, model)
    errs_b, errs_g, rows = [], [], []
    for cid, (b, g) in refs.items():
        iso = float(df.loc[df["call_id"] == cid, "isolated_ms"].iloc[0])
        errs_b.append(100 * (iso / b - 1))
        errs_g.append(100 * (iso / g - 1))
        rows.append(dict(call_id=cid, isolated_ms=iso, do_bench_ms=b, do_bench_cudagraph_ms=g))
    (run / "do_bench.json").write_text(json.dumps(rows))
    print(f"\n=== {name}: {len(df)} calls; capture {t_cap:.1f} s ({len(cap.records)} calls); "
          f"replay wall {wall:.1f} s; timed device time {timed_s:.1f} s; duty cycle "
          f"{timed_s / wall:.0%}")
    print("timers:", df["timer"].value_counts().to_dict())
    fb = df["timer_fallback"].dropna().unique()[:5]
    if len(fb):
        print("fallbacks:", list(fb))
    print("isolated vs do_bench (median):          ", dist(errs_b))
    print("isolated vs do_bench_cudagraph (median):", dist(errs_g))
    print("error table (isolated / in-situ - 1, %):")
    print(table if isinstance(table, str) else table.to_string(float_format=lambda x: f"{x:.2f}"))
    cols = ["fqn", "module_type", "timer", "isolated_ms", "insitu_ms", "error_pct", "flops", "mfu",
            "mbu", "bound", "kernel_count"]
    top = df.sort_values("isolated_ms", ascending=False)[[c for c in cols if c in df]].head(12)
    print(top.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return df


def main():
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(MODELS)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in names:
        bench(name, out)


if __name__ == "__main__":
    main()
