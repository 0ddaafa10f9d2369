"""Capture a model built from a provider spec: the library side of ``cbtrace capture``."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from cbtrace import module_tree
from cbtrace.capture.host_times import host_times
from cbtrace.capture.plain_step import plain_trace
from cbtrace.capture.recorder import CaptureConfig, capture
from cbtrace.console import announce
from cbtrace.cost.dtypes import CLI_DTYPES, torch_dtype
from cbtrace.device import one_thread, resolve_device, steps_ms, waited_off_cpu
from cbtrace.errors import CaptureError, CbtraceError, ProviderError, one_line
from cbtrace.global_state import GlobalSettings
from cbtrace.model.spec import resolve
from cbtrace.nested import flat_tensors
from cbtrace.rundir.layout import prepare_new_run
from cbtrace.rundir.lock import RunLock
from cbtrace.rundir.read import read_manifest
from cbtrace.rundir.writer import write_manifest, write_stage
from cbtrace.schema.manifest import ModelSource, StepSettings
from cbtrace.state import StateGuard


def stored_spec(spec: str) -> str:
    """The spec as the manifest keeps it: a file.py:fn path made absolute, so replay from
    another directory rebuilds the same model."""
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    return spec


def backward_of(output):
    """A scalar to call backward() on: the loss if the model returns one, else a mean."""
    ts = [t for t in flat_tensors(output) if t.requires_grad and t.is_floating_point()]
    if not ts:
        raise CaptureError("the model output has no tensor that requires grad", param="step",
                           value="train")
    scalar = [t for t in ts if t.dim() == 0]
    return scalar[-1] if scalar else ts[0].float().mean()


def run_step(provider, model, batch, step: str):
    out = provider.run(model, batch)
    if step == "train":
        backward_of(out).backward()
    return out


def warm_up(provider, model, batch, step: str, n: int, guard) -> None:
    """Run ``n`` uncaptured steps (lazy init, autotuning); ``guard`` (a StateGuard of the
    model) leaves its state as it was."""
    if n <= 0:
        return
    with guard.call():
        for _ in range(n):
            run_step(provider, model, batch, step)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# Plain steps profiled, by whether the device is a GPU: a call's in-situ figure is its median
# over them. One step's kernel times of a call are one sample, which the step-to-step spread of
# a short or memory-bound kernel moves by more than the figures' bar.
PLAIN_STEPS = {True: 5, False: 3}


def _plain_step(model, fqns: list[str], step, out: Path, device, guard):
    """``plain_trace`` of ``step``, the model's state kept by ``guard``. On a CPU whose steps
    waited off the CPU for most of their wall time (a busy machine: each parallel op waits for a
    worker thread that is not running), once more on one intra-op thread, as the CPU timer and
    the host times then run: the second trace replaces the first."""
    steps = PLAIN_STEPS[device.type == "cuda"]
    if device.type == "cuda":
        with guard.call():
            return plain_trace(model, fqns, step, out, device, steps=steps)
    w0, c0 = time.perf_counter(), time.thread_time()
    with guard.call():
        got = plain_trace(model, fqns, step, out, steps=steps)
    if torch.get_num_threads() == 1 or not waited_off_cpu(
            (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3):
        return got
    with one_thread(), guard.call():
        return plain_trace(model, fqns, step, out, steps=steps)


# Windows of the step's forward repeated as the user runs it (``insitu_step_ms``), by whether
# the device is a GPU: a host-bound forward's window there now and then takes half as long again
# (a host stall, neither a collection nor the allocator: probes/probe_root_window.py), so the
# median is taken over more windows than one or two such can move. A CPU's windows are its
# forward's own time, seconds at real sizes.
STEP_WINDOWS = {True: dict(repeats=9, warmup=3), False: dict(repeats=3, warmup=1)}


@GlobalSettings()  # the provider's seeding, warm-up and step: the caller's RNG back
def capture_model(spec: str, out: Path, *, device: str | None = None, dtype: str | None = None,
                  step: str = "forward", warmup: int = 1, seed: int = 0,
                  options: dict | None = None, **capture_options) -> capture:
    """Build the provider's model and batch, warm up, capture one step into ``out``; time each
    forward call's host time in unprofiled repeats of the forward (the CPU in-situ times; on a
    GPU, host issue times); of a step with one root, time its forward as the user runs it, in a
    loop (``insitu_step_ms``; of a train step with grad, its activations freed each time as a
    training loop's are); on a GPU, profile more steps with only a range per call, the
    in-situ times' steps (``plain_step``; each call's median over them).

    Returns the capture (``cap.out``: the run; ``cap.model``: the model, its parameters,
    buffers, gradients and RNG state as they were when the run's state digest was taken, so
    it replays the run as a model rebuilt from the spec would)."""
    device = resolve_device(device)
    if dtype is not None and dtype not in CLI_DTYPES:
        raise CaptureError(f"expected one of {', '.join(CLI_DTYPES)}", param="dtype", value=dtype)
    depth = capture_options.get("max_depth")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise CaptureError("expected 0 (the root only) or more", param="max_depth", value=depth)
    if Path(out).exists() and any(Path(out).iterdir()):  # before minutes of model building
        prepare_new_run(out)
    spec = stored_spec(spec)
    options = dict(options or {})
    provider = resolve(spec, seed=seed, options=options)
    try:
        model, batch = provider.model_and_batch(device, torch_dtype(dtype) if dtype else None)
        model.train(step == "train")
        guard = StateGuard(model)  # warm-up and the captured step undone (a step may update
        warm_up(provider, model, batch, step, warmup, guard)  # buffers, a train step .grad)
    except CbtraceError:
        raise
    except torch.OutOfMemoryError as e:
        raise CaptureError(f"{spec}: out of memory building or warming up the model "
                           f"({one_line(e, with_type=False)})") from None
    except Exception as e:  # the user's model or options: one line, naming the spec
        raise ProviderError(f"{spec}: failed to build or run the model "
                            f"({one_line(e)})") from e
    cls = type(module_tree.unwrap(model))
    source = ModelSource(model_class=f"{cls.__module__}.{cls.__qualname__}", spec=spec,
                         options=options, seed=seed)
    settings = StepSettings(device=str(device), dtype=dtype, step=step, warmup=warmup)
    Path(out).mkdir(parents=True, exist_ok=True)
    with RunLock(out, "capture"):  # one writer from the step through the host times
        with guard.call(), capture(model, out, config=CaptureConfig(**capture_options),
                                   source=source, step=settings) as cap:
            run_step(provider, model, batch, step)
        if not cap.records:
            raise CaptureError(f"{cap.out}: no module call matched --include/--exclude/"
                               "--max-depth (the run directory holds only the trace)")
        if device.type == "cuda":
            torch.cuda.synchronize()
        # the forward's calls, hooked lightly (a backward's are not timed)
        times = host_times(model, cap.records, lambda: provider.run(model, batch),
                           one_thread_retry=device.type == "cpu")
        by_call: dict[int, dict] = {c: {"insitu_host_ms": ms} for c, ms in (times or {}).items()}
        roots = [r for r in cap.records if r.parent_call_id == -1]
        if len(roots) == 1:  # one root: the step's forward is its call
            try:  # as the user runs it, in a loop: one step from an idle device read
                with guard.call():  # BERT-base's host-bound step 23 % slow
                    ms = steps_ms(lambda: provider.run(model, batch), device,
                                  k=5, **STEP_WINDOWS[device.type == "cuda"])
                by_call.setdefault(roots[0].call_id, {})["insitu_step_ms"] = ms
            except Exception as e:  # noqa: BLE001 - the capture stands without this figure
                announce(f"{cap.out}: the plain repeat of the step failed ({one_line(e)}); "
                         "its root is compared with the captured step")
        plain = clock = None
        # the in-situ times' step: no input copies, no hooks but a range per call. On a CPU the
        # forward's come from the host times above; a train step's backward comes from here
        if (device.type == "cuda" or step == "train") and cap.trace_path is not None:
            try:
                plain, clock = _plain_step(model, [r.fqn for r in cap.records],
                                           lambda: run_step(provider, model, batch, step),
                                           cap.out, device, guard)
                if clock is not None:
                    for r in cap.records:
                        by_call.setdefault(r.call_id, {})["step_clock_mhz"] = clock
            except Exception as e:  # noqa: BLE001 - the capture trace's times stand instead
                announce(f"{cap.out}: the plain profiled step failed ({one_line(e)}); in-situ "
                         "times come from the captured step")
        if by_call:
            write_stage(cap.out, "host_insitu", by_call)
        elif plain is not None:
            write_manifest(cap.out, read_manifest(cap.out))
    return cap
