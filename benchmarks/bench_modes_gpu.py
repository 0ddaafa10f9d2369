"""Issue 14, part 1 on a GPU: the PT2 opportunity per module against compiling the whole model.

Per model: capture one forward step (cbtrace.capture.from_spec.capture_model), replay it with
``modes=("compile", "cudagraph")``, print the top opportunities (the ``cbtrace report
--opportunities`` ranking) and eager vs compiled vs graphed per module class; then build the
provider's model again, time its step eagerly and under ``torch.compile`` (warm-up first,
compile untimed, median of timed steps between CUDA events: host issue included, as a real
step pays it) and print what whole-model compile saved beside the sum of the per-module
savings over the root's children and over the leaves. A short table closes. Usage:

    python benchmarks/bench_modes_gpu.py [--out DIR] [--models nanogpt dlrm]     # on an H200
    python benchmarks/bench_modes_gpu.py --device cpu --models nanogpt:tiny      # a check here
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

# name -> spec, dtype, provider options (GPT-2 small bf16 batch 8; DLRM bf16 batch 8192)
MODELS = {"nanogpt": dict(spec="nanogpt", dtype="bf16", options={"batch_size": 8}),
          "dlrm": dict(spec="dlrm", dtype="bf16", options={"batch_size": 8192})}
STEP_WARMUP = 5       # untimed whole-model steps before timing (after compiling)
STEP_RUNS = 20        # timed whole-model steps; the median is reported
REPLAY = dict(modes=("compile", "cudagraph"), budget_s=0.03, timeout_s=300.0)
TOP = 12


def settings(name: str, device: str) -> dict:
    """A model's spec, dtype and options; "X:tiny" specs (CPU checks) run in float32."""
    if name in MODELS:
        return dict(MODELS[name])
    return dict(spec=name, dtype="bf16" if device == "cuda" else None, options={})


def time_step(fn, device: str) -> float:
    """Median ms of ``fn()`` after STEP_WARMUP untimed calls: CUDA events around each call with
    the device idle before it (the host's issue time counts), perf_counter on a CPU."""
    for _ in range(STEP_WARMUP):
        fn()
    times = []
    for _ in range(STEP_RUNS):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def whole_model(s: dict, device: str, compile_mode: str) -> dict:
    """Eager and torch.compile'd step of the provider's model (forward, grad on, eval mode:
    the step the capture took); compile_s is the first compiled call (untimed)."""
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.model.spec import resolve

    provider = resolve(s["spec"], options=s["options"])
    model, batch = provider.model_and_batch(device, torch_dtype(s["dtype"]) if s["dtype"] else None)
    model.eval()
    eager = time_step(lambda: provider.run(model, batch), device)
    compiled = torch.compile(model, mode=compile_mode)
    t0 = time.perf_counter()
    provider.run(compiled, batch)
    if device == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    fast = time_step(lambda: provider.run(compiled, batch), device)
    torch._dynamo.reset()
    return dict(eager_ms=eager, compiled_ms=fast, compile_s=compile_s)


def per_class(df) -> str:
    """Eager step vs compiled vs graphed ms per module class (calls summed where measured)."""
    from cbtrace.replay.modes.opportunity import mode_costs

    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    agg: dict = {}
    for r in rows:
        if r.get("eager_step_ms") is None:
            continue
        a = agg.setdefault(r["module_type"], dict(calls=0, eager=0.0, compile=0.0, cudagraph=0.0,
                                                  n_compile=0, n_graph=0, saving=0.0))
        costs = mode_costs(r)
        a["calls"] += 1
        a["eager"] += r["eager_step_ms"]
        a["saving"] += r.get("opportunity_ms") or 0.0
        for mode, n in (("compile", "n_compile"), ("cudagraph", "n_graph")):
            if mode in costs:
                a[mode] += costs[mode]
                a[n] += 1
    lines = [f"{'class':<24} {'calls':>5} {'eager ms':>9} {'compile ms':>11} {'ok':>4} "
             f"{'graph ms':>9} {'ok':>4} {'saving ms':>9}"]
    for cls, a in sorted(agg.items(), key=lambda kv: -kv[1]["saving"]):
        lines.append(f"{cls:<24} {a['calls']:>5} {a['eager']:>9.4f} {a['compile']:>11.4f} "
                     f"{a['n_compile']:>4} {a['cudagraph']:>9.4f} {a['n_graph']:>4} "
                     f"{a['saving']:>9.4f}")
    lines.append("(compile/graph ms sum only the calls ok in that mode: compare with 'ok')")
    return "\n".join(lines)


def bench(name: str, out_dir: Path, device: str, compile_mode: str, max_depth) -> dict:
    import cbtrace
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.plugins.reporters.icicle_tree import record_rows
    from cbtrace.plugins.reporters.opportunities import opportunity_table, overlap

    s = settings(name, device)
    run = out_dir / name.replace(":", "_")
    t0 = time.perf_counter()
    # with its trace, as a user's run: compile-ahead workers pick leaves by their step kernels
    capture_model(s["spec"], run, device=device, dtype=s["dtype"], options=s["options"],
                  max_depth=max_depth)
    t_cap = time.perf_counter() - t0
    t0 = time.perf_counter()
    df = cbtrace.replay(run, device=device, compile_mode=compile_mode, **REPLAY)
    wall = time.perf_counter() - t0
    print(f"\n=== {name} on {device}: {len(df)} calls; capture {t_cap:.1f} s; replay with "
          f"modes {wall:.1f} s (compiling {df['compile_s'].sum():.1f} s)")
    print("compile:", df["compile_status"].str.split(":").str[0].value_counts().to_dict(),
          " cudagraph:", df["cudagraph_status"].str.split(":").str[0].value_counts().to_dict(),
          " best:", df["best_mode"].value_counts().to_dict())
    print(opportunity_table(df, top=TOP))
    print(per_class(df))
    o = overlap(record_rows(df))
    t0 = time.perf_counter()
    w = whole_model(s, device, compile_mode)
    saved = w["eager_ms"] - w["compiled_ms"]
    print(f"whole model: eager {w['eager_ms']:.3f} ms, compiled {w['compiled_ms']:.3f} ms "
          f"(compile {w['compile_s']:.1f} s; {time.perf_counter() - t0:.1f} s in all)")
    print(f"whole-model compile saved {saved:.3f} ms vs the sum of module savings "
          f"{o['children']:.3f} ms (over the root's children) / {o['leaves']:.3f} ms (over "
          f"leaves); the root row's own {o['root']:.3f} ms")
    return dict(model=name, calls=len(df), replay_s=wall, **w, saved_ms=saved, **o)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="run directories (default: a temp dir)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--compile-mode", default="default")
    p.add_argument("--max-depth", type=int, default=None, help="capture depth (default: all)")
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="bench_modes_"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for name in a.models:
        try:
            results.append(bench(name, out, a.device, a.compile_mode, a.max_depth))
        except Exception as e:  # noqa: BLE001 - one failing model does not stop the other
            print(f"\n=== {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    print(f"\n--- summary ({time.perf_counter() - t0:.0f} s; runs in {out}; ms per step)")
    print(f"{'model':<14} {'calls':>5} {'eager':>9} {'compiled':>9} {'saved':>8} "
          f"{'children':>9} {'leaves':>8} {'root row':>9} {'compile s':>9} {'replay s':>8}")
    for r in results:
        print(f"{r['model']:<14} {r['calls']:>5} {r['eager_ms']:>9.3f} {r['compiled_ms']:>9.3f} "
              f"{r['saved_ms']:>8.3f} {r['children']:>9.3f} {r['leaves']:>8.3f} "
              f"{r['root']:>9.3f} {r['compile_s']:>9.1f} {r['replay_s']:>8.1f}")


if __name__ == "__main__":
    main()
