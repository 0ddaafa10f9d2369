"""How far one profiled step's per-call times are from another's: the in-situ figure's own noise.

``cbtrace profile`` compares each call's isolated figure with its time in one profiled plain
step (``capture.plain_step``). A call whose kernels vary step to step by more than the +-5 %
bar cannot be within it in every capture, whatever the replay does. Per model (a fidelity_zoo
name): capture once and replay once as ``fidelity_zoo`` does, then profile the plain step
``--steps`` more times, one step a trace, on the same model and batch, and join the replay with
each. Prints, for calls >= 10 us: the share within +-5 % against each single step (min, median,
max over steps), against the per-call median of those steps, against the capture's own in-situ
figure (its plain steps' median, ``capture.from_spec.PLAIN_STEPS``), the steps' own spread per
call (median and p90 of (max - min) / median over steps), and, per module class, the share of
calls whose steps span over 10 %. Usage (on the GPU):

    python benchmarks/probes/probe_insitu_repeat.py /tmp/rep dcn resnet50 nanogpt --steps 5
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fidelity_zoo as zoo  # noqa: E402 - the models and their sizes, as the fidelity table has

WITHIN, MIN_MS = 5.0, 0.010


def captured(name, spec, options, args, run):
    """(modules table joined with the in-situ step, the live model): ``fidelity_zoo``'s
    capture and replay of the model."""
    from cbtrace.attribution.join import join_insitu
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.engine import replay
    from cbtrace.workflows.profile_model import live_model

    dtype = None if name in zoo.OWN_DTYPE else args.dtype
    cap = capture_model(spec, run, device=args.device, dtype=dtype, options=options)
    model = live_model(cap, args.device)
    del cap
    replay(run, model=model, **dict(zoo.replay_options(args), model_spec=spec,
                                    device=args.device))
    return join_insitu(run), model


def plain_repeats(spec, options, device, dtype, model, fqns, run, steps: int) -> list:
    """``steps`` more plain steps of the captured model, one a trace; each joined with the run's
    replay as the run's own plain trace (capture's is kept aside and put back)."""
    from cbtrace.attribution.join import join_insitu
    from cbtrace.capture.from_spec import run_step, stored_spec
    from cbtrace.capture.plain_step import plain_trace
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.model.spec import resolve
    from cbtrace.rundir.layout import PLAIN_TRACE
    from cbtrace.state import StateGuard

    # the batch the capture ran: the provider built again from the same seed
    provider = resolve(stored_spec(spec), seed=0, options=dict(options))
    _, batch = provider.model_and_batch(torch.device(device),
                                        torch_dtype(dtype) if dtype else None)
    first = Path(run) / PLAIN_TRACE
    kept = first.with_name("first_" + first.name)
    if first.exists():
        shutil.copy(first, kept)
    guard, tables = StateGuard(model), []
    try:
        for _ in range(steps):
            with guard.call():
                plain_trace(model, fqns, lambda: run_step(provider, model, batch, "forward"),
                            Path(run), torch.device(device))
            tables.append(join_insitu(run))
    finally:
        if kept.exists():
            shutil.copy(kept, first)
    return tables


def summary(name: str, captured_df, dfs: list, rows_of: str | None = None) -> None:
    import pandas as pd

    base = captured_df
    ok = base[(base["status"] == "ok") & (base["insitu_ms"] >= MIN_MS)]
    ids = ok["call_id"]
    steps = pd.concat([d.set_index("call_id").loc[ids, "insitu_ms"].rename(i)
                       for i, d in enumerate(dfs)], axis=1)
    iso = ok.set_index("call_id")["isolated_ms"]
    per_step = [100 * float(((iso / steps[c] - 1).abs() * 100 <= WITHIN).mean())
                for c in steps.columns]
    med = steps.median(axis=1)
    vs_median = 100 * float(((iso / med - 1).abs() * 100 <= WITHIN).mean())
    own = base.set_index("call_id").loc[ids, "insitu_ms"]
    vs_own = 100 * float(((iso / own - 1).abs() * 100 <= WITHIN).mean())
    span = 100 * (steps.max(axis=1) - steps.min(axis=1)) / med
    per_step.sort()
    print(f"{name}: {len(ids)} calls >= 10 us, {len(dfs)} plain steps\n"
          f"  within +-5 % against one step: min {per_step[0]:.1f} / median "
          f"{per_step[len(per_step) // 2]:.1f} / max {per_step[-1]:.1f} %; against the "
          f"median of the steps: {vs_median:.1f} %; against the capture's own figure: "
          f"{vs_own:.1f} %\n"
          f"  the steps' own span per call, (max - min) / median: median {span.median():.1f} %, "
          f"p90 {span.quantile(0.9):.1f} %; calls spanning > 10 %: "
          f"{100 * float((span > 10).mean()):.1f} %", flush=True)
    types = ok.set_index("call_id")["module_type"]
    if rows_of:  # each call of that class: its steps, the isolated figure, the errors
        fqn = ok.set_index("call_id")["fqn"]
        for cid in types.index[types == rows_of]:
            each = " ".join(f"{1e3 * v:6.1f}" for v in steps.loc[cid])
            print(f"    {fqn[cid]:<36} steps us {each}  isolated {1e3 * iso[cid]:6.1f}  "
                  f"vs median {100 * (iso[cid] / med[cid] - 1):+5.1f} %  span {span[cid]:4.1f} %",
                  flush=True)
    for t, s in span.groupby(types):
        if len(s) >= 3:
            near = ((iso[s.index] / med[s.index] - 1).abs() * 100 <= WITHIN).mean()
            print(f"    {t:<24} n={len(s):<4} span median {s.median():5.1f} %  > 10 %: "
                  f"{100 * float((s > 10).mean()):5.1f} %  within5 vs median "
                  f"{100 * float(near):5.1f} %", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="real", choices=["real", "tiny"])
    ap.add_argument("--rows", default="EmbeddingBag",
                    help="a module class whose calls are printed one by one")
    args = ap.parse_args()
    device = args.device
    zargs = zoo.parse(["--out", args.out, "--device", device, "--dtype", args.dtype,
                       "--models", ",".join(args.models)])
    for name in args.models:
        tiny_spec, tiny_opts, spec, options, _ = zoo.MODELS[name]
        if args.size == "tiny":  # the code paths on a CPU: its in-situ times are host times
            spec, options = tiny_spec, tiny_opts
        run = Path(args.out) / name
        shutil.rmtree(run, ignore_errors=True)
        try:
            df, model = captured(name, spec, options, zargs, run)
            fqns = list(df.sort_values("call_id")["fqn"])
            dtype = None if name in zoo.OWN_DTYPE else args.dtype
            dfs = plain_repeats(spec, options, device, dtype, model, fqns, run, args.steps)
            summary(name, df, dfs, args.rows)
        except Exception as e:  # noqa: BLE001 - one model failing must not hide the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            shutil.rmtree(run, ignore_errors=True)
            zoo._free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
