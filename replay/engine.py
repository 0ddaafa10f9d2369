"""Breadth-first isolated replay of a run: every captured call re-run standalone and measured."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from cbtrace import registry, rundir
from cbtrace.errors import ReplayError
from cbtrace.schema.modules import (COPY_FAILED, ModuleRecord, capture_fields, frame_to_records,
                             records_to_frame, required_fields)
from cbtrace.replay.config import ReplayConfig
from cbtrace.state import StateGuard
from cbtrace.replay.plan import default_plan, measure_call
from cbtrace.replay.progress import ProgressLog, read_done
from cbtrace.calltree import bfs_order


def replay(run, model=None, device=None, **options):
    """Replay every captured call of ``run`` standalone; return the results DataFrame.

    Args:
        run: run directory written by ``cbtrace.capture``.
        model: the live model; if None it is rebuilt from the provider spec in the manifest.
        device: "cpu", "cuda" or "cuda:N"; defaults to the capture device if available.
        **options: fields of ``ReplayConfig`` (timer, resume, memory_budget_bytes, ...).
    """
    cfg = ReplayConfig(**options)
    run = Path(run)
    manifest, df = rundir.load_run(run)
    if not manifest.get("complete", True):
        raise ReplayError(f"{run}: the capture did not complete ({manifest.get('error')})")
    device = _device(device, manifest, model)
    if model is None:
        model = rebuild_model(manifest, device, verify=cfg.verify_state)
    rundir.require_columns(run, df, required_fields())
    verify_inputs(run, manifest)
    records = [fresh_replay_fields(r) for r in frame_to_records(df)]
    by_id = {r.call_id: r for r in records}
    settings = timing_settings(cfg)
    # rows timed with other settings (e.g. --cold vs default) are done again, never mixed
    done = ({cid: r for cid, r in read_done(run).items() if r.get("settings") == settings}
            if cfg.resume else {})
    guard = StateGuard(model)
    plan = default_plan(cfg, device, registry.backends())
    budget = cfg.memory_budget_bytes
    log = ProgressLog(run, resume=cfg.resume)
    order = bfs_order({r.call_id: r.parent_call_id for r in records})
    bar = _progress(cfg, len(order), len(done))
    t0 = time.perf_counter()
    try:
        for cid in order:
            if cid in done:
                continue
            rec = by_id[cid]
            row = replay_one(model, rec, run, device, cfg, plan, guard, budget,
                             manifest.get("training_flags") or {})
            row["call_id"] = cid
            row["settings"] = settings
            log.append(row)
            done[cid] = row
            bar(rec.fqn or "<root>")
    finally:
        log.close()
        bar(None)
    for rec in records:
        for k, v in done.get(rec.call_id, {}).items():
            if k != "call_id" and hasattr(rec, k):
                setattr(rec, k, v)
    from cbtrace.replay.derive import finalize

    finalize(records, device_name=_device_name(device))
    out = records_to_frame(records)
    rundir.write_modules(run, out)
    manifest["replay"] = {"device": str(device), "device_name": _device_name(device),
                          "timer_requested": cfg.timer, "cold": cfg.cold,
                          "timers_used": sorted({r.timer for r in records if r.timer}),
                          "wall_s": time.perf_counter() - t0,
                          "torch_version": torch.__version__}
    rundir.write_manifest(run, manifest)
    rundir.refresh_checksums(run, rewritten=[rundir.MODULES])
    return out


def timing_settings(cfg) -> dict:
    """The options that change what a row measures (kept with each progress row); the time
    budget only changes how many runs are taken, so a resume may use another one. Cold
    replay's warm-up sets the clock it measures at, so its settings count too."""
    settings = {"timer": cfg.timer, "cold": cfg.cold, "graph_k": cfg.graph_k}
    if cfg.cold:
        settings.update(cold_warmup_s=cfg.cold_warmup_s, cold_settle_tol=cfg.cold_settle_tol)
    return settings


def fresh_replay_fields(rec):
    """A record with every replay and in-situ field back at its default (no stale figures)."""
    return ModuleRecord(**{k: getattr(rec, k) for k in capture_fields()})


def verify_inputs(run: Path, manifest: dict) -> None:
    """Every captured input shard exists and matches the sha256 recorded at capture; a shard
    whose size and mtime are as recorded is not read again (gigabytes on a GPT-2 run)."""
    files, stats = manifest.get("files", {}), manifest.get("files_stat", {})
    for rel in manifest.get("input_files", []):
        path = run / rel
        if not path.is_file():
            raise ReplayError(f"{path}: captured input file is missing")
        st = path.stat()
        if stats.get(rel) == [st.st_size, st.st_mtime_ns]:
            continue
        want = files.get(rel)
        if want and rundir.sha256_file(path) != want:
            raise ReplayError(f"{path}: captured input file is corrupt (sha256 differs from "
                              "the manifest)")


def set_training_flags(module, rec, flags: dict) -> None:
    """The call's own train/eval flag, and each submodule's as it was at capture."""
    module.training = bool(rec.training)
    prefix = f"{rec.fqn}." if rec.fqn else ""
    for name, sub in module.named_modules():
        if name and f"{prefix}{name}" in flags:
            sub.training = bool(flags[f"{prefix}{name}"])


def replay_one(model, rec, run, device, cfg, plan, guard, budget, flags=None) -> dict:
    """Replay one call; never raises for the module's own failures (status = error)."""
    from cbtrace.store.load import load_call_inputs

    if (rec.capture_error or "").startswith(COPY_FAILED):
        return dict(status="error", status_reason=f"inputs not captured ({rec.capture_error})")
    try:
        module = model.get_submodule(rec.fqn) if rec.fqn else model
    except AttributeError:
        return dict(status="error", status_reason=f"module '{rec.fqn}' not found in the model")
    need = footprint_bytes(rec)
    limit = budget if budget is not None else _free_memory(device)
    if limit is not None and need > limit:
        return dict(status="skipped", status_reason=f"footprint {need / 2**20:.0f} MiB > "
                    f"budget {limit / 2**20:.0f} MiB")
    try:
        with guard.call():
            args, kwargs = load_call_inputs(run, rec.inputs_ref, device=device)
            set_training_flags(module, rec, flags or {})
            return measure_call(module, rec, args, kwargs, device, cfg, plan)
    except torch.OutOfMemoryError as e:
        _free(device)
        return dict(status="skipped", status_reason=f"OOM: {str(e).splitlines()[0][:200]}")
    except Exception as e:  # the module (or its inputs) failed: record and go on
        _free(device)
        return dict(status="error", status_reason=f"{type(e).__name__}: {str(e)[:300]}")


def footprint_bytes(rec) -> int:
    """Rough peak need: params + buffers + inputs and outputs for the rotating copies + 1."""
    import json

    out = sum(_meta_bytes(m) for m in json.loads(rec.output_meta or "[]"))
    return int(rec.param_bytes + rec.buffer_bytes + 3 * (rec.input_bytes + out))


def _meta_bytes(m) -> int:
    import math

    from cbtrace.cost.flops import itemsize

    return math.prod(m.get("shape", [])) * itemsize(m.get("dtype", "float32"))


def rebuild_model(manifest: dict, device, *, verify: bool):
    """The model from the provider spec in the manifest, checked against the captured state."""
    from cbtrace.capture.recorder import state_digest
    from cbtrace.capture.from_spec import DTYPES
    from cbtrace.model.spec import resolve

    spec = manifest.get("model_spec")
    if not spec:
        raise ReplayError("run was captured from a live model (no spec): pass model= to replay")
    opts = dict(manifest.get("options", {}).get("options", {}))
    dtype = opts.pop("dtype", None)
    for k in ("device", "step", "warmup"):
        opts.pop(k, None)
    from cbtrace.errors import CbtraceError

    try:
        provider = resolve(spec, seed=manifest.get("seeds", {}).get("provider_seed") or 0,
                           options=opts)
        model, _ = provider.model_and_batch(device, DTYPES.get(dtype) if dtype else None)
    except CbtraceError as e:
        raise ReplayError(f"cannot rebuild the run's model '{spec}' ({e}); pass model= to "
                          "cbtrace.replay") from None
    except Exception as e:
        raise ReplayError(f"cannot rebuild the run's model '{spec}' ({type(e).__name__}: {e}); "
                          "pass model= to cbtrace.replay") from None
    if verify and manifest.get("state_sha256") and state_digest(model) != manifest["state_sha256"]:
        raise ReplayError(f"{spec}: the rebuilt model's weights differ from the captured ones "
                          "(provider not deterministic?): pass model= to replay")
    return model


def _device(device, manifest, model) -> torch.device:
    if device is None:
        if model is not None:
            p = next(iter(model.parameters()), None)
            return p.device if p is not None else torch.device("cpu")
        want = manifest.get("device", "cpu")
        device = want if (not want.startswith("cuda") or torch.cuda.is_available()) else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ReplayError(f"--device {device}: not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ReplayError(f"--device {device}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _device_name(device) -> str:
    from cbtrace.cost.peaks import device_name

    return device_name(device)


def _free_memory(device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def _free(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _progress(cfg, total: int, already: int):
    show = sys.stderr.isatty() if cfg.progress is None else cfg.progress
    state = {"n": already}

    def tick(name):
        if not show:
            return
        if name is None:
            sys.stderr.write("\n")
            return
        state["n"] += 1
        width = 30
        filled = width * state["n"] // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {state['n']}/{total} "
                         f"{name[:40]:<40}")
        sys.stderr.flush()

    return tick
