"""The in-situ figures' own steps: more profiled steps with a range per call and nothing else.

The captured step copies each call's inputs on the device just before the call and runs
cbtrace's hooks around it: the copies read the inputs through the L2 and write as much again,
and the hooks slow the host, so the kernels there run in another cache state, and wait on
another host, than in the user's step. This step runs the same calls with only a
``cbtrace::<fqn>`` range around each (no copies, no gradient hooks, no shapes or stacks
recorded); attribution reads it like the capture trace, and ``cbtrace profile`` compares the
isolated figures with its times (``attribution.join``). Right after the step, still in its trace,
the SM clock the step left is read (``device.sm_clock_mhz``): a call timed alone at a higher
clock reads faster by that much, whatever its cache state (``attribution.miss``).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from cbtrace import module_tree
from cbtrace.capture import boundaries
from cbtrace.capture.recorder import RANGE_ENTER, RANGE_EXIT, export_trace, profiler_activities
from cbtrace.console import quiet_kineto
from cbtrace.device import cupti_torn_down, sm_clock_mhz
from cbtrace.rundir.layout import PLAIN_TRACE


def ranged_calls(model, fqns: list[str]) -> list:
    """Hooks opening a ``cbtrace::<fqn>`` range around each call of the modules ``fqns``
    (a checkpoint's recomputation in the backward gets none); returns the handles. A module
    reached by several paths of the model (shared, whether or not all were captured) gets none:
    which path a call took is capture's to say, and its calls keep the captured step's
    figures."""
    open_ranges: list = []

    def hooks(fqn):
        def pre(mod, args, kwargs):
            if not boundaries.in_backward():
                open_ranges.append(RANGE_ENTER(f"cbtrace::{fqn}", None))

        def post(mod, args, kwargs, out):
            if not boundaries.in_backward() and open_ranges:
                RANGE_EXIT(open_ranges.pop())
        return pre, post

    paths = Counter(id(m) for _, m in module_tree.named_modules(model, remove_duplicate=False))
    handles = []
    for fqn in dict.fromkeys(fqns):
        m = module_tree.get_submodule(model, fqn)
        if paths[id(m)] == 1:
            handles += boundaries.hook_calls(m, *hooks(fqn),
                                             boundary=boundaries.why_boundary(m) is not None)
    return handles


def plain_trace(model, fqns: list[str], run_step, out: Path, device=None,
                steps: int = 1) -> tuple[Path, float | None]:
    """Run ``run_step`` ``steps`` times under torch.profiler, each in a ``ProfilerStep#N``
    range, with only ranges around the calls of ``fqns``; write the trace as the run's
    ``PLAIN_TRACE``. Each step starts from the gradients the first found (a train step's
    second backward would otherwise add into the first's gradients, as the user's does not
    after zeroing them). Returns its path and the SM clock (MHz) right after the steps on a
    CUDA ``device`` (None elsewhere). The caller keeps the model's state (a StateGuard) and runs
    this after the step is warm."""
    if steps < 1:
        raise ValueError(f"plain_trace: steps must be >= 1, got {steps}")
    handles = ranged_calls(model, fqns)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    clock = None
    try:
        with quiet_kineto(), cupti_torn_down(), \
                torch.profiler.profile(activities=profiler_activities()) as prof:
            with module_tree.eager(model):  # compiled parts eagerly, as the capture ran them
                for n in range(steps):
                    with torch.profiler.record_function(f"ProfilerStep#{n}"):
                        run_step()
                    for p, g in zip(params, grads):
                        if p.grad is not g:
                            p.grad = g
            if device is not None:
                clock = sm_clock_mhz(device)  # queued behind the step's kernels
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    return export_trace(prof, Path(out) / PLAIN_TRACE), clock
