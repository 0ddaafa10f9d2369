"""Check cbtrace's timers against triton.testing.do_bench on a GPU (run on the H200; < 2 minutes).

    python benchmarks/gpu_timers.py [results.json]

For each case (a tiny LayerNorm+GELU, a medium Linear, an lm_head-sized bf16 GEMM, an EmbeddingBag
with many lookups, and two fwd+bwd calls) it times the call with every timer and with do_bench
(median), and prints timer -> ms, ratio vs do_bench and wall seconds per measurement; then the
profiled-call figures. Variants show the mechanisms: ``events_nospin`` is a bare event pair,
``graph_k1`` one call per graph, ``graph_noflush`` no L2 flush/gap. A failing case or timer
prints its error and the rest go on.
"""
import json
import sys
import time
import traceback

import torch
from torch import nn

# ---- settings ----
N_COPIES = 4          # input copies the calls rotate among (the engine's default)
BUDGET_S = 0.2        # per measurement
DTYPE = torch.bfloat16

from cbtrace.replay.timer.contract import TimingConfig  # noqa: E402
from cbtrace.plugins.backends.cpu import CpuTimer  # noqa: E402
from cbtrace.plugins.backends.events import EventsTimer  # noqa: E402
from cbtrace.plugins.backends.graph import GraphTimer  # noqa: E402
from cbtrace.replay.measure.profiler_pass import profile_call  # noqa: E402

BASE = TimingConfig(budget_s=BUDGET_S)
TIMERS = [  # (label, backend, config)
    ("graph", GraphTimer(), BASE),
    ("events", EventsTimer(), BASE),
    ("cpu_sync", CpuTimer(), BASE),
    ("events_nospin", EventsTimer(), TimingConfig(budget_s=BUDGET_S, spin_min_ms=0, spin_max_ms=0)),
    ("graph_k1", GraphTimer(), TimingConfig(budget_s=BUDGET_S, graph_k=1)),
    ("graph_noflush", GraphTimer(), TimingConfig(budget_s=BUDGET_S, flush_l2=False)),
]


def case_ln_gelu(dev):
    m = nn.Sequential(nn.LayerNorm(768), nn.GELU()).to(dev, DTYPE).eval()
    xs = [torch.randn(4, 256, 768, device=dev, dtype=DTYPE) for _ in range(N_COPIES)]
    return torch.no_grad()(lambda i: m(xs[i]))


def case_linear(dev):
    m = nn.Linear(768, 3072).to(dev, DTYPE).eval()
    xs = [torch.randn(4096, 768, device=dev, dtype=DTYPE) for _ in range(N_COPIES)]
    return torch.no_grad()(lambda i: m(xs[i]))


def case_lm_head(dev):  # (8*1024, 768) @ (768, 50304): 633 GFLOP
    w = torch.randn(50304, 768, device=dev, dtype=DTYPE) * 0.02
    xs = [torch.randn(8 * 1024, 768, device=dev, dtype=DTYPE) for _ in range(N_COPIES)]
    return lambda i: torch.nn.functional.linear(xs[i], w)


def _bag(dev):
    m = nn.EmbeddingBag(1_000_000, 64, mode="sum").to(dev)  # 256 MB fp32 table
    bags, per_bag = 8192, 20
    idx = [torch.randint(0, 1_000_000, (bags * per_bag,), device=dev) for _ in range(N_COPIES)]
    offsets = torch.arange(0, bags * per_bag, per_bag, device=dev)
    return m, idx, offsets


def case_embbag(dev):
    m, idx, offsets = _bag(dev)
    return torch.no_grad()(lambda i: m(idx[i], offsets))


def case_linear_fwd_bwd(dev):  # autograd host time lands inside a bare event pair
    m = nn.Linear(768, 768).to(dev, DTYPE)
    xs = [torch.randn(1024, 768, device=dev, dtype=DTYPE, requires_grad=True)
          for _ in range(N_COPIES)]
    g = torch.randn(1024, 768, device=dev, dtype=DTYPE)
    return lambda i: m(xs[i]).backward(g)


def case_embbag_fwd_bwd(dev):  # graph capture is expected to fail here: a recorded fallback
    m, idx, offsets = _bag(dev)
    g = torch.randn(8192, 64, device=dev)
    return lambda i: m(idx[i], offsets).backward(g)


CASES = [case_ln_gelu, case_linear, case_lm_head, case_embbag, case_linear_fwd_bwd,
         case_embbag_fwd_bwd]


def do_bench_ms(fn):
    from triton.testing import do_bench
    try:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except TypeError:  # older triton: no return_mode
        return float(do_bench(fn, warmup=25, rep=100, quantiles=[0.5])[0])


def short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:140] if lines else ''}"


def header(dev):
    p = torch.cuda.get_device_properties(dev)
    print(f"torch {torch.__version__}  CUDA {torch.version.cuda}  device {p.name}  "
          f"SMs {p.multi_processor_count}  L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MB")
    try:
        import triton
        print(f"triton {triton.__version__}")
    except Exception as e:
        print(f"triton unavailable: {e}")
    try:
        print(f"SM clock now {torch.cuda.clock_rate(dev)} MHz")
    except Exception:
        pass


def run_case(make, dev, out):
    name = make.__name__.removeprefix("case_")
    try:
        call = make(dev)
        call(0)
        torch.cuda.synchronize()
    except Exception as e:
        print(f"{name:<18} SETUP FAILED: {short(e)}")
        return
    ref = None
    t0 = time.perf_counter()
    try:
        ref = do_bench_ms(lambda: call(0))
        out.append(dict(case=name, timer="do_bench", ms=ref, wall_s=time.perf_counter() - t0))
        print(f"{name:<18} {'do_bench':<14} {ref:10.4f} ms {'':>18} {'1.000':>7} "
              f"{time.perf_counter() - t0:6.2f} s")
    except Exception as e:
        print(f"{name:<18} {'do_bench':<14} FAILED {short(e)}")
    for label, timer, cfg in TIMERS:
        t0 = time.perf_counter()
        try:
            t = timer.measure(call, N_COPIES, dev, cfg)
        except Exception as e:
            print(f"{name:<18} {label:<14} FAILED {short(e)}")
            out.append(dict(case=name, timer=label, error=str(e)[:300]))
            torch.cuda.synchronize()
            continue
        wall = time.perf_counter() - t0
        ratio = f"{t.median_ms / ref:7.3f}" if ref else "    n/a"
        print(f"{name:<18} {label:<14} {t.median_ms:10.4f} ms  p10 {t.p10_ms:8.4f} "
              f"p90 {t.p90_ms:8.4f} {ratio} {wall:6.2f} s  n={t.runs} {t.notes or ''}")
        out.append(dict(case=name, timer=label, ms=t.median_ms, p10=t.p10_ms, p90=t.p90_ms,
                        runs=t.runs, ratio=(t.median_ms / ref if ref else None), wall_s=wall,
                        notes=t.notes))
    try:
        t0 = time.perf_counter()
        s = profile_call(lambda: call(0), dev)
        print(f"{name:<18} profiled: kernels {s.kernel_count} device {s.device_ms:.4f} ms wall "
              f"{s.wall_ms:.4f} ms launch {s.launch_overhead_ms:.4f} ms peak "
              f"{s.peak_mem_bytes / 2**20:.1f} MiB ({s.peak_mem_source}) ops {s.op_count} "
              f"[{time.perf_counter() - t0:.2f} s]")
        out.append(dict(case=name, timer="profiled", **vars(s)))
    except Exception as e:
        print(f"{name:<18} profiled FAILED {short(e)}")


def main():
    if not torch.cuda.is_available():
        sys.exit("gpu_timers.py needs a CUDA device")
    dev = torch.device("cuda")
    header(dev)
    print(f"{'case':<18} {'timer':<14} {'median':>13} {'':>18} {'ratio':>7} {'wall':>8}")
    out, t_all = [], time.perf_counter()
    for make in CASES:
        try:
            run_case(make, dev, out)
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t_all:.1f} s")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
