"""What each call would save a step in its fastest mode: eager_step_ms, best_mode, speedup and
opportunity_ms (replay/derive.py's finalize calls ``add_opportunities``).

A call's cost on its own is the larger of its device time and the host time to issue it
(``step_ms``): eager ``max(isolated_ms, host_ms)``; compiled ``max(compile_ms,
compile_host_ms)``; graphed ``cudagraph_ms`` (its launch inside). On a CPU host_ms is None and
isolated_ms is wall time.

Inside a step the host runs ahead of the device, so the step costs max(device total, host
total) and a call's saving is what that maximum loses (``in_step_saving_ms``): device time saved
counts while the device bounds the step, host time saved while the host does. The step's totals
are the root call's (its isolated and host time); a graph replay's host cost is taken as its
launch-included time (an upper bound). The best mode saves the step most (eager on ties);
speedup is the call's own eager / best cost. A module's calls add up to its saving per step; a
parent's saving contains its children's, so savings of different levels overlap.

``verify_in_place`` checks the estimate: each chosen module compiled in place inside the full
model, the whole step measured with and without it (benchmarks/bench_opportunity.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time

from cbtrace.cost.metrics import step_ms


def _num(v) -> float | None:
    """A float, or None for missing and NaN (what parquet's nulls read as)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def best_of(eager_ms: float, modes: dict) -> tuple[str, float]:
    """(name, ms) of the fastest of eager and ``modes`` (name -> ms or None); eager wins ties."""
    best = ("eager", eager_ms)
    for name, ms in modes.items():
        if ms is not None and ms < best[1]:
            best = (name, ms)
    return best


def mode_costs(rec) -> dict:
    """name -> step cost (ms) of each mode measured ok for a record (or a row dict)."""
    get = rec.get if isinstance(rec, dict) else lambda k: getattr(rec, k, None)
    out = {}
    if get("compile_status") == "ok":
        out["compile"] = step_ms(get("compile_ms"), get("compile_host_ms"))
    if get("cudagraph_status") == "ok":
        out["cudagraph"] = _num(get("cudagraph_ms"))
    return {k: v for k, v in out.items() if v is not None}


def opportunity(eager_ms, modes: dict) -> tuple[str, float | None, float] | None:
    """(best mode, speedup, opportunity ms) of one call on its own; None without an eager
    figure."""
    eager_ms = _num(eager_ms)
    if eager_ms is None:
        return None
    name, ms = best_of(eager_ms, modes)
    return name, (eager_ms / ms if ms > 0 else None), eager_ms - ms


def mode_figures(rec) -> dict:
    """name -> (device ms, host ms or None) of each mode measured ok for a record (or a row)."""
    get = rec.get if isinstance(rec, dict) else lambda k: getattr(rec, k, None)
    out = {}
    if get("compile_status") == "ok" and _num(get("compile_ms")) is not None:
        out["compile"] = (_num(get("compile_ms")), _num(get("compile_host_ms")))
    if get("cudagraph_status") == "ok" and _num(get("cudagraph_ms")) is not None:
        out["cudagraph"] = (_num(get("cudagraph_ms")),) * 2  # launch included: host bound
    return out


def step_totals(rows) -> tuple[float | None, float | None]:
    """(device ms, host ms) of the step: the ok root calls' isolated and host time summed;
    host None where a root has none (a CPU), both None without an ok root."""
    get = [r.get if isinstance(r, dict) else (lambda k, r=r: getattr(r, k, None)) for r in rows]
    ids = {g("call_id") for g in get}
    roots = [g for g in get if g("parent_call_id") not in ids and g("status") == "ok"
             and _num(g("isolated_ms")) is not None]
    if not roots:
        return None, None
    hosts = [_num(g("host_ms")) for g in roots]
    return (sum(_num(g("isolated_ms")) for g in roots),
            None if None in hosts else sum(hosts))


def call_savings(rec, step_d, step_h) -> dict:
    """mode -> what this call in that mode saves the step (ms)."""
    d_e, h_e = _num(rec.isolated_ms), _num(rec.host_ms)
    out = {}
    for name, (d, h) in mode_figures(rec).items():
        if step_d is None:  # no step to place the call in: its own cost
            out[name] = step_ms(d_e, h_e) - step_ms(d, h)
            continue
        dh = None if h_e is None or h is None else h_e - h
        out[name] = in_step_saving_ms(step_d, step_h if dh is not None else None, d_e - d, dh)
    return out


def add_opportunities(records) -> None:
    """Fill eager_step_ms of every ok record, and best_mode, speedup and opportunity_ms of those
    replayed in another mode (compile or cudagraph status set and not skipped), in place."""
    step_d, step_h = step_totals(records)
    for rec in records:
        if rec.status != "ok":
            continue
        rec.eager_step_ms = step_ms(rec.isolated_ms, rec.host_ms)
        if not any(s is not None and not s.startswith("skipped")
                   for s in (rec.compile_status, rec.cudagraph_status)):
            continue  # no other mode tried (not asked for, or past --modes-budget-s)
        if rec.eager_step_ms is None:
            continue
        saved = call_savings(rec, step_d, step_h)
        best = max(saved, key=lambda m: saved[m], default=None)
        if best is None or saved[best] <= 0:
            rec.best_mode, rec.speedup, rec.opportunity_ms = "eager", 1.0, 0.0
            continue
        cost = step_ms(*mode_figures(rec)[best])
        rec.best_mode, rec.opportunity_ms = best, saved[best]
        rec.speedup = rec.eager_step_ms / cost if cost > 0 else None


# ---------------------------------------------------------------- the estimate against the step


def in_step_saving_ms(step_device_ms, step_host_ms, device_saved_ms, host_saved_ms=None):
    """What a step saves when some of its calls get faster: the step's host runs ahead of its
    device, so it costs max(device total, host total), and a saving of host time counts only
    where the host bounds the step. None without the step's device time."""
    d, h = _num(step_device_ms), _num(step_host_ms)
    dd, dh = _num(device_saved_ms) or 0.0, _num(host_saved_ms) or 0.0
    if d is None:
        return None
    if h is None:  # a CPU: the wall time is the cost
        return dd
    return max(d, h) - max(d - dd, h - dh)


def compile_estimates(rows: list[dict]) -> dict[str, float]:
    """fqn -> what compiling that module in place would save per step, from a replay's rows:
    its calls' device and host time saved, placed in the step (``in_step_saving_ms``); only
    modules whose every call compiled ok."""
    step_d, step_h = step_totals(rows)
    by_fqn: dict[str, list[dict]] = {}
    for r in rows:
        by_fqn.setdefault(r.get("fqn") or "", []).append(r)
    out = {}
    for fqn, calls in by_fqn.items():
        figs = [mode_figures(c).get("compile") for c in calls]
        eager = [_num(c.get("isolated_ms")) for c in calls]
        if None in figs or None in eager:
            continue
        dd = sum(eager) - sum(d for d, _ in figs)
        h_eager, h_comp = [_num(c.get("host_ms")) for c in calls], [h for _, h in figs]
        dh = None if None in h_eager or None in h_comp else sum(h_eager) - sum(h_comp)
        saving = in_step_saving_ms(step_d, step_h if dh is not None else None, dd, dh)
        if saving is not None:
            out[fqn] = saving
    return out


def pick_modules(estimates: dict[str, float], top: int) -> list[str]:
    """The root ("") and the ``top`` other modules with the largest estimated saving."""
    others = sorted((f for f in estimates if f), key=lambda f: -estimates[f])[:top]
    return ([""] if "" in estimates else []) + others


@dataclasses.dataclass
class InPlace:
    """One module compiled in place inside the full model: the step with and without it."""

    fqn: str                    # "" is the root: the whole model compiled
    estimated_ms: float | None  # the replay's estimate of the saving per step
    eager_ms: float | None      # one step, eager (median over windows of K steps back to back)
    compiled_ms: float | None   # one step with this module compiled in place
    compile_s: float | None = None  # the first compiled step (untimed)
    status: str = "ok"          # or "error: ..." (compile or run failed)
    noise_ms: float | None = None  # half the p10..p90 range of the paired windows' savings

    @property
    def measured_ms(self) -> float | None:
        if self.eager_ms is None or self.compiled_ms is None:
            return None
        return self.eager_ms - self.compiled_ms

    @property
    def error_ms(self) -> float | None:
        """Estimated minus measured saving."""
        m = self.measured_ms
        return None if m is None or self.estimated_ms is None else self.estimated_ms - m


def paired_steps_ms(step_a, step_b, device, *, k: int = 20, repeats: int = 5,
                    warmup: int = 3) -> tuple[float, float, float]:
    """(a ms, b ms, noise ms): windows of K steps of a and of b taken in turn, so that a host or
    clock drifting over the measurement moves both (measured one after the other, a GPT-2
    step read 8.5 ms for its first modules and 5.1 ms for its last); the medians, and half
    the p10..p90 range of the per-pair differences."""
    from cbtrace.device import window_ms  # torch on use: --help and report read this module
    for step in (step_a, step_b):
        for _ in range(warmup):
            step()
    _sync(device)
    a, b = [], []
    for _ in range(repeats):
        a.append(window_ms(step_a, device, k))
        b.append(window_ms(step_b, device, k))
    diffs = sorted(x - y for x, y in zip(a, b))
    lo, hi = diffs[int(0.1 * (len(diffs) - 1))], diffs[round(0.9 * (len(diffs) - 1))]
    return statistics.median(a), statistics.median(b), (hi - lo) / 2


def _sync(device) -> None:
    # torch on use: --help and report import this module (reporters/opportunities)
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def compiled_in_place(model, fqn: str, mode: str = "default"):
    """(eager, compiled): each returns the model to run with module ``fqn`` eager, or replaced
    on its parent by ``torch.compile(module)`` (the root: the whole model compiled), so the
    two can be measured in turn; the module put back and dynamo reset on exit."""
    # torch on use: --help and report import this module (reporters/opportunities)
    import torch

    if not fqn:
        whole = torch.compile(model, mode=mode)
        try:
            yield (lambda: model), (lambda: whole)
        finally:
            torch._dynamo.reset()
        return
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    original = getattr(parent, name)
    compiled = torch.compile(original, mode=mode)

    def use(module):
        setattr(parent, name, module)
        return model

    try:
        yield (lambda: use(original)), (lambda: use(compiled))
    finally:
        setattr(parent, name, original)
        torch._dynamo.reset()


def verify_in_place(model, run_step, fqns: list[str], estimates: dict[str, float], device, *,
                    mode: str = "default", k: int = 20, repeats: int = 7) -> list[InPlace]:
    """Per module of ``fqns``: the whole step (``run_step(model)``) eager and with that module
    compiled in place, in alternating windows (``paired_steps_ms``); a module that fails to
    compile or run is a row with its status and the eager step alone."""
    # torch on use: --help and report import this module (reporters/opportunities)
    import torch

    from cbtrace.device import steps_ms
    from cbtrace.replay.modes.compile_cudagraph import one_line

    rows = []
    for fqn in fqns:
        torch._dynamo.reset()
        row = InPlace(fqn, estimates.get(fqn), None, None)
        try:
            with compiled_in_place(model, fqn, mode) as (eager, compiled):
                t0 = time.perf_counter()
                run_step(compiled())
                _sync(device)
                row.compile_s = time.perf_counter() - t0
                row.eager_ms, row.compiled_ms, row.noise_ms = paired_steps_ms(
                    lambda: run_step(eager()), lambda: run_step(compiled()), device, k=k,
                    repeats=repeats)
        except Exception as e:  # noqa: BLE001 - one module failing leaves the others' rows
            row.status, row.compiled_ms, row.noise_ms = f"error: {one_line(e)}", None, None
            row.eager_ms = steps_ms(lambda: run_step(model), device, k=k, repeats=repeats)
        rows.append(row)
    return rows


def verify_spec(spec: str, df, top: int, *, device=None, dtype: str | None = None,
                step: str = "forward", seed: int = 0, options: dict | None = None,
                mode: str = "default", k: int = 20, repeats: int = 7) -> list[InPlace]:
    """``verify_in_place`` for a profiled run: the root and the ``top`` modules by
    ``compile_estimates`` of its modules frame ``df``, in the model of ``spec`` built again
    (same seed, options, dtype and step as the capture)."""
    # torch on use: --help and report import this module (reporters/opportunities)
    from cbtrace.capture.from_spec import run_step
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.device import resolve_device
    from cbtrace.model.spec import resolve

    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    estimates = compile_estimates(rows)
    dev = resolve_device(device)
    provider = resolve(spec, seed=seed, options=dict(options or {}))
    model, batch = provider.model_and_batch(dev, torch_dtype(dtype) if dtype else None)
    model.train(step == "train")
    return verify_in_place(model, lambda m: run_step(provider, m, batch, step),
                           pick_modules(estimates, top), estimates, dev, mode=mode, k=k,
                           repeats=repeats)
