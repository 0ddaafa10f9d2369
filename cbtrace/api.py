"""The public API as plain functions: ``cbtrace.capture``, ``cbtrace.replay``, ``cbtrace.annotate``.

Each keeps its implementation's signature (tests/test_edges.py checks they match) and imports it
on the first call, so that ``import cbtrace`` and ``cbtrace --help`` import no torch.
"""
from __future__ import annotations

import typing

if typing.TYPE_CHECKING:
    from pathlib import Path

    import pandas
    import torch

    from cbtrace.capture.recorder import CaptureConfig
    from cbtrace.capture.recorder import capture as Capture
    from cbtrace.schema.manifest import ModelSource, StepSettings


def capture(model: torch.nn.Module, out_dir, *, config: CaptureConfig | None = None,
            source: ModelSource | None = None, step: StepSettings | None = None,
            **overrides) -> Capture:
    """Context manager capturing one step of ``model`` into the new run directory ``out_dir``.

    Args:
        model: the live model; every call of its chosen modules in the step is recorded.
        out_dir: a new (or empty) directory.
        config: a ``CaptureConfig``; or pass its fields as keyword ``overrides``.
        source, step: where the model came from and how the step ran (``cbtrace capture``).

    Example::

        with cbtrace.capture(model, "runs/r1", max_depth=3) as cap:
            model(batch)
    """
    from cbtrace.capture.recorder import capture as _capture

    return _capture(model, out_dir, config=config, source=source, step=step, **overrides)


def replay(run, model=None, device=None, **options) -> pandas.DataFrame:
    """Replay every captured call of ``run`` standalone; return the results DataFrame.

    Args:
        run: run directory written by ``cbtrace.capture``.
        model: the live model; if None it is rebuilt from the provider spec in the manifest.
        device: "cpu", "cuda" or "cuda:N"; defaults to the capture device if available.
        **options: fields of ``ReplayConfig`` (timer, resume, memory_budget_bytes, ...).
    """
    from cbtrace.replay.engine import replay as _replay

    return _replay(run, model=model, device=device, **options)


def annotate(run=None, trace=None, out=None, force: bool = False, pftrace: bool = True,
             insitu=None) -> Path:
    """Write an annotated copy of a trace (``annotated_<name>`` beside it); return its path.

    Args:
        run: a run directory whose figures go on the trace (default trace: its capture trace).
        trace: a Kineto trace of the same model.
        out: the output path; ``force`` overwrites an existing one.
        pftrace: also write the Perfetto protobuf (``.pftrace``).
        insitu: the per-slice attribution table (default: attributed from the trace; False:
            none).
    """
    from cbtrace.annotate.write import annotate as _annotate

    return _annotate(run=run, trace=trace, out=out, force=force, pftrace=pftrace, insitu=insitu)
