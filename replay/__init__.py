"""Isolated replay, installed as ``cbtrace.replay``: every captured call re-run standalone.

``cbtrace.replay(run, model=None, device=None, **options)`` is ``engine.replay``: options are
``ReplayConfig`` fields (``config``); one call's measurement is a list of steps (``plan``).
"""
from cbtrace._callable import make_module_callable

make_module_callable(__name__, "cbtrace.replay.engine:replay")
