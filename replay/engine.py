"""Breadth-first isolated replay of a run: every captured call re-run standalone and measured.

    replay(run)  =  setup(run, ...)  ->  ReplayLoop.run()  ->  finish(loop)

``setup`` checks the run, picks the device, rebuilds the model if none was given and builds the
loop's state; ``ReplayLoop`` replays the calls breadth-first, one ``replay_one`` each, appending
each row as it finishes; ``finish`` derives the figures and writes the table and the manifest.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cbtrace import module_tree, registry
from cbtrace.calltree import bfs_order
from cbtrace.console import Progress, announce
from cbtrace.cost.calibrate import calibrate
from cbtrace.cost.dtypes import meta_bytes
from cbtrace.cost.peaks import calibration_path, device_name, load_calibration
from cbtrace.device import OOM_RETRIED, free_memory, hand_back, resolve_device, warm_profiler
from cbtrace.errors import ReplayError, one_line
from cbtrace.global_state import GlobalSettings
from cbtrace.replay.config import ReplayConfig
from cbtrace.replay.derive import finalize
from cbtrace.replay.measure.context import ContextSource
from cbtrace.replay.measure.plan import default_plan, measure_call, time_plan
from cbtrace.replay.measure.time_limit import CallTimeout, time_limit
from cbtrace.replay.modes import precompile
from cbtrace.replay.run_io import rebuild, shard
from cbtrace.replay.run_io.rebuild import TrainingFlags
from cbtrace.replay.run_io.prefetch import ReadAhead
from cbtrace.replay.run_io.progress import ProgressLog, clear_progress, read_done
from cbtrace.replay.timer.graph_capture import MainThreadCollection
from cbtrace.replay.timer.contract import join_notes
from cbtrace.rundir.files import check_writable, sha256_file
from cbtrace.rundir.layout import MODULES
from cbtrace.rundir.lock import locked
from cbtrace.rundir.read import load_run
from cbtrace.rundir.writer import write_columns, write_manifest
from cbtrace.schema.manifest import ReplayInfo
from cbtrace.schema.modules import (CAPTURE, COLUMNS, COPY_FAILED, HOST_INSITU, REPLAY,
                                    ModuleRecord, frame_to_records, stage_columns)
from cbtrace.state import StateGuard
from cbtrace.store import load

TIMED_AGAIN = "timed twice"  # timer_notes of a row whose later window was the faster
# what a later window replaces in a row (replay.measure.steps.Timed's fields; a call the step
# ran compiled: AsInStep's compiled figures in them, and its eager one)
WINDOW_FIELDS = ("timer", "timer_fallback", "isolated_ms", "isolated_ms_p10", "isolated_ms_p90",
                 "noisy", "runs", "timed_ms", "eager_ms")


@locked("replay")  # one writer of the run at a time; a full disk ends in one line
@GlobalSettings()  # calibration, a rebuild's seeding, thread counts: the caller's back
def replay(run, model=None, device=None, **options):
    """Replay every captured call of ``run`` standalone; return the results DataFrame.

    Args:
        run: run directory written by ``cbtrace.capture``.
        model: the live model; if None it is rebuilt from the provider spec in the manifest.
        device: "cpu", "cuda" or "cuda:N"; defaults to the capture device if available.
        **options: fields of ``ReplayConfig`` (timer, resume, memory_budget_bytes, ...).
    """
    loop = setup(Path(run), model, device, ReplayConfig(**options))
    loop.run()
    return finish(loop)


def setup(run: Path, model, device, cfg: ReplayConfig) -> ReplayLoop:
    """Everything before the first call: the run loaded and checked, the device and the model,
    the rows a resume keeps, and the loop's state (plan, guard, progress log, read-ahead)."""
    t_start = time.perf_counter()
    outside: dict[str, float] = {}  # seconds outside the per-call loop, by phase
    with phase(outside, "load_run"):
        manifest, df = load_run(run)
    if not manifest.complete:
        raise ReplayError(f"{run}: the capture did not complete ({manifest.error})")
    check_writable(run)  # a read-only run fails now, before the model is rebuilt
    w = shard.world()  # under torchrun: this rank replays its share (run_io/shard.py)
    device = _device_and_ranks(w, device, manifest, model)
    if model is None and device.type == "cuda":  # a fresh process: the first CUDA profiler
        with phase(outside, "profiler_start"):  # start costs least before the model's kernels
            warm_profiler(device)
    if model is None:  # "rebuild" and "verify_state" in outside
        model = rebuild.rebuild_model(manifest, device, verify=cfg.verify_state, trust=cfg.trust,
                                      spec=cfg.model_spec, run=run, timings=outside)
    with phase(outside, "verify_inputs"):
        verify_inputs(run, manifest)
    with phase(outside, "calibrate"):
        ensure_calibrated(device)
    t_setup = time.perf_counter()
    records = [fresh_replay_fields(r) for r in frame_to_records(df)]
    by_id = {r.call_id: r for r in records}
    settings = timing_settings(cfg)
    # rows timed with other settings (e.g. --cold vs default) are done again, never mixed
    done = ({cid: r for cid, r in read_done(run).items() if r.get("settings") == settings}
            if cfg.resume else {})
    if not cfg.resume and (w is None or w.rank == 0):
        clear_progress(run)
    if w is not None:
        shard.barrier()  # rank 0 cleared old rows before any rank writes new ones
    with phase(outside, "state_copy"):  # StateGuard: a copy of every parameter
        guard = StateGuard(model)
    flags = TrainingFlags(manifest.training_flags)
    with phase(outside, "compile_ahead"):  # the loop's compiles, ahead in parallel (modes/)
        ahead_note = precompile.compile_ahead(
            run, manifest, [r for r in records if r.call_id not in done], model, cfg, device,
            sharded=w is not None)
    order = bfs_order({r.call_id: r.parent_call_id for r in records})
    if w is not None:
        mine = shard.assign(shard.costs(df), w.size)
        order = [cid for cid in order if mine[cid] == w.rank]
    loop = ReplayLoop(
        run_dir=run, cfg=cfg, model=model, device=device, manifest=manifest, table=df, world=w,
        records=records, by_id=by_id, settings=settings, done=done, kept=set(done),
        order=order, plan=default_plan(cfg, device, registry.backends()), guard=guard,
        flags=flags, log=ProgressLog(run, resume=cfg.resume, rank=None if w is None else w.rank),
        bar=Progress("replay", len(order), len(done), show=cfg.progress),
        ahead=ReadAhead(run, [c for c in order if c not in done], by_id, cfg.backward,
                        enabled=device.type == "cuda", pin=device.type == "cuda",
                        device=device),
        context=context_source(cfg, records, model, run, device, flags,
                               pending={c for c in order if c not in done}),
        outside=outside, t_start=t_start, compile_ahead=ahead_note)
    outside["setup"] = (time.perf_counter() - t_setup - outside["state_copy"]
                        - outside["compile_ahead"])
    return loop


def _device_and_ranks(w, device, manifest, model) -> torch.device:
    """The replay's device; under torchrun the process group joined and, on a CPU, this rank's
    share of the threads set."""
    if w is not None and device is None and model is None:
        device = _rank_device(manifest, w)
    device = replay_device(device, manifest, model)
    if w is not None:
        shard.init(w, device.type == "cuda")
        if device.type == "cpu":
            torch.set_num_threads(shard.cpu_threads(w))
    return device


@dataclass(kw_only=True, eq=False)
class ReplayLoop:
    """The per-call loop: what every call's replay needs, and the rows done so far."""

    run_dir: Path
    cfg: ReplayConfig
    model: torch.nn.Module
    device: torch.device
    manifest: object            # the run's Manifest
    table: object               # the run's modules DataFrame
    world: object               # shard.World under torchrun, else None
    records: list               # ModuleRecord per call, capture's fields only
    by_id: dict                 # call_id -> its record
    settings: dict              # timing_settings(cfg), kept with each row
    done: dict                  # call_id -> row: resumed rows, then each call's as it ends
    kept: set                   # call_ids of the rows a --resume kept
    order: list                 # call_ids this process replays, breadth-first
    plan: list                  # the steps measuring one call (measure/plan.py)
    guard: StateGuard           # parameters and buffers put back after each call
    flags: TrainingFlags        # each call's train/eval flags as at capture
    log: ProgressLog            # rows appended as they finish (--resume)
    bar: Progress
    ahead: ReadAhead            # the next calls' inputs read while one is timed
    context: ContextSource | None  # each call's predecessors, run before its timed runs
    outside: dict               # seconds outside the per-call loop, by phase
    t_start: float              # perf_counter at the start of setup
    timings: dict = field(default_factory=dict)  # seconds per phase of a call's replay
    compile_ahead: str | None = None  # what compiling ahead did (modes/precompile.py)

    def run(self) -> None:
        """Every call of ``order`` not done yet, then (CPU) the noisy ones again."""
        t0 = time.perf_counter()
        try:
            with MainThreadCollection() as collection:  # CUDA graphs die on this thread
                for cid in self.order:
                    if cid not in self.done:
                        self._replay_and_log(cid)
                        collection.between()
                if self.device.type == "cpu":  # a busy machine slows calls at random: retime
                    self._time_again(collection)
        finally:
            self.guard.undo()  # what a call wrote outside its subtree other than in place
            self.ahead.close()
            self.log.close()
            self.bar.close()
        # the loop's time in no phase of a call: progress rows, the bar, picking the next call
        self.timings["loop_other"] = time.perf_counter() - t0 - sum(self.timings.values())

    def _replay_and_log(self, cid: int) -> None:
        """One call replayed, its row appended to the progress log and kept in ``done``."""
        rec = self.by_id[cid]
        with phase(self.timings, "load"):
            read = self.ahead.take(cid)  # waits only when the read-ahead is slower than timing
        row = self.replay_one(rec, read=read)
        self.ahead.issued(cid)  # its input copies are queued: their pinned bytes reused once done
        if self.context is not None:  # what was kept for its context goes
            self.context.finished(cid)
        row["call_id"] = cid
        row["settings"] = self.settings
        row["rank"] = 0 if self.world is None else self.world.rank
        self.log.append(row)
        self.done[cid] = row
        self.bar.advance(rec.fqn or "(root)")

    def _time_again(self, collection: MainThreadCollection) -> None:
        """CPU: calls timed in more windows once every call had its first (``cpu_windows``; at
        1, the calls ``recheck`` picks), the time step alone; the fastest window is kept."""
        done, windows = self.done, self.cfg.cpu_windows
        rows = {c: done[c] for c in self.order if c in done}
        again = [c for c in recheck(rows, self.by_id, every=windows > 1) if c not in self.kept]
        if not again:
            return
        plan = time_plan(self.cfg, self.device, registry.backends(), self.plan)
        self.bar.close()  # the first windows' bar, full: this pass has its own
        passes = max(windows - 1, 1)
        self.bar = Progress("timed again", passes * len(again), show=self.cfg.progress)
        for _ in range(passes):
            for cid in again:
                self._keep_faster(cid, self.replay_one(self.by_id[cid], plan=plan))
                self.bar.advance(self.by_id[cid].fqn or "(root)")
                collection.between()

    def _keep_faster(self, cid: int, row: dict) -> None:
        first = self.done[cid]
        if row.get("status") != "ok" or row.get("isolated_ms") is None or (
                row["isolated_ms"] >= first["isolated_ms"]):
            return
        kept = {k: row[k] for k in WINDOW_FIELDS if k in row}
        had = (first.get("timer_notes") or "").split("; ")
        notes = join_notes(*had, *[n for n in (row.get("timer_notes") or "").split("; ")
                                   if n not in had], None if TIMED_AGAIN in had else TIMED_AGAIN)
        faster = {**first, **kept, "timer_notes": notes}
        self.log.append(faster)
        self.done[cid] = faster

    def replay_one(self, rec, read=(None, None), plan=None) -> dict:
        """Replay one call; never raises for the module's own failures (status = error).
        ``read``: its inputs' and output gradients' chunks read ahead (``run_io.prefetch``);
        ``plan``: the steps, if not the loop's."""
        if (rec.capture_error or "").startswith(COPY_FAILED):
            return dict(status="error", status_reason=f"inputs not captured ({rec.capture_error})")
        try:
            module = module_tree.get_submodule(self.model, rec.fqn)  # eager, inside any compile
        except AttributeError:
            return dict(status="error", status_reason=f"module '{rec.fqn}' not found in the model")
        skipped = self._over_budget(rec)
        if skipped is not None:
            return skipped
        device, cfg, timings = self.device, self.cfg, self.timings
        for attempt in (1, 2):  # out of memory: the cache handed back, once more
            try:
                with timed(self.guard.call(module), timings, "state_guard"), \
                        time_limit(cfg.timeout_s):
                    with phase(timings, "load"):
                        (args, kwargs), grads = self._inputs(rec, read)
                        if self.context is not None:  # a later call's context may need them
                            self.context.offer(rec, (args, kwargs))
                    # loaded only if the call qualifies, once its device time is known (Timed)
                    ctx = self.context.of(rec.call_id) if self.context is not None else None
                    self.flags.apply(module, rec)
                    row = measure_call(module, rec, args, kwargs, device, cfg, plan or self.plan,
                                       grads, timings, context=ctx)
                if attempt == 2:
                    row["timer_notes"] = join_notes(row.get("timer_notes"), OOM_RETRIED)
                return row
            except CallTimeout as e:
                hand_back(device)
                return dict(status="timeout", status_reason=f"{e} (--timeout-s; replay went on)")
            except torch.OutOfMemoryError as e:
                oom = one_line(e, with_type=False)  # the error's frames go with it, below
            except Exception as e:  # the module (or its inputs) failed: record and go on
                hand_back(device)
                after = f" (after running out of memory once: {oom})" if attempt == 2 else ""
                return dict(status="error", status_reason=one_line(e) + after)
            # out of memory, and nothing of the attempt is alive now but the inputs here
            if self.context is not None:  # the predecessors' copies kept for later contexts
                self.context.release()
            args = kwargs = grads = None
            hand_back(device)  # collected, and torch's cache handed back to the driver
            # ``read`` serves again: its ring bytes are held until the loop's issued(cid)
        return dict(status="skipped", status_reason=f"OOM: {oom} (twice, the second after "
                    "torch's cache went back to the driver)")

    def _inputs(self, rec, read) -> tuple:
        """The call's (args, kwargs) and, with --backward, its output gradients (else None)."""
        inputs = load.load_call_inputs(self.run_dir, rec.inputs_ref, device=self.device,
                                       chunks_read=read[0])
        grads = None
        if self.cfg.backward and rec.grads_ref:
            grads = load.load_call_inputs(self.run_dir, rec.grads_ref, device=self.device,
                                          chunks_read=read[1])[0]
        return inputs, grads

    def _over_budget(self, rec) -> dict | None:
        """A skipped row when the call's footprint exceeds the memory budget (or what is free)."""
        budget, device = self.cfg.memory_budget_bytes, self.device
        need = footprint_bytes(rec)
        limit = budget if budget is not None else _free_memory(device)
        if budget is None and limit is not None and need > limit:  # near the edge: the exact one
            limit = _free_memory(device, exact=True)
        if limit is not None and need > limit:
            return dict(status="skipped", status_reason=f"footprint {need / 2**20:.0f} MiB > "
                        f"budget {limit / 2**20:.0f} MiB")
        return None


def finish(loop: ReplayLoop):
    """After the loop: rows gathered from the ranks (rank 0 goes on alone), the figures derived,
    the table and the manifest written; returns the results DataFrame."""
    w, run, outside = loop.world, loop.run_dir, loop.outside
    done = loop.done
    if w is not None:  # rank 0 derives the figures over the whole tree and writes the table
        done = shard.gather(done, w)
        if w.rank != 0:
            shard.barrier()
            return load_run(run)[1]
    records = loop.records
    for rec in records:
        for k, v in done.get(rec.call_id, {}).items():
            if k in COLUMNS and COLUMNS[k].stage == REPLAY:
                setattr(rec, k, v)
    name = device_name(loop.device)
    with phase(outside, "finalize"):
        finalize(records, device_name=name)
    columns = stage_columns(REPLAY)
    with phase(outside, "write"):
        out = write_columns(run, REPLAY, {r.call_id: {c: getattr(r, c) for c in columns}
                                          for r in records}, table=loop.table)
    wall = time.perf_counter() - loop.t_start
    outside["other"] = wall - sum(loop.timings.values()) - sum(outside.values())
    write_replay_info(loop, name, wall)
    if w is not None:
        shard.barrier()  # the table is written: the other ranks may read it
    return out


def write_replay_info(loop: ReplayLoop, name: str, wall: float) -> None:
    """The manifest's ``replay`` section: device, timers, wall and where it went."""
    cfg, manifest = loop.cfg, loop.manifest
    manifest.replay = ReplayInfo(device=str(loop.device), device_name=name,
                                 timer_requested=cfg.timer, cold=cfg.cold,
                                 timers_used=sorted({r.timer for r in loop.records if r.timer}),
                                 wall_s=wall, torch_version=str(torch.__version__),
                                 timings_s=_rounded(loop.timings),
                                 outside_s=_rounded(loop.outside))
    manifest.replay.ranks = 1 if loop.world is None else loop.world.size
    manifest.replay.compile_ahead = loop.compile_ahead
    write_manifest(loop.run_dir, manifest, rewritten=[MODULES])


@contextlib.contextmanager
def phase(timings: dict | None, name: str):
    """Add the seconds the block takes to ``timings[name]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _add(timings, name, time.perf_counter() - t0)


@contextlib.contextmanager
def timed(cm, timings: dict | None, name: str):
    """``cm``, the seconds its entry and exit take added to ``timings[name]``."""
    t0 = time.perf_counter()
    try:
        with cm:
            _add(timings, name, time.perf_counter() - t0)
            try:
                yield
            finally:
                t0 = time.perf_counter()
    finally:
        _add(timings, name, time.perf_counter() - t0)


def _add(timings: dict | None, name: str, seconds: float) -> None:
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + seconds


def _rounded(timings: dict) -> dict:
    return {k: round(v, 4) for k, v in timings.items()}


def _rank_device(manifest, w) -> str | None:
    """A rank's own GPU (cuda:LOCAL_RANK) when the run was captured on CUDA and this host has
    one for it; None (the capture device, else CPU) otherwise."""
    if manifest.device.startswith("cuda") and torch.cuda.is_available():
        return f"cuda:{w.local_rank % torch.cuda.device_count()}"
    return None


def ensure_calibrated(device) -> None:
    """A CPU has no datasheet peaks: without a stored calibration MFU, MBU and bound would be
    empty, so the first replay on a CPU measures its peaks (a few seconds, stored for later)."""
    if device.type != "cpu" or device_name(device) in load_calibration():
        return
    announce(f"measuring this CPU's peak FLOP/s and bandwidth once (MFU/MBU denominators; "
             f"stored in {calibration_path()})")
    calibrate("cpu")


def recheck(done: dict, by_id: dict, every: bool = False) -> list[int]:
    """Calls (CPU) to time again: flagged noisy, or slower than their parent, which runs them;
    ``every``: every call timed. Not the calls ``--reuse-timing`` copied, nor those they
    copied (the pair stays equal)."""
    sources = {r.get("timing_copied_from") for r in done.values()} - {None}
    out = []
    for cid, row in done.items():
        if row.get("timing_copied_from") is not None or by_id[cid].fqn in sources:
            continue
        iso, parent = row.get("isolated_ms"), done.get(by_id[cid].parent_call_id, {})
        above = iso is not None and parent.get("isolated_ms") is not None and (
            iso > parent["isolated_ms"])
        if row.get("status") == "ok" and iso is not None and (every or row.get("noisy") or above):
            out.append(cid)
    return out


def replay_notes(manifest, backward: bool = False) -> list[str]:
    """What a user should know about what replay measured, one line each."""
    notes = []
    if manifest.step is not None and manifest.step.step == "train" and not backward:
        notes.append("note: the run was captured with --step train (forward + backward); replay "
                     "measured each call's forward only (--backward measures the backward too)")
    return notes


def timing_settings(cfg) -> dict:
    """The options that change what a row measures (kept with each progress row); the time
    budget only changes how many runs are taken, so a resume may use another one. Cold
    replay's warm-up sets the clock it measures at, so its settings count too."""
    settings = {"timer": cfg.timer, "cold": cfg.cold, "graph_k": cfg.graph_k,
                "warm_inputs": cfg.warm_inputs and not cfg.cold, "modes": list(cfg.modes),
                "reuse_timing": cfg.reuse_timing,
                "context": cfg.context, "context_calls": cfg.context_calls,
                "compile_mode": cfg.compile_mode, "backward": cfg.backward}
    if cfg.cold:
        settings.update(cold_warmup_s=cfg.cold_warmup_s, cold_settle_tol=cfg.cold_settle_tol)
    elif cfg.context is not False:  # which calls get a context, and what is rewritten after it
        settings.update(context_max_ms=cfg.context_max_ms, context_rewrite=cfg.context_rewrite,
                        context_activation_max_ms=cfg.context_activation_max_ms,
                        context_memory_max_ms=cfg.context_memory_max_ms,
                        context_kernels_max_ms=cfg.context_kernels_max_ms,
                        table_copies_max=cfg.table_copies_max)
    if not cfg.cold:  # which graph-timed calls take their kernels' busy time as their figure
        settings.update(kernels_figure_min=cfg.kernels_figure_min,
                        small_call_max_ms=cfg.small_call_max_ms,
                        table_kernels_figure=cfg.table_kernels_figure,
                        profile_as_timed=cfg.profile_as_timed)
    if cfg.eager_only:  # only when set: rows of earlier replays keep their settings
        settings["eager_only"] = True
    if cfg.cpu_windows != ReplayConfig.cpu_windows:  # a CPU row's fastest of how many windows
        settings["cpu_windows"] = cfg.cpu_windows
    if "compile" in cfg.modes:  # what the compile mode's host figure means
        settings["cold_host_issue"] = cfg.cold_host_issue
    return settings


def fresh_replay_fields(rec):
    """A record with what capture measured and every later field at its default."""
    return ModuleRecord(**{k: getattr(rec, k) for k, c in COLUMNS.items()
                           if c.stage in (CAPTURE, HOST_INSITU)})


def verify_inputs(run: Path, manifest) -> None:
    """Every captured input shard exists and matches the sha256 recorded at capture; a shard
    whose size and mtime are as recorded is not read again (gigabytes on a GPT-2 run)."""
    for rel in manifest.input_files:
        path = run / rel
        if not path.is_file():
            raise ReplayError(f"{path}: captured input file is missing")
        st = path.stat()
        if manifest.files_stat.get(rel) == (st.st_size, st.st_mtime_ns):
            continue
        want = manifest.files.get(rel)
        if want and sha256_file(path) != want:
            raise ReplayError(f"{path}: captured input file is corrupt (sha256 differs from "
                              "the manifest)")


def uses_context(cfg, device) -> bool:
    """Whether calls are timed in their context: ``cfg.context``, None meaning on a GPU."""
    on = cfg.context if cfg.context is not None else device.type == "cuda"
    return bool(on) and not cfg.cold


def context_source(cfg, records, model, run, device, flags, pending=None):
    """Where each call's context comes from (``replay.measure.context``); None when off.
    ``pending``: the call_ids this replay measures (None: all)."""
    if not uses_context(cfg, device):
        return None
    return ContextSource(records, model, device,
                         lambda r: load.load_call_inputs(run, r.inputs_ref, device=device),
                         flags, max_calls=cfg.context_calls,
                         rewrite=cfg.context_rewrite != "off", pending=pending)


def footprint_bytes(rec) -> int:
    """Rough peak need: params + buffers + inputs and outputs for the rotating copies + 1."""
    out = meta_bytes(rec.output_meta)
    return int(rec.param_bytes + rec.buffer_bytes + 3 * (rec.input_bytes + out))


def replay_device(device, manifest, model) -> torch.device:
    """``device``, else the live model's, else the capture's where this machine has it."""
    if device is None and model is not None:
        p = next(iter(model.parameters()), None)
        return p.device if p is not None else torch.device("cpu")
    if device is None:
        here = not manifest.device.startswith("cuda") or torch.cuda.is_available()
        device = manifest.device if here else "cpu"
    return resolve_device(device)


def _free_memory(device, exact: bool = False) -> int | None:
    if device.type == "cuda":
        return free_memory(device, exact)
    return None

