"""A call's measurement as a plan: a list of steps run in order on one prepared call.

    plan = default_plan(cfg, device, backends)  # [OpCount, ProfilerPass, Timed, HostIssue, ...]
    row = measure_call(module, rec, args, kwargs, device, cfg, plan)

Each step returns the ModuleRecord fields it measures; the row is their union plus
``status`` and ``replay_wall_s``. Modes and directions are further steps, not branches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Protocol

from cbtrace.replay.timer import choice
from cbtrace.replay.measure.prepare import CallUnderTest, prepare
from cbtrace.replay.measure.reuse import ProfileCache
from cbtrace.replay.measure.steps import HostIssue, OpCount, OutputCheck, ProfilerPass, Timed
from cbtrace.replay.modes.backward import BackwardStep
from cbtrace.replay.modes.compile_cudagraph import AsInStep, Compiled, mode_steps, stance


class Step(Protocol):
    name: str

    def run(self, call: CallUnderTest) -> dict: ...


def default_plan(cfg, device, backends: dict) -> list[Step]:
    """FLOPs/bytes, profile (once per kind of work), time (the timer chain of ``cfg.timer``),
    host issue time, a look at the outputs (NaN/Inf); then the other modes and the backward
    when asked for."""
    chain = choice.chain(cfg.timer, device, backends)
    # FLOPs first: a call of the same work as one profiled before reuses its profiled pass;
    # the pass's device time then sizes the graph timer's K without a trial capture
    reuse = cfg.count_flops and cfg.reuse_counts
    steps: list[Step] = [OpCount(reuse)] if cfg.count_flops else []
    steps += [ProfilerPass(cfg.profile_runs, ProfileCache() if reuse else None,
                           cfg.profile_as_timed),
              Timed(chain, backends, cfg), HostIssue(cfg.host_runs), OutputCheck()]
    compiled = None
    if not cfg.eager_only:  # a call the step ran compiled: timed compiled (modes/)
        compiled = Compiled(cfg, chain, backends)
        steps.append(AsInStep(compiled))
    if cfg.modes:  # the same call compiled / from a CUDA graph (modes/)
        steps += mode_steps(cfg, device, chain, backends, compiled)
    if cfg.backward:  # its backward on the output gradients (modes/backward.py)
        steps.append(BackwardStep(cfg, chain, backends))
    return steps


def time_plan(cfg, device, backends: dict, plan: list[Step]) -> list[Step]:
    """The time steps of ``plan`` alone, every call timed (no ``reuse_timing``): a call timed
    again (``ReplayLoop._time_again``). A call the step ran compiled is timed compiled again,
    through ``plan``'s own compiled entries (``AsInStep``): its two windows are alike."""
    cfg = dataclasses.replace(cfg, reuse_timing=False)
    return [Timed(choice.chain(cfg.timer, device, backends), backends, cfg),
            *[s for s in plan if isinstance(s, AsInStep)]]


def measure_call(module, rec, args, kwargs, device, cfg, plan: list[Step], grads=None,
                 timings: dict | None = None, context=None) -> dict:
    """All figures of one call as a dict of ModuleRecord fields; ``timings`` (step name ->
    seconds) accumulates where the time went. ``context``: the calls timers run before it
    (``replay.measure.context``)."""
    t0 = time.perf_counter()
    call = prepare(module, rec, args, kwargs, device, cfg, grads)
    call.context = context  # the Timed step sets it up once the call's device time is known
    row = call.row
    row["status"] = "ok"
    timings = {} if timings is None else timings
    timings["prepare"] = timings.get("prepare", 0.0) + time.perf_counter() - t0
    # the eager figures of a call the step ran compiled, or of any call with --eager-only: its
    # compiled parts run eagerly (the compile steps time it compiled under the default stance)
    eager = rec.step_compiled or cfg.eager_only
    with stance("force_eager") if eager else contextlib.nullcontext():
        for step in plan:
            t1 = time.perf_counter()
            row.update(step.run(call))
            timings[step.name] = timings.get(step.name, 0.0) + time.perf_counter() - t1
    row["replay_wall_s"] = time.perf_counter() - t0
    return row
