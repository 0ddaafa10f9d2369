"""``cbtrace profile``: capture a model from its spec, replay it, join the in-situ times."""
from __future__ import annotations

from pathlib import Path

import torch

from cbtrace.attribution.join import join_insitu
from cbtrace.capture.from_spec import capture_model
from cbtrace.device import resolve_device
from cbtrace.replay.engine import replay


def profile(spec: str, out, *, replay_options: dict | None = None, **capture_options):
    """Capture ``spec`` into ``out``, replay it, join in-situ times; returns the modules frame.
    A training step (``step="train"``) replays each call's backward too.

    Replay takes the model the capture ran (left as it was before the step), not one rebuilt
    from the spec: the same weights without building them twice (DLRM's 839 M parameters);
    a replay on another device than the capture's rebuilds it there."""
    cap = capture_model(spec, Path(out), **capture_options)
    options = {"model_spec": spec,  # the spec the user named, if the model must be rebuilt
               "backward": capture_options.get("step") == "train", **(replay_options or {})}
    run, model = cap.out, live_model(cap, options.get("device"))
    del cap  # the capture's own buffers go before replay starts
    replay(run, model=model, **options)
    return join_insitu(run)


def live_model(cap, device=None):
    """The model ``cap`` captured, for replay on ``device`` (None: where it is); None when
    replay is asked for another device (it rebuilds the model there)."""
    p = next(iter(cap.model.parameters()), None)
    here = p.device if p is not None else torch.device("cpu")
    if device is not None and resolve_device(device) != here:
        return None
    return cap.model
