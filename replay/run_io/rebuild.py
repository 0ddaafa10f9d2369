"""The model of a run rebuilt from its manifest (provider spec, options, seed, dtype), checked
against the state digest taken at capture.

A run directory is data (a teammate's capture, a bug report, a CI artifact): its spec is
resolved only when it names a registered provider, whose installed code gets the run's options
as keyword values. A ``file.py:fn`` or ``pkg.module:fn`` spec runs the code it names, so it is
used only when the run is signed by this user (captured here, or ``cbtrace trust RUN``:
``cbtrace.rundir.signature``) or the user trusts it for this replay (``trust``); or the user
names the model (``spec``, resolved as ``cbtrace capture --model`` resolves it, with the run's
options and seed). ``TrainingFlags`` puts each call's train/eval flags back as captured.
"""
from __future__ import annotations

import time

from cbtrace import module_tree
from cbtrace.cost.dtypes import torch_dtype
from cbtrace.errors import CbtraceError, ReplayError, one_line
from cbtrace.model.spec import is_registered, resolve
from cbtrace.rundir.signature import signed_manifest
from cbtrace.state import same_state

HOW = ("the run is not signed by you (captured here, or cbtrace trust RUN after reading it); "
       "pass the model (model=) or its spec (model_spec=SPEC), or trust=True to rebuild it "
       "from the run's spec")


def rebuild_model(manifest, device, *, verify: bool, trust: bool = False,
                  spec: str | None = None, run=None, timings: dict | None = None):
    """The run's model on ``device``.

    Args:
        manifest: the run's Manifest.
        verify: check the rebuilt weights against the digest taken at capture.
        trust: resolve the run's spec even when it names code (file.py:fn, pkg.module:fn)
            and the run is not signed by this user.
        spec: the user's model spec, used instead of the run's.
        run: the run directory, named in errors; its signature is checked.
        timings: gets the seconds of "rebuild" and "verify_state" (the digest check).
    """
    where = f"{run}: " if run is not None else ""
    refused = refusal(manifest, trust=trust, spec=spec, run=run)
    if refused is not None:
        raise refused
    named = spec is not None
    spec = spec if named else manifest.model.spec
    dtype = manifest.step.dtype if manifest.step is not None else None
    whose = "the model" if named else "the run's model"
    t0 = time.perf_counter()
    try:
        provider = resolve(spec, seed=manifest.model.seed or 0,
                           options=dict(manifest.model.options))
        model, _ = provider.model_and_batch(device, torch_dtype(dtype) if dtype else None)
    except CbtraceError as e:
        raise ReplayError(f"{where}cannot rebuild {whose} '{spec}' ({e}); pass model= to "
                          "cbtrace.replay") from None
    except Exception as e:
        raise ReplayError(f"{where}cannot rebuild {whose} '{spec}' ({type(e).__name__}: "
                          f"{one_line(e, with_type=False)}); pass model= to cbtrace.replay") from None
    t1 = time.perf_counter()
    same = not (verify and manifest.state_sha256) or same_state(model, manifest.state_sha256)
    if timings is not None:
        timings.update(rebuild=t1 - t0, verify_state=time.perf_counter() - t1)
    if not same:
        raise ReplayError(f"{where}{spec}: the rebuilt model's weights differ from the captured "
                          "ones (provider not deterministic, its init changed since the capture, "
                          "or another model?): pass model= to replay, or capture again")
    return model


def refusal(manifest, *, trust: bool = False, spec: str | None = None,
            run=None) -> ReplayError | None:
    """Why ``rebuild_model`` would refuse to rebuild the model (nothing is run to tell), or
    None when it would try."""
    where = f"{run}: " if run is not None else ""
    named = spec is not None
    spec = spec if named else manifest.model.spec
    if not spec:
        return ReplayError(f"{where}run was captured from a live model (no spec): pass the "
                           "model (model=) or its spec (model_spec=SPEC)", retry="model_spec")
    if not (named or trust or is_registered(spec) or signed_source(run, manifest)):
        return ReplayError(f"{where}the run's model spec '{spec}' is not a registered provider; "
                           + HOW, retry=("model_spec", "trust"))
    return None


def signed_source(run, manifest) -> bool:
    """Whether ``run`` is signed by this user for the model source ``manifest`` names (the
    manifest as read, checked against the bytes the signature covers)."""
    if run is None:
        return False
    signed = signed_manifest(run)
    return signed is not None and signed.model == manifest.model


class TrainingFlags:
    """``apply(module, rec)``: the call's own train/eval flag, and each submodule's as it was at
    capture (``flags``: fqn -> training, the manifest's). A call's submodules are looked up
    once, and a flag is set only where it differs (a walk of every submodule per call is slow
    on a large model)."""

    def __init__(self, flags: dict | None):
        self.flags, self._subs = flags or {}, {}

    def apply(self, module, rec) -> None:
        subs = self._subs.get((rec.fqn, id(module)))  # a module swapped in: walked again
        if subs is None:
            prefix = f"{rec.fqn}." if rec.fqn else ""
            subs = self._subs[(rec.fqn, id(module))] = [
                (sub, bool(self.flags[f"{prefix}{name}"]))
                for name, sub in module_tree.named_modules(module)
                if name and f"{prefix}{name}" in self.flags]
        for sub, want in [(module, bool(rec.training)), *subs]:
            if sub.training != want:
                sub.training = want
