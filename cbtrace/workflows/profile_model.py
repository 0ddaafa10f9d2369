"""``cbtrace profile``: capture a model from its spec, replay it, join the in-situ times."""
from __future__ import annotations

from pathlib import Path


def profile(spec: str, out, *, replay_options: dict | None = None, **capture_options):
    """Capture ``spec`` into ``out``, replay it, join in-situ times; returns the modules frame.
    A training step (``step="train"``) replays each call's backward too."""
    from cbtrace.attribution.join import join_insitu
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.engine import replay

    cap = capture_model(spec, Path(out), **capture_options)
    options = {"model_spec": spec,  # the spec the user named
               "backward": capture_options.get("step") == "train", **(replay_options or {})}
    replay(cap.out, **options)
    return join_insitu(cap.out)
