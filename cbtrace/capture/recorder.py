"""Capture one real step of a model: module tree, live inputs (Parquet) and a Kineto trace.

    with cbtrace.capture(model, "runs/r1") as cap:
        model(batch)

Forward pre/post hooks (removed on exit, even on error) record every call of the chosen modules.
Each call's inputs are copied on entry inside a ``cbtrace.copy::<fqn>`` range (cbtrace's own
overhead, which attribution subtracts), then the call runs inside ``cbtrace::<fqn>``.
"""
from __future__ import annotations

import fnmatch
import functools
import json
import os
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from cbtrace import module_tree
from cbtrace.capture import boundaries
from cbtrace.capture.helper_thread import HelperThread, InlineHelper, untraced
from cbtrace.console import quiet_kineto
from cbtrace.device import cupti_torn_down
from cbtrace.cost.dtypes import name_of
from cbtrace.cost.peaks import device_name
from cbtrace.errors import CaptureError, one_line
from cbtrace.global_state import GlobalSettings
from cbtrace.nested import flat_tensors
from cbtrace.rundir import writer
from cbtrace.rundir.files import atomic_path
from cbtrace.rundir.layout import INPUTS, prepare_new_run
from cbtrace.rundir.lock import RunLock
from cbtrace.schema import manifest as manifest_schema
from cbtrace.schema.modules import COPY_FAILED, ModuleRecord
from cbtrace.state import state_digest
from cbtrace.store import ref_format, shards
from cbtrace.store.snapshot import Snapshotter
from cbtrace.store.tensor_store import meta_dict, run_copies, tensor_meta
from cbtrace.trace_io import gzip_trace


@dataclass(kw_only=True)
class CaptureConfig:
    include: tuple = ()
    """fnmatch globs on fqn; a module is captured if it matches one (empty: all modules)."""
    exclude: tuple = ()
    """fnmatch globs on fqn; matching modules are not captured (their children still may be)."""
    max_depth: int | None = None
    """Deepest module-hierarchy level captured (0 = root only); None: no limit."""
    synthesize_above_bytes: int | None = None
    """Store input tensors larger than this as metadata + statistics only (replay synthesizes)."""
    max_pending_bytes: int | None = None
    """Write captured inputs out early once this many bytes of copies are pending."""
    trace: bool = True
    """Run the step under torch.profiler and write its Kineto trace into the run directory."""
    with_stack: bool = False
    """Profile with ``with_stack=True``: Python frames in the trace. Off by default: attribution
    reads the ``cbtrace::`` ranges, not frames, and the Python tracer makes every Python call of
    the step (the hooks' included) several times slower (benchmarks/RESULTS.md)."""
    worker_name: str | None = None
    """Trace file prefix (torch-tb-profiler naming); default: <hostname>_<pid>."""
    overwrite: bool = False
    """Allow capturing into a non-empty directory (never the default)."""

    def __post_init__(self):
        if self.max_depth is not None and self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0 (0: the root only), got {self.max_depth}")

    def settings(self) -> manifest_schema.CaptureSettings:
        """What the manifest keeps of this config."""
        return manifest_schema.CaptureSettings(
            include=list(self.include), exclude=list(self.exclude), max_depth=self.max_depth,
            synthesize_above_bytes=self.synthesize_above_bytes,
            max_pending_bytes=self.max_pending_bytes, trace=self.trace,
            with_stack=self.with_stack, worker_name=self.worker_name)


def module_depth(fqn: str) -> int:
    """Hierarchy depth of a module path: "" -> 0, "a" -> 1, "a.b" -> 2."""
    return 0 if fqn == "" else fqn.count(".") + 1


def selected(fqn: str, cfg: CaptureConfig) -> bool:
    """Whether a module path is captured under ``cfg``'s include/exclude/max_depth."""
    if cfg.max_depth is not None and module_depth(fqn) > cfg.max_depth:
        return False
    if cfg.include and not any(fnmatch.fnmatchcase(fqn, g) for g in cfg.include):
        return False
    return not any(fnmatch.fnmatchcase(fqn, g) for g in cfg.exclude)


_ACTIVE: list = []  # the capture in progress, if any (captures do not nest)


def _raw_op(overload):
    """The C++ callable behind an op overload, untraced: no trace event of its own under
    with_stack, where the OpOverload's Python ``__call__`` layers add 5 (and the packet's 10)."""
    return untraced(getattr(overload, "_op", overload))


# The ops behind torch.autograd.profiler.record_function (a user_annotation range), called
# directly: the context manager's own Python layers made ~17 trace events per range.
RANGE_ENTER = _raw_op(torch.ops.profiler._record_function_enter_new.default)
RANGE_EXIT = _raw_op(torch.ops.profiler._record_function_exit._RecordFunction)
# What the hooks call on the step's thread, untraced (helper_thread.untraced): with the hand-off
# and the ranges, no trace events of their own, and on a GPU none of
# torch.cuda.current_stream()'s few dozen (_stream_reader)
_ANY_AUTOCAST = untraced(getattr(torch._C, "_is_any_autocast_enabled", lambda: True))
_GRAD_ENABLED = untraced(torch.is_grad_enabled)
_EXC_INFO = untraced(sys.exc_info)
_STRIDE, _OFFSET = untraced(torch.Tensor.stride), untraced(torch.Tensor.storage_offset)
# RecordFunction on this thread (at::enableRecordFunction, thread-local): off while a call's
# copies are planned, so that the profiler neither records nor pays for the planning's ops (an
# empty source, its set_, the buffer's empty_like: 4 of a call's 5 ops; the copy_ stays)
_RECORD_OPS = untraced(torch._C._autograd._enable_record_function)
_TENSOR, _STRIDED = torch.Tensor, torch.strided
# capture_timings_s entries that follow one another (the rest are parts of one of them, or
# thread seconds): their sum plus what the caller's own code adds is the capture's wall
TIMINGS_IN_SEQUENCE = ("prepare", "state_digest", "hooks_install", "profiler_start",
                       "helper_start", "step", "helper_drain", "profiler_stop", "hooks_remove",
                       "inputs_and_trace", "checksums_and_manifest")

# A frame of the hook stack: (record or None for a call through an unselected path, module,
# range handle, exception already being handled when it was called). A plain tuple: building
# a dataclass is one more traced Python call per module call.
_REC, _MOD, _RF, _PENDING = range(4)


class capture:
    """Context manager capturing one step of ``model`` into the run directory ``out_dir``.

    ``source`` says where the model came from (``cbtrace capture`` passes its provider spec, so
    replay can rebuild it) and ``step`` how the step was run; both go into the manifest.
    """

    def __init__(self, model: torch.nn.Module, out_dir, *, config: CaptureConfig | None = None,
                 source: manifest_schema.ModelSource | None = None,
                 step: manifest_schema.StepSettings | None = None, **overrides):
        self.model = model
        self.source, self.step_settings = source, step
        self.cfg = config or CaptureConfig(**overrides)
        if config is not None and overrides:
            raise ValueError("capture: pass either config= or keyword overrides, not both")
        self.out = Path(out_dir)
        self.records: list[ModuleRecord] = []
        self._handles = []
        self._stack: list[tuple] = []
        self._counts: dict[str, int] = {}
        self._names: dict[int, list[str]] = {}
        self._selected: dict[str, bool] = {}
        self._bounds: dict[str, str] = {}  # fqn -> why it is recorded at its boundary only
        self._in_compiled: set[str] = set()  # fqns under torch.compile in the step
        self._recomputes = boundaries.Recomputes()  # forward call each recomputation redoes
        self._prof = None
        self._cupti = None  # cupti_torn_down() while the profiler runs
        self._helper = InlineHelper()  # runs hook bookkeeping (a HelperThread under with_stack)
        self._lock = threading.RLock()
        self._acquire, self._release = untraced(self._lock.acquire), untraced(self._lock.release)
        self._push, self._pop = untraced(self._stack.append), untraced(self._stack.pop)
        self._stream = None  # untraced call giving the current CUDA stream (a CUDA model)
        self._cuda = False
        self._eager = None
        self._grads: dict[int, list] = {}  # call_id -> inputs_ref of each output's gradient
        self._grad_handles: list = []
        self._closed = False
        self.trace_path: Path | None = None
        # where capture time went (TIMINGS_IN_SEQUENCE and their parts); the manifest gets all
        # but checksums_and_manifest and total (the whole capture), known after it is written
        self.timings_s: dict[str, float] = {}

    # --- context manager -------------------------------------------------------------
    @GlobalSettings()  # capture's own work only: the user's step runs between the two
    def __enter__(self):
        if _ACTIVE:
            raise CaptureError(f"{self.out}: a cbtrace capture is already active; captures "
                               "cannot nest")
        if self.cfg.trace and torch.autograd.profiler._is_profiler_enabled:
            raise CaptureError(f"{self.out}: a torch.profiler session is already active; "
                               "capture with trace=False inside it (ranges still recorded)")
        self._t_enter = time.perf_counter()
        self.rank = distributed_rank()  # a rank of a torch.distributed job writes its shard
        if self.rank is not None:
            self.out = self.out / f"rank-{self.rank[0]}"
        self.out = prepare_new_run(self.out, overwrite=self.cfg.overwrite)
        self._run_lock = RunLock(self.out, "capture").acquire()  # one writer at a time
        _ACTIVE.append(self)
        try:
            self._start()
        except BaseException:  # leave nothing half-open: hooks, profiler, helper, _ACTIVE
            self._undo_start()
            self._run_lock.release()
            raise
        self._t0 = self._t_lap  # the step: from the last lap of _start to __exit__
        return self

    def _lap(self, name: str) -> None:
        """Add the seconds since the last lap to timings_s[name]."""
        now = time.perf_counter()
        self.timings_s[name] = self.timings_s.get(name, 0.0) + now - self._t_lap
        self._t_lap = now

    def _start(self) -> None:
        self._t_lap = self._t_enter
        self._lap("prepare")
        self._state_sha256 = state_digest(self.model)  # before the step changes any buffer
        self._lap("state_digest")
        self._snap = Snapshotter(self.out / INPUTS,
                                 synthesize_above_bytes=self.cfg.synthesize_above_bytes,
                                 max_pending_bytes=self.cfg.max_pending_bytes)
        # the user's tree: a torch.compile'd model (or submodule) is hooked inside its wrapper
        for name, mod in module_tree.named_modules(self.model, remove_duplicate=False):
            self._names.setdefault(id(mod), []).append(name)
            self._selected[name] = selected(name, self.cfg)  # once: hooks only look it up
        self._static = _static_facts(self.model)
        # a step begun without grad recomputes nothing: no stack walk per call for checkpoints
        self._may_recompute = _GRAD_ENABLED()
        # paths the user's step runs under torch.compile: their calls are step_compiled
        self._in_compiled = module_tree.compiled_paths(self.model)
        self._flags = {n: m.training for n, m in module_tree.named_modules(self.model)}
        self._cuda = any(t.is_cuda for t in self.model.parameters()) or any(
            t.is_cuda for t in self.model.buffers())
        if self._cuda:
            self._stream = _stream_reader()
        # TorchScript and fast-path modules: recorded at their boundary, nothing inside hooked
        self._bounds = boundaries.find(module_tree.named_modules(self.model))
        seen = set()
        for name, mod in module_tree.named_modules(self.model, remove_duplicate=False):
            if id(mod) in seen or not any(self._selected[n] for n in self._names[id(mod)]):
                continue
            if boundaries.inside(name, self._bounds):
                continue
            seen.add(id(mod))
            names = self._names[id(mod)]
            # a module of one path (selected, or it had no hooks) knows its fqn; a shared one
            # finds it per call (_fqn). The partial adds no trace event (helper_thread.untraced)
            pre = functools.partial(self._pre, names[0] if len(names) == 1 else None)
            self._handles += boundaries.hook_calls(mod, pre, self._post,
                                                   boundary=name in self._bounds)
        # compiled parts run eagerly: calls of their own, marked step_compiled
        self._eager = module_tree.eager(self.model)
        self._eager.__enter__()
        self._lap("hooks_install")
        self._t_step0 = self._t_lap  # capture_step_s: from here (profiler start) to hooks removed
        if self.cfg.trace:
            self._prof = torch.profiler.profile(activities=profiler_activities(), record_shapes=True,
                                                with_stack=self.cfg.with_stack)
            # the whole session with TEARDOWN_CUPTI=1, as replay's: CUPTI set up lazily at its
            # start, torn down at its stop (device.cupti_torn_down)
            self._cupti = cupti_torn_down()
            self._cupti.__enter__()
            with quiet_kineto():  # Kineto's USDT/STAGE log lines stay off the terminal
                self._prof.__enter__()
            self._lap("profiler_start")
            if self.cfg.with_stack:
                # started after the profiler, so the profiler neither traces it nor records its
                # ops; without with_stack no Python call is traced: the hand-off would only wait
                self._helper = HelperThread()
            self._lap("helper_start")

    def _end_cupti(self) -> None:
        """TEARDOWN_CUPTI as it was before the session (``cupti_torn_down``)."""
        cupti, self._cupti = self._cupti, None
        if cupti is not None:
            cupti.__exit__(None, None, None)

    def _undo_start(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._remove_hooks()
        self._leave_eager()
        try:
            self._stop_helper()
        except BaseException:  # noqa: BLE001 - the original error is the one to report
            pass
        if self._prof is not None:
            try:
                with quiet_kineto():
                    self._prof.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            self._prof = None
            self._end_cupti()

    @GlobalSettings()
    def __exit__(self, exc_type, exc, tb):
        try:
            result = self._exit(exc_type, exc, tb)
        except BaseException as e:  # the lock file stays, marking the run; a full disk: one line
            self._run_lock.release(e)
            raise
        self._run_lock.release(exc)
        return result

    def _exit(self, exc_type, exc, tb):
        self._t_lap = self._t0
        self._lap("step")
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        helper_error = None
        try:
            try:
                self._stop_helper()
            except BaseException as e:  # a handed-over job failed: stop and write the run first
                helper_error = e
            self._lap("helper_drain")
            if self._prof is not None:
                try:
                    with quiet_kineto():
                        self._prof.__exit__(exc_type, exc, tb)
                finally:
                    self._end_cupti()
                self._lap("profiler_stop")
        finally:
            self._remove_hooks()
            self._leave_eager()
            while self._stack:  # forward raised past some post hooks
                rec, _, rf, _ = self._stack.pop()
                if rf is not None:
                    RANGE_EXIT(rf)
                if rec is None:
                    continue
                rec.capture_error = rec.capture_error or _short(exc)
        self._lap("hooks_remove")
        self.step_s = self._t_lap - self._t_step0
        self._finish(exc if exc is not None else helper_error)
        self.timings_s["total"] = self._t_lap - self._t_enter  # the sum of the sequence
        if helper_error is not None and exc is None:
            raise helper_error
        return False

    def _leave_eager(self) -> None:
        eager, self._eager = self._eager, None
        if eager is not None:
            eager.__exit__(None, None, None)

    # --- hooks -----------------------------------------------------------------------
    def _remove_hooks(self) -> None:
        self._closed = True  # gradient hooks still on live tensors do nothing from now on
        for h in self._handles + self._grad_handles:
            h.remove()
        self._handles.clear()
        self._grad_handles.clear()

    def _stop_helper(self) -> None:
        """Let the helper thread finish; hooks called later (none should be) run inline."""
        self._helper.close()
        self._helper = InlineHelper()

    def _fqn(self, module) -> str:
        names = self._names.get(id(module), ["?"])
        if len(names) > 1 and self._stack:  # shared module: pick the path under the caller
            rec, mod = self._stack[-1][_REC], self._stack[-1][_MOD]
            parent = rec.fqn if rec is not None else next(
                (n for n in self._names.get(id(mod), [])), None)
            for n in names:
                if n.rpartition(".")[0] == parent:
                    return n
        return next((n for n in names if self._selected.get(n)), names[0])

    def _pre(self, fqn, module, args, kwargs):
        # Runs inside the profiled step. Under with_stack every Python call (built-ins too) is
        # an event that costs time now, when the profiler stops and in the exported trace: the
        # bookkeeping (parent, walking and planning the inputs, the record, allocating the
        # copies) then runs on the helper thread, which the profiler does not trace; this
        # thread only makes the copies, and calls built-ins untraced (helper_thread.untraced).
        self._acquire()  # hooks may fire on several threads (e.g. nn.DataParallel replicas)
        try:
            pending = _EXC_INFO()[1]  # an exception being handled around this call
            if fqn is None:  # a shared module: the path it is called through
                fqn = self._fqn(module)
                if not self._selected.get(fqn):  # reached through an unselected path
                    self._push((None, module, None, pending))
                    return
            # this thread's state, not the helper's
            backward, region = boundaries.checkpoint_state(self._may_recompute)
            if backward:  # checkpointing recomputes it: backward work, no call
                name = boundaries.recompute_range(fqn, self._recomputes.recompute(fqn, region))
                self._push((None, module, RANGE_ENTER(name, None), pending))
                return
            grad = _GRAD_ENABLED()  # this thread's modes
            autocast = _autocast_dtype() if _ANY_AUTOCAST() else None
            stream = self._stream() if self._stream is not None else None
            copy_range = RANGE_ENTER(f"cbtrace.copy::{fqn}", None)
            try:
                rec, copies = self._helper.call(self._plan_call, module, fqn, args, kwargs,
                                                grad, autocast, stream, region)
                try:
                    run_copies(copies)
                except BaseException as e:
                    rec.capture_error = f"{COPY_FAILED}: {_short(e)}"
                    raise
            finally:
                RANGE_EXIT(copy_range)
            self._push((rec, module, RANGE_ENTER(f"cbtrace::{fqn}", None), pending))
        finally:
            self._release()

    def _plan_call(self, module, fqn, args, kwargs, grad, autocast, stream, region):
        """The call's record and its input copies to run (on the helper thread; kernels it
        launches, e.g. statistics of synthesized inputs, and the copies' buffers go to the
        caller's stream)."""
        if stream is not None:
            _follow_stream(stream, self._stream)
        _RECORD_OPS(False)
        try:
            rec, copies = self._record_call(module, fqn, args, kwargs, grad, autocast)
            self._recomputes.forward(rec, region)
            return rec, copies
        finally:
            _RECORD_OPS(True)

    def _record_call(self, module, fqn, args, kwargs, grad, autocast):
        idx = self._counts.get(fqn, 0)
        self._counts[fqn] = idx + 1
        parent = next((f[_REC] for f in reversed(self._stack) if f[_REC] is not None), None)
        ref, copies = self._snap.plan(tuple(args), dict(kwargs))
        mtype, mclass, pbytes, bbytes = self._static[id(module)]
        rec = ModuleRecord(
            fqn=fqn, call_index=idx, call_id=len(self.records),
            parent_call_id=parent.call_id if parent else -1,
            parent_fqn=parent.fqn if parent else None,
            depth=parent.depth + 1 if parent else 0,
            module_type=mtype, module_class=mclass, param_bytes=pbytes, buffer_bytes=bbytes,
            input_bytes=self._snap.last_input_bytes, input_shapes="[]", input_meta="[]",
            output_meta="[]", training=module.training, grad_enabled=grad,
            autocast_dtype=autocast, inputs_ref=ref, synthesized=self._snap.last_synthesized,
            boundary=self._bounds.get(fqn), step_compiled=fqn in self._in_compiled)
        self.records.append(rec)
        return rec, copies

    def _post(self, module, args, kwargs, output):
        self._acquire()
        try:
            if not self._stack or self._stack[-1][_MOD] is not module:
                return  # hook of a call whose pre hook did not run (registered mid-call)
            rec, _, rf, pending = self._pop()
            if rf is not None:
                RANGE_EXIT(rf)
            if rec is None:
                return
            raised = _EXC_INFO()[1]  # always_call hooks run inside torch's except block
            if raised is not None and raised is not pending:  # the call itself raised
                rec.capture_error = _short(raised)
                return
            if (output.__class__ is _TENSOR and output.layout is _STRIDED
                    and not output.is_nested):  # the common case: metadata now, JSON later
                meta = (output.shape, _STRIDE(output), _OFFSET(output), output.dtype,
                        output.device, output.requires_grad)
                self._helper.submit(_set_tensor_meta, rec, meta)
            else:  # containers may change once the caller has them: read them now, off-trace
                self._helper.call(_set_output_meta, rec, output)
            if rec.grad_enabled:  # on the helper: register_hook's Python is ~10 trace events
                self._helper.call(self._watch_grads, rec, output)
        finally:
            self._release()

    def _watch_grads(self, rec, output) -> None:
        """Hooks on the call's outputs that require grad: the gradients that reach them in the
        step's backward are stored like inputs (grads_ref), for ``replay --backward``."""
        outs = [output] if output.__class__ is _TENSOR else flat_tensors(output)
        outs = [t for t in outs if t.requires_grad and t.grad_fn is not None]
        if not outs:
            return
        self._grads[rec.call_id] = [None] * len(outs)
        for k, t in enumerate(outs):
            self._grad_handles.append(t.register_hook(functools.partial(self._grad_hook, rec, k)))

    def _grad_hook(self, rec, k: int, grad) -> None:
        if self._closed or grad is None:  # a backward after the capture: not ours
            return
        with self._lock:
            copy_range = RANGE_ENTER(f"cbtrace.copy::{rec.fqn}", None)
            try:
                stream = self._stream() if self._stream is not None else None  # autograd's
                ref, copies = self._helper.call(self._plan_grad, grad, stream)
                run_copies(copies)
                self._grads[rec.call_id][k] = ref
            finally:
                RANGE_EXIT(copy_range)

    def _plan_grad(self, grad, stream):
        """A gradient's inputs_ref and copies, planned on the stream the backward runs on (the
        helper otherwise keeps the last forward call's)."""
        if stream is not None:
            _follow_stream(stream, self._stream)
        _RECORD_OPS(False)
        try:
            return self._snap.plan((grad,), {})
        finally:
            _RECORD_OPS(True)

    # --- outputs ---------------------------------------------------------------------
    def _finish(self, exc):
        t = self.timings_s
        shards.PHASE_S.clear()
        # The inputs are written by a pool of threads while this one exports the trace and
        # writes the modules table (both mostly outside the GIL, so they overlap).
        with ThreadPoolExecutor(1, thread_name_prefix="cbtrace-inputs") as bg:
            flushing = bg.submit(self._timed_flush)
            try:
                if self._prof is not None:
                    t1 = time.perf_counter()
                    self.trace_path = self._write_trace()
                    t["trace_write"] = time.perf_counter() - t1
                t1 = time.perf_counter()
                self._recomputes.mark()
                for rec in self.records:
                    rec.input_meta, rec.input_shapes = _input_meta(rec.inputs_ref)
                    if any(r is not None for r in self._grads.get(rec.call_id, ())):
                        rec.grads_ref = ref_format.merge(self._grads[rec.call_id])
                writer.write_records(self.out, self.records)
                t["modules_table"] = time.perf_counter() - t1
            except BaseException as e:
                failed = flushing.exception()  # waits: no write is left running
                if failed is not None and hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"writing the inputs failed too: {_short(failed)}")
                raise
            files = flushing.result()
        self._lap("inputs_and_trace")
        t.update({f"inputs_{k}_thread_s": v for k, v in shards.PHASE_S.items()})
        manifest = self._manifest(files, exc)
        # the user's own capture (over an older run too): signed, so replay rebuilds its spec
        writer.write_manifest(self.out, manifest, known=self._snap.digests, sign=True)
        self._lap("checksums_and_manifest")

    def _manifest(self, files, exc) -> manifest_schema.Manifest:
        p = next(iter(self.model.parameters()), None)
        dev = str(p.device) if p is not None else "cpu"
        cls = type(module_tree.unwrap(self.model))
        source = self.source or manifest_schema.ModelSource(
            model_class=f"{cls.__module__}.{cls.__qualname__}")
        source.compiled = module_tree.has_compiled(self.model)
        return manifest_schema.Manifest(
            created=manifest_schema.now(), environment=manifest_schema.environment(),
            device=dev, device_name=device_name(dev), model=source, step=self.step_settings,
            capture=self.cfg.settings(), torch_initial_seed=torch.initial_seed(),
            num_calls=len(self.records), capture_step_s=self.step_s,
            capture_timings_s=self.timings_s, state_sha256=self._state_sha256,
            training_flags=self._flags,
            trace=self.trace_path.name if self.trace_path else None,
            input_files=[str(Path(f).relative_to(self.out)) for f in files],
            input_bytes_written=self._snap.bytes_written, complete=exc is None,
            error=_short(exc),
            distributed=(manifest_schema.Distributed(rank=self.rank[0], world_size=self.rank[1])
                         if self.rank is not None else None))

    def _timed_flush(self):
        t0 = time.perf_counter()
        files = self._snap.flush()
        self.timings_s["inputs_write"] = time.perf_counter() - t0
        return files

    def _write_trace(self) -> Path:
        worker = self.cfg.worker_name or f"{socket.gethostname()}_{os.getpid()}"
        if self.rank is not None:
            worker = f"rank-{self.rank[0]}_{worker}"  # torch-tb-profiler and attribute: per rank
        return export_trace(self._prof,
                            self.out / f"{worker}.{time.time_ns() // 1_000_000}.pt.trace.json.gz")


def export_trace(prof, path: Path) -> Path:
    """A stopped profiler's Kineto trace, gzipped into ``path`` (atomic; raw JSON in a temporary
    directory beside it)."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with atomic_path(path) as out:
            gzip_trace(raw, out)
    return path


def _set_output_meta(rec: ModuleRecord, output) -> None:
    try:
        rec.output_meta = json.dumps([tensor_meta(t) for t in flat_tensors(output)])
    except Exception as e:  # noqa: BLE001 - an odd output must not fail the capture
        rec.output_meta = json.dumps([{"error": _short(e)}])


def _set_tensor_meta(rec: ModuleRecord, meta: tuple) -> None:
    """output_meta of a call whose output is one plain tensor, from the metadata the post hook
    read (shape, stride, offset, dtype, device, requires_grad): the caller may change the tensor
    in place (``y.unsqueeze_(0)``) before this runs."""
    rec.output_meta = json.dumps([meta_dict(*meta)])


def distributed_rank() -> tuple[int, int] | None:
    """(rank, world size) inside an initialized torch.distributed job of 2+ ranks, else None."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _static_facts(model) -> dict[int, tuple[str, str, int, int]]:
    """id(module) -> (class name, class path, parameter bytes, buffer bytes) of every module,
    the bytes recursive with each tensor counted once, as ``module.parameters()`` sums them;
    in one walk up the tree (a parameters() walk per module visits a module once per ancestor)."""
    facts, sizes = {}, {}  # sizes: id(module) -> ({id: bytes} of its params, of its buffers)

    def walk(m):
        if id(m) in sizes:  # a shared module: done already
            return sizes[id(m)]
        params = {id(p): p.numel() * p.element_size() for p in m._parameters.values()
                  if p is not None}
        bufs = {id(b): b.numel() * b.element_size() for b in m._buffers.values() if b is not None}
        for child in m._modules.values():
            if child is not None:
                p, b = walk(child)
                params.update(p)
                bufs.update(b)
        cls = type(m)
        facts[id(m)] = (cls.__name__, f"{cls.__module__}.{cls.__qualname__}",
                        sum(params.values()), sum(bufs.values()))
        sizes[id(m)] = params, bufs
        return params, bufs

    walk(model)
    return facts


def _autocast_dtype() -> str | None:
    for dev in ("cuda", "cpu"):
        if torch.is_autocast_enabled(dev):
            return name_of(torch.get_autocast_dtype(dev))
    return None


def _input_meta(inputs_ref: str) -> tuple[str, str]:
    """(input_meta, input_shapes) JSON from the tensor nodes of an inputs_ref, in order."""
    nodes = ref_format.tensor_nodes(ref_format.parse(inputs_ref))
    metas = [{"shape": n["shape"], "dtype": n["dtype"], "stride": n["stride"],
              "storage_offset": n.get("off"), "device": n.get("dev"),
              "requires_grad": bool(n.get("rg"))} for n in nodes]
    return json.dumps(metas), json.dumps([m["shape"] for m in metas])


def _stream_reader():
    """An untraced call giving the current CUDA stream as torch's raw (stream id, device index,
    device type): torch.cuda.current_stream() is a few dozen traced Python and built-in calls
    per hook (lazy-init checks, device index lookups, Stream.__new__; read from torch 2.13's
    code, not yet counted in a GPU trace). Checked once against it; where the raw call differs
    or is missing, that is what the hooks call instead."""
    raw = getattr(torch._C, "_cuda_getCurrentStream", None)
    s = torch.cuda.current_stream()
    try:
        if raw is not None and tuple(raw(-1)) == (s.stream_id, s.device_index, s.device_type):
            return untraced(raw, -1)  # -1: the current device, as current_stream() reads it
    except Exception:  # noqa: BLE001 - another torch: the public call still works
        pass
    return torch.cuda.current_stream


def _follow_stream(stream, read) -> None:
    """Make ``stream`` (the hook caller's current CUDA stream: torch's raw (id, device index,
    device type) or a Stream) current on this thread too, where it is not already. The helper
    thread keeps it until the caller's changes; on the caller's own thread (inline) it already
    is. (A ``torch.cuda.stream`` context per call was a Stream built from the raw triple and the
    context's enter and exit: a few dozen Python calls, which cost on the helper thread too
    under Python 3.12, whose profiling instruments every thread's code.)"""
    if stream.__class__ is not tuple:
        stream = (stream.stream_id, stream.device_index, stream.device_type)
    now = read()
    if now.__class__ is not tuple:
        now = (now.stream_id, now.device_index, now.device_type)
    if tuple(now) != tuple(stream):  # sets the device too
        torch._C._cuda_setStream(stream_id=stream[0], device_index=stream[1],
                                 device_type=stream[2])


def profiler_activities():
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _short(exc) -> str | None:
    return None if exc is None else one_line(exc)
