"""Issue 31, item 1: the compile opportunity's estimate against the saving measured in place.

Builds the model, captures one forward step (no grad, eval mode), replays it with
``--modes`` (compile at least), and takes the root and the ``--top`` modules by estimated
compile saving (``replay.modes.opportunity.compile_estimates``: each module's calls placed in the
step, whose host runs ahead of its device). Each is then compiled in place inside the full
model (the root: the whole model compiled) and the whole step measured with and without it
(``replay.modes.opportunity.verify_in_place``: K steps back to back between CUDA events, median of
repeats, ``torch._dynamo.reset()`` between modules). Prints one row per module: estimated and
measured saving per step, their difference, and whether it is within the issue's bound
(+-15 % or 0.1 ms). The run gives both estimates, the cold one (``compile_host_ms``, the
default) and the back-to-back one (``compile_host_steady_ms``), each module picked by either
measured once and compared with both; ``--back-to-back-host-issue`` replays with
``cold_host_issue`` off and gives the back-to-back one alone. Usage:

    python benchmarks/bench_opportunity.py --model efficientnet_b0 --top 5     # on an H200
    python benchmarks/bench_opportunity.py --model nanogpt --modes compile,cudagraph
    python benchmarks/bench_opportunity.py --model nanogpt:tiny --device cpu --max-depth 2
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

# registered providers and their GPU sizes (GPT-2 small batch 8; DLRM batch 8192)
PROVIDERS = {"nanogpt": {"batch_size": 8}, "dlrm": {"batch_size": 8192}}
CNN_BATCH, CNN_SIDE = 64, 224  # a timm / torchvision CNN: batch 64 of 224 x 224 images
REPLAY = dict(budget_s=0.03, timeout_s=300.0)
STEPS_K = 20      # steps back to back per timed repeat (the host runs ahead as in training)
REPEATS = 7       # windows per configuration, eager and compiled in turn; the medians are reported


def build(name: str, device: str, dtype):
    """(model, run(model) -> outputs) for a provider spec or a timm / torchvision model name."""
    from cbtrace.model.spec import resolve

    if name.split(":")[0] in PROVIDERS or ":" in name:
        options = {} if ":" in name else PROVIDERS[name]
        provider = resolve(name, options=options)
        model, batch = provider.model_and_batch(device, dtype)
        return model.eval(), lambda m: provider.run(m, batch)
    model = cnn(name).to(device)
    if dtype is not None:
        model = model.to(dtype)
    x = torch.randn(CNN_BATCH, 3, CNN_SIDE, CNN_SIDE, device=device, dtype=dtype)
    return model.eval(), lambda m: m(x)


def cnn(name: str):
    """A randomly initialised timm model if timm has it, else a torchvision one."""
    try:
        import timm

        if name in timm.list_models():
            return timm.create_model(name, pretrained=False)
    except ImportError:
        pass
    try:
        import torchvision
    except ImportError:
        raise SystemExit(f"--model {name}: neither nanogpt/dlrm nor a timm or torchvision model "
                         "(neither package is installed)") from None
    return torchvision.models.get_model(name, weights=None)


def table(rows, types: dict, calls: dict, steady: dict | None = None) -> str:
    """One line per module checked; ``steady``: the back-to-back estimates (fqn -> ms) of a
    cold_host_issue run (the default), in two more columns."""
    from cbtrace.plugins.reporters.opportunities import within

    head = ("module", "type", "calls", "estimated ms", "measured ms", "+- ms", "error ms",
            "error %", "eager step ms", "compiled step ms", "compile s", "ok?")
    if steady is not None:
        head += ("steady est ms", "steady ok?")
    out = [head]
    for r in rows:
        m, e = r.measured_ms, r.error_ms

        def f(v, spec=".3f"):
            return "-" if v is None else format(v, spec)

        pct = None if e is None or not m else 100 * e / abs(m)
        ok = "-" if e is None else ("yes" if within(r.estimated_ms, m) else "no")
        line = (r.fqn or "(root)", types.get(r.fqn, "-"), str(calls.get(r.fqn, "-")),
                f(r.estimated_ms), f(m), f(r.noise_ms), f(e), f(pct, "+.1f"), f(r.eager_ms),
                f(r.compiled_ms), f(r.compile_s, ".1f"),
                ok if r.status == "ok" else r.status[:60])
        if steady is not None:
            s = steady.get(r.fqn)
            line += (f(s), "-" if s is None or m is None or e is None
                     else ("yes" if within(s, m) else "no"))
        out.append(line)
    widths = [max(len(str(row[i])) for row in out) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) if i < 2 or i == 11 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    import cbtrace
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.plugins.reporters.icicle_tree import record_rows
    from cbtrace.plugins.reporters.opportunities import ABS_TOL_MS, REL_TOL, within
    from cbtrace.replay.modes import opportunity as opp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="nanogpt",
                   help="nanogpt, dlrm, a provider spec (nanogpt:tiny) or a timm/torchvision name")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, help="bf16, fp16, fp32 (default: bf16 on cuda)")
    p.add_argument("--top", type=int, default=5, help="modules besides the root")
    p.add_argument("--modes", default="compile", help="replay modes (compile at least)")
    p.add_argument("--modes-budget-s", type=float, default=None)
    p.add_argument("--compile-mode", default="default")
    p.add_argument("--max-depth", type=int, default=None, help="capture depth (default: all)")
    p.add_argument("--k", type=int, default=STEPS_K)
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a temp dir)")
    p.add_argument("--back-to-back-host-issue", dest="cold_host_issue", action="store_false",
                   help="ReplayConfig.cold_host_issue off (compiled issue time back to back, "
                        "not after the CPU's caches were evicted)")
    a = p.parse_args(argv)
    dtype_name = a.dtype or ("bf16" if a.device == "cuda" else None)
    dtype = torch_dtype(dtype_name) if dtype_name and dtype_name != "fp32" else None
    modes = tuple(m for m in a.modes.split(",") if m and m != "eager")
    if "compile" not in modes:
        raise SystemExit("--modes must include compile: the estimate is of compiling")
    run_dir = (a.out or Path(tempfile.mkdtemp(prefix="bench_opportunity_"))) / "run"

    model, step = build(a.model, a.device, dtype)
    with torch.no_grad():
        step(model)  # warm-up: lazy init outside the capture
        with cbtrace.capture(model, run_dir, trace=False, max_depth=a.max_depth):
            step(model)
    t0 = time.perf_counter()
    df = cbtrace.replay(run_dir, model=model, device=a.device, modes=modes,
                        compile_mode=a.compile_mode, modes_budget_s=a.modes_budget_s,
                        cold_host_issue=a.cold_host_issue, **REPLAY)
    wall = time.perf_counter() - t0
    statuses = {m: df[f"{m}_status"].fillna("-").str.split(":").str[0].value_counts().to_dict()
                for m in modes}
    oom = {m: int(df[f"{m}_status"].fillna("").str.contains("out of memory", case=False).sum())
           for m in modes}
    print(f"=== {a.model} on {a.device} ({dtype_name or 'fp32'}): {len(df)} calls; replay with "
          f"modes {','.join(modes)} {wall:.1f} s (compiling {df['compile_s'].sum():.1f} s; "
          f"{int((df['compile_graphs'] > 0).sum())} calls compiled a graph)")
    print(f"statuses: eager {df['status'].value_counts().to_dict()}, {statuses}; "
          f"out-of-memory rows {oom}")
    for m in modes:  # why, where a mode failed: the three commonest reasons as they read
        errs = df[f"{m}_status"].dropna()
        stopped = errs.str.startswith("skipped: compile mode stopped")
        for why, n in errs[errs.str.startswith("error") | stopped].value_counts().head(3).items():
            print(f"  {m}: {n} x {why[:200]}")

    rows = record_rows(df)
    est = opp.compile_estimates(rows)
    fqns = opp.pick_modules(est, a.top)
    steady, picked = None, {"cold" if a.cold_host_issue else "": set(fqns)}
    if a.cold_host_issue:  # the back-to-back estimate too, and the modules it would pick
        # (a row without an eager host_ms took the back-to-back figure as compile_host_ms)
        steady = opp.compile_estimates([
            {**r, "compile_host_ms": r.get("compile_host_steady_ms")
             if r.get("compile_host_steady_ms") is not None else r.get("compile_host_ms")}
            for r in rows])
        picked["steady"] = set(opp.pick_modules(steady, a.top))
        fqns += [f for f in opp.pick_modules(steady, a.top) if f not in fqns]
    types = {r.get("fqn") or "": r.get("module_type") for r in rows}
    calls = {f: sum((r.get("fqn") or "") == f for r in rows) for f in fqns}

    def run_step(m):
        with torch.no_grad():
            return step(m)

    t0 = time.perf_counter()
    checked = opp.verify_in_place(model, run_step, fqns, est, a.device, mode=a.compile_mode,
                                  k=a.k, repeats=a.repeats)
    print(f"\nin place, {len(fqns)} modules ({time.perf_counter() - t0:.1f} s; one step = median "
          f"of {a.repeats} windows of {a.k} steps back to back, eager and compiled in turn; saving = eager step - compiled step)")
    print(table(checked, types, calls, steady))
    root = next((r for r in rows if r.get("parent_call_id") not in {x["call_id"] for x in rows}),
                None)
    whole = next((r for r in checked if r.fqn == "" and r.status == "ok"), None)
    if root is not None and whole is not None:  # which side of the root's estimate is off

        def f(v):
            return "-" if v is None else f"{v:.3f}"

        print(f"root, estimated: eager step {f(root.get('eager_step_ms'))} ms = max(device "
              f"{f(root.get('isolated_ms'))}, host {f(root.get('host_ms'))}); compiled max(device "
              f"{f(root.get('compile_ms'))}, host {f(root.get('compile_host_ms'))}); measured: "
              f"eager step {whole.eager_ms:.3f} ms, compiled step {whole.compiled_ms:.3f} ms")
    for name, mine in picked.items():  # each estimate on the modules it picked
        est_of = (lambda r: steady.get(r.fqn)) if name == "steady" else (lambda r: r.estimated_ms)
        done = [r for r in checked if r.fqn in mine and r.error_ms is not None
                and est_of(r) is not None]
        good = sum(within(est_of(r), r.measured_ms) for r in done)
        label = {"": "", "cold": "the cold estimate, ", "steady": "the back-to-back estimate, "}
        print(f"{label[name]}within +-{REL_TOL:.0%} or {ABS_TOL_MS} ms: {good} of {len(done)} "
              f"of the {len(mine)} it picked (rows with both figures; "
              f"{len(mine) - len(done)} failed)")
    if not any(r.error_ms is not None for r in checked):  # a run that measured nothing
        print(f"bench_opportunity: no module was measured in place ({len(fqns)} picked; the "
              "compile mode's statuses above say why)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
