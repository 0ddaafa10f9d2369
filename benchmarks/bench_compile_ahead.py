"""Issue 31, item 2: the compile mode's wall with and without compiling ahead in worker processes
(``ReplayConfig.compile_workers``, ``replay/modes/precompile.py``), side by side on one run.

Captures the model once from its spec (a worker rebuilds it from there), then replays it with
``--modes`` once per worker count, each in a fresh process with an empty inductor cache of its
own (nothing compiled before, in memory or on disk), and prints per variant: the replay's
wall, the compile-ahead phase, the loop's own compiling (sum of ``compile_s``), inductor's FX
graph cache hits and misses in the loop, the statuses, and how the compiled figures compare
with the first variant's (median ratio of ``compile_ms``, call by call: workers only warm
caches, so the loop should measure the same compiled calls). Usage:

    python benchmarks/bench_compile_ahead.py --model efficientnet_b0 --workers 0,4,8   # H200
    python benchmarks/bench_compile_ahead.py --model cnn --device cpu --workers 0,2
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ZOO = str(Path(__file__).resolve().parent / "zoo.py")
# name -> (spec, options, capture depth); real sizes on a GPU, tiny on a CPU
MODELS = {
    "efficientnet_b0": (f"{ZOO}:timm_efficientnet_b0", {"size": "real"}, {"size": "tiny"}),
    "resnet50": (f"{ZOO}:tv_resnet50", {"size": "real"}, {"size": "tiny"}),
    "nanogpt": ("nanogpt", {"batch_size": 8}, None),
    "cnn": (f"{ZOO}:cnn", {"size": "real"}, {"size": "tiny"}),
}
REPLAY = dict(budget_s=0.03, timeout_s=300.0, progress=False)


def variant(run: Path, device: str, modes: tuple, workers: int) -> dict:
    """One replay (in this process, which the parent started with a fresh inductor cache)."""
    import cbtrace
    from cbtrace.rundir.read import read_manifest
    from torch._dynamo.utils import counters

    t0 = time.perf_counter()
    df = cbtrace.replay(run, device=device, modes=modes, compile_workers=workers, **REPLAY)
    wall = time.perf_counter() - t0
    info = read_manifest(run).replay
    return {"workers": workers, "wall_s": wall,
            "ahead_s": info.outside_s.get("compile_ahead", 0.0), "ahead": info.compile_ahead,
            # where the rest of the wall went: the loop's steps (time, profile, compile,
            # cudagraph, ...) and the phases outside it, seconds each
            "phases": {**{f"loop.{k}": v for k, v in info.timings_s.items()},
                       **{f"outside.{k}": v for k, v in info.outside_s.items()}},
            "loop_compile_s": float(df["compile_s"].sum()),
            "graphs": int((df["compile_graphs"] > 0).sum()),
            "fx_hits": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
            "fx_misses": int(counters["inductor"].get("fxgraph_cache_miss", 0)),
            # AOTAutograd's own cache: on a miss it traces the graph again before the FX lookup
            "aot_hits": int(counters["aot_autograd"].get("autograd_cache_hit", 0)),
            "aot_misses": int(counters["aot_autograd"].get("autograd_cache_miss", 0)),
            "status": {m: df[f"{m}_status"].fillna("-").str.split(":").str[0]
                       .value_counts().to_dict() for m in modes},
            "compile_ms": {str(k): v for k, v in
                           df.set_index("call_id")["compile_ms"].dropna().items()},
            # the modules whose compile made a graph in the loop, with their profiled kernels
            "loop_graphs": [[f if isinstance(f, str) else "", t, int(k) if k == k else -1]
                            for f, t, k in df.loc[df["compile_graphs"] > 0,
                                                  ["fqn", "module_type", "kernel_count"]]
                            .itertuples(index=False)]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", help=f"one of {', '.join(MODELS)}, or a spec")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, help="bf16, fp16 (default: bf16 on cuda)")
    p.add_argument("--modes", default="compile,cudagraph")
    p.add_argument("--workers", default="0,4,8", help="worker counts, comma-separated")
    p.add_argument("--out", type=Path, default=None, help="where runs and caches go")
    p.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--run", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m and m != "eager")
    if a.device == "cpu":
        modes = tuple(m for m in modes if m != "cudagraph")
    if a.variant is not None:  # the child: one replay, its figures on the last line
        print(json.dumps(variant(a.run, a.device, modes, a.variant)), flush=True)
        return

    from cbtrace.capture.from_spec import capture_model

    spec, gpu_options, cpu_options = MODELS.get(a.model, (a.model, {}, {}))
    options = gpu_options if a.device == "cuda" else (cpu_options or gpu_options)
    dtype = a.dtype or ("bf16" if a.device == "cuda" else None)
    out = a.out or Path(tempfile.mkdtemp(prefix="bench_compile_ahead_"))
    run = out / "run"
    t0 = time.perf_counter()
    # with its trace, as a user's run: the workers pick the leaves to compile from its kernels
    cap = capture_model(spec, run, device=a.device, dtype=dtype, options=options)
    ahead = ahead_modules(run, cap.model, a.device, modes)
    print(f"=== {a.model} on {a.device} ({dtype or 'fp32'}), modes {','.join(modes)}; captured "
          f"in {time.perf_counter() - t0:.1f} s; each variant a fresh process and inductor cache",
          flush=True)
    rows = []
    for w in (int(x) for x in a.workers.split(",")):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(out / f"inductor_{w}"),
                   TRITON_CACHE_DIR=str(out / f"triton_{w}"))
        p2 = subprocess.run([sys.executable, __file__, "--variant", str(w), "--run", str(run),
                             "--device", a.device, "--modes", ",".join(modes)],
                            env=env, capture_output=True, text=True)
        last = (p2.stdout.strip().splitlines() or [""])[-1]
        try:
            rows.append(json.loads(last))
        except ValueError:
            print(f"workers={w}: failed (exit {p2.returncode}): "
                  f"{(p2.stderr.strip().splitlines() or [''])[-1][:300]}")
            continue
        r = rows[-1]
        print(f"workers={w}: wall {r['wall_s']:.1f} s; {r['ahead'] or 'no compile ahead'}",
              flush=True)
    if not rows:
        raise SystemExit("no variant ran")
    base = rows[0]["compile_ms"]
    print(f"\n{'workers':>7} {'wall_s':>7} {'ahead_s':>7} {'loop_compile_s':>14} {'graphs':>6} "
          f"{'fx_hit':>6} {'fx_miss':>7} {'aot_hit':>7} {'aot_miss':>8} {'compile_ms/first':>16}"
          "  status")
    for r in rows:
        ratios = sorted(r["compile_ms"][k] / base[k] for k in r["compile_ms"]
                        if k in base and base[k] > 0)
        med = f"{ratios[len(ratios) // 2]:.3f} ({len(ratios)})" if ratios else "-"
        print(f"{r['workers']:>7} {r['wall_s']:>7.1f} {r['ahead_s']:>7.1f} "
              f"{r['loop_compile_s']:>14.1f} {r['graphs']:>6} {r['fx_hits']:>6} "
              f"{r['fx_misses']:>7} {r['aot_hits']:>7} {r['aot_misses']:>8} {med:>16}  "
              f"{r['status']}")
    names = sorted({k for r in rows for k in r["phases"]})
    print("\nphases, s: " + " ".join(f"{'workers=' + str(r['workers']):>12}" for r in rows))
    for k in names:
        if any(r["phases"].get(k, 0.0) >= 0.05 for r in rows):
            print(f"  {k:28}" + " ".join(f"{r['phases'].get(k, 0.0):>12.1f}" for r in rows))
    print("\nmodules whose compile made a graph in the loop, compiled ahead or not (the workers' "
          "choice for this run):")
    for r in rows:
        made = r["loop_graphs"]
        missed = [(t, k) for f, t, k in made if f not in ahead]
        kinds = collections.Counter(f"{t} ({k} kernels)" for t, k in missed)
        print(f"  workers={r['workers']}: {len(made)} modules, {len(made) - len(missed)} among "
              f"the {len(ahead)} compiled ahead; not ahead: {dict(kinds.most_common(8))}")


def ahead_modules(run: Path, model, device: str, modes: tuple) -> set:
    """The fqns whose calls the workers compile ahead for this run (precompile.candidates,
    the leaves chosen by their kernels in the step's trace, as compile_ahead does)."""
    import torch

    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.modes.precompile import candidates, kernels_in_step
    from cbtrace.rundir.read import load_run
    from cbtrace.schema.modules import frame_to_records

    manifest, df = load_run(run)
    records = frame_to_records(df)
    dev = torch.device(device)
    kernels = kernels_in_step(run, manifest, records) if dev.type == "cuda" else None
    groups = candidates(records, model, ReplayConfig(modes=modes), dev, kernels)
    return {r.fqn for g in groups for r in g}


if __name__ == "__main__":
    main()
