"""What each call would save a step in its fastest mode: eager_step_ms, best_mode, speedup and
opportunity_ms (replay/derive.py's finalize calls ``add_opportunities``).

A call's cost to a step is the larger of its device time and the host time to issue it: a call
whose host issue outlasts its kernels leaves the GPU idle for the difference.

- eager: ``max(isolated_ms, host_ms)`` (host_ms is None on a CPU, where isolated_ms is wall time);
- compile: ``max(compile_ms, compile_host_ms)`` (guards and launches of the compiled call; None
  on a CPU, or where the column is not recorded);
- cudagraph: ``cudagraph_ms`` (the graph's launch is inside it).

The best mode is the fastest of eager and the modes whose status is ok; speedup = eager / best,
opportunity = eager - best. A module's calls add up to its saving per step; a parent's saving
contains its children's, so savings of different levels overlap.
"""
from __future__ import annotations

import math


def _num(v) -> float | None:
    """A float, or None for missing and NaN (what parquet's nulls read as)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def step_ms(device_ms, host_ms=None) -> float | None:
    """What a call costs a step: its device time, or its host issue time if that is longer."""
    device_ms, host_ms = _num(device_ms), _num(host_ms)
    if device_ms is None:
        return None
    return device_ms if host_ms is None else max(device_ms, host_ms)


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
    """(best mode, speedup, opportunity ms) of one call; None without an eager figure."""
    eager_ms = _num(eager_ms)
    if eager_ms is None:
        return None
    name, ms = best_of(eager_ms, modes)
    return name, (eager_ms / ms if ms > 0 else None), eager_ms - ms


def add_opportunities(records) -> None:
    """Fill eager_step_ms of every ok record, and best_mode, speedup and opportunity_ms of those
    replayed in another mode (compile or cudagraph status set and not skipped), in place."""
    for rec in records:
        if rec.status != "ok":
            continue
        rec.eager_step_ms = step_ms(rec.isolated_ms, rec.host_ms)
        if not any(s is not None and not s.startswith("skipped")
                   for s in (rec.compile_status, rec.cudagraph_status)):
            continue  # no other mode tried (not asked for, or past --modes-budget-s)
        found = opportunity(rec.eager_step_ms, mode_costs(rec))
        if found is not None:
            rec.best_mode, rec.speedup, rec.opportunity_ms = found
