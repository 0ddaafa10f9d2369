"""Isolated replay engine, installed as ``cbtrace.replay``.

The package is callable, so both ``cbtrace.replay(run, ...)`` and
``from cbtrace.replay import engine`` work.
"""
def replay(run, model=None, device=None, **options):
    """Replay every captured call of ``run`` standalone; return the results DataFrame.

    Args:
        run: run directory written by ``cbtrace.capture``.
        model: the live model; if None it is rebuilt from the provider spec in the manifest.
        device: "cpu", "cuda" or "cuda:N"; defaults to the capture device if available.
        **options: fields of ``ReplayConfig`` (timer, resume, memory_budget_bytes, ...).
    """
    from cbtrace.replay.engine import run_replay

    return run_replay(run, model=model, device=device, **options)


from cbtrace._callable import make_module_callable  # noqa: E402

make_module_callable(__name__, "replay")
