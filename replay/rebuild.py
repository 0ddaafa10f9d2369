"""The model of a run rebuilt from its manifest (provider spec, options, seed, dtype), checked
against the state digest taken at capture."""
from __future__ import annotations

from cbtrace.errors import CbtraceError, ReplayError


def rebuild_model(manifest, device, *, verify: bool):
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.model.spec import resolve
    from cbtrace.state import state_digest

    spec = manifest.model.spec
    if not spec:
        raise ReplayError("run was captured from a live model (no spec): pass model= to replay")
    dtype = manifest.step.dtype if manifest.step is not None else None
    try:
        provider = resolve(spec, seed=manifest.model.seed or 0, options=manifest.model.options)
        model, _ = provider.model_and_batch(device, torch_dtype(dtype) if dtype else None)
    except CbtraceError as e:
        raise ReplayError(f"cannot rebuild the run's model '{spec}' ({e}); pass model= to "
                          "cbtrace.replay") from None
    except Exception as e:
        raise ReplayError(f"cannot rebuild the run's model '{spec}' ({type(e).__name__}: {e}); "
                          "pass model= to cbtrace.replay") from None
    if verify and manifest.state_sha256 and state_digest(model) != manifest.state_sha256:
        raise ReplayError(f"{spec}: the rebuilt model's weights differ from the captured ones "
                          "(provider not deterministic?): pass model= to replay")
    return model
