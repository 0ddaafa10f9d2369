"""Compile ahead: before the replay's loop, the calls it will compile are compiled in worker
processes, in parallel, so that the loop's own compiles hit inductor's on-disk caches.

    note = compile_ahead(run, manifest, records, model, flags, cfg, device)   # engine.setup

The compile mode (and a call the step ran compiled) compiles each kind of call once
(``compile_cudagraph.EntryCache``), one after another: dynamo traces one frame at a time, and a
330-call CNN spent two minutes compiling on the H200 host. A compile whose FX graph inductor
has compiled before (same graph, input metadata and settings, in any process: its FX graph,
AOTAutograd and Triton caches live on disk) only traces and loads, about a tenth of the time
(``benchmarks/bench_compile_ahead.py``). So each module's first call is handed to one of N
workers (``python -m cbtrace.replay.modes.precompile JOB``), a kind's modules to one worker
(where dynamo's guards pass, the modules after the first cost a run), largest first, each
worker with its own rebuild of the run's model (from the run's spec, as replay would rebuild
it: a run from elsewhere still needs ``trust`` or ``model_spec``); the loop waits for them,
then compiles as before, now mostly from the caches. Nothing else runs on the device while the
workers do: their compiles run the call once, and Triton tunes kernels on the device.

Workers only warm caches: what the loop measures is its own compile, whether the workers
finished, failed or were never started (not asked for: ``compile_workers`` is 0 by default
until an H200 measures it; a live model with no spec to rebuild; a sharded replay; ``auto`` on
a CPU). On a GPU a leaf that ran at most one kernel in the step (the plain step's trace, else
the captured one's) is left out: the compile mode does not compile it (``nothing_to_fuse``);
one that ran more is compiled ahead like a parent (the loop compiles it, and a leaf no worker
compiled misses the cache). Without a trace that shows kernels, no leaf is.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cbtrace import module_tree
from cbtrace.attribution.join import insitu_for_run, plain_trace
from cbtrace.calltree import CallTree
from cbtrace.console import announce
from cbtrace.errors import one_line
from cbtrace.replay.measure.prepare import call_context
from cbtrace.replay.measure.reuse import call_key
from cbtrace.replay.measure.time_limit import time_limit
from cbtrace.replay.modes.compile_cudagraph import (EntryCache, counted_since,
                                                    dynamo_counters, stance)
from cbtrace.replay.run_io.rebuild import TrainingFlags, rebuild_model, refusal
from cbtrace.rundir.read import load_run
from cbtrace.schema.modules import COPY_FAILED, frame_to_records
from cbtrace.store import load

MAX_WORKERS = 8
WORKER_HOST_BYTES = 1 << 30  # what a worker's CUDA context and inductor take beside the model


@dataclass
class Job:
    """One worker's share, as written to its job file."""

    run: str
    device: str
    calls: list[int]
    compile_mode: str
    trust: bool = False
    model_spec: str | None = None
    threads: int = 1
    timeout_s: float | None = None


@dataclass
class Outcome:
    """What one worker reports on its last line of output."""

    compiled: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def candidates(records, model, cfg, device, step_kernels: dict | None = None) -> list[list]:
    """The calls the loop will compile, by kind (``call_key``; a call without one is its own
    kind): the first call of each module, every call under the compile mode, else those the
    step ran compiled; on a GPU, only the leaves that ran more than one kernel in the step
    (``step_kernels``: call_id -> kernels; a leaf it lacks counts as more; none when it is
    empty or None). Every module, not the first of its kind alone:
    a kind whose modules differ in what dynamo guards on and the key does not see (a
    convolution's stride, a flag, a rate) compiles a graph per module, and a graph no worker
    compiled misses the cache in the loop; where the guards pass, a module after the first of
    its kind costs its worker one run."""
    groups: dict = {}
    compiling = "compile" in cfg.modes
    for rec in sorted(records, key=lambda r: r.call_id):
        if (rec.capture_error or "").startswith(COPY_FAILED):
            continue
        if not compiling and (cfg.eager_only or not rec.step_compiled):
            continue
        try:
            module = module_tree.get_submodule(model, rec.fqn)
        except AttributeError:
            continue
        if (device.type == "cuda" and next(module.children(), None) is None
                and (not step_kernels or step_kernels.get(rec.call_id, 2) <= 1)):
            continue
        key = call_key(module, rec)
        group = groups.setdefault(("module", rec.fqn) if key is None else key, [])
        if all(r.fqn != rec.fqn for r in group):
            group.append(rec)
    return list(groups.values())


def shares(groups: list[list], records, n: int) -> list[list[int]]:
    """The kinds of ``groups`` split among ``n`` workers, each kind to one worker (its modules
    after the first then hit that worker's dynamo cache where their guards pass), weighed by
    its first call's subtree size (a parent's compile traces all of it) and a quarter of the
    others', largest first to the least loaded worker; in each share, the call order of the
    step."""
    tree = CallTree({r.call_id: r.parent_call_id for r in records})
    size: dict[int, int] = {}
    for cid in sorted(tree.parent, reverse=True):  # children begin after their parent
        size[cid] = 1 + sum(size[c] for c in tree.children[cid])
    loads = [[0, []] for _ in range(max(n, 1))]
    # a kind's first module compiles; the others mostly pass its guards and cost a run
    weight = {id(g): size.get(g[0].call_id, 1) + sum(size.get(r.call_id, 1) for r in g[1:]) / 4
              for g in groups}
    for group in sorted(groups, key=lambda g: -weight[id(g)]):
        least = min(loads, key=lambda x: x[0])
        least[0] += weight[id(group)]
        least[1].extend(r.call_id for r in group)
    return [sorted(ids) for _, ids in loads if ids]


def workers_for(cfg, device, model, n_calls: int) -> int:
    """``cfg.compile_workers``, or by default on a GPU: up to MAX_WORKERS, half the CPUs, and as
    many as fit in half the free device memory with a model each; 0 on a CPU."""
    if cfg.compile_workers is not None:
        return min(cfg.compile_workers, n_calls)
    if device.type != "cuda":
        return 0
    model_bytes = sum(t.numel() * t.element_size()
                      for t in [*model.parameters(), *model.buffers()])
    free, _ = torch.cuda.mem_get_info(device)
    fit = int(0.5 * free) // (model_bytes + WORKER_HOST_BYTES)
    return max(0, min(MAX_WORKERS, (os.cpu_count() or 2) // 2, fit, n_calls))


def compile_ahead(run: Path, manifest, records, model, cfg, device, *,
                  sharded: bool = False) -> str | None:
    """Compile the loop's compiles ahead in worker processes (module docstring); returns a
    note for the manifest (what was done, or why not), None when nothing was to compile or
    no workers were asked for."""
    if cfg.compile_workers == 0 or not (
            "compile" in cfg.modes or any(r.step_compiled for r in records)):
        return None
    groups = candidates(records, model, cfg, device)  # on a GPU, no leaf yet: the trace waits
    if not groups:
        return None
    n = workers_for(cfg, device, model, len(groups))
    if n <= 0:
        return None
    if sharded:
        return "no compile ahead: a sharded replay's ranks compile in parallel already"
    if refusal(manifest, trust=cfg.trust, spec=cfg.model_spec, run=run) is not None:
        return ("no compile ahead: the workers could not rebuild the model (a live model with "
                "no spec, or a run from elsewhere: model_spec= or trust=True)")
    if device.type == "cuda":  # the leaves the loop will compile: those of several kernels
        groups = candidates(records, model, cfg, device, kernels_in_step(run, manifest, records))
    calls = sum(len(g) for g in groups)
    if cfg.progress is not False:
        announce(f"compiling {calls} calls of {len(groups)} kinds ahead in {_processes(n)}")
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cbtrace-compile-") as tmp:
        procs = []
        try:
            for i, share in enumerate(shares(groups, records, n)):
                job = Job(run=str(Path(run).resolve()), device=str(device), calls=share,
                          compile_mode=cfg.compile_mode, trust=cfg.trust,
                          model_spec=cfg.model_spec, threads=threads, timeout_s=cfg.timeout_s)
                path = Path(tmp) / f"job{i}.json"
                path.write_text(json.dumps(asdict(job)))
                procs.append(_start(path, n))
            outcomes = [_wait(*p) for p in procs]
        finally:  # interrupted (Ctrl-C, an error here): no worker outlives the replay
            for p, _, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    compiled = sum(o.compiled for o in outcomes)
    failed = sum(o.failed for o in outcomes)
    errors = [e for o in outcomes for e in o.errors]
    note = (f"compiled ahead: {compiled} of {calls} calls ({len(groups)} kinds) in "
            f"{_processes(len(procs))}"
            f", {time.perf_counter() - t0:.1f} s")
    if failed:
        note += f"; {failed} failed ({errors[0] if errors else 'no reason given'})"
    return note


def kernels_in_step(run: Path, manifest, records) -> dict[int, int]:
    """call_id -> the kernels the call ran in the step: from the plain step's trace where the
    run has one (no input copies of cbtrace's inside the calls), else from the captured step's;
    {} where no trace with device kernels can be read (a trace that cannot be read only
    leaves the leaves to the loop: the replay's attribution says what is wrong with it)."""
    plain = plain_trace(run, manifest)
    for trace in ([plain] if plain is not None else []) + [None]:  # None: the captured one
        try:
            table = insitu_for_run(run, manifest, trace=trace)
        except Exception:  # noqa: BLE001 - see the docstring
            continue
        if table["kernel_count"].sum() > 0:
            break
    else:
        return {}
    by_key = dict(zip(zip(table["fqn"], table["call_index"]), table["kernel_count"]))
    out = {}
    for r in records:
        k = by_key.get((r.fqn, r.call_index))
        if k is not None:
            out[r.call_id] = int(k)
    return out


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _start(job: Path, n: int) -> tuple:
    """The worker's process, its output going to files beside its job (a pipe left unread
    while another worker is waited for would stall it)."""
    env = dict(os.environ)
    # each worker's inductor compiles kernels in a pool of its own: share the CPUs
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 2) // n)))
    out, err = job.with_suffix(".out"), job.with_suffix(".err")
    with out.open("w") as o, err.open("w") as e:
        p = subprocess.Popen([sys.executable, "-m", "cbtrace.replay.modes.precompile", str(job)],
                             env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
    return p, out, err


def _wait(p: subprocess.Popen, out: Path, err: Path) -> Outcome:
    p.wait()
    last = out.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    try:
        return Outcome(**json.loads(last[0]))
    except (ValueError, TypeError):
        why = err.read_text(errors="replace").strip().splitlines()[-1:] or [
            f"exit {p.returncode}"]
        return Outcome(failed=1, errors=[f"a worker ended without a report: {why[0][:200]}"])


# ---------------------------------------------------------------- the worker


def work(job: Job) -> Outcome:
    """Compile each of ``job.calls`` once, as the loop's compile step would: the module as
    flagged at capture, through an entry of its kind, on the captured inputs, under the call's
    grad mode and autocast, dynamo's stance default."""
    torch.set_num_threads(job.threads)
    run, device = Path(job.run), torch.device(job.device)
    manifest, df = load_run(run)
    by_id = {r.call_id: r for r in frame_to_records(df)}
    model = rebuild_model(manifest, device, verify=False, trust=job.trust, spec=job.model_spec,
                          run=run)
    flags = TrainingFlags(manifest.training_flags)
    cache, outcome = EntryCache(job.compile_mode), Outcome()
    for cid in job.calls:
        rec = by_id[cid]
        try:
            module = module_tree.get_submodule(model, rec.fqn)
            args, kwargs = load.load_call_inputs(run, rec.inputs_ref, device=device)
            flags.apply(module, rec)
            key = cache.key(module, rec)
            fn = cache.runner_fn(key, module)
            before = dynamo_counters()
            with time_limit(job.timeout_s), stance("default"), \
                    call_context(rec, device.type):
                fn(*args, **kwargs)
            if counted_since(before).graphs:  # as the loop does: past SHARE_MISSES of a kind
                cache.compiled_again(key, module)  # a module of it gets an entry of its own
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            outcome.compiled += 1
        except Exception as e:  # noqa: BLE001 - the loop will meet it and say so in the row
            outcome.failed += 1
            outcome.errors.append(f"{rec.fqn or '(root)'}: {one_line(e, 160)}")
            torch._dynamo.reset()
            cache.clear()
    return outcome


def main(argv: list[str]) -> int:
    job = Job(**json.loads(Path(argv[0]).read_text()))
    try:
        outcome = work(job)
    except Exception as e:  # noqa: BLE001 - reported to the replay, which goes on without
        outcome = Outcome(failed=len(job.calls), errors=[one_line(e, 200)])
    print(json.dumps(asdict(outcome)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
