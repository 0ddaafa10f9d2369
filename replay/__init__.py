"""Isolated replay, installed as ``cbtrace.replay``: every captured call re-run standalone.

``cbtrace.replay(run, model=None, device=None, **options)`` (``cbtrace.api``) calls
``engine.replay``: setup, a loop over the calls, finish. Options are ``ReplayConfig`` fields
(``config``); one call is measured by a plan of steps (``measure/``), timed through the timer
contract (``timer/``), in other modes and its backward when asked (``modes/``); ``run_io/``
holds what replay reads and writes around the loop, ``derive`` the figures after it.
"""
