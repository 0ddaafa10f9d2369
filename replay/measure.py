"""Measure one captured call standalone: timing, profiler counts, FLOPs/bytes, peak memory."""
from __future__ import annotations

import contextlib
import time

import torch

from cbtrace.replay.inputs import clone_like, embedding_copies, n_copies, tensor_bytes


def timer_chain(name: str, device: torch.device) -> list[str]:
    """Timers to try in order: the requested one, then fallbacks that work on this device."""
    if device.type != "cuda":
        return [name, "cpu"] if name not in ("auto", "cpu") else ["cpu"]
    return {"auto": ["graph", "events", "cpu"], "graph": ["graph", "events", "cpu"],
            "events": ["events", "cpu"], "cpu": ["cpu"]}.get(name, [name, "events", "cpu"])


def call_context(rec, device_type: str | None = None):
    """Grad mode and autocast as at capture time, on the replay device."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.set_grad_enabled(bool(rec.grad_enabled)))
    if rec.autocast_dtype:
        dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        stack.enter_context(torch.autocast(dev, dtype=getattr(torch, rec.autocast_dtype)))
    return stack


def make_call(module, rec, args, kwargs, device, cfg):
    """call(i) runs the module on input copy i; returns (call, number of copies)."""
    copies = embedding_copies(module, args, kwargs, device)
    if copies is None:
        n = n_copies(tensor_bytes((args, kwargs)), device, cfg.max_copies)
        copies = [(args, kwargs)] + [clone_like((args, kwargs)) for _ in range(n - 1)]
    n = len(copies)

    def call(i: int = 0):
        a, k = copies[i % n]
        with call_context(rec, device.type):
            return module(*a, **k)

    return call, n


def time_call(call, n: int, device, chain: list[str], cfg) -> tuple[object, str | None]:
    """Run the timer chain; returns (Timing, fallback reasons or None)."""
    from cbtrace import registry
    from cbtrace.plugins.backends.base import TimerUnavailable, TimingConfig

    backends = registry.backends()
    # cold: do_bench's convention, one call per graph for its warm-up and run durations
    mode = (dict(budget_s=cfg.cold_budget_s, graph_k=1, warmup_s=cfg.cold_warmup_s,
                 settle_tol=cfg.cold_settle_tol) if cfg.cold
            else dict(budget_s=cfg.budget_s, graph_k=cfg.graph_k))
    tcfg = TimingConfig(min_runs=cfg.min_runs, warmup_runs=cfg.warmup_runs, **mode)
    reasons = []
    for name in chain:
        backend = backends.get(name)
        if backend is None:
            reasons.append(f"{name}: not registered")
            continue
        why = backend.unavailable_reason(device)
        if why:
            reasons.append(f"{name}: {why}")
            continue
        try:
            return backend.measure(call, n, device, tcfg), "; ".join(reasons) or None
        except TimerUnavailable as e:
            reasons.append(f"{name}: {e}")
            if device.type == "cuda":
                torch.cuda.synchronize()
    raise RuntimeError("no timer could measure this call (" + "; ".join(reasons) + ")")


def host_issue_ms(call, n: int, device, reps: int = 10) -> float | None:
    """Host time to enqueue one call on a GPU (no sync inside the timed loop).

    If this exceeds the call's device time the GPU starves in a real step: launch-bound.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    times = []
    for i in range(reps):  # the queue never fills in `reps` calls: no call waits for the device
        t0 = time.perf_counter()
        call(i % n)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize(device)
    return sorted(times)[len(times) // 2] * 1e3  # median: one slow call is the OS, not the module


def count_cost(module, call):
    """FLOPs/bytes of one call with cbtrace's formulas (OpCounter)."""
    from cbtrace.opcount import OpCounter

    params = {id(p): n for n, p in module.named_parameters()}
    with OpCounter(params=params) as oc:
        call(0)
    return oc.cost()


def measure_call(module, rec, args, kwargs, device, cfg, chain) -> dict:
    """All figures of one call as a dict of ModuleRecord fields."""
    from cbtrace.plugins.backends.profiled import profile_call

    t0 = time.perf_counter()
    call, n = make_call(module, rec, args, kwargs, device, cfg)
    timing, fallback = time_call(call, n, device, chain, cfg)
    prof = profile_call(lambda: call(0), device, runs=cfg.profile_runs)
    notes = "; ".join(n for n in (timing.notes, "cold" if cfg.cold else None) if n) or None
    row = dict(status="ok", timer=timing.timer, timer_fallback=fallback, timer_notes=notes,
               isolated_ms=timing.median_ms, isolated_ms_p10=timing.p10_ms,
               isolated_ms_p90=timing.p90_ms, runs=timing.runs,
               kernel_count=prof.kernel_count, device_ms=prof.device_ms, wall_ms=prof.wall_ms,
               launch_overhead_ms=prof.launch_overhead_ms, peak_mem_bytes=prof.peak_mem_bytes,
               peak_mem_source=prof.peak_mem_source, host_ms=host_issue_ms(call, n, device))
    if cfg.count_flops:
        cost = count_cost(module, call)
        row.update(flops=cost.flops, flops_executed=cost.flops_executed, bytes=cost.bytes,
                   unknown_ops=cost.unknown_ops, compute_dtype=cost.compute_dtype)
    row["replay_wall_s"] = time.perf_counter() - t0
    return row
