"""Resolve a model spec to a Provider.

Specs: a registered name with an optional preset (``nanogpt``, ``nanogpt:tiny``, ``dlrm:tiny``,
``torchrec``), ``pkg.module:callable``, or ``path/to/file.py:callable``. The callable returns a
Provider, or a tuple ``(model, batch)`` where batch is a tuple of positional args or a dict of
keyword args.

A registered name runs only installed code (its options are passed as values); the other two
forms run the code they name, so a spec read from a run directory is resolved only if
``is_registered`` says so or the user asked for it (``cbtrace.replay.run_io.rebuild``).

Options are checked against what the provider takes: a registered provider's ``OPTIONS``, a
callable's keyword parameters (one with ``**kwargs`` takes any); any other is a one-line error.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cbtrace import registry
from cbtrace.errors import ProviderError, one_line
from cbtrace.model.provider import Provider, move_batch


@dataclass
class CallableProvider(Provider):
    """Wraps a user callable returning a Provider or (model, batch)."""

    factory: object = None
    options: dict = field(default_factory=dict)

    def model_and_batch(self, device="cpu", dtype=None):
        import torch  # here: attribution imports this module and runs without torch

        torch.manual_seed(self.seed)
        try:
            out = self.factory(**self.options)
        except Exception as e:
            raise ProviderError(f"{self.spec}: the model callable raised "
                                f"({one_line(e)})") from e
        if isinstance(out, Provider):
            out.spec, out.seed = self.spec, self.seed
            return out.model_and_batch(device, dtype)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ProviderError(f"{self.spec}: must return a Provider or (model, batch), "
                                f"got {type(out).__name__}")
        model, batch = out
        if not isinstance(batch, (tuple, dict)):
            batch = (batch,)
        model = model.to(device)
        if dtype is not None:
            model = model.to(dtype)
        return model, move_batch(batch, device, dtype)


def _load_callable(spec: str):
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ProviderError(f"'{spec}': expected NAME[:PRESET], pkg.module:callable or file.py:callable")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ProviderError(f"{target}: no such file")
        name = f"cbtrace_user_{abs(hash(str(path.resolve())))}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise ProviderError(f"{target}: failed to import ({one_line(e)})") from e
    else:
        if os.getcwd() not in sys.path:  # `pkg.module:fn` of the current directory, as python -m
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ProviderError(f"{target}: cannot import ({one_line(e, with_type=False)})") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ProviderError(f"{spec}: '{attr}' is not a callable in {target}")
    return fn


def is_registered(spec: str) -> bool:
    """True if ``spec`` (``NAME[:PRESET]``) names a provider registered through the plugin
    hooks, so that resolving it imports no module the spec names."""
    return str(spec).partition(":")[0] in registry.models()


def resolve(spec: str, *, seed: int = 0, options: dict | None = None) -> Provider:
    """Spec string -> Provider (registered names first, then module/file callables)."""
    options = dict(options or {})
    models = registry.models()
    name, _, preset = spec.partition(":")
    if name in models:
        if preset:
            options.setdefault("preset", preset)
        provider = models[name](spec=spec, seed=seed, options=options)
        check_options(name, options, getattr(provider, "OPTIONS", None))
        return provider
    if ":" not in spec:
        raise ProviderError(f"unknown model '{spec}' (registered: {', '.join(sorted(models))}; "
                            "or use pkg.module:callable / file.py:callable)")
    factory = _load_callable(spec)
    check_options(spec, options, callable_options(factory))
    return CallableProvider(spec=spec, seed=seed, options=options, factory=factory)


def callable_options(fn) -> tuple[str, ...] | None:
    """The keyword parameters of ``fn``; None if it takes ``**kwargs`` (or has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_options(who: str, options: dict, known) -> None:
    """A ProviderError naming the options ``who`` does not take, and those it does."""
    if known is None:
        return
    unknown = [k for k in options if k not in known]
    if unknown:
        names = ", ".join(f"'{k}'" for k in unknown)
        raise ProviderError(f"{who}: unknown option{'s' if len(unknown) > 1 else ''} {names} "
                            f"(options: {', '.join(sorted(known)) or 'none'})")
