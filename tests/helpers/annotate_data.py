"""Test data for the annotate tests: a capture-like trace and a run directory (fake figures).

The trace is recorded here, on CPU, the way cbtrace's capture marks module calls: forward
pre/post hooks open and close ``record_function("cbtrace::<fqn>")``. The figures written to
modules.parquet are made up (plausible magnitudes), never measured.
"""
from __future__ import annotations

import json
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
GENERATED = SHARED / "traces" / "generated"
RUN_ID = "run@2026-01-01T00:00:00"  # <run directory name>@<manifest.created>


def shared_module_traces() -> list[Path]:
    """The shared traces that carry nn.Module events (empty list if shared/ is absent)."""
    return sorted(GENERATED.glob("*/*.pt.trace.json.gz")) if GENERATED.is_dir() else []


def tiny_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin1, self.act, self.lin2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

        def forward(self, x):
            return self.lin2(self.act(self.lin1(x)))

    class Net(nn.Module):
        def __init__(self, d=64):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.blocks = nn.ModuleList([Block(d), Block(d)])
            self.head = nn.Linear(d, 8)

        def forward(self, x):
            x = self.norm(x)
            for b in self.blocks:
                x = x + b(x)
            return self.head(self.norm(x))  # norm is called twice: call_index 0 and 1

    torch.manual_seed(0)
    return Net()


def _hook(model):
    """Open/close record_function("cbtrace::<fqn>") around every module call, as capture does."""
    import torch

    handles, stack = [], []
    for fqn, mod in model.named_modules():
        def pre(m, args, fqn=fqn):
            rf = torch.autograd.profiler.record_function(f"cbtrace::{fqn}")
            rf.__enter__()
            stack.append(rf)

        def post(m, args, out):
            stack.pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def record_capture_trace(out_dir: Path, steps: int = 1, gz: bool = True,
                         device: str = "cpu") -> Path:
    """Profile ``steps`` training steps of the toy model; returns the trace path."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    model = tiny_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handles = _hook(model)
    x = torch.randn(16, 32, 64, device=device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("worker0.1.pt.trace.json" + (".gz" if gz else ""))
    kw = {}
    if steps > 1:  # export from on_trace_ready: the cycle's events are gone after it
        kw = dict(schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                  on_trace_ready=lambda p: p.export_chrome_trace(str(path)))
    with profile(activities=acts, record_shapes=True, with_stack=True, with_modules=True,
                 **kw) as prof:
        for _ in range(steps + 1 if steps > 1 else 1):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    for h in handles:
        h.remove()
    if steps == 1:
        prof.export_chrome_trace(str(path))
    return path


def module_calls() -> list[tuple[str, int, str, int, str]]:
    """(fqn, call_index, parent_fqn, depth, module_type) in call order, for the toy model."""
    calls = [("", 0, None, 0, "Net"), ("norm", 0, "", 1, "LayerNorm")]
    for b in ("blocks.0", "blocks.1"):
        calls.append((b, 0, "", 1, "Block"))
        for leaf, t in (("lin1", "Linear"), ("act", "GELU"), ("lin2", "Linear")):
            calls.append((f"{b}.{leaf}", 0, b, 2, t))
    calls += [("norm", 1, "", 1, "LayerNorm"), ("head", 0, "", 1, "Linear")]
    return calls


def write_fake_run(run: Path, trace: Path | None = None) -> Path:
    """A run directory with modules.parquet (made-up figures) and manifest; copies ``trace``."""
    import shutil

    from helpers.runs import write_run

    from cbtrace.schema.modules import ModuleRecord

    run.mkdir(parents=True, exist_ok=True)
    recs, ids = [], {}
    for cid, (fqn, ci, parent, depth, mtype) in enumerate(module_calls()):
        ids[(fqn, ci)] = cid
        leaf = mtype in ("Linear", "GELU", "LayerNorm")
        flops = 2 * 16 * 32 * 64 * 128 if mtype == "Linear" else (0 if leaf else None)
        iso = {"Linear": 0.05, "GELU": 0.02, "LayerNorm": 0.03, "Block": 0.15, "Net": 0.5}[mtype]
        recs.append(ModuleRecord(
            fqn=fqn, call_index=ci, call_id=cid,
            parent_call_id=-1 if parent is None else ids[(parent, 0)], parent_fqn=parent,
            depth=depth, module_type=mtype, module_class=f"torch.nn.{mtype}", param_bytes=0,
            buffer_bytes=0, input_bytes=16 * 32 * 64 * 4, input_shapes="[[16, 32, 64]]",
            input_meta="[]", output_meta="[]", training=True, grad_enabled=True,
            autocast_dtype=None, inputs_ref="{}", status="ok", timer="cpu", isolated_ms=iso,
            flops=flops, bytes=3 * 16 * 32 * 64 * 4,
            mfu=(flops / (iso * 1e-3) / 1e12 if flops else None),
            mbu=3 * 16 * 32 * 64 * 4 / (iso * 1e-3) / 50e9, hfu=None,
            bound="compute" if flops else "memory", peak_mem_bytes=1 << 20,
            insitu_ms=iso * 1.1, error_pct=-9.1))
    if trace is not None:
        shutil.copy(trace, run / trace.name)
    return write_run(run, recs, trace=trace.name if trace is not None else None)


def load_trace(path: Path) -> dict:
    import gzip

    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        return json.load(f)
