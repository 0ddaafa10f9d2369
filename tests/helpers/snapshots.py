"""Capture's two halves of storing a call's inputs, in one call (tests store inputs directly)."""
from cbtrace.store.tensor_store import run_copies


def take(snap, args: tuple, kwargs: dict) -> str:
    """Plan the call's inputs, copy them now, return its ``inputs_ref``."""
    ref, copies = snap.plan(args, kwargs)
    run_copies(copies)
    return ref
