"""Why compiling a submodule in place saves less than its replayed figures say (issue 31):
the host cost of a compiled call inside a step against the same call back to back.

For a few modules of a model (default: NanoGPT tiny on the CPU), prints per module:
- back to back: host µs of one call, eager and compiled, each call right after the last
  (how ``steady_issue_ms`` and ``HostIssue`` measure);
- cold: the same with a 64 MB write before each call (the CPU's caches evicted, as the rest of
  a step evicts them);
- after a step: the same with a whole eager step run before each call (the caches as a step
  leaves them);
- in the step: what the whole step gains in ms when the module is compiled in place (median of
  windows of steps, eager and compiled in turn; > 0 is a saving).

``--gc-off``: Python's garbage collector off during each window (collected before it), to see
whether its pauses make the step's time drift between windows.

Usage: python benchmarks/probes/probe_inplace_host.py [--spec nanogpt:tiny] [--device cpu]
       [--gc-off]
"""
import argparse
import gc
import statistics
import time

import numpy as np
import torch


def per_call_us(fn, args, before=None, n=300):
    out = []
    with torch.no_grad():
        for _ in range(20):
            fn(*args)
        for _ in range(n):
            if before is not None:
                before()
            t = time.perf_counter()
            fn(*args)
            out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="nanogpt:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modules",
                    default="transformer.drop,transformer.ln_f,transformer.h.0.mlp,transformer.h.0")
    ap.add_argument("--windows", type=int, default=15)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--gc-off", action="store_true")
    a = ap.parse_args()
    from cbtrace.device import window_ms
    from cbtrace.model.spec import resolve
    from cbtrace.replay.modes.opportunity import compiled_in_place

    p = resolve(a.spec)
    model, batch = p.model_and_batch(a.device)
    model.eval()
    seen = {}

    def grab(name):
        def hook(m, args, kwargs):
            seen.setdefault(name, (args, kwargs))
        return hook

    handles = [model.get_submodule(f).register_forward_pre_hook(grab(f), with_kwargs=True)
               for f in a.modules.split(",")]
    with torch.no_grad():
        p.run(model, batch)
    for h in handles:
        h.remove()
    sink = np.zeros(64 << 20, dtype=np.uint8)

    def evict():
        sink[:] = 1

    def run_step(m):
        with torch.no_grad():
            return p.run(m, batch)

    print(f"{a.spec} on {a.device}, torch {torch.__version__}, {torch.get_num_threads()} threads"
          f"{', GC off in the windows' if a.gc_off else ''}; host us per call, step ms")
    print(f"{'module':22} {'eager b2b':>9} {'comp b2b':>9} {'eager cold':>10} {'comp cold':>10}"
          f" {'eager step':>10} {'comp step':>10}"
          f" {'step saving (median of pairs)':>30} {'eager step p10..p90':>20}")
    for fqn, (args, kwargs) in seen.items():
        mod = model.get_submodule(fqn)
        comp = torch.compile(mod)
        call_e = lambda *x: mod(*x, **kwargs)  # noqa: E731
        call_c = lambda *x: comp(*x, **kwargs)  # noqa: E731
        row = [per_call_us(call_e, args), per_call_us(call_c, args),
               per_call_us(call_e, args, evict), per_call_us(call_c, args, evict),
               per_call_us(call_e, args, lambda: run_step(model)),
               per_call_us(call_c, args, lambda: run_step(model))]
        torch._dynamo.reset()
        with compiled_in_place(model, fqn) as (eager, compiled):
            run_step(compiled())
            for _ in range(3):
                run_step(eager())
                run_step(compiled())
            diffs, eagers = [], []

            def window(step):
                if a.gc_off:
                    gc.collect()
                    gc.disable()
                try:
                    return window_ms(step, a.device, a.k)
                finally:
                    gc.enable()

            for _ in range(a.windows):
                e = window(lambda: run_step(eager()))
                c = window(lambda: run_step(compiled()))
                diffs.append(e - c)
                eagers.append(e)
        q = statistics.quantiles(eagers, n=10)
        print(f"{fqn:22} {row[0]:9.1f} {row[1]:9.1f} {row[2]:10.1f} {row[3]:10.1f} "
              f"{row[4]:10.1f} {row[5]:10.1f} "
              f"{statistics.median(diffs):+30.3f} {f'{q[0]:.3f}..{q[-1]:.3f}':>20}")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
