"""The four plugin layers: one hookspec each (pluggy, project name ``cbtrace``).

Third-party packages expose a module under the entry-point group ``cbtrace``; our own
built-ins in ``cbtrace.plugins`` register through exactly the same hooks.
"""
import pluggy

hookspec = pluggy.HookspecMarker("cbtrace")
hookimpl = pluggy.HookimplMarker("cbtrace")


@hookspec
def register_models(register):
    """Add model providers: ``register(name, factory)``; ``factory(spec=, seed=, options=)``
    returns a ``cbtrace.model.provider.Provider`` (``spec`` "name[:preset]"; a preset arrives as
    ``options["preset"]``)."""


@hookspec
def register_serializers(register):
    """Add input serializers: ``register(serializer)``; see ``cbtrace.store.serializer.Serializer``."""


@hookspec
def register_backends(register):
    """Add measurement backends (timers): ``register(name, backend)``; see
    ``cbtrace.replay.timer.contract``."""


@hookspec
def register_reporters(register):
    """Add reporters: ``register(name, reporter)``; a reporter has ``report(records, manifest,
    out_dir) -> list[Path]`` (the run's ModuleRecords and ``cbtrace.schema.manifest.Manifest``)
    and ``close()``."""
