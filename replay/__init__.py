"""Isolated replay, installed as ``cbtrace.replay``: every captured call re-run standalone.

``cbtrace.replay(run, model=None, device=None, **options)`` (``cbtrace.api``) calls
``engine.replay``: options are ``ReplayConfig`` fields (``config``); one call's measurement is a
list of steps (``plan``).
"""
